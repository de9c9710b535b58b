"""GPU timing without the host in the way.

A W4A16 decode GEMM of one Kimi-K2 expert moves ~16 MB: a few microseconds on an H200, less
than the host needs to launch a Triton kernel from Python. Timed launch by launch, CUDA events
would measure the launch overhead, not the kernel. `gpu_time` captures `inner` calls in a CUDA
graph and times the graph's replay, so the kernels run back to back as a serving engine's
graph-captured decode step runs them; per-call time = replay time / inner. Where capture fails,
it falls back to direct launches and says so (the record keeps which one was used).
"""
from __future__ import annotations

import torch

from ..measure import Timing, benchmark


def gpu_time(fn, device: torch.device, *, label: str, reps: int, inner: int = 10,
             uses_triton: bool = True) -> tuple[Timing, str]:
    """(Timing per call, how it was timed). `fn` must not read values back to the host."""
    if device.type != "cuda":
        raise ValueError(f"gpu_time needs a CUDA device, got {device}")
    try:
        fn()  # compile and autotune outside the capture
        torch.cuda.synchronize(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs recommends
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        t = benchmark(graph.replay, device, label=label, uses_triton=uses_triton, min_reps=reps)
        per = Timing(label=label, samples_s=[s / inner for s in t.samples_s],
                     timer=f"{t.timer}, CUDA graph of {inner} calls", warmup=t.warmup)
        return per, f"CUDA graph replay of {inner} back-to-back calls, divided by {inner}"
    except Exception as e:  # capture not possible: time direct launches, and say so
        torch.cuda.synchronize(device)
        t = benchmark(fn, device, label=label, uses_triton=uses_triton, min_reps=reps)
        return t, f"direct launches, launch overhead included (graph capture failed: {type(e).__name__}: {e})"
