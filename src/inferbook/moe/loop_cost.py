"""How many warp-instructions a W4A16 kernel's main loop issues per DRAM byte, read from its SASS.

The main loop is found in the SASS (Triton's bundled `cuobjdump -sass` on the cubin compiled for the
target): every backward branch (a `BRA` whose target address precedes it) closes a loop; the main
loop is the one with the most instructions in its body (the K loop: everything else runs once).
One pass through it is one K step of the launch's tiles (`iteration_bytes`), so

    warp-instructions per byte = body instructions / DRAM bytes one warp streams per pass

and with an SM issuing `ISSUE_PER_CYCLE` warp-instructions per cycle, the loop can stream at most
ISSUE_PER_CYCLE / (instructions per byte) bytes per cycle per SM -- the issue bound -- against the
copy ceiling's bytes per cycle per SM (H200 datasheet: 4.8 TB/s / 132 SMs / 1.98 GHz ~ 18.4 B).
Predicated-off instructions still issue, so the count is what the scheduler sees; stalls are not
in it (the latency bound is separate). Activations are L2-resident across CTAs and not counted as
DRAM bytes; weights and scales are.

`python -m inferbook.moe.loop_cost [--save]` compiles the chord-w4a16 decode launches for sm_90 and
prints (or saves to data/compiled/loops/chord-w4a16.json) one row per launch.
"""
from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ISSUE_PER_CYCLE = 4                  # warp-instructions an SM issues per cycle (4 schedulers)
H200 = dict(sms=132, clock_ghz=1.98, hbm_tb_s=4.8)
COPY_B_PER_CYCLE_SM = H200["hbm_tb_s"] * 1e12 / H200["sms"] / (H200["clock_ghz"] * 1e9)   # ~18.4
LOOPS_FILE = "data/compiled/loops/chord-w4a16.json"

_INS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
_BRA = re.compile(r"\bBRA\b[^;]*?(0x[0-9a-f]+)")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of every instruction in `cuobjdump -sass` output, in order."""
    return [(int(a, 16), t) for a, t in _INS.findall(sass)]


def loops(sass: str) -> list[dict]:
    """Each backward branch's loop: {start, end, body (instruction texts)}, in address order."""
    ins = instructions(sass)
    out = []
    for addr, text in ins:
        m = _BRA.search(text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            out.append({"start": start, "end": addr, "body": [t for a, t in ins if start <= a <= addr]})
    return out


def opcode(text: str) -> str:
    """'@!P0 LDG.E.128 R4, desc[UR4][R2.64]' -> 'LDG' (predicate and modifiers dropped)."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0].split(".")[0]


def main_loop(sass: str) -> dict:
    """The loop with the most instructions: {instructions, opcodes (Counter, most common first)}."""
    ls = loops(sass)
    if not ls:
        raise ValueError("no backward branch in this SASS: no loop")
    body = max(ls, key=lambda l: len(l["body"]))["body"]
    return {"instructions": len(body), "opcodes": dict(collections.Counter(map(opcode, body)).most_common())}


def loop_cost(instructions_per_pass: int, weights_per_pass_cta: int, dram_bytes_per_pass_cta: int,
              warps: int) -> dict:
    """Per-pass SASS count -> warp-instructions per 64 weights per thread, per DRAM byte, and the issue
    bound as a fraction of the copy ceiling (datasheet bytes per cycle per SM)."""
    threads = 32 * warps
    per_byte = instructions_per_pass * warps / dram_bytes_per_pass_cta
    return {"instructions_per_pass": instructions_per_pass,
            "weights_per_thread_per_pass": weights_per_pass_cta / threads,
            "instructions_per_64_weights_per_thread": round(instructions_per_pass * 64 * threads / weights_per_pass_cta, 1),
            "warp_instructions_per_byte": round(per_byte, 4),
            "issue_bound_vs_copy_ceiling": round(ISSUE_PER_CYCLE / per_byte / COPY_B_PER_CYCLE_SM, 3)}


def iteration_bytes(launch) -> tuple[int, int]:
    """(weights, DRAM bytes of weights + scales) one CTA streams per pass of `launch`'s main loop."""
    from . import w4a16 as W

    kw = launch.kwargs
    group = kw["GROUP"]
    name = getattr(launch.kernel, "__name__", "") or getattr(getattr(launch.kernel, "fn", None), "__name__", "")
    bn = kw["BLOCK_N"]
    if name in (*W.DENSE_DECODE_KERNELS, "moe_decode_kernel"):   # one pass = one run of 256 K values
        bk = 256
    else:
        bk = kw["BLOCK_K"]
    gated = 2 if kw.get("GATED") else 1
    weights = gated * bn * bk
    return weights, weights // 2 + 2 * weights // group


def residency(regs: int, shared_bytes: int, warps: int, grid_ctas: int, bytes_per_pass_cta: int, stages: int,
              sms: int = H200["sms"]) -> dict:
    """CTAs an SM can hold (registers: 64K per SM, allocated per warp in 256s; shared memory 228 KB,
    1 KB reserved per CTA; 32 CTAs, 64 warps), how many the grid gives it, its warps, and its bytes in
    flight (stages - 1 passes of weights and scales per CTA under cp.async) against Little's law
    (copy bytes per cycle per SM x ~800 ns DRAM latency)."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * warps)
    by_smem = (228 * 1024) // (shared_bytes + 1024) if shared_bytes else 32
    resident = max(0, min(by_regs, by_smem, 32, 64 // warps))
    per_sm = min(resident, -(-grid_ctas // sms))
    need = COPY_B_PER_CYCLE_SM * 800e-9 * H200["clock_ghz"] * 1e9
    in_flight = per_sm * max(stages - 1, 1) * bytes_per_pass_cta
    return {"ctas_resident_max": resident, "ctas_per_sm": per_sm, "warps_per_sm": per_sm * warps,
            "bytes_in_flight_per_sm": in_flight, "bytes_in_flight_needed": round(need),
            "latency_cover": round(min(1.0, in_flight / need), 3)}


def compile_facts(launch, target: str = "sm_90") -> tuple[str, dict]:
    """(SASS, {regs, spill_bytes, shared_bytes}) of `launch` compiled for `target`."""
    from .. import compiled

    ck = _compile(launch, target)
    log = compiled._ptxas_log(ck.asm["ptx"], compiled.TARGETS[target], launch.kwargs.get("enable_fp_fusion", True))
    facts = compiled.parse_ptxas(log)
    return _disassemble(ck), {"regs": facts["regs"], "spill_bytes": facts["spill_bytes"],
                              "shared_bytes": int(ck.metadata.shared)}


def _compile(launch, target: str):
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    from .. import compiled

    arch = compiled.TARGETS[target]
    driver.set_active(compiled._AOTDriver(GPUTarget("cuda", arch, 32)))
    args = [compiled.ptr(a.dtype) if isinstance(a, torch.Tensor) else a for a in launch.args]
    return launch.kernel.run(*args, grid=(1,), warmup=True, **launch.kwargs)


def _disassemble(ck) -> str:
    from triton.backends.nvidia import compiler as nvc

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(ck.asm["cubin"])
        tool = Path(nvc.__file__).parent / "bin" / "cuobjdump"
        return subprocess.run([str(tool), "-sass", str(p)], capture_output=True, text=True, check=True).stdout


def sass_of(launch, target: str = "sm_90") -> str:
    """Compile `launch` for `target` (the interpreter must be off in this process) and disassemble it."""
    return _disassemble(_compile(launch, target))


def decode_launches(params: dict | None = None) -> list:
    """The chord-w4a16 gpu preset's W4A16 launches at M <= 16 (dense decode sweep and the old tiles)."""
    from .. import toc  # the chapter's module by name: nothing below the chapters imports them

    C = toc.load_module(toc.CHAPTERS["chord-w4a16"])
    return C.decode_cost_launches(params or C.PRESETS["gpu"])


def measure(target: str = "sm_90", params: dict | None = None) -> list[dict]:
    rows = []
    for la in decode_launches(params):
        sass, facts = compile_facts(la, target)
        loop = main_loop(sass)
        weights, dram = iteration_bytes(la)
        warps = la.kwargs.get("num_warps", 4)
        ctas = 1
        for g in la.grid:
            ctas *= g
        rows.append({"launch": la.name, "target": target, "num_warps": warps, "grid_ctas": ctas, **facts,
                     **loop_cost(loop["instructions"], weights, dram, warps),
                     **residency(facts["regs"] or 255, facts["shared_bytes"], warps, ctas, dram,
                                 la.kwargs.get("num_stages", 3)),
                     "opcodes": loop["opcodes"]})
    return rows


def source_hash() -> str:
    """12 hex digits over the sources of the decode kernels and their helpers: the saved rows are
    stale when it changes (a test compares)."""
    import hashlib
    import inspect

    from . import fused_moe as FM, w4a16 as W

    fns = (W.w4a16_decode_kernel, W.decode_program, W.decode_run, W.group_activations, W.group_dot, W.run_scales,
           W.widen_pairs, W.nibble_bf16, W._nibble_pairs, W.decode_neg, FM.moe_decode_kernel, FM.moe_decode_epilogue,
           FM.stores_done)
    src = "".join(inspect.getsource(getattr(f, "fn", f)) for f in fns)
    return hashlib.sha256((src + repr(W.decode_config(1, 4096, 7168)) + repr(FM.moe_decode_config(False, True))
                           + repr(FM.moe_decode_config(False, False))).encode()).hexdigest()[:12]


def load_saved(root: Path | None = None) -> list[dict]:
    """The committed rows (data/compiled/loops/chord-w4a16.json), [] if absent."""
    from ..compiled import repo_root

    p = (root or repo_root()) / LOOPS_FILE
    return json.loads(p.read_text())["rows"] if p.is_file() else []


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "0":   # compile for real: restart with the interpreter off
        os.environ["TRITON_INTERPRET"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "inferbook.moe.loop_cost", *sys.argv[1:]])
    import argparse

    ap = argparse.ArgumentParser(prog="python -m inferbook.moe.loop_cost")
    ap.add_argument("--target", default="sm_90")
    ap.add_argument("--save", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(tempfile.gettempdir()) / "inferbook-loop-cost"))
    rows = measure(a.target)
    for r in rows:
        print(f"{r['launch']:<70} {r['instructions_per_64_weights_per_thread']:>6} per 64 w/thread  "
              f"{r['warp_instructions_per_byte']:.3f}/B  issue bound {r['issue_bound_vs_copy_ceiling']:.2f}x copy  "
              f"regs {r['regs']} smem {r['shared_bytes']} warps/SM {r['warps_per_sm']} "
              f"in flight {r['bytes_in_flight_per_sm']}/{r['bytes_in_flight_needed']} B")
    if a.save:
        from ..compiled import repo_root

        (repo_root() / LOOPS_FILE).write_text(json.dumps({"target": a.target, "copy_b_per_cycle_sm": COPY_B_PER_CYCLE_SM,
                                                          "issue_per_cycle": ISSUE_PER_CYCLE,
                                                          "source_hash": source_hash(), "rows": rows}, indent=1) + "\n")
