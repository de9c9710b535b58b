"""MXFP8 on the expert-parallel wire: dispatch and combine over torch.distributed whose payload is
MXFP8 codes plus E8M0 scales, feeding a grouped GEMM that takes the pre-quantized rows.

Transformer Engine 2.19 (seed section 七): NCCL-EP dispatch (forward) and combine (backward) accept
MXFP8, and GroupedLinear / the fused grouped MLP accept pre-quantized inputs. The point: the GEMM
consumes MXFP8 anyway, so quantizing *before* the exchange sends 1 + 1/32 bytes per element instead
of BF16's 2, and the expert rank does not quantize again. Row-wise MX blocks run along the hidden
dimension of one token, so a token's codes and scales do not depend on where it is quantized:
quantize-then-exchange is bit-exact with exchange-then-quantize. `run_rank` checks exactly that.

Layout (world W ranks, E experts, E % W == 0, experts_per_rank = E / W, expert e on rank e // epr):

- each rank holds T tokens x [T, H] (BF16), top-k expert ids [T, k] and weights [T, k];
- dispatch: every (token, slot) pair goes to its expert's rank, in the order (destination rank,
  token, slot); counts are exchanged first (`all_to_all_single`), then the payload;
- the expert rank sorts its received rows by local expert (stable) and runs one grouped GEMM
  y = dequant(rows) @ W_e^T (fp32 accumulate, BF16 out);
- combine (forward, BF16): y goes back along the reverse exchange; the origin sums
  w[t, s] * y[t, s] over slots s = 0..k-1 in fp32, in slot order, and rounds to BF16 once;
- combine backward: dy [T, N] goes to the experts by the same routing, with the same MXFP8 payload
  option, and the expert rank computes dx rows = dequant(dy rows) @ W_e (the dgrad GEMM).

Where the ranks live (`launch`): on CPU, one gloo process per rank on loopback; on CUDA with at least
`world` GPUs, one NCCL process per rank, each on its own GPU, device tensors end to end; on CUDA with
fewer GPUs, one process holds every rank's slice on its GPU and `SlicesWire` moves the rows between the
slices (device-to-device copies: the same bytes in the same order as the all-to-all, through HBM, not
NVLink). The layer's code is one (`moe_forward_backward` over the ranks a process holds); only the
wire differs.

Not built: DeepEP/NCCL-EP's deduplication of a token sent to several experts on one rank (here
one row per (token, slot) pair), and their low-latency kernels.
"""
from __future__ import annotations

import datetime
import math
import traceback
from pathlib import Path

import torch

from ..errors import UserError
from . import grouped, mx

PAYLOADS = ("mxfp8", "bf16")
BLOCK = 32


def check_layout(world: int, experts: int, topk: int, hidden: int) -> int:
    """experts_per_rank, or UserError naming what does not fit."""
    for name, v in (("world", world), ("experts", experts), ("topk", topk), ("hidden", hidden)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{name} must be a positive int, got {v!r}")
    if world > 8:
        raise UserError(f"world must be at most 8 ranks on one machine, got {world}")
    if hidden % BLOCK:
        raise UserError(f"hidden={hidden} must be a multiple of the MX block ({BLOCK})")
    if experts % world:
        raise UserError(f"experts={experts} must be a multiple of the ranks ({world})")
    if topk > experts:
        raise UserError(f"topk={topk} exceeds experts={experts}")
    return experts // world


def make_problem(rank: int, tokens: int, hidden: int, inter: int, experts: int, topk: int, seed: int,
                 device="cpu") -> dict:
    """This rank's tokens, routing and upstream gradient, and every expert's weight [E, N, H]
    (the same on every rank from the seed; each rank uses its own experts'). Fresh random values,
    drawn on CPU (the same on any device) and placed on `device`."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(tokens, hidden, generator=g)
    x[:, torch.randperm(hidden, generator=g)[: max(1, hidden // 64)]] *= 20.0   # outlier channels
    logits = torch.randn(tokens, experts, generator=g)
    w_top, ids = logits.softmax(-1).topk(topk, dim=-1)
    dy = torch.randn(tokens, inter, generator=g)
    gw = torch.Generator().manual_seed(seed * 104729)
    w = torch.randn(experts, inter, hidden, generator=gw) / math.sqrt(hidden)
    p = {"x": x.bfloat16(), "ids": ids, "weights": w_top.float(), "dy": dy.bfloat16(), "w": w.bfloat16()}
    return {k: v.to(device) for k, v in p.items()}


def _order(ids: torch.Tensor, epr: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair order, destination rank per pair in that order): pairs (token, slot) flattened and
    stably sorted by destination rank."""
    dest = (ids // epr).reshape(-1)
    order = torch.sort(dest, stable=True).indices
    return order, dest[order]


class ProcessWire:
    """This process is one rank of a torch.distributed group (gloo on CPU, NCCL on CUDA): `a2a` is
    `all_to_all_single` of its rows. Lists have one entry, this rank's."""

    def __init__(self, group=None):
        self.group = group

    def counts(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed as dist

        recv = torch.empty_like(send[0])
        dist.all_to_all_single(recv, send[0], group=self.group)
        return [recv]

    def a2a(self, ts: list[torch.Tensor], send_counts: list[list[int]], recv_counts: list[list[int]]):
        import torch.distributed as dist

        t, sc, rc = ts[0], send_counts[0], recv_counts[0]
        row = int(math.prod(t.shape[1:]))
        out = torch.empty((sum(rc), *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_to_all_single(out.view(-1) if row else out, t.contiguous().view(-1) if row else t,
                               [c * row for c in rc], [c * row for c in sc], group=self.group)
        return [out]

    def barrier(self):
        import torch.distributed as dist

        dist.barrier(group=self.group)


class SlicesWire:
    """One process holds every rank's slice (one GPU, or a test on CPU): `a2a` delivers to rank j the
    rows each rank i sends it, in source-rank order, as `all_to_all_single` does: the same bytes, moved
    by device copies. Lists have one entry per rank, in rank order."""

    def counts(self, send: list[torch.Tensor]) -> list[torch.Tensor]:
        m = torch.stack(send)                      # m[i, j]: rows rank i sends to rank j
        return list(m.t().contiguous().unbind(0))

    def a2a(self, ts: list[torch.Tensor], send_counts: list[list[int]], recv_counts: list[list[int]]):
        parts = [t.split(sc) for t, sc in zip(ts, send_counts)]
        return [torch.cat([parts[i][j] for i in range(len(ts))]) for j in range(len(ts))]

    def barrier(self):
        pass


def quantize_rows(x: torch.Tensor) -> mx.MXTensor:
    """Row-wise 1 x 32 MXFP8 E4M3 (floor rule) along the last axis: what the GEMM reduces over."""
    chosen, _ = mx.pick_backend(x.device, "auto")
    fn = mx.quantize_triton if chosen == "triton" else mx.quantize_reference
    return fn(x, "e4m3", axis=-1, block=BLOCK)


def exchange(rows: list[torch.Tensor], dest: list[torch.Tensor], world: int, payload: str, wire) -> dict:
    """Send each held rank's rows [P, D] (BF16, already in destination-rank order `dest` [P]) to their ranks.

    payload 'mxfp8': quantize at the sender, send codes [P, D] uint8 and scales [P, D/32] uint8; the
    receiver gets MXTensors. payload 'bf16': send the rows (the receiver quantizes).
    Returns {'mx' or 'bf16': [per held rank], 'send_counts', 'recv_counts', 'bytes_sent': [per held rank]}."""
    if payload not in PAYLOADS:
        raise UserError(f"payload must be one of {PAYLOADS}, got {payload!r}")
    send = [torch.bincount(d, minlength=world).to(torch.int64) for d in dest]
    recv = wire.counts(send)
    sc, rc = [x.tolist() for x in send], [x.tolist() for x in recv]
    if payload == "mxfp8":
        qs = [quantize_rows(r) for r in rows]
        codes = wire.a2a([q.elements for q in qs], sc, rc)
        scales = wire.a2a([q.scales for q in qs], sc, rc)
        got = [mx.MXTensor(c, g, "e4m3", 1, BLOCK, "floor", rows[0].dtype, qs[0].backend) for c, g in zip(codes, scales)]
        return {"mx": got, "send_counts": sc, "recv_counts": rc,
                "bytes_sent": [q.elements.numel() + q.scales.numel() for q in qs]}
    got = wire.a2a(rows, sc, rc)
    return {"bf16": got, "send_counts": sc, "recv_counts": rc,
            "bytes_sent": [r.numel() * r.element_size() for r in rows]}


def received_mx(ex: dict) -> list[mx.MXTensor]:
    """The MXFP8 rows each held rank's expert GEMM consumes: as received, or quantized on arrival."""
    return ex["mx"] if "mx" in ex else [quantize_rows(r) for r in ex["bf16"]]


def expert_gemm(a: mx.MXTensor, local_expert: torch.Tensor, w_local: torch.Tensor) -> torch.Tensor:
    """The expert rank's grouped GEMM on its received MXFP8 rows, in received order.

    a: rows [R, K] as MXFP8; local_expert [R] in 0..G-1; w_local [G, N, K]. Rows are grouped by expert
    (stable sort), each group is one matmul of its dequantized rows (fp32 values, exact) with fp32
    accumulation, BF16 out; returns [R, N] in received order."""
    by_expert = torch.sort(local_expert, stable=True).indices
    sizes = torch.bincount(local_expert, minlength=w_local.shape[0]).tolist()
    y_sorted = grouped.grouped_gemm_reference(mx.dequantize(a)[by_expert], w_local.float(), sizes).bfloat16()
    y = torch.empty_like(y_sorted)
    y[by_expert] = y_sorted
    return y


def combine(pair_rows: torch.Tensor, order: torch.Tensor, T: int, k: int, weights: torch.Tensor | None):
    """Rows back at their origin, in send order -> [T, D]: sum over slots 0..k-1 in slot order in fp32,
    weighted by `weights` [T, k] (forward) or not (backward's dx), rounded to BF16 once."""
    pair = torch.empty(T * k, pair_rows.shape[1], dtype=pair_rows.dtype, device=pair_rows.device)
    pair[order] = pair_rows
    pair = pair.view(T, k, -1).float()
    out = torch.zeros(T, pair_rows.shape[1], dtype=torch.float32, device=pair_rows.device)
    for s in range(k):
        out += pair[:, s] * (weights[:, s, None] if weights is not None else 1.0)
    return out.bfloat16()


def _pairs(p: dict, epr: int) -> dict:
    """A rank's (token, slot) pairs in send order: order, destination, token, local expert, and the
    backward's per-pair upstream gradient w[t, s] * dy[t] (BF16)."""
    T, k = p["ids"].shape
    order, dest = _order(p["ids"], epr)
    tok = order // k
    local = p["ids"].reshape(-1)[order] % epr
    dy_pairs = (p["dy"].float()[tok] * p["weights"].reshape(-1)[order, None]).bfloat16()
    return {"order": order, "dest": dest, "tok": tok, "local": local, "dy": dy_pairs, "T": T, "k": k}


def moe_forward_backward(ps: list[dict], ranks: list[int], world: int, epr: int, payload: str, wire) -> list[dict]:
    """One MoE layer's expert part for the ranks this process holds (`ps[i]` is rank `ranks[i]`'s
    problem): dispatch (payload), grouped GEMM, combine (BF16); then the backward's dy dispatch
    (payload) and dgrad grouped GEMM, combined back (BF16). Per held rank: the combined forward
    output [T, N], dx [T, H], the bytes it sent and the codes/scales it received."""
    qs = [_pairs(p, epr) for p in ps]
    dest = [q["dest"] for q in qs]
    ex = exchange([p["x"][q["tok"]] for p, q in zip(ps, qs)], dest, world, payload, wire)
    send, recv = ex["send_counts"], ex["recv_counts"]
    local_in = wire.a2a([q["local"] for q in qs], send, recv)         # which local expert each row is for
    w_local = [p["w"][r * epr:(r + 1) * epr] for p, r in zip(ps, ranks)]   # [epr, N, H]
    a = received_mx(ex)
    y = [expert_gemm(ai, li, wi) for ai, li, wi in zip(a, local_in, w_local)]
    back = wire.a2a(y, recv, send)
    out = [combine(b, q["order"], q["T"], q["k"], p["weights"]) for b, q, p in zip(back, qs, ps)]   # BF16 combine

    exb = exchange([q["dy"] for q in qs], dest, world, payload, wire)   # combine backward: dy to the experts
    dq = received_mx(exb)
    dx_rows = [expert_gemm(di, li, wi.transpose(1, 2)) for di, li, wi in zip(dq, local_in, w_local)]   # dgrad
    dx = [combine(b, q["order"], q["T"], q["k"], None) for b, q in zip(wire.a2a(dx_rows, recv, send), qs)]
    return [{"out": out[i], "dx": dx[i], "bytes_sent": ex["bytes_sent"][i] + exb["bytes_sent"][i],
             "received_codes": a[i].elements, "received_scales": a[i].scales} for i in range(len(ps))]


def timed_dispatch(ps: list[dict], world: int, epr: int, wire, device, reps: int, warmup: int = 2) -> dict:
    """Dispatch times per payload for the held ranks, warmed up and interleaved: each round times one
    dispatch of each payload, alternating which goes first, with a barrier and a device sync around
    each sample (so every rank's sample covers the whole exchange). {payload: [seconds]}."""
    import time

    from ..device import synchronize

    order = [_order(p["ids"], epr) for p in ps]
    rows = [p["x"][o // p["ids"].shape[1]] for p, (o, _) in zip(ps, order)]
    dest = [d for _, d in order]
    times = {pl: [] for pl in PAYLOADS}
    for i in range(warmup + reps):
        for pl in (PAYLOADS if i % 2 == 0 else PAYLOADS[::-1]):
            wire.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            exchange(rows, dest, world, pl, wire)
            synchronize(device)
            if i >= warmup:
                times[pl].append(time.perf_counter() - t0)
    return times


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    return x


def single_process_reference(problems: list[dict], epr: int) -> list[dict]:
    """The same layer with no communication: every rank's pairs gathered in one process in the order an
    all-to-all delivers them (source rank, then the source's send order), quantized before the move,
    the same grouped GEMM and the same combine. The distributed result must equal it in bits."""
    world = len(problems)
    pairs = [_pairs(p, epr) for p in problems]
    outs = [{} for _ in problems]
    for what in ("fwd", "bwd"):
        back = [[None] * world for _ in range(world)]                # back[src][dst]: rows for src from dst
        for dst in range(world):
            sel = [pr["dest"] == dst for pr in pairs]
            rows = [quantize_rows(problems[s]["x"][pairs[s]["tok"][sel[s]]] if what == "fwd" else pairs[s]["dy"][sel[s]])
                    for s in range(world)]
            a = mx.MXTensor(torch.cat([r.elements for r in rows]), torch.cat([r.scales for r in rows]), "e4m3", 1,
                            BLOCK, "floor", torch.bfloat16)
            local = torch.cat([pairs[s]["local"][sel[s]] for s in range(world)])
            w_local = problems[dst]["w"][dst * epr:(dst + 1) * epr]
            y = expert_gemm(a, local, w_local if what == "fwd" else w_local.transpose(1, 2))
            counts = [int(x.sum()) for x in sel]
            for s, part in enumerate(torch.split(y, counts)):
                back[s][dst] = part
        for s, p in enumerate(problems):
            rows = torch.cat(back[s])
            pr = pairs[s]
            outs[s]["out" if what == "fwd" else "dx"] = combine(rows, pr["order"], pr["T"], pr["k"],
                                                                p["weights"] if what == "fwd" else None)
    return outs


def run_rank(rank: int, world: int, init_method: str, args: dict, out_dir: str, timeout_s: float) -> None:
    """One rank (spawned by `launch`): both payloads on the same problem, their results and the
    interleaved dispatch times. gloo with CPU tensors, or NCCL with this rank's GPU (args['device'])."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    path = Path(out_dir)
    try:
        device = torch.device(args.get("device", "cpu"))
        if device.type == "cuda":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if backend == "nccl" else {}))
        try:
            epr = check_layout(world, args["experts"], args["topk"], args["hidden"])
            p = make_problem(rank, args["tokens"], args["hidden"], args["inter"], args["experts"], args["topk"],
                             args["seed"], device)
            wire = ProcessWire()
            res = {pl: moe_forward_backward([p], [rank], world, epr, pl, wire)[0] for pl in PAYLOADS}
            reps = int(args.get("reps", 0))
            times = timed_dispatch([p], world, epr, wire, device, reps) if reps else {}
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save({"rank": rank, "results": _to_cpu(res), "times": times, "backend": backend,
                    "device": str(device)}, path / f"rank{rank}.pt")
    except BaseException:
        (path / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_slices(world: int, args: dict, device) -> list[dict]:
    """Every rank's slice in this process on `device` (one GPU for all ranks), moved by `SlicesWire`:
    the same layer code and the same results structure as `run_rank`'s."""
    device = torch.device(device)
    epr = check_layout(world, args["experts"], args["topk"], args["hidden"])
    ps = [make_problem(r, args["tokens"], args["hidden"], args["inter"], args["experts"], args["topk"], args["seed"],
                       device) for r in range(world)]
    wire = SlicesWire()
    res = {pl: moe_forward_backward(ps, list(range(world)), world, epr, pl, wire) for pl in PAYLOADS}
    reps = int(args.get("reps", 0))
    times = timed_dispatch(ps, world, epr, wire, device, reps) if reps else {}
    return [{"rank": r, "results": _to_cpu({pl: res[pl][r] for pl in PAYLOADS}), "times": times,
             "backend": "one process, slices", "device": str(device)} for r in range(world)]


def transport(world: int, device) -> str:
    """How `launch` moves the rows for `world` ranks on `device`: 'nccl' (a GPU per rank), 'slices'
    (one GPU holds every rank) or 'gloo' (CPU processes)."""
    device = torch.device(device)
    if device.type == "cuda":
        return "nccl" if torch.cuda.device_count() >= world and world > 1 else "slices"
    return "gloo"


def launch(world: int, *, tokens: int, hidden: int, inter: int, experts: int, topk: int, seed: int = 0,
           reps: int = 0, timeout_s: float = 120.0, device="cpu", how: str | None = None) -> list[dict]:
    """Run both payloads on `world` ranks (see `transport`; `how` overrides it, e.g. 'slices' on CPU
    for a test); the ranks' results in rank order, on CPU."""
    from ..dist import loopback_ranks

    check_layout(world, experts, topk, hidden)
    how = how or transport(world, device)
    args = dict(tokens=tokens, hidden=hidden, inter=inter, experts=experts, topk=topk, seed=seed, reps=reps,
                device=str(device))
    if how == "slices":
        return run_slices(world, args, device)
    with loopback_ranks(run_rank, world, (args,), timeout_s=timeout_s, what=f"MXFP8 dispatch/combine ({how})",
                        prefix="inferbook-mxep-") as out_dir:
        return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world)]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)) \
        if a.dtype == torch.bfloat16 else torch.equal(a, b)


def within_one_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """BF16 tensors equal up to one unit in the last place per element (finite, same shape)."""
    if a.shape != b.shape or not (torch.isfinite(a.float()).all() and torch.isfinite(b.float()).all()):
        return False
    ia, ib = a.view(torch.int16).to(torch.int32), b.view(torch.int16).to(torch.int32)
    # order-preserving integer view of BF16 (sign-magnitude -> two's complement), so neighbours differ by 1
    ka = torch.where(ia < 0, -32768 - ia, ia)
    kb = torch.where(ib < 0, -32768 - ib, ib)
    return bool(((ka - kb).abs() <= 1).all())


def check(results: list[dict], *, tokens: int, hidden: int, inter: int, experts: int, topk: int,
          seed: int = 0) -> list[dict]:
    """Rows {check, passed, detail}: per rank, the MXFP8 payload's forward output and dx equal the
    BF16 payload's (quantized after the exchange) bit for bit, the received codes and scales too,
    and both agree with the single-process layer with no exchange to one BF16 ulp."""
    world = len(results)
    epr = check_layout(world, experts, topk, hidden)
    probs = [make_problem(r, tokens, hidden, inter, experts, topk, seed) for r in range(world)]
    single = single_process_reference(probs, epr)
    rows = []
    for r, res in enumerate(results):
        m, b = res["results"]["mxfp8"], res["results"]["bf16"]
        for what in ("out", "dx"):
            rows.append({"check": f"rank {r} {what}: MXFP8 payload == quantize after the exchange, in bits",
                         "passed": bits_equal(m[what], b[what]) and bool(torch.isfinite(m[what].float()).all()),
                         "detail": f"{int((m[what].view(torch.int16) != b[what].view(torch.int16)).sum())} elements differ"})
            # Not bitwise: the same rows reach the GEMM here in other matrices (other processes, other
            # shapes), and BLAS may block fp32 sums differently; what the math guarantees is agreement
            # to BF16 rounding of the same sum.
            rows.append({"check": f"rank {r} {what}: == the single-process layer, within one BF16 ulp",
                         "passed": within_one_ulp(m[what], single[r][what]),
                         "detail": f"{int((m[what].view(torch.int16) != single[r][what].view(torch.int16)).sum())} "
                                   "elements differ in bits"})
        rows.append({"check": f"rank {r}: received codes and scales identical for both payloads",
                     "passed": torch.equal(m["received_codes"], b["received_codes"])
                     and torch.equal(m["received_scales"], b["received_scales"]), "detail": ""})
    return rows


def payload_bytes(rows: int, hidden: int, payload: str) -> int:
    """Bytes one dispatch puts on the wire for `rows` rows of `hidden` elements."""
    if payload == "mxfp8":
        return rows * hidden + rows * (-(-hidden // BLOCK))
    if payload == "bf16":
        return rows * hidden * 2
    raise UserError(f"payload must be one of {PAYLOADS}, got {payload!r}")
