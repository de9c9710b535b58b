"""Split-KV decode attention (flash-decoding) whose split count is either chosen from the batch
size — the device-filling heuristic of the kind the seed's Lean Attention follows — or fixed in
tokens per split, which makes every request's result independent of the batch it sits in.

    out = decode_attention(q, k_cache, v_cache, seqlens, deterministic)

Shapes (B = batch, H = query heads, Hk = key/value heads, H % Hk == 0, D = head dim <= 256,
S = cache capacity): q [B, H, D]; k_cache and v_cache [B, S, Hk, D]; seqlens int [B], each in
0..S (request b attends to its first seqlens[b] keys). Returns out [B, H, D] in q's dtype.
dtypes: float16, bfloat16 or float32 (q, k_cache and v_cache the same). A request with
seqlen 0 gets zeros.

**Why the split count matters.** Decoding one token reads the whole KV cache but does little
math, so with a small batch there are too few (request, head) pairs to fill the device. Split-KV
cuts each request's keys into `num_splits` pieces, computes a partial softmax-weighted sum per
piece (stage 1), and merges the pieces with their log-sum-exps (stage 2). Floating-point
addition is not associative: *where* the cuts fall changes the grouping of the sums, hence the
bits of the output.

- `deterministic=False` (adaptive): `num_splits = ceil(target programs / (B * Hk))`, so the
  cuts move whenever the batch size (or the batch's longest request) changes: the same request
  gives different bits in different batches.
- `deterministic=True` (fixed split size): cuts every `split_size` tokens from the start of each
  request, whatever the batch. Stage 1's block loop and stage 2's merge order then depend only on
  the request itself: batch-invariant, bit for bit. This is the seed's #37740 in miniature — with
  deterministic inference on, SGLang on AMD stops using Lean Attention and takes the standard
  Triton path; the non-deterministic choice stays available.

Both stages are Triton kernels; `decode_attention_reference` is the fp32 PyTorch definition.
`batch_invariant_matmul` is the same idea for a linear layer: fixed tiles and one K loop per
output tile, no split-K, so a row's result does not depend on how many rows are in the batch.
"""
from __future__ import annotations

import math

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

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_N = 32               # keys per inner iteration (both modes)
DEFAULT_SPLIT_SIZE = 256   # tokens per split in deterministic mode (a multiple of BLOCK_N)
MAX_SPLITS = 64
CPU_SM_COUNT = 132         # on CPU, plan as for a 132-SM GPU so the interpreter sees a GPU's choices
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------
# Checks and plans

def _name(dt) -> str:
    return str(dt).replace("torch.", "")


def check_inputs(q, k_cache, v_cache, seqlens, values: bool = True) -> tuple[int, int, int, int, int]:
    """Validate shapes, dtypes and devices (and, with `values`, that every seqlen lies in 0..S,
    which reads the tensor: a device sync); returns (B, H, Hk, D, S). UserError names the value."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("seqlens", seqlens)):
        if not isinstance(t, torch.Tensor):
            raise UserError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise UserError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    B, H, D = q.shape
    if k_cache.dim() != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise UserError(f"k_cache must be [B={B}, S, Hk, D={D}], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise UserError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    S, Hk = k_cache.shape[1], k_cache.shape[2]
    if Hk < 1 or H % Hk:
        raise UserError(f"query heads H={H} must be a multiple of key/value heads Hk={Hk}")
    if not 1 <= D <= 256:
        raise UserError(f"head dim D must be in 1..256, got {D}")
    if q.dtype not in DTYPES:
        raise UserError(f"q dtype {_name(q.dtype)} is not supported; use " + ", ".join(_name(d) for d in DTYPES))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise UserError(f"{name} dtype {_name(t.dtype)} differs from q's {_name(q.dtype)}")
        if t.device != q.device:
            raise UserError(f"{name} is on {t.device}, q on {q.device}")
    if seqlens.dim() != 1 or seqlens.shape[0] != B or seqlens.dtype not in (torch.int32, torch.int64):
        raise UserError(f"seqlens must be an int32/int64 tensor of shape [{B}], got {seqlens.dtype} {tuple(seqlens.shape)}")
    if values and B and (int(seqlens.min()) < 0 or int(seqlens.max()) > S):
        raise UserError(f"seqlens must lie in 0..{S} (the cache capacity), got min {int(seqlens.min())}, "
                        f"max {int(seqlens.max())}")
    if B * S * Hk * D >= 2**31:
        raise UserError(f"the cache has {B * S * Hk * D} elements; the kernels use int32 offsets (< 2**31)")
    return B, H, Hk, D, S


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


def plan_splits(batch: int, kv_heads: int, max_seqlen: int, *, deterministic: bool, sms: int,
                split_size: int = DEFAULT_SPLIT_SIZE) -> dict:
    """How the keys are cut. Returns {'mode', 'split_len', 'num_splits', 'programs'}.

    adaptive: enough splits for about two programs per SM, given B * Hk (request, kv-head) pairs,
    then the split length that covers the batch's longest request in that many pieces (rounded up
    to BLOCK_N). deterministic: `split_size` tokens per split, whatever the batch."""
    if isinstance(split_size, bool) or not isinstance(split_size, int) or split_size < BLOCK_N or split_size % BLOCK_N:
        raise UserError(f"split_size must be a positive multiple of {BLOCK_N}, got {split_size!r}")
    max_seqlen = max(int(max_seqlen), 1)
    if deterministic:
        split_len = split_size
        mode = "fixed split size"
    else:
        want = math.ceil(2 * sms / max(batch * kv_heads, 1))
        blocks = math.ceil(max_seqlen / BLOCK_N)
        n = max(1, min(want, blocks, MAX_SPLITS))
        split_len = math.ceil(math.ceil(max_seqlen / n) / BLOCK_N) * BLOCK_N
        mode = "adaptive (from batch size)"
    num_splits = math.ceil(max_seqlen / split_len)
    return {"mode": mode, "split_len": split_len, "num_splits": num_splits,
            "programs": batch * kv_heads * num_splits}


# ---------------------------------------------------------------------------
# Reference

def decode_attention_reference(q, k_cache, v_cache, seqlens, scale: float | None = None,
                               compute_dtype=torch.float32) -> torch.Tensor:
    """softmax(q k^T * scale) v over each request's first seqlens[b] keys, computed in
    `compute_dtype` (float32: the definition; bfloat16: PyTorch in the kernel's precision)."""
    B, H, Hk, D, S = check_inputs(q, k_cache, v_cache, seqlens)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    G = H // Hk
    qf = q.to(compute_dtype)
    kf = k_cache.to(compute_dtype).repeat_interleave(G, dim=2)   # [B, S, H, D]
    vf = v_cache.to(compute_dtype).repeat_interleave(G, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", qf, kf) * scale
    keep = torch.arange(S, device=q.device)[None, :] < seqlens[:, None].to(q.device)   # [B, S]
    scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
    p = torch.softmax(scores.float(), dim=-1).to(compute_dtype)
    p = torch.where(keep[:, None, :], p, torch.zeros((), dtype=compute_dtype, device=q.device))  # empty rows: 0
    out = torch.einsum("bhs,bshd->bhd", p, vf)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------
# Triton kernels

if triton is not None:

    @triton.jit
    def _split_kernel(Q, K, V, SEQLENS, MID_O, MID_LSE, qk_scale, split_len, num_splits,
                      stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                      G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, EMU: tl.constexpr):
        """Stage 1: one program per (request, kv head, split); all G query heads of the kv head
        together (a [BLOCK_G, D] tile, so tl.dot has M >= 16). Writes the split's normalized
        output and its base-2 log-sum-exp; an empty split writes lse = -inf."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seqlen = tl.load(SEQLENS + b)
        start = split * split_len
        end = tl.minimum(start + split_len, seqlen)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        g_mask = g < G
        d_mask = d < D
        q = tl.load(Q + b * stride_qb + (kvh * G + g)[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for lo in range(start, end, BLOCK_N):
            keys = lo + n
            k_mask = keys < end
            kv_off = b * stride_kb + keys[:, None] * stride_ks + kvh * stride_kh + d[None, :]
            k = tl.load(K + kv_off, mask=k_mask[:, None] & d_mask[None, :], other=0.0)
            v = tl.load(V + kv_off, mask=k_mask[:, None] & d_mask[None, :], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k)) * qk_scale                      # [BLOCK_G, BLOCK_N], base-2 logits
            s = tl.where(k_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            # p is rounded to the cache dtype before P @ V, as on the GPU (also under the interpreter)
            p_lo = _round(p, V.dtype.element_ty, EMU)
            if DOT_FP32:
                p_lo = p_lo.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_lo, v)
            m = m_new
        has = l > 0
        o = acc / tl.where(has, l, 1.0)[:, None]
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
        heads = kvh * G + g
        row = (b * (G * tl.num_programs(1)) + heads) * num_splits + split   # [B, H, num_splits]
        tl.store(MID_LSE + row, lse, mask=g_mask)
        tl.store(MID_O + row[:, None] * D + d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])

    @triton.jit
    def _merge_kernel(MID_O, MID_LSE, SEQLENS, OUT, split_len, num_splits, H,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, EMU: tl.constexpr):
        """Stage 2: one program per (request, head); merges the request's own splits in order
        0, 1, ..., ceil(seqlen / split_len) - 1 — a count that depends only on the request."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        seqlen = tl.load(SEQLENS + b)
        n_valid = (seqlen + split_len - 1) // split_len
        d = tl.arange(0, BLOCK_D)
        d_mask = d < D
        one = tl.arange(0, 1)
        base = (b * H + h) * num_splits
        m = tl.full([1], float("-inf"), tl.float32)
        l = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s in range(0, n_valid):
            lse = tl.load(MID_LSE + base + s + one)
            o = tl.load(MID_O + (base + s) * D + d, mask=d_mask, other=0.0)
            m_new = tl.maximum(m, lse)
            live = m_new > float("-inf")
            alpha = tl.where(live, tl.exp2(m - m_new), 1.0)
            w = tl.where(live, tl.exp2(lse - m_new), 0.0)
            acc = acc * alpha + o * w
            l = l * alpha + w
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)
        tl.store(OUT + (b * H + h) * D + d, _round(out, OUT.dtype.element_ty, EMU), mask=d_mask)






select_backend = _device.select_backend  # kept as this module's name: chapters call it here


def _decode_launches(q, k, v, lens, out, plan: dict, scale: float, *, device: torch.device) -> list:
    """The split and merge launches (`compiled.Launch`) of `decode_attention` for contiguous
    q [B, H, D], k/v [B, S, Hk, D], int32 lens [B] and out (tensors or `meta` stand-ins)."""
    from ..compiled import Launch

    B, H, D = q.shape
    Hk = k.shape[2]
    G = H // Hk
    ns = plan["num_splits"]
    mid_o = torch.empty(B, H, ns, D, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(B, H, ns, dtype=torch.float32, device=q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))   # tl.dot needs every dimension >= 16
    BLOCK_G = max(16, triton.next_power_of_2(G))
    emu = _device.bf16_cast_needs_emulation(device)
    split = Launch("split", _split_kernel,
                   [q, k, v, lens, mid_o, mid_lse, scale * LOG2E, plan["split_len"], ns,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2)],
                   dict(G=G, D=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                        DOT_FP32=_device.dot_needs_fp32(device), EMU=emu, num_warps=4),
                   "attention/decode.py:decode_attention", (B, Hk, ns))
    merge = Launch("merge", _merge_kernel, [mid_o, mid_lse, lens, out, plan["split_len"], ns, H],
                   dict(D=D, BLOCK_D=BLOCK_D, EMU=emu, num_warps=1), "attention/decode.py:decode_attention", (B, H))
    return [split, merge]


def decode_launches(batch: int, heads: int, kv_heads: int, head_dim: int, max_seqlen: int, *,
                    deterministic: bool, split_size: int = DEFAULT_SPLIT_SIZE, sms: int = 132,
                    dtype=torch.bfloat16, name: str = "") -> list:
    """The launches `decode_attention` makes for a batch of this shape on a GPU with `sms` SMs
    (132: H100/H200), without running them. The cache is [batch, max_seqlen, kv_heads, head_dim]."""
    from ..compiled import meta

    plan = plan_splits(batch, kv_heads, max_seqlen, deterministic=deterministic, sms=sms, split_size=split_size)
    q = meta((batch, heads, head_dim), dtype)
    k = meta((batch, max_seqlen, kv_heads, head_dim), dtype)
    launches = _decode_launches(q, k, meta(k.shape, dtype), meta((batch,), torch.int32), meta(q.shape, dtype),
                                plan, 1.0 / math.sqrt(head_dim), device=torch.device("cuda"))
    tag = f"B{batch} {'det' if deterministic else 'adaptive'} x{plan['num_splits']} H{heads}/{kv_heads} D{head_dim} S{max_seqlen}"
    for la in launches:
        la.name = f"{name} {la.name} {tag}".strip()
    return launches


def decode_attention(q, k_cache, v_cache, seqlens, deterministic: bool = False, *, split_size: int = DEFAULT_SPLIT_SIZE,
                     scale: float | None = None, sms: int | None = None, backend: str = "auto",
                     return_plan: bool = False, max_seqlen: int | None = None):
    """Split-KV decode attention (see the module docstring). `deterministic=True` forces the
    fixed split size (batch-invariant); False picks the split count from the batch size.
    With `return_plan`, returns (out, plan) where plan says how the keys were cut and by which backend.
    `max_seqlen` (the batch's longest seqlen, if the caller knows it) skips reading `seqlens` on the
    host — and the range check that needs it — so a timed call does not synchronize the device."""
    if not isinstance(deterministic, bool):
        raise UserError(f"deterministic must be True or False, got {deterministic!r}")
    B, H, Hk, D, S = check_inputs(q, k_cache, v_cache, seqlens, values=max_seqlen is None)
    if max_seqlen is not None and not (isinstance(max_seqlen, int) and 0 <= max_seqlen <= S):
        raise UserError(f"max_seqlen must be an int in 0..{S}, got {max_seqlen!r}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    max_len = max_seqlen if max_seqlen is not None else (int(seqlens.max()) if B else 0)
    plan = plan_splits(B, Hk, max_len, deterministic=deterministic, sms=sms or sm_count(q.device), split_size=split_size)
    chosen, why = select_backend(q.device, backend)
    plan = {**plan, "backend": chosen, "reason": why}
    if chosen == "torch":
        out = decode_attention_reference(q, k_cache, v_cache, seqlens, scale)
        return (out, plan) if return_plan else out
    out = torch.empty_like(q)
    if B == 0:
        return (out, plan) if return_plan else out
    q_, k_, v_ = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    lens = seqlens if seqlens.dtype == torch.int32 and seqlens.device == q.device else seqlens.to(q.device, torch.int32)
    for launch in _decode_launches(q_, k_, v_, lens.contiguous(), out, plan, scale, device=q.device):
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return (out, plan) if return_plan else out


# ---------------------------------------------------------------------------
# Batch invariance, measured

def output_bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (for counting distinct bit patterns)."""
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def batch_invariance_sweep(*, batch_sizes, heads: int, kv_heads: int, head_dim: int, max_seqlen: int,
                           target_len: int, dtype=torch.bfloat16, device="cpu", seed: int = 0,
                           split_size: int = DEFAULT_SPLIT_SIZE, sms: int | None = None) -> list[dict]:
    """The same request (q, keys, values, length) placed last in batches of each size, the other
    requests random with random lengths. One row per (mode, batch): the plan and the target's
    output bit pattern (hex digest) and its error against the fp32 reference."""
    import hashlib

    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    tq = torch.randn(heads, head_dim, generator=g).to(dtype)
    tk = torch.randn(max_seqlen, kv_heads, head_dim, generator=g).to(dtype)
    tv = torch.randn(max_seqlen, kv_heads, head_dim, generator=g).to(dtype)
    rows = []
    for B in batch_sizes:
        gb = torch.Generator().manual_seed(seed * 1000 + B)
        q = torch.randn(B, heads, head_dim, generator=gb).to(dtype)
        k = torch.randn(B, max_seqlen, kv_heads, head_dim, generator=gb).to(dtype)
        v = torch.randn(B, max_seqlen, kv_heads, head_dim, generator=gb).to(dtype)
        lens = torch.randint(1, max_seqlen + 1, (B,), generator=gb)
        q[-1], k[-1], v[-1], lens[-1] = tq, tk, tv, target_len
        q, k, v, lens = q.to(device), k.to(device), v.to(device), lens.to(device)
        ref = decode_attention_reference(q[-1:], k[-1:], v[-1:], lens[-1:]).float()
        for deterministic in (False, True):
            out, plan = decode_attention(q, k, v, lens, deterministic, split_size=split_size, sms=sms, return_plan=True)
            target = out[-1:]
            rows.append({"mode": "deterministic" if deterministic else "adaptive", "batch": B,
                         "split_len": plan["split_len"], "num_splits": plan["num_splits"],
                         "target_splits": math.ceil(target_len / plan["split_len"]),
                         "bits": hashlib.sha256(output_bits(target)).hexdigest()[:16],
                         "max_err": float((target.float() - ref).abs().max()),
                         "nan": bool(target.isnan().any()), "backend": plan["backend"]})
    return rows


# ---------------------------------------------------------------------------
# A batch-invariant matmul for the linear layers

if triton is not None:

    @triton.jit
    def _bi_matmul_kernel(A, W, C, M, N, K, stride_am, stride_wn, stride_cm, NUM_PROGRAMS,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr, EMU: tl.constexpr):
        """C[M, N] = A[M, K] @ W[N, K]^T, persistent: NUM_PROGRAMS programs (one per SM) walk the
        output tiles in grouped order (GROUP_M row tiles share a weight column strip in L2). Each tile
        is one K loop in order with fixed tiles and no split-K, so a row's result never depends on M
        or on which program computed it (batch_invariant_ops' persistent matmul)."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        for tile in range(pid, num_pid_m * num_pid_n, NUM_PROGRAMS):
            group = tile // (GROUP_M * num_pid_n)
            first_m = group * GROUP_M
            size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
            pid_m = first_m + (tile % (GROUP_M * num_pid_n)) % size_m
            pid_n = (tile % (GROUP_M * num_pid_n)) // size_m
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = tl.load(A + rm[:, None] * stride_am + (k0 + rk)[None, :],
                            mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
                w = tl.load(W + rn[:, None] * stride_wn + (k0 + rk)[None, :],
                            mask=(rn[:, None] < N) & ((k0 + rk)[None, :] < K), other=0.0)
                if DOT_FP32:
                    # interpreter: tl.dot becomes a BLAS call whose rounding can depend on a row's
                    # position inside the tile; an explicit product and sum over k does not
                    acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
                else:
                    acc += tl.dot(a, tl.trans(w))
            tl.store(C + rm[:, None] * stride_cm + rn[None, :], _round(acc, C.dtype.element_ty, EMU),
                     mask=(rm[:, None] < M) & (rn[None, :] < N))


if triton is not None:

    @triton.jit
    def _bi_rms_norm_kernel(X, Y, M, D, stride_x, stride_y, eps, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                            EMU: tl.constexpr):
        """BLOCK_M rows per program: y = x / sqrt(mean(x^2) + eps), each row's sum of squares in fp32 over
        the whole row in one fixed reduction of a fixed [BLOCK_M, BLOCK_D] tile (rows past M are masked
        zeros and reduce alone), so a row's result does not depend on how many rows there are."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < M) & (d[None, :] < D)
        x = tl.load(X + rows[:, None] * stride_x + d[None, :], mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)
        tl.store(Y + rows[:, None] * stride_y + d[None, :], _round(x * r[:, None], Y.dtype.element_ty, EMU),
                 mask=mask)


# rows per RMSNorm program: a constant (never chosen from the row count), so a row's bits do not follow M;
# 16 rows cut the interpreter's programs (one Python step each) sixteenfold against one row per program
BI_RMS_ROWS = 16


def batch_invariant_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> x / sqrt(mean(x^2, -1) + eps) in x's dtype (no weight: multiply after, as
    `serving.model.RMSNorm` does), batch-invariant by construction (each row reduced alone, in a tile of fixed shape). torch's own
    mean over the last axis picks its reduction split from the tensor's shape on a GPU, so a row's
    bits can change with the number of rows; batch_invariant_ops replaces it for the same reason."""
    if x.dtype not in DTYPES or x.dim() < 1:
        raise UserError(f"batch_invariant_rms_norm takes a float16/bfloat16/float32 tensor, got {_name(x.dtype)}")
    ok, why = _device.triton_backend_for(x.device)
    if not ok:
        raise UserError(f"batch_invariant_rms_norm needs Triton on {x.device}: {why}")
    D = x.shape[-1]
    rows = x.reshape(-1, D).contiguous()
    out = torch.empty_like(rows)
    if rows.numel():
        M = rows.shape[0]
        _bi_rms_norm_kernel[(triton.cdiv(M, BI_RMS_ROWS),)](rows, out, M, D, rows.stride(0), out.stride(0), float(eps),
                                                            BLOCK_M=BI_RMS_ROWS, BLOCK_D=triton.next_power_of_2(D),
                                                            EMU=_device.bf16_cast_needs_emulation(x.device))
    return out.view(x.shape)


def batch_invariant_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] (F.linear's layout), batch-invariant by construction."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or x.dim() != 2 or weight.dim() != 2:
        raise UserError("batch_invariant_matmul takes x [M, K] and weight [N, K]")
    if x.shape[1] != weight.shape[1] or x.dtype != weight.dtype or x.dtype not in DTYPES:
        raise UserError(f"x {tuple(x.shape)} {_name(x.dtype)} and weight {tuple(weight.shape)} {_name(weight.dtype)} "
                        "must share K and a float16/bfloat16/float32 dtype")
    ok, why = _device.triton_backend_for(x.device)
    if not ok:
        raise UserError(f"batch_invariant_matmul needs Triton on {x.device}: {why}")
    M, K = x.shape
    N = weight.shape[0]
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    launch = _bi_matmul_launch(x, weight, out, device=x.device)
    launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    return out


# Fixed for every M (a row's result never depends on M): batch_invariant_ops' persistent config for
# 16-bit inputs (128x128x64, 8 warps, 3 stages: wgmma on sm_90); 32-bit inputs halve K per stage.
BI_MATMUL_TILES = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)
BI_MATMUL_TILES_FP32 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8)


def _bi_matmul_launch(x, weight, out, *, device: torch.device, sms: int | None = None):
    from ..compiled import Launch

    M, K = x.shape
    N = weight.shape[0]
    t = BI_MATMUL_TILES_FP32 if x.dtype == torch.float32 else BI_MATMUL_TILES
    tiles = triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"])
    programs = max(1, min(tiles, sm_count(device) if sms is None else sms))
    return Launch(f"bi_matmul M{M} N{N} K{K}", _bi_matmul_kernel,
                  [x, weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0), programs],
                  dict(**t, DOT_FP32=_device.dot_needs_fp32(device), EMU=_device.bf16_cast_needs_emulation(device),
                       num_warps=8, num_stages=3), "attention/decode.py:batch_invariant_matmul", (programs,))


def bi_matmul_launches(m: int, n: int, k: int, dtype=torch.bfloat16, sms: int = 132) -> list:
    """The launch `batch_invariant_matmul` makes for x [m, k] @ weight[n, k]^T, without running it."""
    from ..compiled import meta

    return [_bi_matmul_launch(meta((m, k), dtype), meta((n, k), dtype), meta((m, n), dtype), device=torch.device("cuda"),
                              sms=sms)]


def matmul_batch_invariance(fn, *, m_values, k: int, n: int, dtype=torch.bfloat16, device="cpu", seed: int = 0) -> dict:
    """Is fn(a[:1], w) == fn(a, w)[:1] in bits for each M — and, since in a batch a request's row
    can sit anywhere, is the middle and the last row of fn(a[:M], w) equal to that row computed
    alone? Returns {'same': {M: bool}, 'distinct': distinct patterns of row 0 across M,
    'rows_checked': n}."""
    g = torch.Generator().manual_seed(seed)
    a_all = torch.randn(max(m_values), k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype).to(device)
    alone = {}

    def row_alone(j):
        if j not in alone:
            alone[j] = output_bits(fn(a_all[j:j + 1], w))
        return alone[j]

    same, patterns, checked = {}, {row_alone(0)}, 0
    for m in m_values:
        out = fn(a_all[:m], w)
        patterns.add(output_bits(out[:1]))
        ok = True
        for j in sorted({0, m // 2, m - 1}):
            ok &= output_bits(out[j:j + 1]) == row_alone(j)
            checked += 1
        same[m] = ok
    return {"same": same, "distinct": len(patterns), "rows_checked": checked}
