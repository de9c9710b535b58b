"""The kernels a reader would use instead of ours, launched at our gpu-preset shapes, for the cost model.

Each peer's own Python entry point runs under `compiled.recording()` on `meta` tensors, so its own
config logic picks the launch (block sizes, warps) and nothing runs. Peers are optional
dependencies (`pip install -e .[peers]`); a peer that is not installed, or that cannot be imported on
this machine, is skipped and said so (`available()`).

- liger-kernel (RMSNorm, SwiGLU): beside the comm tail's RMSNorm (sglang-fused-comm, kimi-topk-tail-fusion).
- gemlite (W4A16 GEMV/GEMM): its package asserts a CUDA build of PyTorch at import, so it cannot be
  traced on a CPU-only build (`available()` says so); fla-core, torchao and vLLM's fused-MoE are not
  wired yet.

`inspect(["py:inferbook.compiled.peers:sglang_fused_comm"], targets)` compiles them like ours;
`compare(slug, target, card)` sets ours beside the peer's prediction for the same shape.
"""
from __future__ import annotations

import torch


def available() -> dict[str, str]:
    """{peer: 'ok' | why not} for the peers this module knows."""
    out = {}
    for name, module in (("liger-kernel", "liger_kernel.ops.rms_norm"), ("gemlite", "gemlite")):
        try:
            __import__(module)
            out[name] = "ok"
        except Exception as e:                     # not installed, or it refuses a CPU-only torch at import
            out[name] = f"{type(e).__name__}: {str(e)[:120]}"
    return out


def liger_rmsnorm(T: int, H: int, dtype=torch.bfloat16) -> list:
    """liger-kernel's RMSNorm forward on x [T, H] (its own `calculate_settings` picks the block)."""
    from liger_kernel.ops import rms_norm as R

    from . import recording

    with recording("liger_kernel/ops/rms_norm.py") as launches:
        R.rms_norm_forward(torch.empty(T, H, dtype=dtype, device="meta"), torch.empty(H, dtype=dtype, device="meta"),
                           1e-6, 0.0, "llama", None)
    for la in launches:
        la.name = f"liger rmsnorm T{T} H{H}"
    return launches


def _our_rmsnorm_shapes(slug: str) -> list[tuple[int, int]]:
    from . import launches_for

    shapes = []
    for la in launches_for(slug):
        if getattr(getattr(la.kernel, "fn", la.kernel), "__name__", "") == "_rmsnorm_kernel":
            x = la.args[0]
            shape = (int(x.shape[0]), int(x.shape[-1])) if x.dim() == 2 else None
            if shape and shape not in shapes:
                shapes.append(shape)
    return shapes


def sglang_fused_comm(params=None) -> list:
    """liger's RMSNorm at every RMSNorm shape of sglang-fused-comm's gpu preset."""
    return [la for T, H in _our_rmsnorm_shapes("sglang-fused-comm") for la in liger_rmsnorm(T, H)]


PEERS = {"sglang-fused-comm": "py:inferbook.compiled.peers:sglang_fused_comm"}


def compare(slug: str, peer_rows: list[dict], target: str = "sm_90", card: str = "H200") -> list[dict]:
    """Ours beside the peer, same shape, same model: [{'shape', 'ours_s', 'peer_s', 'ratio', bounds}]
    for each peer row (compiled rows of `PEERS[slug]`) whose 'T.. H..' matches one of our launches."""
    import re

    from . import predict_launches, predict_rows

    ours = {re.search(r"T\d+ H\d+", p["launch"]).group(0): p for p in predict_launches(slug, target, card)
            if p["kernel"] == "_rmsnorm_kernel" and re.search(r"T\d+ H\d+", p["launch"])}
    out = []
    for p in predict_rows([r for r in peer_rows if r["target"] == target], card):
        key = re.search(r"T\d+ H\d+", p["launch"]).group(0)
        if key in ours:
            o = ours[key]
            out.append({"shape": key, "ours_s": o["seconds"], "ours_bound": o["bound"], "peer_s": p["seconds"],
                        "peer_bound": p["bound"], "ours_over_peer": o["seconds"] / p["seconds"]})
    return out
