"""Kernels whose cost is known by hand, to hold the cost model (`compiled.cost`) to it.

- `copy_kernel`: each CTA copies `tiles` tiles of `BLOCK` fp32 elements in a loop (16-byte loads
  and stores, no arithmetic): memory-bound at the copy ceiling when the grid fills the GPU.
- `gemm_kernel`: one 128x128 output tile per CTA, K streamed in 64-wide steps through `tl.dot`
  (bf16 in, fp32 accumulate): compute-bound at the tensor-core rate when the grid is one CTA per SM.
- the copy kernel on a grid of 4 CTAs: each CTA's loop waits one DRAM latency per iteration, so
  latency (the grid, not the bandwidth) binds.

`launches()` returns them (`compiled.Launch`, `meta` tensors) for `inspect(["py:inferbook.compiled.calibration:launches"], ...)`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def copy_kernel(x_ptr, y_ptr, tiles, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    for i in range(tiles):
        offs = (pid * tiles + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs))


@triton.jit
def gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """a [M, K] bf16 row-major, b [K, N] bf16 row-major, c [M, N] fp32; M, N, K multiples of the tiles."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
        b = tl.load(b_ptr + (k0 + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc)


def copy_launch(ctas: int, tiles: int, block: int = 1024, name: str = ""):
    from . import Launch, meta

    n = ctas * tiles * block
    x, y = meta((n,), torch.float32), meta((n,), torch.float32)
    return Launch(name or f"copy {ctas} CTAs x {tiles} tiles of {block}", copy_kernel, [x, y, tiles],
                  dict(BLOCK=block, num_warps=4, num_stages=1), "compiled/calibration.py", (ctas,))


def gemm_launch(m: int, n: int, k: int, name: str = ""):
    from . import Launch, meta

    cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4)
    a, b, c = meta((m, k), torch.bfloat16), meta((k, n), torch.bfloat16), meta((m, n), torch.float32)
    return Launch(name or f"gemm M{m} N{n} K{k}", gemm_kernel, [a, b, c, m, n, k], cfg, "compiled/calibration.py",
                  (triton.cdiv(m, 128), triton.cdiv(n, 128)))


def launches(params: dict | None = None) -> list:
    """The hand-checked cases: a GPU-filling copy, a GEMM of one tile per H200 SM (12 x 11 tiles),
    the same GEMM with one more row of tiles (12 x 12: a second wave on 12 SMs), a 4-CTA copy."""
    return [copy_launch(1024, 64, name="copy"), gemm_launch(128 * 12, 128 * 11, 8192, name="gemm 132 tiles"),
            gemm_launch(128 * 12, 128 * 12, 8192, name="gemm 144 tiles"), copy_launch(4, 256, name="copy tiny grid")]
