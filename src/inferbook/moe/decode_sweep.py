"""Which decode-kernel config the cost model prefers for one shape: a sweep of `w4a16_decode_kernel`'s
tiles, warps, pipeline depth and split-K, each compiled for a target and predicted by `compiled.predict`.

The per-target rules in `w4a16.DECODE_TARGETS` were chosen from such sweeps; this is the tool that
reruns them, so a reader (or the next rule) can see every alternative's bounds, not only the pick:

    python -m inferbook.moe.decode_sweep sm_100 6144 1536 --m 1,8 --block-n 64,128 --warps 2,4 \\
        --stages 3,4 --splits 2,3 --swap 0,1

prints one line per config: the predicted time (predicted, not measured), its binding bound, issue time
over memory time (issue 21's bar is <= 1/0.9), the spill bytes, the loads a trip waits one after another
(`compiled.machine.load_rounds`, which the prediction does not charge) and every bound's time. `--swap 1` sweeps
the swap-AB kernel (`w4a16_decode_swapped_kernel`, BLOCK_M 8, M <= 8) beside or instead of the plain one. The default card
is the target's (`compiled.TARGET_CARD`); its copy ceiling is the measured one where a committed
`ceilings` record has it, else the datasheet's (`compiled.predict_rows`). Nothing here runs a kernel.

`--moe E` sweeps the fused MoE decode's gate/up launch instead (`fused_moe.moe_decode_kernel`, E experts of
M rows each, N its intermediate size, K its hidden size; the split count is its SPLITS):

    python -m inferbook.moe.decode_sweep gfx950 1536 6144 --moe 9 --m 12 --block-n 64 --warps 1 --stages 1 \
        --splits 1,2,3,4
"""
from __future__ import annotations

import itertools
import sys

from ..errors import UserError, choices

USAGE = ("python -m inferbook.moe.decode_sweep TARGET N K [--m 1,8] [--block-n 64,128] [--warps 2,4] "
         "[--stages 3] [--splits 1,2,3] [--group 32] [--swap 0,1] [--moe E]")
LIMITS = dict(m=(1, 16), n=(16, 1 << 17), k=(16, 1 << 17), splits=(1, 512), stages=(1, 6), moe=(0, 1024))
BLOCK_NS = (16, 32, 64, 128, 256)
WARPS = (1, 2, 4, 8)
GROUPS = (32, 64, 128, 256)   # pack_decode's group sizes: divisors of a 256-wide run
MAX_CONFIGS = 256          # each config is one compile (seconds): a larger grid is a typo more often than a plan


def _ints(name: str, text: str, lo: int | None = None, hi: int | None = None, allowed=None) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise UserError(f"{name}: {text!r} is not a comma-separated list of integers") from None
    for v in vals:
        if allowed is not None and v not in allowed:
            raise UserError(f"{name}: {v} is not allowed; choose {choices(allowed)}")
        if lo is not None and not lo <= v <= hi:
            raise UserError(f"{name}: {v} is outside {lo}..{hi}")
    return vals


def parse(argv: list[str]) -> dict:
    """The sweep's arguments, checked before any compile (a bad value raises `UserError` naming it)."""
    from .. import compiled

    if len(argv) < 3 or argv[0] in ("-h", "--help"):
        raise UserError(f"usage: {USAGE}")
    target, n_text, k_text, rest = argv[0], argv[1], argv[2], argv[3:]
    if target not in compiled.TARGET_CARD:
        raise UserError(f"target {target!r} is not known; choose {choices(compiled.TARGET_CARD)}")
    (n,), (k,) = _ints("N", n_text, *LIMITS["n"]), _ints("K", k_text, *LIMITS["k"])
    opts = {"--m": "1", "--block-n": "64,128", "--warps": "2,4", "--stages": "3", "--splits": "1,2,3",
            "--group": "32", "--swap": "0", "--moe": "0"}             # w4a16.GROUP_SIZE, the chapters' packing
    if len(rest) % 2:
        raise UserError(f"{rest[-1]!r} needs a value; usage: {USAGE}")
    for flag, value in zip(rest[::2], rest[1::2]):
        if flag not in opts:
            raise UserError(f"unknown option {flag!r}; choose {choices(opts)}")
        opts[flag] = value
    (group,) = _ints("--group", opts["--group"], allowed=GROUPS)
    a = dict(target=target, n=n, k=k, group=group,
             m=_ints("--m", opts["--m"], *LIMITS["m"]),
             block_n=_ints("--block-n", opts["--block-n"], allowed=BLOCK_NS),
             warps=_ints("--warps", opts["--warps"], allowed=WARPS),
             stages=_ints("--stages", opts["--stages"], *LIMITS["stages"]),
             splits=_ints("--splits", opts["--splits"], *LIMITS["splits"]),
             swap=_ints("--swap", opts["--swap"], allowed=(0, 1)))
    (a["moe"],) = _ints("--moe", opts["--moe"], *LIMITS["moe"])
    if a["moe"] and 1 in a["swap"]:
        raise UserError("--moe sweeps the MoE kernel, which has no swap-AB form: drop --swap 1")
    from .w4a16 import RUN, SWAP_MAX_M

    if 1 in a["swap"] and max(a["m"]) > SWAP_MAX_M:
        raise UserError(f"--swap 1 takes M <= {SWAP_MAX_M} (its BLOCK_M), got --m {max(a['m'])}")

    runs = -(-k // RUN)
    if max(a["splits"]) > runs:
        raise UserError(f"--splits: {max(a['splits'])} is more than K {k}'s {runs} runs of {RUN}")
    size = len(configs(a))
    if size > MAX_CONFIGS:
        raise UserError(f"{size} configs to compile; at most {MAX_CONFIGS} (narrow --m, --block-n, --warps, "
                        f"--stages or --splits)")
    return a


def configs(a: dict) -> list[dict]:
    """Every (M, decode config) of the sweep, in the order printed."""
    from .w4a16 import SWAP_MAX_M

    return [dict(M=m, cfg=dict(BLOCK_M=SWAP_MAX_M, BLOCK_N=bn, SPLIT_K=sp, num_warps=w, num_stages=st, SWAP_AB=True)
                 if sw else dict(BLOCK_M=16, BLOCK_N=bn, SPLIT_K=sp, num_warps=w, num_stages=st))
            for m, sw, bn, w, st, sp in itertools.product(a["m"], a["swap"], a["block_n"], a["warps"], a["stages"],
                                                          a["splits"])]


def launch(a: dict, m: int, cfg: dict):
    """The `compiled.Launch` `decode_linear` makes at this config (`w4a16.decode_launches`: deterministic
    split-K, meta tensors of pack_decode's shapes)."""
    from ..device import building_for
    from . import w4a16 as W

    with building_for(a["target"]):
        if W.decode_config(m, a["n"], a["k"]).get("CDNA_LOOP"):   # the target's loop, as decode_config picks it
            cfg = {**cfg, "CDNA_LOOP": True}
        if a["moe"]:
            from . import fused_moe as FM

            moe = {key: v for key, v in cfg.items() if key != "SPLIT_K"}
            if cfg["SPLIT_K"] > 1:
                moe["SPLITS"] = cfg["SPLIT_K"]
            return FM.fused_moe_decode_launches(m, 1, a["moe"], a["k"], a["n"], max_m=m, group_size=a["group"],
                                                gated_cfg=moe)[0]
        return W.decode_launches(m, a["n"], a["k"], group_size=a["group"], cfg=cfg)[0]


def line(m: int, cfg: dict, row: dict, p: dict | None) -> str:
    head = (f"M{m} bn{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']} split{cfg['SPLIT_K']}"
            + (" swap-AB" if cfg.get("SWAP_AB") else ""))
    if p is None:
        return f"{head}: did not compile: {row.get('error', '?')[:200]}"
    b = p["bounds"]
    rounds = (row.get("sass") or row.get("isa_loop") or {}).get("load_rounds")
    return (f"{head}: {p['seconds'] * 1e6:.2f} µs predicted, {p['bound']}-bound, issue/memory "
            f"{b['issue'] / b['memory']:.2f}, spill {row.get('spill_bytes', 0)} B, loads in turn a trip {rounds} | "
            + " ".join(f"{name} {t * 1e6:.2f}" for name, t in b.items()))


def sweep(a: dict, out=print) -> list[tuple[dict, dict | None]]:
    """Compile and predict every config (the Triton interpreter must be off in this process)."""
    from .. import compiled

    card = compiled.TARGET_CARD[a["target"]]
    res = []
    for c in configs(a):
        row = compiled.compile_launch(launch(a, c["M"], c["cfg"]), a["target"])
        preds = compiled.predict_rows([row], card)
        p = preds[0] if preds else None
        out(line(c["M"], c["cfg"], row, p))
        res.append((c, p))
    return res


def main(argv: list[str]) -> int:
    from .. import compiled

    return compiled.run_tool("decode_sweep", argv, parse, sweep)


if __name__ == "__main__":
    from inferbook.compiled import restart_compiling

    restart_compiling("inferbook.moe.decode_sweep", sys.argv[1:])
    sys.exit(main(sys.argv[1:]))
