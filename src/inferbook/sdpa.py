"""Which kernel `F.scaled_dot_product_attention` really runs for given inputs, observed by running it.

A record that says "attention: sdpa" says nothing: SDPA dispatches at run time to one of several
kernels — FlashAttention-2, memory-efficient (xFormers-style), cuDNN, or the math (explicit
softmax) fallback — by checking each backend's constraints (dtype, head dim, mask, dropout,
dimensionality, GPU generation) in a priority order (`torch._C._get_sdp_priority_order()`; by
default flash, efficient, math, cuDNN on CUDA; in `sdp_utils.cpp`). The first whose constraints
pass runs.

`observed_sdpa_kernel` finds it the same way: it runs SDPA restricted to each backend in turn
(`torch.nn.attention.sdpa_kernel`), in the current priority order, and returns the first that
succeeds: the restriction applies exactly the constraint checks the unrestricted dispatch applies.
`profiled_sdpa_op` is a second, independent observation: the ATen op the profiler saw.

On CPU, SDPA has two kernels (`sdp_utils_cpp.cpp`): "flash" there is ATen's own CPU kernel
(`aten::_scaled_dot_product_flash_attention_for_cpu`: blocked over queries and keys with an online
softmax, vectorised with `at::vec`, not the FlashAttention CUDA library), and "math" is the
explicit-softmax composite (`aten::_scaled_dot_product_attention_math`), taken for example with
3-D inputs or dropout. The memory-efficient and cuDNN kernels exist only on CUDA.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

# SDPBackend members by the short names records use
KERNEL_NAMES = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "MATH": "math",
                "CUDNN_ATTENTION": "cudnn", "OVERRIDEABLE": "overrideable"}
DEFAULT_ORDER = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH", "CUDNN_ATTENTION")


def priority_order() -> list[str]:
    """SDPBackend names in PyTorch's current dispatch priority (the documented default if this
    PyTorch does not expose it)."""
    from torch.nn.attention import SDPBackend

    getter = getattr(torch._C, "_get_sdp_priority_order", None)
    if getter is None:
        return list(DEFAULT_ORDER)
    by_value = {int(m.value): name for name, m in SDPBackend.__members__.items() if name != "ERROR"}
    return [by_value[int(v)] for v in getter() if int(v) in by_value]


def observed_sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                         enable_gqa: bool = False) -> str:
    """The kernel SDPA runs for these inputs: 'flash', 'efficient', 'math', 'cudnn' or 'overrideable'.

    q [B, H, Lq, D], k/v [B, Hkv, Lk, D] (any dtype/device SDPA takes). Runs SDPA once per backend
    tried (no autograd), in priority order, until one succeeds. 'none' if none does (then the
    unrestricted call would fail too)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # each refusing backend warns why; the refusal is what we observe
        for name in priority_order():
            if name not in KERNEL_NAMES:
                continue
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                   is_causal=is_causal, enable_gqa=enable_gqa)
            except RuntimeError:
                continue
            return KERNEL_NAMES[name]
    return "none"


def profiled_sdpa_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                     attn_mask: torch.Tensor | None = None, enable_gqa: bool = False) -> str:
    """The ATen kernel op the profiler records under one unrestricted SDPA call, e.g.
    'aten::_scaled_dot_product_flash_attention_for_cpu' or 'aten::_scaled_dot_product_efficient_attention'."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if q.is_cuda else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
    ops = [e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")
           or e.name.startswith("aten::_flash_attention") or e.name.startswith("aten::_efficient_attention")
           or e.name.startswith("aten::_cudnn_attention")]
    return ops[0] if ops else "aten::scaled_dot_product_attention (decomposed)"


def sdpa_record(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                attn_mask: torch.Tensor | None = None, enable_gqa: bool = False) -> dict:
    """What a RunRecord's attention backend entry needs: the observed kernel, the profiled op,
    the priority order and the inputs' shapes and dtype."""
    return {"kernel": observed_sdpa_kernel(q, k, v, is_causal, attn_mask=attn_mask, enable_gqa=enable_gqa),
            "op": profiled_sdpa_op(q, k, v, is_causal, attn_mask=attn_mask, enable_gqa=enable_gqa),
            "priority": [KERNEL_NAMES.get(n, n.lower()) for n in priority_order()],
            "device": q.device.type, "dtype": str(q.dtype).replace("torch.", ""),
            "shapes": {"q": list(q.shape), "k": list(k.shape), "v": list(v.shape)},
            "mask": None if attn_mask is None else str(attn_mask.dtype).replace("torch.", ""),
            "is_causal": bool(is_causal)}


# What the profiler names each SDPA backend by: ATen ops (CPU and CUDA) and CUDA kernel names.
_BACKEND_MARKS = (
    ("flash", ("_scaled_dot_product_flash_attention", "_flash_attention_forward", "flash_fwd", "pytorch_flash")),
    ("efficient", ("_scaled_dot_product_efficient_attention", "_efficient_attention_forward", "fmha_cutlass",
                   "efficient_attention")),
    ("cudnn", ("_scaled_dot_product_cudnn_attention", "cudnn_attention", "cudnn_generated_fort_native_sdpa",
               "sm90_flash", "sdpa_cudnn")),
    ("math", ("_scaled_dot_product_attention_math",)),
)


def attention_kernels_in(fn, device: torch.device) -> dict:
    """Run `fn()` once under the profiler (CPU, and CUDA on a GPU) and report the attention that ran in
    it: {'backend': 'flash' | 'efficient' | 'cudnn' | 'math' | 'none', 'events': the matching op and
    kernel names}. This observes the caller's own forward, not a stand-in call."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad(), profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = sorted({e.name for e in prof.events()})
    found, events = [], []
    for backend, marks in _BACKEND_MARKS:
        hit = [n for n in names if any(m in n for m in marks)]
        if hit:
            found.append(backend)
            events += hit
    # the math op calls no fused kernel; a fused backend's op shows with its kernel: the fused one wins
    backend = next((b for b in found if b != "math"), found[0] if found else "none")
    return {"backend": backend, "events": events}
