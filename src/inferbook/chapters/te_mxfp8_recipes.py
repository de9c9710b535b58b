"""Chapter `te-mxfp8-recipes`: microscaling recipes per tensor role and direction.

Records (one each):
- `quantize-bit-exact`: the Triton MX kernel against the PyTorch reference, every format x
  scale rule x layout, on fresh random inputs with edge values planted (checks only);
- `recipe:<name>`: SQNR of every GEMM operand per direction and of each GEMM's output, and a
  short training run of a small MLP (loss curve in the `final_loss` measurement);
- `quantize-speed`: time per quantize pass (row-wise, column-wise, 2-D) — the Triton kernel on
  a GPU, with achieved GB/s against the measured copy ceiling; the PyTorch reference on a CPU
  (labelled CPU, never the interpreter);
- `mx-gemm-paths`: what an MXFP8 forward GEMM costs where it runs — BF16 GEMM, quantize, and
  dequantize + BF16 GEMM (Hopper has no MX tensor-core GEMM; that needs sm_100);
- `rowcol-one-pass`: both MX copies of one tensor in one pass against two passes (bytes; bits;
  times on a GPU);
- `mxfp8-dispatch`: an MXFP8 dispatch/combine (NCCL, one GPU's slices, or gloo on CPU), bit-exact against
  quantizing after the exchange, with bytes and loopback times per payload;
- `grouped-gemm-check`: the grouped GEMM checker on our Triton kernel and on a kernel with an
  injected fault (which must fail);
- `cuda-graph-retained-grads`: GPU only (CUDA Graphs do not exist on CPU).
"""
from __future__ import annotations

import math

import torch

from ..measure import benchmark, ceilings, roofline
from ..errors import UserError
from ..presets import Param
from ..record import RunRecord
from ..numerics import graphs, grouped, mx, small_op_threads

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('recipe:mxfp8', 'sqnr input (row-wise)', "Signal-to-quantization-noise ratio of MXFP8's row-wise input copy")

PARAMETERS = {
    "m": Param(int, help="tokens (rows of x) in the SQNR GEMMs"),
    "k": Param(int, help="input features of the SQNR linear layer"),
    "n": Param(int, help="output features of the SQNR linear layer"),
    "outlier_scale": Param(float, 20.0, help="scale of the few outlier channels of x (activations)"),
    "recipes": Param(str, "all", help="comma-separated recipe names, or 'all'"),
    "d_in": Param(int, help="MLP input width"),
    "d_hidden": Param(int, help="MLP hidden width"),
    "train_batch": Param(int, help="training batch"),
    "train_steps": Param(int, help="optimizer steps per recipe"),
    "lr": Param(float, 3e-3, help="Adam learning rate"),
    "check_m": Param(int, help="rows of the bit-exactness check tensor"),
    "check_n": Param(int, help="columns of the bit-exactness check tensor"),
    "quant_m": Param(int, help="rows of the timed quantize input"),
    "quant_k": Param(int, help="columns of the timed quantize input"),
    "n_groups": Param(int, help="groups in the grouped-GEMM check"),
    "max_rows": Param(int, help="largest group in the grouped-GEMM check"),
    "ep_ranks": Param(int, help="ranks of the MXFP8 dispatch/combine (NCCL, one GPU's slices, or gloo on CPU)"),
    "ep_tokens": Param(int, help="tokens per rank in the MXFP8 dispatch/combine"),
    "ep_hidden": Param(int, help="hidden size H (multiple of 32) of the dispatched tokens"),
    "ep_inter": Param(int, help="expert GEMM output features N"),
    "ep_experts": Param(int, help="experts (a multiple of ep_ranks)"),
    "ep_topk": Param(int, help="experts per token"),
    "ep_reps": Param(int, help="timed dispatches per payload"),
}

PRESETS = {
    "smoke": dict(m=64, k=128, n=96, d_in=32, d_hidden=64, train_batch=64, train_steps=12, check_m=37,
                  check_n=70, quant_m=128, quant_k=256, n_groups=3, max_rows=24,
                  ep_ranks=2, ep_tokens=16, ep_hidden=128, ep_inter=64, ep_experts=4, ep_topk=2, ep_reps=5),
    "cpu": dict(m=512, k=1024, n=768, d_in=64, d_hidden=256, train_batch=256, train_steps=150, check_m=67,
                check_n=133, quant_m=1024, quant_k=2048, n_groups=6, max_rows=48,
                ep_ranks=2, ep_tokens=256, ep_hidden=1024, ep_inter=256, ep_experts=8, ep_topk=2, ep_reps=15),
    # the EP ranks: gloo on CPU; on a GPU machine NCCL with a GPU per rank, else one GPU holds every rank's slice
    "gpu": dict(m=4096, k=4096, n=4096, d_in=256, d_hidden=1024, train_batch=1024, train_steps=150, check_m=1031,
                check_n=2053, quant_m=8192, quant_k=8192, n_groups=16, max_rows=300,
                ep_ranks=4, ep_tokens=512, ep_hidden=2048, ep_inter=512, ep_experts=16, ep_topk=4, ep_reps=15),
}

LAYOUTS = {"row-wise 1x32": dict(axis=-1, block=32), "column-wise 32x1": dict(axis=0, block=32),
           "2-D 32x32": dict(block=(32, 32)), "2-D 128x128": dict(block=(128, 128))}


def selected_recipes(names: str) -> dict[str, mx.Recipe]:
    allr = mx.recipes()
    if names == "all":
        return allr
    chosen = [s.strip() for s in names.split(",") if s.strip()]
    unknown = [c for c in chosen if c not in allr]
    if unknown or not chosen:
        raise UserError(f"unknown recipe(s) {unknown or names!r}; choose from {sorted(allr)} or 'all'")
    return {c: allr[c] for c in chosen}


def check_params(P: dict) -> None:
    """The recipe names exist and the MXFP8 dispatch's layout fits (ranks, experts, top-k, hidden a multiple of
    the MX block), before any work (`setup` calls this)."""
    from ..numerics import mx_ep

    selected_recipes(P["recipes"])
    mx_ep.check_layout(P["ep_ranks"], P["ep_experts"], P["ep_topk"], P["ep_hidden"])


def edge_input(m: int, n: int, generator: torch.Generator, device) -> torch.Tensor:
    """Fresh N(0,1) values over six decades, with the edge values the format rules care about planted."""
    x = torch.randn(m, n, generator=generator, device=device) * torch.logspace(-3, 3, n, device=device)[None, :]
    flat = x.view(-1)
    picks = torch.randint(0, flat.numel(), (8,), generator=generator, device=device)
    specials = torch.tensor([460.0, -0.0, float("nan"), float("inf"), 2.0 ** -140, 57344.0 * 3, 6.5, 0.0],
                            device=device)
    flat[picks] = specials
    return x


def outlier_activations(m: int, k: int, outlier_scale: float, generator: torch.Generator, device) -> torch.Tensor:
    """Activations with a few large channels (as LLM activations have): what makes block scaling matter."""
    x = torch.randn(m, k, generator=generator, device=device)
    chans = torch.randperm(k, generator=generator, device=device)[: max(1, k // 64)]
    x[:, chans] *= outlier_scale
    return x


def check_bit_exact(ctx, check_m: int, check_n: int) -> RunRecord:
    from ..device import triton_backend_for

    ok, why = triton_backend_for(ctx.device)
    rec = ctx.new_record("quantize-bit-exact", variant="triton vs torch reference",
                         workload={"shapes": [check_m, check_n], "dtype": "float32"})
    rec.set_backend("mx_quantize", "triton" if ok else "torch reference only", reason=why,
                    shapes={"x": [check_m, check_n]}, dtype="float32")
    g = ctx.generator(1)
    x = edge_input(check_m, check_n, g, ctx.device)
    for fmt in mx.FORMATS:
        for rule in mx.SCALE_ROUNDING:
            for layout, kw in LAYOUTS.items():
                ref = mx.quantize_reference(x, fmt, scale_rounding=rule, **kw)
                if not ok:
                    continue
                got = mx.quantize_triton(x, fmt, scale_rounding=rule, **kw)
                mism = int((ref.elements != got.elements).sum()) + int((ref.scales != got.scales).sum())
                rec.add_check(f"{fmt} {rule} {layout}", mism == 0, error=float(mism), tolerance=0.0,
                              elements=ref.elements.numel(), scales=ref.scales.numel())
    return rec


def train_mlp(recipe: mx.Recipe, *, d_in: int, d_hidden: int, batch: int, steps: int, lr: float,
              outlier_scale: float, seed: int, device, backend: str = "auto") -> list[float]:
    """A 2-layer MLP student (emulated linears) fits a fixed random teacher; returns loss per step.

    Same initial weights, same batches and same teacher for every recipe (seeded), so the curves
    differ only by the recipe's rounding.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    teacher1 = torch.randn(d_hidden, d_in, generator=g) / math.sqrt(d_in)
    teacher2 = torch.randn(8, d_hidden, generator=g) / math.sqrt(d_hidden)
    w1 = (torch.randn(d_hidden, d_in, generator=g) / math.sqrt(d_in)).to(device).requires_grad_(True)
    w2 = (torch.randn(8, d_hidden, generator=g) / math.sqrt(d_hidden)).to(device).requires_grad_(True)
    teacher1, teacher2 = teacher1.to(device), teacher2.to(device)
    chans = torch.randperm(d_in, generator=g)[: max(1, d_in // 16)].to(device)
    params = [w1, w2]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    losses = []
    for step in range(steps):
        gs = torch.Generator(device="cpu").manual_seed(seed * 100_003 + step)
        x = torch.randn(batch, d_in, generator=gs).to(device)
        x[:, chans] *= outlier_scale
        with torch.no_grad():
            target = torch.tanh(x @ teacher1.T) @ teacher2.T
        h = torch.nn.functional.gelu(mx.emulated_linear(x, w1, recipe, backend))
        y = mx.emulated_linear(h, w2, recipe, backend)
        loss = torch.nn.functional.mse_loss(y, target)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():  # Adam, written out (torch.optim's first step imports the compiler stack)
            for p, gr, (m1, m2) in zip(params, grads, moments):
                m1.mul_(0.9).add_(gr, alpha=0.1)
                m2.mul_(0.999).addcmul_(gr, gr, value=0.001)
                m1h, m2h = m1 / (1 - 0.9 ** (step + 1)), m2 / (1 - 0.999 ** (step + 1))
                p.sub_(lr * m1h / (m2h.sqrt() + 1e-8))
        losses.append(float(loss.detach()))
    return losses


def recipe_record(ctx, recipe: mx.Recipe, *, m, k, n, outlier_scale, d_in, d_hidden, train_batch, train_steps,
                  lr, backend: str, reason: str) -> RunRecord:
    rec = ctx.new_record(f"recipe:{recipe.name}", variant=recipe.name, workload={
        "model": f"linear {k}->{n} (SQNR) and MLP {d_in}-{d_hidden}-8 (training)",
        "quantization": recipe.description,
        "batch": train_batch, "shapes": {"sqnr_gemm": [m, k, n]}, "dtype": "bf16 operands / fp32 master weights",
    })
    rec.set_backend("mx_quantize", backend, reason=reason, shapes={"x": [m, k], "w": [n, k], "dy": [m, n]})
    rec.set_backend("gemm", "torch fp32 matmul of dequantized operands (emulation)",
                    reason="no MXFP8 tensor cores are used: this chapter measures numerics, not GEMM speed")
    g = ctx.generator(2)
    x = outlier_activations(m, k, outlier_scale, g, ctx.device)
    w = torch.randn(n, k, generator=g, device=ctx.device) / math.sqrt(k)
    dy = torch.randn(m, n, generator=g, device=ctx.device) / math.sqrt(m)
    with small_op_threads(ctx.device):
        err_rows = mx.gemm_errors(recipe, x, w, dy, backend=backend)
    for row in err_rows:
        if math.isfinite(row["sqnr_db"]):
            rec.add(f"sqnr {row['tensor']}", row["sqnr_db"], "dB", kind=row["kind"], quantizer=row["quantizer"])
        else:
            rec.notes += f"sqnr {row['tensor']} = {row['sqnr_db']}; "
    with small_op_threads(ctx.device):
        losses = train_mlp(recipe, d_in=d_in, d_hidden=d_hidden, batch=train_batch, steps=train_steps, lr=lr,
                           outlier_scale=outlier_scale, seed=ctx.seed, device=ctx.device, backend=backend)
    tail = losses[-max(1, len(losses) // 10):]
    rec.add("final_loss", sum(tail) / len(tail), "mse", phase="train", curve=losses,
            note="mean over the last 10% of steps")
    rec.add_check("training loss finite", all(math.isfinite(v) for v in losses))
    rec.add_check("training loss decreased", tail[-1] < losses[0], error=tail[-1], tolerance=losses[0])
    return rec


def quantize_speed(ctx, quant_m: int, quant_k: int) -> RunRecord:
    chosen, reason = mx.pick_backend(ctx.device, "auto")
    is_gpu = ctx.device.type == "cuda"
    rec = ctx.new_record("quantize-speed", variant=chosen, workload={
        "shapes": [quant_m, quant_k], "dtype": "bfloat16", "quantization": "MXFP8 E4M3 (floor)"})
    rec.set_backend("mx_quantize", "triton kernel" if chosen == "triton" else "torch reference (CPU)",
                    reason=reason, shapes={"x": [quant_m, quant_k]}, dtype="bfloat16")
    g = ctx.generator(3)
    x = torch.randn(quant_m, quant_k, generator=g, device=ctx.device).to(torch.bfloat16)
    ceil = ceilings(ctx.device) if is_gpu else None
    fn = mx.quantize_triton if chosen == "triton" else mx.quantize_reference
    # enough samples a side that a real 10 % difference separates in compare_timings
    reps = dict(warmup=3 if is_gpu else 1, min_reps=20 if is_gpu else 12, max_reps=200 if is_gpu else 20,
                min_time_s=0.3 if is_gpu else 0.1)
    for layout, kw in list(LAYOUTS.items())[:3]:
        t = benchmark(lambda: fn(x, "e4m3", **kw), ctx.device, label=layout, uses_triton=chosen == "triton", **reps)
        blocks = x.numel() // (kw["block"][0] * kw["block"][1] if isinstance(kw["block"], tuple) else kw["block"])
        nbytes = x.numel() * 2 + x.numel() + blocks  # read bf16, write 1-byte codes, write scales
        rec.add_timing(f"quantize {layout}", t, bytes=nbytes)
        if ceil is not None:
            rf = roofline(bytes_moved=nbytes, flops=0, seconds=t.median_s, ceil=ceil)
            rec.add(f"GB/s {layout}", rf["achieved_gbps"], "GB/s", frac_of_copy=rf["frac_copy"],
                    copy_ceiling_gbps=ceil.copy_gbps)
    if is_gpu:  # the PyTorch reference on the same GPU, for scale
        t = benchmark(lambda: mx.quantize_reference(x, "e4m3"), ctx.device, label="torch reference row-wise")
        rec.add_timing("torch reference row-wise 1x32", t)
    peer, why = torchao_to_mx()
    rec.notes = (rec.notes + " " if rec.notes else "") + f"torchao peer: {why}"
    if peer is not None and is_gpu and chosen == "triton":
        ours = mx.quantize_triton(x, "e4m3")
        scales, codes = peer(x)
        same = torch.equal(scales.contiguous().view(torch.uint8).reshape(ours.scales.shape), ours.scales) and \
            torch.equal(codes.contiguous().view(torch.uint8).reshape(ours.elements.shape), ours.elements)
        rec.add_check("torchao to_mx (FLOOR, e4m3, 32) == our kernel, every code and scale byte", same)
        t = benchmark(lambda: peer(x), ctx.device, label="torchao to_mx", **reps)
        rec.add_timing("torchao to_mx row-wise 1x32", t)
    beside_torchao_triton(ctx, rec, x, chosen)
    return rec


def beside_torchao_triton(ctx, rec, x, chosen: str) -> None:
    """On a GPU: our row-wise and column-wise quantize and torchao's Triton MXFP8 kernels
    (`triton_to_mxfp8_dim0` / `_dim1`, FLOOR, block 32: the kernels the compiler section predicts beside
    ours, `inferbook.compiled.peers`) timed in the same run, warmed and interleaved (`peers.time_beside`),
    ours / torchao from `compare_timings`. torchao itself enables these kernels on sm_100 only; elsewhere
    `peers._torchao_kernels` loads them all the same (the same Triton source). Else a note says why not."""
    from ..compiled import peers
    from ..measure import compare_timings

    if ctx.device.type != "cuda" or chosen != "triton":
        rec.notes = (rec.notes + " " if rec.notes else "") + "torchao Triton beside ours: not timed (needs a GPU)"
        return
    try:
        KX = peers._torchao_kernels()
    except Exception as e:  # noqa: BLE001 - any import failure: not available
        rec.notes = (rec.notes + " " if rec.notes else "") + \
            f"torchao Triton beside ours: not timed ({type(e).__name__}: {str(e)[:80]})"
        return
    rec.set_backend("peer", "torchao triton_to_mxfp8_dim0/dim1 (Triton), timed beside ours", reason="interleaved, same run")
    pairs = {"row-wise 1x32": lambda: KX.triton_to_mxfp8_dim0(x, 32, "floor"),
             "column-wise 32x1": lambda: KX.triton_to_mxfp8_dim1(x, 32, "floor")}
    for layout, theirs in pairs.items():
        kw = LAYOUTS[layout]
        ours = (lambda kw=kw: mx.quantize_triton(x, "e4m3", **kw))
        times = peers.time_beside({"ours": ours, "torchao": theirs}, ctx.device, rounds=4, min_reps=5,
                                  max_reps=50, min_time_s=0.05)
        for side, t in times.items():
            rec.add_timing(f"beside torchao triton: {side} {layout}", t, interleaved=True)
        c = compare_timings(times["ours"], times["torchao"])
        rec.add(f"ours / torchao triton {layout} (same run, interleaved)", c.ratio, "x", lo=c.lo, hi=c.hi,
                confidence=c.confidence)


def torchao_to_mx():
    """(fn(x) -> (E8M0 scales, E4M3 codes), why) with torchao's `to_mx` (FLOOR scaling, block 32), or
    (None, why not). torchao is an optional peer; this book does not depend on it."""
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    except Exception as e:  # noqa: BLE001 - any import failure: not available
        return None, f"torchao is not installed here ({type(e).__name__}); no peer comparison"

    def fn(x):
        scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
        return scale, data

    return fn, "torchao.prototype.mx_formats.to_mx (FLOOR)"


def rowcol_record(ctx, quant_m: int, quant_k: int) -> RunRecord:
    """Both MX copies of one tensor: one pass (one read of x, both directions written) against two
    passes (row-wise, then column-wise). Bytes on every device; times of the Triton kernels on a GPU,
    and bit-exactness of the one-pass kernel against two reference passes wherever Triton runs."""
    from ..device import triton_backend_for

    ok, why = triton_backend_for(ctx.device)
    is_gpu = ctx.device.type == "cuda"
    rec = ctx.new_record("rowcol-one-pass", variant="one pass vs two", workload={
        "shapes": [quant_m, quant_k], "dtype": "bfloat16", "quantization": "MXFP8 E4M3 1x32 and 32x1 (floor)"})
    rec.set_backend("mx_quantize_rowcol", "triton" + ("" if is_gpu else " (interpreter: checked, not timed)")
                    if ok else "torch reference only", reason=why, shapes={"x": [quant_m, quant_k]})
    rec.add("bytes_one_pass", mx.rowcol_bytes(quant_m, quant_k, passes=1), "bytes", phase="derived",
            note="model: one BF16 read of x, both copies' codes and scales written")
    rec.add("bytes_two_passes", mx.rowcol_bytes(quant_m, quant_k, passes=2), "bytes", phase="derived",
            note="model: two BF16 reads of x")
    if ok:  # bits, at a small shape with edge values (the interpreter on CPU)
        g = ctx.generator(8)
        xs = edge_input(67, 133, g, ctx.device)
        rows, cols = mx.quantize_rowcol_reference(xs, "e4m3")
        r, c = mx.quantize_rowcol_triton(xs, "e4m3")
        mism = sum(int((a.elements != b.elements).sum() + (a.scales != b.scales).sum())
                   for a, b in ((rows, r), (cols, c)))
        rec.add_check("one-pass kernel == two reference passes, every code and scale byte", mism == 0,
                      error=float(mism), tolerance=0.0)
    if is_gpu and ok:
        x = torch.randn(quant_m, quant_k, generator=ctx.generator(9), device=ctx.device).to(torch.bfloat16)
        reps = dict(warmup=3, min_reps=20, max_reps=200, min_time_s=0.3, uses_triton=True)
        t1 = benchmark(lambda: mx.quantize_rowcol_triton(x, "e4m3"), ctx.device, label="one pass", **reps)
        t2 = benchmark(lambda: (mx.quantize_triton(x, "e4m3", axis=-1), mx.quantize_triton(x, "e4m3", axis=0)),
                       ctx.device, label="two passes", **reps)
        ceil = ceilings(ctx.device)
        for name, t, passes in (("one pass", t1, 1), ("two passes", t2, 2)):
            nbytes = mx.rowcol_bytes(quant_m, quant_k, passes=passes)
            rf = roofline(bytes_moved=nbytes, flops=0, seconds=t.median_s, ceil=ceil)
            rec.add_timing(f"row+column {name}", t, bytes=nbytes, achieved_gbps=rf["achieved_gbps"],
                           frac_of_copy=rf["frac_copy"])
    return rec


def dispatch_record(ctx, *, ep_ranks, ep_tokens, ep_hidden, ep_inter, ep_experts, ep_topk, ep_reps) -> RunRecord:
    """MXFP8 dispatch/combine on the run's device (`mx_ep.transport`: NCCL with a GPU per rank, one GPU
    holding every rank's slice, or gloo on CPU): checks (bits against quantize-after-exchange and against
    the no-communication layer), bytes per payload, and interleaved dispatch times per payload."""
    from ..numerics import mx_ep

    prob = dict(tokens=ep_tokens, hidden=ep_hidden, inter=ep_inter, experts=ep_experts, topk=ep_topk, seed=ctx.seed)
    how = mx_ep.transport(ep_ranks, ctx.device)
    results = mx_ep.launch(ep_ranks, **prob, reps=ep_reps, timeout_s=300, device=ctx.device)
    label = {"gloo": f"gloo on CPU, {ep_ranks} ranks on loopback: bytes and order are real, speed is not NVLink",
             "nccl": f"NCCL, {ep_ranks} GPUs, one rank each",
             "slices": f"one GPU holding all {ep_ranks} ranks' slices: the exchange is device copies through HBM, "
                       "not NVLink"}[how]
    rec = ctx.new_record("mxfp8-dispatch", variant="mxfp8 vs bf16 payload", workload={
        "model": f"MoE expert layer: {ep_experts} experts, top-{ep_topk}, H={ep_hidden}, N={ep_inter}",
        "batch": ep_tokens, "dtype": "bfloat16 tokens, MXFP8 E4M3 1x32 payload", "quantization": "MXFP8 E4M3 (floor)"},
        topology={"ranks": ep_ranks, "ep": ep_ranks, "backend": how, "rank_device": results[0]["device"],
                  "run_label": label})
    rec.set_backend("dispatch/combine", {"gloo": "torch.distributed all_to_all_single (gloo)",
                                         "nccl": "torch.distributed all_to_all_single (NCCL)",
                                         "slices": "mx_ep.SlicesWire (device copies, one process)"}[how],
                    reason=f"{ep_ranks} ranks on {ctx.device.type}", shapes={"ranks": ep_ranks})
    rec.set_backend("expert GEMM", "grouped GEMM (torch per-group matmul, fp32 accumulate) on pre-quantized rows")
    for row in mx_ep.check(results, **prob):
        rec.add_check(row["check"], row["passed"], detail=row["detail"])
    for pl in mx_ep.PAYLOADS:
        sent = sum(r["results"][pl]["bytes_sent"] for r in results)
        rec.add(f"bytes_sent_{pl}", sent, "bytes", phase="derived", payload=pl,
                note="dispatch + combine-backward payloads, all ranks")
    if ep_reps:
        slowest = {pl: max((r["times"][pl] for r in results), key=lambda xs: sorted(xs)[len(xs) // 2])
                   for pl in mx_ep.PAYLOADS}
        for pl, xs in slowest.items():
            rec.add(f"dispatch_time_{pl}", sorted(xs)[len(xs) // 2], "s", payload=pl, samples_s=xs, n=len(xs),
                    timer=f"perf_counter + barrier + device sync, payloads interleaved ({how}, slowest rank)")
    return rec


def mx_gemm_support(device: torch.device) -> dict:
    """What this device can do with MX operands. MX (block-scaled) tensor-core GEMMs are an sm_100
    feature (Blackwell `tcgen05.mma` with `kind::mxf8f6f4` and E8M0 scale operands); Hopper (sm_90)
    has FP8 `wgmma` with one scale per tensor or per row, no block scales: there an MXFP8 tensor
    is dequantized (or re-scaled) before the GEMM, and only the cast and a BF16 GEMM run."""
    if device.type != "cuda":
        return {"capability": None, "mx_tensor_core_gemm": False,
                "runs_here": "quantize and dequantized GEMM in PyTorch on the CPU (reference, not the kernels)"}
    cap = torch.cuda.get_device_capability(device)
    native = cap[0] >= 10
    return {"capability": f"sm_{cap[0]}{cap[1]}", "mx_tensor_core_gemm": native,
            "runs_here": ("quantize; mx_gemm's tl.dot_scaled compiles to tcgen05.mma kind::mxf8f6f4.block_scale here"
                          if native else "quantize; mx_gemm upcasts the MX operands to BF16 in registers (MX "
                          "tensor-core GEMMs need sm_100)")}


def gemm_paths(ctx, m: int, k: int, n: int) -> RunRecord:
    """Time what runs of an MXFP8 forward GEMM y = x W^T on this device: the BF16 GEMM alone, the
    quantize of x and W (row-wise 1x32 E4M3), and dequantize-to-BF16 followed by the BF16 GEMM
    (the path a GPU without MX tensor cores takes). On a CPU: the PyTorch reference, labelled."""
    support = mx_gemm_support(ctx.device)
    is_gpu = ctx.device.type == "cuda"
    chosen, reason = mx.pick_backend(ctx.device, "auto")
    rec = ctx.new_record("mx-gemm-paths", variant=chosen, workload={
        "shapes": {"x": [m, k], "w": [n, k]}, "dtype": "bfloat16", "quantization": "MXFP8 E4M3 1x32 (floor)"})
    rec.set_backend("mx_quantize", "triton kernel" if chosen == "triton" else "torch reference (CPU)", reason=reason)
    rec.set_backend("gemm", "torch.matmul bf16 (cuBLAS)" if is_gpu else "torch.matmul float32 (CPU)",
                    reason=support["runs_here"])
    rec.notes = f"MX tensor-core GEMM on this device: {support['mx_tensor_core_gemm']} ({support['capability']})"
    g = ctx.generator(4)
    gemm_dtype = torch.bfloat16 if is_gpu else torch.float32
    x = torch.randn(m, k, generator=g, device=ctx.device).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=ctx.device) / math.sqrt(k)).to(torch.bfloat16)
    fn = mx.quantize_triton if chosen == "triton" else mx.quantize_reference
    qx, qw = fn(x, "e4m3"), fn(w, "e4m3")
    xd, wd = x.to(gemm_dtype), w.to(gemm_dtype)
    reps = dict(warmup=3 if is_gpu else 1, min_reps=20 if is_gpu else 8, max_reps=200 if is_gpu else 12,
                min_time_s=0.3 if is_gpu else 0.1)
    paths = {
        "BF16 GEMM" if is_gpu else "float32 GEMM (CPU)": (lambda: xd @ wd.T, False),
        "quantize x and W (MXFP8)": (lambda: (fn(x, "e4m3"), fn(w, "e4m3")), chosen == "triton"),
        "dequantize + GEMM": (lambda: mx.dequantize(qx).to(gemm_dtype) @ mx.dequantize(qw).to(gemm_dtype).T, False),
    }
    if is_gpu and k % mx.mx_gemm_config(False, ctx.device)["BLOCK_K"] == 0:   # the block-scaled GEMM on the codes themselves
        paths["MX GEMM (tl.dot_scaled)"] = (lambda: mx.mx_gemm(qx, qw), True)
    for name, (f, uses_triton) in paths.items():
        t = benchmark(f, ctx.device, label=name, uses_triton=uses_triton, **reps)
        rec.add_timing(name, t, flops=2.0 * m * n * k)
    # correctness on the recipe's own codes and scales: the first rows of x and W (whole K blocks)
    r = 64
    sub = lambda q: mx.MXTensor(q.elements[:r].contiguous(), q.scales[:r].contiguous(), q.fmt, q.axis, q.block,
                                q.scale_rounding, q.dtype, q.backend)
    sx, sw = sub(qx), sub(qw)
    cfg = mx.mx_gemm_config(not is_gpu, ctx.device)
    if k % cfg["BLOCK_K"] == 0:
        c, ref = mx.mx_gemm(sx, sw), mx.mx_gemm_reference(sx, sw)
        bound = k * 2.0 ** -24 * (mx.dequantize(sx).abs().double() @ mx.dequantize(sw).abs().double().T).float()
        if is_gpu:  # tensor-core fp32 accumulation may round each addition less finely than IEEE fp32
            bound = 4 * bound
        err = float((c - ref).abs().max())
        rec.add_check("mx_gemm (tl.dot_scaled on the codes and E8M0 scales) vs dequantize-then-matmul",
                      bool(torch.isfinite(c).all()) and bool(((c - ref).abs() <= bound + 1e-30).all()),
                      error=err, tolerance=float(bound.max()))
    rec.add("mx_tensor_core_gemm", float(support["mx_tensor_core_gemm"]), "bool", phase="derived",
            capability=support["capability"], runs_here=support["runs_here"])
    return rec


def grouped_record(ctx, n_groups: int, max_rows: int) -> RunRecord:
    from ..device import triton_backend_for

    ok, why = triton_backend_for(ctx.device)
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    rec = ctx.new_record("grouped-gemm-check", variant="checker", workload={
        "shapes": {"n_groups": n_groups, "max_rows": max_rows}, "dtype": str(dtype).replace("torch.", "")})
    # (K, N): odd sizes on purpose; on a CPU the Triton kernels run in the interpreter, so one shape.
    shapes = ((64, 48), (33, 70), (256, 200)) if ctx.device.type == "cuda" else ((33, 70),)
    candidates = {"torch per-group loop": lambda x, w, s, out=None: grouped.grouped_gemm_reference(x, w, s)}
    if ok:
        candidates["triton grouped GEMM"] = grouped.grouped_gemm_triton
        candidates["triton, fault injected (must fail)"] = grouped.broken_grouped_gemm
    rec.set_backend("grouped_gemm", "triton" if ok else "torch only", reason=why)
    rows_all = []
    for name, fn in candidates.items():
        rows = grouped.check_grouped_gemm(fn, n_groups=n_groups, max_rows=max_rows, shapes=shapes, dtype=dtype,
                                          device=ctx.device, seed=ctx.seed)
        for r in rows:
            r["candidate"] = name
        rows_all += rows
        n_pass = sum(r["passed"] for r in rows)
        expect_fail = "must fail" in name
        rec.add(f"cases passed: {name}", n_pass, "cases", cases=len(rows))
        rec.add_check(f"{name}: " + ("checker flags every case" if expect_fail else "all cases pass"),
                      (n_pass == 0) if expect_fail else (n_pass == len(rows)), error=float(len(rows) - n_pass))
    rec.notes = "rows: " + repr([{k: r[k] for k in ("candidate", "K", "N", "group_sizes", "max_rel_err", "passed")}
                                 for r in rows_all])[:4000]
    return rec


def graph_record(ctx) -> RunRecord | None:
    if ctx.device.type != "cuda":
        return None
    rec = ctx.new_record("cuda-graph-retained-grads", variant="torch.cuda.CUDAGraph",
                         workload={"model": "MLP 256-256-8", "batch": 64})
    rec.set_backend("graph", "torch.cuda.CUDAGraph", reason="capture of forward + backward")
    out = graphs.retained_gradient_check(ctx.device)
    rec.add_check("gradients retained as copies survive the next replay", out["retained_copies_equal_eager_A"])
    rec.add_check("replay B equals eager B", out["replay_B_equals_eager_B"])
    rec.add("reference to A's gradient overwritten by replay B", float(out["reference_to_A_overwritten_by_B"]), "bool",
            note="the hazard: a reference (no copy) to a static gradient buffer changes on replay")
    return rec


def measure(ctx, *, m, k, n, outlier_scale, recipes, d_in, d_hidden, train_batch, train_steps, lr, check_m, check_n,
            quant_m, quant_k, n_groups, max_rows, ep_ranks=2, ep_tokens=16, ep_hidden=128, ep_inter=64, ep_experts=4,
            ep_topk=2, ep_reps=5) -> list[RunRecord]:
    from ..numerics import mx_ep

    mx_ep.check_layout(ep_ranks, ep_experts, ep_topk, ep_hidden)  # bad input: one line, before any work
    chosen = selected_recipes(recipes)
    backend, reason = mx.pick_backend(ctx.device, "auto")
    records = [check_bit_exact(ctx, check_m, check_n)]
    for recipe in chosen.values():
        records.append(recipe_record(ctx, recipe, m=m, k=k, n=n, outlier_scale=outlier_scale, d_in=d_in,
                                     d_hidden=d_hidden, train_batch=train_batch, train_steps=train_steps, lr=lr,
                                     backend=backend, reason=reason))
    records.append(quantize_speed(ctx, quant_m, quant_k))
    records.append(gemm_paths(ctx, m, k, n))
    records.append(rowcol_record(ctx, quant_m, quant_k))
    records.append(dispatch_record(ctx, ep_ranks=ep_ranks, ep_tokens=ep_tokens, ep_hidden=ep_hidden, ep_inter=ep_inter,
                                   ep_experts=ep_experts, ep_topk=ep_topk, ep_reps=ep_reps))
    records.append(grouped_record(ctx, n_groups, max_rows))
    g = graph_record(ctx)
    if g is not None:
        records.append(g)
    return records


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`): MX quantize for
    the timed bf16 input, the GEMM paths' x and W and the bit-exactness check (every format, rounding
    and layout), the one-pass row+column quantize (timed and bit-checked), and the grouped-GEMM checker (its GPU shapes, with and without the injected fault)."""
    from .. import compiled

    launches = []
    for layout, kw in LAYOUTS.items():
        launches += mx.quantize_launches((params["quant_m"], params["quant_k"]), torch.bfloat16, "e4m3",
                                         scale_rounding="floor", name=f"quantize-speed e4m3 floor {layout}", **kw)
    for fmt in mx.FORMATS:
        for rule in mx.SCALE_ROUNDING:
            for layout, kw in LAYOUTS.items():
                launches += mx.quantize_launches((params["check_m"], params["check_n"]), torch.float32, fmt,
                                                 scale_rounding=rule, name=f"bit-exact {fmt} {rule} {layout}", **kw)
    for name, shape in (("x", (params["m"], params["k"])), ("W", (params["n"], params["k"]))):    # gemm_paths
        launches += mx.quantize_launches(shape, torch.bfloat16, "e4m3", name=f"mx-gemm-paths quantize {name} e4m3 floor")
    # rowcol_record: the one-pass row+column kernel, timed (bf16) and bit-checked (fp32 edge input 67x133)
    launches += mx.quantize_rowcol_launches((params["quant_m"], params["quant_k"]), torch.bfloat16, "e4m3",
                                            name=f"rowcol one pass e4m3 floor bf16 {params['quant_m']}x{params['quant_k']}")
    launches += mx.quantize_rowcol_launches((67, 133), torch.float32, "e4m3", name="rowcol bit-exact e4m3 floor fp32 67x133")
    launches += mx.mx_gemm_launches(params["m"], params["n"], params["k"], name=f"mx_gemm e4m3 x e4m3 "
                                    f"M{params['m']} N{params['n']} K{params['k']} (gemm_paths, timed)")
    launches += mx.mx_gemm_launches(64, 64, params["k"], name=f"mx_gemm e4m3 x e4m3 M64 N64 K{params['k']} (check)")
    for K, N in ((64, 48), (33, 70), (256, 200)):          # grouped_record's GPU shapes
        for skip in (False, True):
            launches += grouped.grouped_gemm_launches(params["max_rows"], params["n_groups"], N, K, torch.bfloat16,
                                                      skip_last_row=skip)
    return compiled.dedupe(launches)


def roofline_work(params: dict) -> list[dict]:
    """The timed MXFP8 quantize as {name, bytes, flops}: bytes as `quantize_speed` counts them (read
    bf16, write 1-byte codes and one scale per 32 values); no flops counted."""
    n = params["quant_m"] * params["quant_k"]
    return [{"name": f"quantize {layout} {params['quant_m']}x{params['quant_k']} bf16", "bytes": 2 * n + n + n // 32,
             "flops": 0.0, "record": "quantize-speed", "metric": f"quantize {layout}"} for layout in LAYOUTS]
