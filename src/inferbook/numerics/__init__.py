"""Low-precision recipes and correctness harnesses (seed section 七, Transformer Engine 2.19).

- `mx`: OCP microscaling (MXFP8 / MXFP4) quantize and dequantize, PyTorch reference and
  Triton kernel, recipes per tensor role and direction, an emulated linear layer.
- `gdn`: Gated DeltaNet, recurrent and chunked, and the NaN/accuracy harness for backends.
- `mx_ep`: an MXFP8 expert-parallel dispatch/combine over torch.distributed (codes + E8M0 scales
  on the wire, pre-quantized rows into the grouped GEMM).
- `grouped`: a grouped GEMM and a checker against per-group references.
- `graphs`: a CUDA Graph replay check that retained gradients are not overwritten.
"""


import torch


def small_op_threads(device):
    """One intra-op thread on CPU while running many tiny ops (a toy MLP's steps, a Python-loop
    recurrence); never used around a timed region. See `device.torch_threads`."""
    from ..device import torch_threads

    return torch_threads(device, 1)