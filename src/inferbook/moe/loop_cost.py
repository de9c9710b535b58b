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
prints (or saves to data/compiled/chord-w4a16-loops.json) one row per launch.
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
LOOPS_FILE = "data/compiled/chord-w4a16-loops.json"

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
    kw = launch.kwargs
    group = kw["GROUP"]
    name = getattr(launch.kernel, "__name__", "") or getattr(getattr(launch.kernel, "fn", None), "__name__", "")
    bn = kw["BLOCK_N"]
    if name in ("w4a16_decode_kernel", "moe_decode_kernel"):   # one pass = one run of 256 K values
        bk = 256
    else:
        bk = kw["BLOCK_K"]
    gated = 2 if kw.get("GATED") else 1
    weights = gated * bn * bk
    return weights, weights // 2 + 2 * weights // group


def sass_of(launch, target: str = "sm_90") -> str:
    """Compile `launch` for `target` (the interpreter must be off in this process) and disassemble it."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import compiler as nvc
    from triton.runtime.driver import driver

    from .. import compiled

    arch = compiled.TARGETS[target]
    driver.set_active(compiled._AOTDriver(GPUTarget("cuda", arch, 32)))
    args = [compiled.ptr(a.dtype) if isinstance(a, torch.Tensor) else a for a in launch.args]
    ck = launch.kernel.run(*args, grid=(1,), warmup=True, **launch.kwargs)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.cubin"
        p.write_bytes(ck.asm["cubin"])
        tool = Path(nvc.__file__).parent / "bin" / "cuobjdump"
        return subprocess.run([str(tool), "-sass", str(p)], capture_output=True, text=True, check=True).stdout


def decode_launches(params: dict | None = None) -> list:
    """The chord-w4a16 gpu preset's W4A16 launches at M <= 16 (dense decode sweep and the old tiles)."""
    from ..chapters import chord_w4a16 as C

    return C.decode_cost_launches(params or C.PRESETS["gpu"])


def measure(target: str = "sm_90", params: dict | None = None) -> list[dict]:
    rows = []
    for la in decode_launches(params):
        loop = main_loop(sass_of(la, target))
        weights, dram = iteration_bytes(la)
        rows.append({"launch": la.name, "target": target, "num_warps": la.kwargs.get("num_warps", 4),
                     **loop_cost(loop["instructions"], weights, dram, la.kwargs.get("num_warps", 4)),
                     "opcodes": loop["opcodes"]})
    return rows


def load_saved(root: Path | None = None) -> list[dict]:
    """The committed rows (data/compiled/chord-w4a16-loops.json), [] if absent."""
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
        print(f"{r['launch']:<70} {r['instructions_per_pass']:>5} instr/pass  "
              f"{r['instructions_per_64_weights_per_thread']:>6} per 64 w/thread  {r['warp_instructions_per_byte']:.3f}/B  "
              f"issue bound {r['issue_bound_vs_copy_ceiling']:.2f}x copy")
    if a.save:
        from ..compiled import repo_root

        (repo_root() / LOOPS_FILE).write_text(json.dumps({"target": a.target, "copy_b_per_cycle_sm": COPY_B_PER_CYCLE_SM,
                                                          "issue_per_cycle": ISSUE_PER_CYCLE, "rows": rows}, indent=1) + "\n")
