"""Which launch config the cost model prefers for one kernel's launches in a chapter: the chapter's
gpu-preset launches built again with a named config's values replaced (tiles, warps, stages), each
compiled for a target and predicted by `compiled.predict`, beside the config the code chooses now.

The per-target configs of the attention, conv, MX and GDN kernels were chosen from such sweeps; this is
the tool that reruns them, e.g. the CDNA dK/dV tile of `attention.flash.block_config`:

    inferbook sweep attention-test-matrix gfx942 attention.dkdv --kernel _attn_bwd_dkdv_kernel \\
        --launch "throughput d128 full" --set BLOCK_M=32,64,128 --set BLOCK_N=32,64 --set num_warps=4,8

The launches are built by the chapter's own `gpu_launches`, so a launcher that derives its grid from
the tile derives it from the swept tile too (`device.overriding_config`; the config functions return
their value through `device.swept` under the names in `CONFIGS`). Each config prints its predicted time
summed over the matched launches (predicted, not measured), how many of them it makes faster or slower
than the chosen config (by more than 1 %), the most any of them spills, the most loads one trip of theirs waits
in turn (`machine.load_rounds`, which the prediction does not charge), and what binds them; `--each` adds
a line per launch. The card is the target's (`compiled.TARGET_CARD`) unless `--card` names another of its vendor;
its copy ceiling is the measured one where a committed `ceilings` record has it, else the datasheet's.
The launches are every one the chapter makes, as often as it makes it (`compiled.every_launch`), where
its compile table keeps one per specialisation. The values apply wherever the named config is asked (every
head dim's dK/dV, say); `--launch` picks which of the kernel's launches are compiled and summed, so a sweep
of one branch of a config function names that branch's launches. `inferbook sweep ...` is this module with
the interpreter off. Nothing here runs a kernel. The W4A16 decode kernels have their own sweep
(`inferbook.moe.decode_sweep`: split-K and swap-AB are not a config dict's values).
"""
from __future__ import annotations

import itertools
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from .. import compiled
from ..errors import UserError, choices

# name -> where the config is chosen (each returns it through `device.swept(name, ...)`)
CONFIGS = {
    "attention.fwd": "attention.flash.block_config(kind='fwd')",
    "attention.dq": "attention.flash.block_config(kind='dq')",
    "attention.dkdv": "attention.flash.block_config(kind='dkdv')",
    "conv3d": "diffusion.fused.conv_config",
    "mx.quantize": "numerics.mx (mx_quantize_kernel's warps)",
    "mx.quantize_rowcol": "numerics.mx (mx_quantize_rowcol_kernel's warps)",
    "mx.gemm": "numerics.mx.mx_gemm_config",
    "gdn.chunk": "numerics.gdn_chunk.chunk_blocks",
    "gdn.bwd": "numerics.gdn_chunk_bwd.bwd_blocks",
    "moe.decode_tail": "moe.fused_moe.decode_tail_config",
    "moe.decode_tail_fp4": "moe.fused_moe.decode_tail_config(fp4=True)",
}
USAGE = ("python -m inferbook.compiled.sweep CHAPTER TARGET CONFIG --kernel NAME [--launch TEXT ...] "
         "[--set KEY=V1,V2 ...] [--card CARD] [--jobs N] [--each]")
MAX_CONFIGS = 64        # each config is a compile per matched launch: a larger grid is a typo more often than a plan
MAX_COMPILES = 1000
VALUE_RANGE = (1, 1 << 16)
SAME = 0.01             # a launch predicted within 1 % of the chosen config's counts as neither faster nor slower:
                        # the model (datasheet ceilings, no stalls) is not that precise


def _values(key: str, text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UserError(f"--set {key}: {text!r} is not a comma-separated list of integers") from None
    for v in vals:
        if not VALUE_RANGE[0] <= v <= VALUE_RANGE[1]:
            raise UserError(f"--set {key}: {v} is outside {VALUE_RANGE[0]}..{VALUE_RANGE[1]}")
    return vals


def parse(argv: list[str]) -> dict:
    """The sweep's arguments, checked before any compile (a bad value raises `UserError` naming it).
    Builds the chapter's launches once (no compile) to check the kernel, the launch filter and the keys."""
    if len(argv) < 3:
        raise UserError(f"usage: {USAGE}")
    slug, target, name, rest = argv[0], argv[1], argv[2], argv[3:]
    if target not in compiled.TARGETS:
        raise UserError(f"target {target!r} is not known; choose {choices(compiled.TARGETS)}")
    if name not in CONFIGS:
        raise UserError(f"config {name!r} is not known; choose {choices(CONFIGS)}")
    a = dict(slug=slug, target=target, name=name, kernel=None, launch=[], set={}, card=compiled.TARGET_CARD[target],
             jobs=1, each=False)
    i, given = 0, set()
    while i < len(rest):
        flag = rest[i]
        if flag == "--each":
            a["each"] = True
            i += 1
            continue
        if flag not in ("--kernel", "--launch", "--set", "--card", "--jobs"):
            raise UserError(f"unknown option {flag!r}; choose --kernel, --launch, --set, --card, --jobs, --each")
        if i + 1 >= len(rest):
            raise UserError(f"{flag} needs a value; usage: {USAGE}")
        value = rest[i + 1]
        i += 2
        if flag in given and flag != "--launch" and flag != "--set":
            raise UserError(f"{flag} given twice")
        given.add(flag)
        if flag == "--launch":
            a["launch"].append(value)
        elif flag == "--set":
            key, eq, text = value.partition("=")
            if not eq or not key:
                raise UserError(f"--set {value!r}: write KEY=V1,V2")
            if key in a["set"]:
                raise UserError(f"--set {key} given twice")
            a["set"][key] = _values(key, text)
        elif flag == "--jobs":
            try:
                a["jobs"] = int(value)
            except ValueError:
                raise UserError(f"--jobs {value!r} is not an integer") from None
            if not 1 <= a["jobs"] <= 64:
                raise UserError(f"--jobs {a['jobs']} is outside 1..64")
        else:
            a[flag[2:]] = value
    if a["kernel"] is None:
        raise UserError(f"--kernel is required (the kernel whose launches are compiled; `inferbook inspect "
                        f"{slug} --target {target}` lists them)")
    compiled._check_card(target, a["card"])
    if not a["set"]:
        raise UserError("nothing to sweep: give at least one --set KEY=V1,V2")
    size = len(grid(a))
    if size > MAX_CONFIGS:
        raise UserError(f"{size} configs; at most {MAX_CONFIGS} (narrow the --set lists)")
    from ..toc import get_chapter

    get_chapter(slug)                        # an unknown chapter: its UserError, naming the chapters
    if not compiled.has_launches(slug):
        raise UserError(f"chapter {slug!r} has no kernel launches to sweep; choose {choices(compiled.kernel_chapters())}")
    launches, override = build(a, {})
    matched = match(a, launches)
    if not matched:
        kernels = sorted({compiled.kernel_name(x) for x in launches})
        raise UserError(f"no launch of kernel {a['kernel']!r}" + (f" named with {' or '.join(map(repr, a['launch']))}"
                                                                  if a["launch"] else "")
                        + f" in {slug} on {target}; its kernels: {', '.join(kernels)}")
    if not override.asked:
        raise UserError(f"config {name!r} is not asked for by {slug}'s launches on {target}")
    unknown = sorted(set(a["set"]) - override.keys)
    if unknown:
        raise UserError(f"config {name!r} has no {', '.join(unknown)}; its keys are {', '.join(sorted(override.keys))}")
    a["indices"] = matched
    if len(matched) * (size + 1) > MAX_COMPILES:
        raise UserError(f"{len(matched)} launches x {size + 1} configs = {len(matched) * (size + 1)} compiles; at most "
                        f"{MAX_COMPILES} (narrow --launch or the --set lists)")
    return a


def grid(a: dict) -> list[dict]:
    """Every combination of the --set values, in the order given."""
    keys = list(a["set"])
    return [dict(zip(keys, combo)) for combo in itertools.product(*(a["set"][k] for k in keys))]


def build(a: dict, values: dict):
    """(the chapter's launches for the target with `values` over the named config, the `ConfigOverride`)."""
    from ..device import overriding_config

    with overriding_config(a["name"], values) as o, compiled.every_launch():
        launches = compiled.launches_for(a["slug"], a["target"])
    return launches, o


def match(a: dict, launches: list) -> list[int]:
    """Indices of the launches of `--kernel` whose name contains a `--launch` text (any; all without one), in a
    build of every launch (`compiled.every_launch`): each launch the chapter makes, as often as it makes it,
    where its compile table keeps one per specialisation. A tile that makes two launches one compile cannot
    shift them."""
    return [i for i, x in enumerate(launches)
            if compiled.kernel_name(x) == a["kernel"] and (not a["launch"] or any(t in x.name for t in a["launch"]))]


def run_config(a: dict, values: dict | None) -> dict:
    """Compile and predict the matched launches at `values` (None: the config as chosen). The Triton
    interpreter must be off in this process."""
    launches, _ = build(a, values or {})
    rows = []
    for i in a["indices"]:          # the chosen config's matched launches (`parse`), at these values
        if i >= len(launches) or compiled.kernel_name(launches[i]) != a["kernel"]:
            rows.append(dict(index=i, name="?", ok=False, seconds=None, error="the build at this config made other launches"))
            continue
        launch = launches[i]
        r = compiled.compile_launch(launch, a["target"])
        preds = compiled.predict_rows([r], a["card"]) if r.get("ok") else []
        p = preds[0] if preds else None
        rows.append(dict(index=i, name=launch.name, ok=p is not None, error=(r.get("error") or "")[:300],
                         seconds=p["seconds"] if p else None, bound=p["bound"] if p else None,
                         ceiling=p.get("ceiling") if p else None, spill=int(r.get("spill_bytes") or 0),
                         regs=r.get("regs"), num_warps=r.get("num_warps"), grid=r.get("grid"),
                         rounds=(r.get("sass") or r.get("isa_loop") or {}).get("load_rounds")))
    return {"values": values, "rows": rows}


def summary(res: dict, chosen: dict | None) -> str:
    """One config's line: predicted total over the matched launches, faster/slower than the chosen
    config on how many, the largest spill, and the binding bounds."""
    head = "chosen" if res["values"] is None else " ".join(f"{k}={v}" for k, v in res["values"].items())
    rows = res["rows"]
    bad = [r for r in rows if not r["ok"]]
    if bad:
        return f"{head}: {len(bad)} of {len(rows)} launches did not compile ({bad[0]['error'][:160]})"
    total = sum(r["seconds"] for r in rows)
    bounds: dict[str, int] = {}
    for r in rows:
        bounds[r["bound"]] = bounds.get(r["bound"], 0) + 1
    vs = ""
    if chosen is not None and res["values"] is not None and all(r["ok"] for r in chosen["rows"]):
        base = {r["index"]: r["seconds"] for r in chosen["rows"]}
        faster = sum(1 for r in rows if r["seconds"] < base[r["index"]] * (1 - SAME))
        slower = sum(1 for r in rows if r["seconds"] > base[r["index"]] * (1 + SAME))
        vs = f", faster on {faster}, slower on {slower}"
    rounds = max((r.get("rounds") or 0 for r in rows), default=0)
    return (f"{head}: {_time(total)} predicted over {len(rows)} launches{vs}, spill up to "
            f"{max(r['spill'] for r in rows)} B, loads in turn a trip up to {rounds} (not charged); bound "
            + ", ".join(f"{b} {n}" for b, n in sorted(bounds.items())))


def _time(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


def each(res: dict) -> list[str]:
    return [f"    [{r['index']}] {r['name'][:90]}: " + (f"{_time(r['seconds'])} {r['bound']}-bound, {r['num_warps']} warps, "
                                                      f"{r['regs']} registers, grid {r['grid']}, spill {r['spill']} B, "
                                                      f"loads in turn a trip {r.get('rounds')}"
                                                      if r["ok"] else f"did not compile: {r['error'][:120]}")
            for r in res["rows"]]


def sweep(a: dict, out=print) -> list[dict]:
    """The chosen config, then every grid config: compiled, predicted, printed best first."""
    configs = [None] + grid(a)
    measured = compiled.measured_copy_gbps(a["card"])
    out(f"{a['name']} ({CONFIGS[a['name']]}) on {a['target']}, {a['card']}: kernel {a['kernel']}"
        + (f", launches named with {' or '.join(map(repr, a['launch']))}" if a["launch"] else "")
        + "; predicted by the cost model, not "
        f"measured ({'measured copy ceiling: ' + measured[1] if measured else 'datasheet ceilings'})")
    if a["jobs"] > 1:
        with ProcessPoolExecutor(max_workers=a["jobs"], mp_context=get_context("spawn")) as pool:
            results = list(pool.map(run_config, [a] * len(configs), configs))
    else:
        results = [run_config(a, c) for c in configs]
    chosen = results[0]

    def key(res):
        rows = res["rows"]
        return (not all(r["ok"] for r in rows), sum(r["seconds"] or 0 for r in rows))
    for res in [chosen] + sorted(results[1:], key=key):
        out(summary(res, chosen))
        if a["each"]:
            for line in each(res):
                out(line)
    return results


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {USAGE}\n\nCONFIG, and where each is chosen:")
        for name, where in CONFIGS.items():
            print(f"  {name:20s} {where}")
        return 0
    return compiled.run_tool("sweep", argv, parse, sweep)


if __name__ == "__main__":
    from inferbook.compiled import restart_compiling

    restart_compiling("inferbook.compiled.sweep", sys.argv[1:])
    sys.exit(main(sys.argv[1:]))
