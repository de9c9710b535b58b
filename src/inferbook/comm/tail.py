"""The MoE layer's tail with fixed rounding points: finalize -> all-reduce -> + shared expert ->
+ residual -> RMSNorm, unfused (one kernel per step), fused (one pass after the exchange) and
fused naively (fp32 throughout).

Shapes (N = ranks, T = tokens, H = hidden size, K = top-k slots held by one rank):

- expert_out [T, K, H] and topk_weights [T, K] float32 on each rank -> `finalize` -> partial [T, H]
- partials [N, T, H]: every rank's finalized partial, in rank order — what a one-shot push
  all-reduce leaves in each rank's receive buffer
- shared [T, H] (the shared expert's output), residual [T, H], norm_weight [H]
- outputs: out [T, H] (the next layer's normalized input) and residual_out [T, H]

dtypes: bfloat16 (the case that matters), float16 or float32 for expert_out, partials, shared,
residual and norm_weight (all the same); topk_weights float32.

**The rounding points** (the reference's, kept by `fused_tail`): every arithmetic step runs in
fp32, and the result is rounded to the data dtype at exactly these places —

1. the finalized partial on each rank (the all-reduce moves BF16 bytes);
2. the all-reduce's result (partials summed in fp32 in rank order 0..N-1, rounded once, as a
   custom one-shot all-reduce does);
3. after adding the shared expert's output;
4. after adding the residual (this is also `residual_out`, the next layer's residual);
5. the RMSNorm output (its sum of squares, scale and weight product stay in fp32).

`naive_fused_tail` drops points 1–4: it keeps fp32 from the expert outputs to the RMSNorm and
rounds only the two outputs. Its results are closer to exact arithmetic — and differ from the
reference's bits, which is what a model trained and served with the reference rounding sees.

All Triton kernels launch with `enable_fp_fusion=False`: otherwise the compiler contracts
`acc + w * y` into one fused multiply-add with a single rounding, which PyTorch eager (two
roundings) does not do. The unfused chain and the fused pass call the same `@triton.jit` helpers
with the same block shape, so their fp32 reductions run in the same order: they are bitwise equal.
Against the PyTorch reference the only difference left is the order of the RMSNorm's fp32 sum of
squares (a tree in Triton, PyTorch's own order in `torch.sum`), counted in the chapter.
"""
from __future__ import annotations

import torch

from .. import device as _device
from ..errors import UserError

try:
    import triton
    import triton.language as tl

    from ..triton_utils import cast_rtne as _round
except Exception:  # pragma: no cover - triton missing: only the references work
    triton = None
    tl = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROUNDING_POINTS = (
    ("1 finalize", "weighted top-k combine of this rank's expert outputs", "partial -> dtype"),
    ("2 all-reduce", "partials summed in fp32 in rank order 0..N-1", "sum -> dtype"),
    ("3 + shared expert", "all-reduce result + shared expert output", "-> dtype"),
    ("4 + residual", "previous sum + residual (written as residual_out)", "-> dtype"),
    ("5 RMSNorm", "x / sqrt(mean(x*x) + eps) * weight, all fp32 inside", "-> dtype"),
)
BACKENDS = _device.BACKEND_CHOICES


# ---------------------------------------------------------------------------
# Input checks (before any work)

def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def check_tail_inputs(partials, shared, residual, norm_weight, eps) -> tuple[int, int, int]:
    """Validate the post-exchange inputs; returns (N, T, H). Raises UserError naming the value."""
    for name, t in (("partials", partials), ("shared", shared), ("residual", residual), ("norm_weight", norm_weight)):
        if not isinstance(t, torch.Tensor):
            raise UserError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if partials.dim() != 3:
        raise UserError(f"partials must be [N, T, H] (3-D), got shape {tuple(partials.shape)}")
    N, T, H = partials.shape
    if N < 1 or H < 1:
        raise UserError(f"partials must have N >= 1 ranks and H >= 1, got shape {tuple(partials.shape)}")
    if partials.dtype not in DTYPES:
        raise UserError(f"partials dtype {_dtype_name(partials.dtype)} is not supported; use "
                        + ", ".join(_dtype_name(d) for d in DTYPES))
    for name, t in (("shared", shared), ("residual", residual)):
        if tuple(t.shape) != (T, H):
            raise UserError(f"{name} must have shape {(T, H)} to match partials, got {tuple(t.shape)}")
    if tuple(norm_weight.shape) != (H,):
        raise UserError(f"norm_weight must have shape {(H,)}, got {tuple(norm_weight.shape)}")
    data_dtype = shared.dtype
    for name, t in (("residual", residual), ("norm_weight", norm_weight)):
        if t.dtype != data_dtype:
            raise UserError(f"{name} dtype {_dtype_name(t.dtype)} differs from shared's {_dtype_name(data_dtype)}")
    if data_dtype not in DTYPES:
        raise UserError(f"data dtype {_dtype_name(data_dtype)} is not supported; use "
                        + ", ".join(_dtype_name(d) for d in DTYPES))
    if partials.dtype not in (data_dtype, torch.float32):
        raise UserError(f"partials dtype {_dtype_name(partials.dtype)} must be {_dtype_name(data_dtype)} "
                        "(or float32 for the naive fusion)")
    for name, t in (("shared", shared), ("residual", residual), ("norm_weight", norm_weight)):
        if t.device != partials.device:
            raise UserError(f"{name} is on {t.device}, partials on {partials.device}: all inputs must share a device")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (0 < float(eps) < 1):
        raise UserError(f"eps must be a float in (0, 1), got {eps!r}")
    if N * T * H >= 2**31:
        raise UserError(f"N*T*H = {N * T * H} elements exceeds the kernels' int32 offsets (< 2**31)")
    return N, T, H


def check_finalize_inputs(expert_out, topk_weights) -> tuple[int, int, int]:
    if not isinstance(expert_out, torch.Tensor) or expert_out.dim() != 3:
        raise UserError(f"expert_out must be a [T, K, H] tensor, got "
                        f"{tuple(expert_out.shape) if isinstance(expert_out, torch.Tensor) else type(expert_out).__name__}")
    T, K, H = expert_out.shape
    if expert_out.dtype not in DTYPES:
        raise UserError(f"expert_out dtype {_dtype_name(expert_out.dtype)} is not supported; use "
                        + ", ".join(_dtype_name(d) for d in DTYPES))
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != (T, K):
        raise UserError(f"topk_weights must have shape {(T, K)}, got "
                        f"{tuple(topk_weights.shape) if isinstance(topk_weights, torch.Tensor) else type(topk_weights).__name__}")
    if topk_weights.dtype != torch.float32:
        raise UserError(f"topk_weights must be float32, got {_dtype_name(topk_weights.dtype)}")
    if topk_weights.device != expert_out.device:
        raise UserError(f"topk_weights is on {topk_weights.device}, expert_out on {expert_out.device}")
    if K < 1 or H < 1:
        raise UserError(f"expert_out needs K >= 1 slots and H >= 1, got shape {(T, K, H)}")
    return T, K, H


# ---------------------------------------------------------------------------
# PyTorch references: the rounding points written out, one line each.

def finalize_reference(expert_out: torch.Tensor, topk_weights: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """sum_k w[t, k] * y[t, k, :] in fp32, slot order 0..K-1, rounded once to `out_dtype`
    (default: expert_out's dtype; float32 for the naive fusion)."""
    T, K, H = check_finalize_inputs(expert_out, topk_weights)
    acc = torch.zeros(T, H, dtype=torch.float32, device=expert_out.device)
    for k in range(K):
        acc = acc + topk_weights[:, k:k + 1] * expert_out[:, k].float()
    return acc.to(out_dtype or expert_out.dtype)


def allreduce_reference(partials: torch.Tensor, dtype=None) -> torch.Tensor:
    """Rank order 0..N-1, fp32 accumulation, one rounding (rounding point 2)."""
    acc = partials[0].float()
    for r in range(1, partials.shape[0]):
        acc = acc + partials[r].float()
    return acc.to(dtype or partials.dtype)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype=None) -> torch.Tensor:
    """fp32 inside: x * (1 / sqrt(sum(x*x) / H + eps)) * weight, rounded once."""
    xf = x.float()
    var = (xf * xf).sum(-1, keepdim=True) / x.shape[-1]
    scale = 1.0 / torch.sqrt(var + eps)
    return ((xf * scale) * weight.float()).to(out_dtype or x.dtype)


def tail_reference(partials, shared, residual, norm_weight, eps=1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: all-reduce (2), + shared (3), + residual (4), RMSNorm (5).
    Returns (out, residual_out)."""
    check_tail_inputs(partials, shared, residual, norm_weight, eps)
    dt = shared.dtype
    ar = allreduce_reference(partials, dt)
    h = (ar.float() + shared.float()).to(dt)
    residual_out = (h.float() + residual.float()).to(dt)
    return rmsnorm_reference(residual_out, norm_weight, eps), residual_out


def naive_tail_reference(partials_fp32, shared, residual, norm_weight, eps=1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 from the (fp32) partials to the RMSNorm; only the two outputs are rounded."""
    check_tail_inputs(partials_fp32, shared, residual, norm_weight, eps)
    dt = shared.dtype
    acc = allreduce_reference(partials_fp32.float(), torch.float32)
    r = acc + shared.float() + residual.float()
    return rmsnorm_reference(r, norm_weight, eps, out_dtype=dt), r.to(dt)


# ---------------------------------------------------------------------------
# Triton kernels. One program per token row; BLOCK_H covers the whole hidden dim.

if triton is not None:


    @triton.jit
    def _sum_ranks(P, offs, mask, stride_rank, N: tl.constexpr):
        """fp32 sum of the N partials at `offs`, rank order 0..N-1 (fixed)."""
        acc = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
        for r in tl.static_range(1, N):
            acc = acc + tl.load(P + r * stride_rank + offs, mask=mask, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _rms_normalize(x, w, mask, h_f, eps):
        """x [BLOCK_H] fp32 -> x / sqrt(mean(x*x) + eps) * w, in fp32; IEEE-rounded sqrt and divisions."""
        xx = tl.where(mask, x * x, 0.0)
        var = tl.div_rn(tl.sum(xx, axis=0), h_f)
        scale = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        return (x * scale) * w

    @triton.jit
    def _finalize_kernel(Y, TW, OUT, H, K: tl.constexpr, BLOCK_H: tl.constexpr, EMU: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)   # a row split over CTAs at small T
        mask = cols < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for k in tl.static_range(K):
            w = tl.load(TW + row * K + k)
            y = tl.load(Y + (row * K + k) * H + cols, mask=mask, other=0.0).to(tl.float32)
            acc = acc + w * y
        tl.store(OUT + row * H + cols, _round(acc, OUT.dtype.element_ty, EMU), mask=mask)       # rounding point 1

    @triton.jit
    def _allreduce_sum_kernel(P, OUT, H, stride_rank, N: tl.constexpr, BLOCK_H: tl.constexpr, EMU: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        acc = _sum_ranks(P, row * H + cols, mask, stride_rank, N)
        tl.store(OUT + row * H + cols, _round(acc, OUT.dtype.element_ty, EMU), mask=mask)       # rounding point 2

    @triton.jit
    def _add_kernel(A, B, OUT, H, BLOCK_H: tl.constexpr, EMU: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        a = tl.load(A + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * H + cols, _round(a + b, OUT.dtype.element_ty, EMU), mask=mask)   # rounding points 3, 4

    @triton.jit
    def _rmsnorm_kernel(X, W, OUT, H, h_f, eps, BLOCK_H: tl.constexpr, EMU: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        x = tl.load(X + row * H + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        y = _rms_normalize(x, w, mask, h_f, eps)
        tl.store(OUT + row * H + cols, _round(y, OUT.dtype.element_ty, EMU), mask=mask)         # rounding point 5

    @triton.jit
    def _fused_tail_kernel(P, SHARED, RES, W, OUT, RES_OUT, H, h_f, eps, stride_rank,
                           N: tl.constexpr, BLOCK_H: tl.constexpr, EMU: tl.constexpr):
        """One pass after the exchange: reduce, + shared, + residual, RMSNorm — the rounding
        points of the unfused chain kept as explicit casts (the `.to(dt).to(fp32)` pairs)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        offs = row * H + cols
        dt = OUT.dtype.element_ty
        ar = _round(_sum_ranks(P, offs, mask, stride_rank, N), dt, EMU).to(tl.float32)           # rounding point 2
        shared = tl.load(SHARED + offs, mask=mask, other=0.0).to(tl.float32)
        h = _round(ar + shared, dt, EMU).to(tl.float32)                                         # rounding point 3
        res = tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
        r = _round(h + res, dt, EMU)                                                          # rounding point 4
        tl.store(RES_OUT + offs, r, mask=mask)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        y = _rms_normalize(r.to(tl.float32), w, mask, h_f, eps)
        tl.store(OUT + offs, _round(y, dt, EMU), mask=mask)                                       # rounding point 5

    @triton.jit
    def _naive_tail_kernel(P, SHARED, RES, W, OUT, RES_OUT, H, h_f, eps, stride_rank,
                           N: tl.constexpr, BLOCK_H: tl.constexpr, EMU: tl.constexpr):
        """The same pass with fp32 partials and no intermediate rounding (points 1-4 dropped)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        offs = row * H + cols
        dt = OUT.dtype.element_ty
        acc = _sum_ranks(P, offs, mask, stride_rank, N)
        shared = tl.load(SHARED + offs, mask=mask, other=0.0).to(tl.float32)
        res = tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
        r = acc + shared + res
        tl.store(RES_OUT + offs, _round(r, dt, EMU), mask=mask)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        y = _rms_normalize(r, w, mask, h_f, eps)
        tl.store(OUT + offs, _round(y, dt, EMU), mask=mask)




def _launch_cfg(H: int, device: torch.device) -> dict:
    """Same block shape and warps for every kernel of the tail, so reductions match."""
    block = triton.next_power_of_2(H)
    return {"BLOCK_H": block, "EMU": _device.bf16_cast_needs_emulation(device), "num_warps": 4 if block <= 1024 else 8,
            "enable_fp_fusion": False}



# The elementwise kernels (finalize, the rank sum, the adds) need no row-wide reduction, so at small T a
# row is split over CTAs: one CTA per row would leave most of a GPU's SMs idle at decode (T = 1..16 CTAs on
# 132 SMs). Per element the arithmetic and its order are unchanged, so the bits are too. The RMSNorm and
# the fused passes reduce over the whole row and keep one CTA per row (a split would need a second pass or
# a grid-wide wait for the sum of squares).
TARGET_CTAS = 132     # H100/H200 SMs
MIN_SPLIT_BLOCK = 256


def _split_cfg(T: int, H: int, device: torch.device) -> dict:
    """The elementwise kernels' block: the whole row when T alone fills the GPU, else a power-of-two
    slice of at least MIN_SPLIT_BLOCK columns so that T x slices reaches TARGET_CTAS."""
    cfg = _launch_cfg(H, device)
    full = cfg["BLOCK_H"]
    want = max(1, -(-TARGET_CTAS // max(T, 1)))           # slices per row
    per = max(1, H // want)
    block = max(MIN_SPLIT_BLOCK, 1 << (per.bit_length() - 1))    # rounded down: at least `want` slices
    block = min(block, full)
    cfg.update(BLOCK_H=block, num_warps=4 if block <= 1024 else 8)
    return cfg


select_backend = _device.select_backend  # kept as this module's name: chapters call it here


def _run(launch) -> None:
    launch.kernel[launch.grid](*launch.args, **launch.kwargs)


def _finalize_launch(expert_out, topk_weights, out, *, device: torch.device):
    """`finalize`'s launch (`compiled.Launch`): expert_out [T, K, H], topk_weights fp32 [T, K] -> out [T, H]."""
    from ..compiled import Launch

    T, K, H = expert_out.shape
    cfg = _split_cfg(T, H, device)
    return Launch(f"finalize -> {str(out.dtype)[6:]} T{T} K{K} H{H} block {cfg['BLOCK_H']}", _finalize_kernel,
                  [expert_out, topk_weights, out, H], dict(K=K, **cfg), "comm/tail.py:finalize",
                  (T, triton.cdiv(H, cfg["BLOCK_H"])))


def _unfused_launches(p, s, r, w, ar, h, residual_out, out, eps: float, *, device: torch.device) -> list:
    """`unfused_tail`'s four launches: partials [N, T, H], shared/residual [T, H], norm weight [H]."""
    from ..compiled import Launch

    N, T, H = p.shape
    cfg = _launch_cfg(H, device)
    sc = _split_cfg(T, H, device)
    split = (T, triton.cdiv(H, sc["BLOCK_H"]))
    src = "comm/tail.py:unfused_tail"
    tag = f"block {sc['BLOCK_H']}"
    return [Launch(f"allreduce_sum N{N} T{T} H{H} {tag}", _allreduce_sum_kernel, [p, ar, H, T * H], dict(N=N, **sc), src,
                   split),
            Launch(f"add (shared) T{T} H{H} {tag}", _add_kernel, [ar, s, h, H], dict(sc), src, split),
            Launch(f"add (residual) T{T} H{H} {tag}", _add_kernel, [h, r, residual_out, H], dict(sc), src, split),
            Launch(f"rmsnorm T{T} H{H}", _rmsnorm_kernel, [residual_out, w, out, H, float(H), float(eps)], dict(cfg),
                   src, (T,))]


def _tail_launch(kernel, p, s, r, w, out, residual_out, eps: float, *, device: torch.device):
    """`fused_tail`'s or `naive_fused_tail`'s one launch (the kernel says which)."""
    from ..compiled import Launch

    N, T, H = p.shape
    which = "fused_tail" if kernel is _fused_tail_kernel else "naive_fused_tail"
    return Launch(f"{which} N{N} T{T} H{H} partials:{str(p.dtype)[6:]}", kernel,
                  [p, s, r, w, out, residual_out, H, float(H), float(eps), T * H], dict(N=N, **_launch_cfg(H, device)),
                  f"comm/tail.py:{which}", (T,))


def tail_launches(world_size: int, tokens: int, hidden: int, top_k: int, dtype=torch.bfloat16, eps: float = 1e-6) -> list:
    """Every launch of the tail at these shapes on a GPU, without running them: finalize (to `dtype`
    and to fp32), the unfused four, the fused one and the naive fp32 fusion."""
    from ..compiled import meta

    N, T, H = world_size, tokens, hidden
    dev = torch.device("cuda")
    th = lambda: meta((T, H), dtype)  # noqa: E731
    out = [_finalize_launch(meta((T, top_k, H), dtype), meta((T, top_k), torch.float32), meta((T, H), odt), device=dev)
           for odt in (dtype, torch.float32)]
    p = meta((N, T, H), dtype)
    out += _unfused_launches(p, th(), th(), meta((H,), dtype), th(), th(), th(), th(), eps, device=dev)
    out.append(_tail_launch(_fused_tail_kernel, p, th(), th(), meta((H,), dtype), th(), th(), eps, device=dev))
    out.append(_tail_launch(_naive_tail_kernel, meta((N, T, H), torch.float32), th(), th(), meta((H,), dtype), th(), th(),
                            eps, device=dev))
    return out


def finalize(expert_out, topk_weights, out_dtype=None, backend: str = "auto") -> torch.Tensor:
    """Rounding point 1 (or fp32 partials with out_dtype=float32, for the naive fusion)."""
    T, K, H = check_finalize_inputs(expert_out, topk_weights)
    if select_backend(expert_out.device, backend)[0] == "torch":
        return finalize_reference(expert_out, topk_weights, out_dtype)
    out = torch.empty(T, H, dtype=out_dtype or expert_out.dtype, device=expert_out.device)
    if T:
        _run(_finalize_launch(expert_out.contiguous(), topk_weights.contiguous(), out, device=expert_out.device))
    return out


def unfused_tail(partials, shared, residual, norm_weight, eps=1e-6, backend: str = "auto"):
    """Four launches, each step's result through memory: reduce, add, add, RMSNorm."""
    N, T, H = check_tail_inputs(partials, shared, residual, norm_weight, eps)
    if select_backend(partials.device, backend)[0] == "torch":
        return tail_reference(partials, shared, residual, norm_weight, eps)
    p, s, r, w = (t.contiguous() for t in (partials, shared, residual, norm_weight))
    ar, h, residual_out, out = (torch.empty_like(s) for _ in range(4))
    if T:
        for launch in _unfused_launches(p, s, r, w, ar, h, residual_out, out, eps, device=partials.device):
            _run(launch)
    return out, residual_out


def fused_tail(partials, shared, residual, norm_weight, eps=1e-6, backend: str = "auto"):
    """One launch after the exchange, keeping rounding points 2-5. Returns (out, residual_out)."""
    N, T, H = check_tail_inputs(partials, shared, residual, norm_weight, eps)
    if partials.dtype != shared.dtype:
        raise UserError(f"fused_tail keeps the reference's rounding: partials must be {_dtype_name(shared.dtype)}, "
                        f"got {_dtype_name(partials.dtype)} (fp32 partials are the naive fusion)")
    if select_backend(partials.device, backend)[0] == "torch":
        return tail_reference(partials, shared, residual, norm_weight, eps)
    p, s, r, w = (t.contiguous() for t in (partials, shared, residual, norm_weight))
    out, residual_out = torch.empty_like(s), torch.empty_like(s)
    if T:
        _run(_tail_launch(_fused_tail_kernel, p, s, r, w, out, residual_out, eps, device=p.device))
    return out, residual_out


def naive_fused_tail(partials_fp32, shared, residual, norm_weight, eps=1e-6, backend: str = "auto"):
    """One launch, fp32 throughout (partials fp32 from `finalize(..., out_dtype=torch.float32)`)."""
    N, T, H = check_tail_inputs(partials_fp32, shared, residual, norm_weight, eps)
    if partials_fp32.dtype != torch.float32:
        raise UserError(f"the naive fusion takes fp32 partials, got {_dtype_name(partials_fp32.dtype)}")
    if select_backend(partials_fp32.device, backend)[0] == "torch":
        return naive_tail_reference(partials_fp32, shared, residual, norm_weight, eps)
    p, s, r, w = (t.contiguous() for t in (partials_fp32, shared, residual, norm_weight))
    out, residual_out = torch.empty_like(s), torch.empty_like(s)
    if T:
        _run(_tail_launch(_naive_tail_kernel, p, s, r, w, out, residual_out, eps, device=p.device))
    return out, residual_out


# ---------------------------------------------------------------------------
# A whole tail on N simulated ranks, in one process (the distributed version is in workers.py).

def make_tail_inputs(ranks: int, tokens: int, hidden: int, topk_per_rank: int, dtype=torch.bfloat16, *,
                     generator: torch.Generator | None = None, device="cpu") -> dict:
    """Random inputs for `ranks` ranks: expert outputs [N, T, K, H], top-k weights [N, T, K]
    (a softmax over all N*K slots of a token), shared expert output, residual (larger: it is the
    stream the layers add into) and RMSNorm weight. Made on CPU from `generator`, then moved."""
    for name, v in (("ranks", ranks), ("tokens", tokens), ("hidden", hidden), ("topk_per_rank", topk_per_rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "tokens" else 1):
            raise UserError(f"{name} must be an int >= {0 if name == 'tokens' else 1}, got {v!r}")
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype} is not supported; use " + ", ".join(_dtype_name(d) for d in DTYPES))
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    N, T, H, K = ranks, tokens, hidden, topk_per_rank
    logits = torch.randn(T, N * K, generator=g)
    weights = torch.softmax(logits, dim=-1).reshape(T, N, K).permute(1, 0, 2).contiguous()
    inputs = {
        "expert_out": torch.randn(N, T, K, H, generator=g).to(dtype),
        "topk_weights": weights.float(),
        "shared": torch.randn(T, H, generator=g).to(dtype),
        "residual": (4 * torch.randn(T, H, generator=g)).to(dtype),
        "norm_weight": (1 + 0.1 * torch.randn(H, generator=g)).to(dtype),
    }
    return {k: v.to(device) for k, v in inputs.items()}


VARIANTS = ("reference", "unfused", "fused", "naive")


def run_tail(inputs: dict, variant: str, eps: float = 1e-6, backend: str = "auto"):
    """The full tail on the simulated ranks: finalize per rank, exchange (stack in rank order), then
    the post-exchange pass of `variant`. Returns (out, residual_out)."""
    if variant not in VARIANTS:
        raise UserError(f"variant must be one of {VARIANTS}, got {variant!r}")
    ys, ws = inputs["expert_out"], inputs["topk_weights"]
    args = (inputs["shared"], inputs["residual"], inputs["norm_weight"], eps)
    if variant == "reference":
        partials = torch.stack([finalize_reference(ys[r], ws[r]) for r in range(ys.shape[0])])
        return tail_reference(partials, *args)
    if variant == "naive":
        partials = torch.stack([finalize(ys[r], ws[r], torch.float32, backend) for r in range(ys.shape[0])])
        return naive_fused_tail(partials, *args, backend=backend)
    partials = torch.stack([finalize(ys[r], ws[r], None, backend) for r in range(ys.shape[0])])
    fn = fused_tail if variant == "fused" else unfused_tail
    return fn(partials, *args, backend=backend)


# ---------------------------------------------------------------------------
# Counting bits

_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Boolean mask of elements whose bit patterns differ (NaN payloads and -0.0 count)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise UserError(f"cannot compare bits of {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    view = _INT_VIEW.get(a.dtype)
    if view is None:
        raise UserError(f"bits_differ supports {list(_INT_VIEW)}, got {a.dtype}")
    return a.contiguous().view(view) != b.contiguous().view(view)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between a and b (same dtype), as int64; NaN anywhere -> -1."""
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype not in _INT_VIEW:
        raise UserError(f"ulp_distance needs two tensors of one float dtype and shape, got {a.dtype} and {b.dtype}")
    bits = 16 if _INT_VIEW[a.dtype] == torch.int16 else 32
    mask = (1 << (bits - 1))

    def ordered(x):
        i = x.contiguous().view(_INT_VIEW[x.dtype]).to(torch.int64) & ((1 << bits) - 1)
        return torch.where(i >= mask, mask - i, i)  # sign-magnitude -> monotone integers

    d = (ordered(a) - ordered(b)).abs()
    return torch.where(a.isnan() | b.isnan(), torch.full_like(d, -1), d)


def tail_bytes(ranks: int, tokens: int, hidden: int, itemsize: int) -> dict[str, int]:
    """Device-memory bytes each rank moves after the exchange (the finalize is common to both)."""
    th, h = tokens * hidden * itemsize, hidden * itemsize
    return {
        # reduce: N reads + 1 write; two adds: 2 reads + 1 write each; RMSNorm: 1 read + weight + 1 write
        "unfused": (ranks + 1) * th + 2 * 3 * th + 2 * th + h,
        # partials, shared, residual and weight in; out and residual_out back
        "fused": (ranks + 2) * th + h + 2 * th,
        # the naive fusion reads fp32 partials (and the exchange moved twice the bytes)
        "naive": ranks * tokens * hidden * 4 + 2 * th + h + 2 * th,
    }


def after_allreduce(allreduced, shared, residual, norm_weight, eps=1e-6, backend: str = "auto"):
    """The unfused chain's steps 3-5 on an already all-reduced tensor (as after
    `torch.distributed` or `allreduce.all_reduce`): add, add, RMSNorm, three launches."""
    return unfused_tail(allreduced[None], shared, residual, norm_weight, eps, backend)
