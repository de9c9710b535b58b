"""Attention kernels and the checks around them. `flash`: a Triton FlashAttention (forward and
backward, varlen, paged KV, GQA with PackGQA, sinks) with its PyTorch references; `matrix`: the
acceptance matrix that checks it; `matrix_chapter`: that chapter's measurements. Other modules
here describe themselves."""
