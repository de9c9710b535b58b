"""MoE kernels: W4A16 weights and their layouts, fused MoE, routing, tail fusion, shared experts.

- `w4a16.py`    symmetric INT4 weights (group 32, BF16 scales), three packing specs, the
                compressed-tensors import/export, the dense W4A16 GEMM and its Triton kernel.
- `routing.py`  top-k routing and the three ways to lay tokens out per expert.
- `fused_moe.py` the MoE layer (gate/up, SiLU-and-mul, down, top-k combine) for each layout,
                the decode tail with the combine folded into the down projection, and the
                shared expert as one more routed slot.
- `backends.py` attention backends that depend on the per-rank shapes (MiniMax M3 chapter).
"""
