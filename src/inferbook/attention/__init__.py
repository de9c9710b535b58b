"""Attention kernels and the checks around them. `flash`: a Triton FlashAttention (forward and
backward, varlen, paged KV, GQA with PackGQA, sinks) with its PyTorch references; `matrix`: the
acceptance matrix that checks it. Other modules here describe themselves; the chapters' measure
modules live in `inferbook.chapters`."""
