"""A grouped GEMM (one weight per group, rows of x split by group sizes) and a checker that
compares any grouped GEMM against per-group references on many shapes.

Transformer Engine 2.19 ships a fix (#3475) that disables cuBLAS 13.7 grouped-GEMM algorithms
on B300/Rubin because they could corrupt data *silently*: no error, wrong numbers. Nothing in a
loss curve says which group went wrong. The defence is a checker like `check_grouped_gemm`: every
group against its own reference, with empty, tiny and odd-sized groups, and an output buffer
pre-filled with NaN so rows a kernel never wrote cannot pass.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..device import dot_needs_fp32

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None


def _check(x, w, group_sizes):
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped GEMM needs x [M, K] and w [G, N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    sizes = [int(s) for s in group_sizes]
    if len(sizes) != w.shape[0] or any(s < 0 for s in sizes) or sum(sizes) != x.shape[0]:
        raise ValueError(f"group_sizes {sizes} must be {w.shape[0]} non-negative ints summing to M = {x.shape[0]}")
    return sizes


def grouped_gemm_reference(x: torch.Tensor, w: torch.Tensor, group_sizes) -> torch.Tensor:
    """out[rows of group g] = x[rows of g] @ w[g].T, one torch matmul per group (fp32 accumulate)."""
    sizes = _check(x, w, group_sizes)
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for gi, n in enumerate(sizes):
        out[start:start + n] = (x[start:start + n].float() @ w[gi].float().T).to(x.dtype)
        start += n
    return out


if triton is not None:
    @triton.jit
    def grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, tile_group_ptr, tile_row_ptr, group_end_ptr, N, K,
                            sxm, sxk, swg, swn, swk, som, son,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
                            IEEE: tl.constexpr, SKIP_LAST_ROW: tl.constexpr):
        tile = tl.program_id(0)
        pid_n = tl.program_id(1)
        grp = tl.load(tile_group_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile)
        row_end = tl.load(group_end_ptr + grp)  # rows of this group end here: tiles never cross groups
        if SKIP_LAST_ROW:  # fault injection for the checker's own test: drop each group's last row
            row_end = row_end - 1
        rows = row0 + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxm + ks[None, :] * sxk,
                        mask=(rows[:, None] < row_end) & (ks[None, :] < K), other=0.0)
            b = tl.load(w_ptr + grp.to(tl.int64) * swg + cols[None, :] * swn + ks[:, None] * swk,
                        mask=(cols[None, :] < N) & (ks[:, None] < K), other=0.0)
            if DOT_FP32:  # the interpreter's bf16 tl.dot is wrong: upcast there only
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:  # fp32 operands: full fp32 products, as torch's fp32 matmul (tl.dot defaults to TF32)
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * som + cols[None, :] * son, acc,
                 mask=(rows[:, None] < row_end) & (cols[None, :] < N))


def grouped_gemm_triton(x: torch.Tensor, w: torch.Tensor, group_sizes, *, block_m: int = 32, block_n: int = 32,
                        block_k: int = 32, out: torch.Tensor | None = None, _skip_last_row: bool = False):
    """Triton grouped GEMM: tiles of `block_m` rows never cross a group boundary (the host lists
    (group, first row) per tile), so an empty group launches no tile. Writes into `out` if given."""
    sizes = _check(x, w, group_sizes)
    if triton is None:
        raise RuntimeError("triton is not installed")
    M, K = x.shape
    N = w.shape[1]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if out is None else out
    # The kernel writes fp32 and torch rounds to the output dtype: the Triton 3.9 interpreter
    # truncates fp32 -> bf16 in `.to()` (compiled Triton and torch round to nearest even), and a
    # checker must not blame the kernel for the interpreter's rounding.
    buf = out if out.dtype == torch.float32 else out.float()
    tile_group, tile_row, ends, start = [], [], [], 0
    for gi, n in enumerate(sizes):
        for r in range(start, start + n, block_m):
            tile_group.append(gi)
            tile_row.append(r)
        start += n
        ends.append(start)
    if not tile_group or N == 0:
        return out
    dev = x.device
    tg = torch.tensor(tile_group, dtype=torch.int32, device=dev)
    tr = torch.tensor(tile_row, dtype=torch.int32, device=dev)
    ge = torch.tensor(ends, dtype=torch.int32, device=dev)
    launch = _grouped_launch(x, w, buf, tg, tr, ge, block_m, block_n, block_k, _skip_last_row, device=dev)
    launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    if buf is not out:
        out.copy_(buf)
    return out


def _grouped_launch(x, w, buf, tg, tr, ge, block_m: int, block_n: int, block_k: int, skip_last_row: bool, *,
                    device: torch.device):
    """The launch (`compiled.Launch`) of `grouped_gemm_triton` for x [M, K], w [G, N, K], the fp32
    output buffer [M, N] and the int32 tile tables (tensors or `meta` stand-ins)."""
    from ..compiled import Launch

    K = x.shape[1]
    N = w.shape[1]
    return Launch(f"grouped_gemm N{N} K{K}{' fault' if skip_last_row else ''}", grouped_gemm_kernel,
                  [x, w, buf, tg, tr, ge, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                   w.stride(2), buf.stride(0), buf.stride(1)],
                  dict(BM=block_m, BN=block_n, BK=block_k, DOT_FP32=dot_needs_fp32(device),
                       IEEE=dot_needs_fp32(device) or x.dtype == torch.float32, SKIP_LAST_ROW=skip_last_row),
                  "numerics/grouped.py:grouped_gemm_triton", (tg.shape[0], triton.cdiv(N, block_n)))


def grouped_gemm_launches(rows: int, groups: int, n: int, k: int, dtype=torch.bfloat16, *, block_m: int = 32,
                          block_n: int = 32, block_k: int = 32, skip_last_row: bool = False) -> list:
    """The launch `grouped_gemm_triton` makes for x [rows, k] and w [groups, n, k] (one tile per
    block_m rows of each group; the tile count only sizes the grid), without running it."""
    from ..compiled import meta

    tiles = max(1, -(-rows // block_m))
    i32 = torch.int32
    return [_grouped_launch(meta((rows, k), dtype), meta((groups, n, k), dtype), meta((rows, n), torch.float32),
                            meta((tiles,), i32), meta((tiles,), i32), meta((groups,), i32), block_m, block_n, block_k,
                            skip_last_row, device=torch.device("cuda"))]


def broken_grouped_gemm(x, w, group_sizes, out=None):
    """The Triton kernel with an injected fault (each group's last row never written)."""
    return grouped_gemm_triton(x, w, group_sizes, out=out, _skip_last_row=True)


def grouped_cases(n_groups: int, max_rows: int, seed: int = 0) -> list[list[int]]:
    """Group-size patterns that break kernels: empty groups (first, middle, last), one row,
    sizes around the tile size, all rows in one group, random."""
    g = torch.Generator().manual_seed(seed)
    cases = [
        [0] * (n_groups - 1) + [max_rows],
        [max_rows] + [0] * (n_groups - 1),
        [1] * n_groups,
        [(31 + i) % (max_rows + 1) for i in range(n_groups)],
        [0 if i % 2 else 33 for i in range(n_groups)],
        torch.randint(0, max_rows + 1, (n_groups,), generator=g).tolist(),
        torch.randint(0, max_rows + 1, (n_groups,), generator=g).tolist(),
    ]
    return [c for c in cases if sum(c) > 0]


def check_grouped_gemm(fn: Callable, *, n_groups: int, max_rows: int, shapes=((64, 48), (33, 70)),
                       dtype=torch.float32, device="cpu", seed: int = 0, factor: float = 2.0) -> list[dict]:
    """Run `fn(x, w, group_sizes, out=None) -> out` on many group patterns and (K, N) shapes.

    Per case and per group: relative max error against the fp64 per-group reference, against a
    tolerance of `factor` x the error of torch's own matmul in `dtype` (floor: 4 ulp of dtype).
    `out` is pre-filled with NaN, so rows a kernel skips are non-finite and fail.
    """
    rows = []
    eps = torch.finfo(dtype).eps
    case = 0
    for K, N in shapes:
        for sizes in grouped_cases(n_groups, max_rows, seed + case):
            g = torch.Generator().manual_seed(seed + 1000 + case)
            case += 1
            M = sum(sizes)
            x = torch.randn(M, K, generator=g).to(dtype).to(device)
            w = (torch.randn(len(sizes), N, K, generator=g) / math.sqrt(K)).to(dtype).to(device)
            out = torch.full((M, N), math.nan, dtype=dtype, device=device)
            try:
                got = fn(x, w, sizes, out=out)
                err_msg = ""
            except Exception as e:
                got, err_msg = None, f"raised {type(e).__name__}: {str(e)[:100]}"
            start, bad_groups, worst, worst_tol = 0, [], 0.0, 0.0
            for gi, n in enumerate(sizes):
                if n == 0:
                    continue
                ref = x[start:start + n].double() @ w[gi].double().T
                same_prec = (x[start:start + n] @ w[gi].T).double()
                scale = ref.abs().max().item() or 1.0
                tol = max(factor * (same_prec - ref).abs().max().item(), 4 * eps * scale) / scale
                if got is None:
                    err = math.nan
                else:
                    part = got[start:start + n].double()
                    err = (part - ref).abs().max().item() / scale if torch.isfinite(part).all() else math.nan
                if not (err <= tol):
                    bad_groups.append(gi)
                worst = err if (math.isnan(err) or math.isnan(worst)) else max(worst, err)
                worst_tol = max(worst_tol, tol)
                start += n
            rows.append({"K": K, "N": N, "group_sizes": " ".join(map(str, sizes)), "M": M,
                         "max_rel_err": worst, "tolerance": worst_tol, "bad_groups": bad_groups,
                         "passed": not bad_groups and not err_msg, "error": err_msg})
    return rows
