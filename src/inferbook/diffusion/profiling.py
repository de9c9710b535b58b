"""What ran inside a VAE call, read from torch.profiler: the library kernels' share of the time, and whether
an INT8 GEMM kernel really ran.

On CUDA the answer comes from **kernel rows only** (events the profiler recorded on the device): each kernel
is counted once, by its own name. Operator rows (`aten::conv3d`, ...) also carry the device time of the
kernels they launched, so summing op rows and kernel rows counts every kernel twice. Library kernels are
recognised by the names cuDNN, cuBLAS / cuBLASLt (including Hopper's `nvjet_*` kernels), CUTLASS,
FlashAttention and PyTorch's memory-efficient attention give them.

On a CPU there are no kernel rows: operator rows' *self* CPU time (disjoint by construction) is split by op
name (conv, matmul, attention against the rest).
"""
from __future__ import annotations

import re
import statistics

import torch

# CUDA kernel names of the libraries torch.compile leaves convolutions, matmuls and attention to.
LIBRARY_KERNEL = re.compile(
    r"cudnn|cublas|cutlass|nvjet|gemm|xmma|flash|fmha|efficient_attention|mem_eff|implicit_convolve|"
    r"fprop|dgrad|wgrad|winograd|conv2d_|conv3d_|ampere_|hopper_|volta_|turing_", re.IGNORECASE)
# CPU operator names of the same work (oneDNN / MKL / ATen's own kernels).
LIBRARY_OPS = ("conv", "mm", "matmul", "scaled_dot_product", "attention", "linear", "addmm", "bmm")
# An INT8 GEMM kernel: cuBLAS(Lt) `..._i8i8_i32_...` / `imma` / `igemm`, CUTLASS `s8`, or a Triton INT8 kernel of ours.
INT8_KERNEL = re.compile(r"i8i8|imma|igemm|int8|_s8|s8_|i8_", re.IGNORECASE)


def kernel_rows(prof) -> list[tuple[str, float]]:
    """(kernel name, device time in µs) for every device kernel the profiler saw, each once."""
    rows = []
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = getattr(e, "cuda_time_total", 0.0)
            rows.append((e.name, float(t)))
    return rows


def op_rows(prof) -> list[tuple[str, float]]:
    """(operator name, self CPU time in µs) per operator kind."""
    return [(e.key, float(e.self_cpu_time_total)) for e in prof.key_averages()]


def share_of_library(rows: list[tuple[str, float]], *, kernels: bool) -> float:
    """Fraction of the summed time in library work: `kernels` rows matched by LIBRARY_KERNEL, else op rows
    matched by LIBRARY_OPS. NaN when nothing was timed."""
    total = sum(t for _, t in rows)
    if kernels:
        lib = sum(t for n, t in rows if LIBRARY_KERNEL.search(n))
    else:
        lib = sum(t for n, t in rows if any(k in n for k in LIBRARY_OPS))
    return lib / total if total > 0 else float("nan")


def _profile(fn, device):
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad(), profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize(device)
    return prof, cuda


def library_share(fn, device, *, calls: int = 3) -> dict:
    """The share of `fn`'s time in library kernels, from `calls` separately profiled calls after one warm-up:
    {"library_share": median, "samples": [...], "how": ...}. CUDA: kernel rows' device time; CPU: op rows'
    self CPU time."""
    if calls < 2:
        raise ValueError(f"calls must be >= 2 (a share from one sample is not a measurement), got {calls}")
    with torch.no_grad():
        fn()
    samples, kernel_names = [], set()
    cuda = False
    for _ in range(calls):
        prof, cuda = _profile(fn, device)
        rows = kernel_rows(prof) if cuda else op_rows(prof)
        kernel_names.update(n for n, _ in rows if cuda and LIBRARY_KERNEL.search(n))
        samples.append(share_of_library(rows, kernels=cuda))
    how = ("torch.profiler device kernel rows (each kernel once), " if cuda else
           "torch.profiler operator rows' self CPU time, ") + f"median of {calls} profiled calls after a warm-up"
    return {"library_share": statistics.median(samples), "samples": samples, "how": how,
            "library_kernels": sorted(kernel_names)[:20]}


def int8_kernels_seen(fn, device) -> dict:
    """Profile one call of `fn`: on CUDA, the device kernels whose names say INT8 GEMM; on a CPU (no kernel
    rows) the operator rows named `_int_mm` that completed. {"seen": bool, "names": [...], "how": ...}."""
    prof, cuda = _profile(fn, device)
    if cuda:
        names = sorted({n for n, _ in kernel_rows(prof) if INT8_KERNEL.search(n)})
        how = "CUDA kernel names matching " + INT8_KERNEL.pattern
    else:
        names = sorted({n for n, _ in op_rows(prof) if "_int_mm" in n})
        how = "CPU operator rows aten::_int_mm (the int8 GEMM op; the backend label says whether it returned)"
    return {"seen": bool(names), "names": names[:20], "how": how}
