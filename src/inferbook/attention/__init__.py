"""Attention kernels and the checks around them. `flash`: a Triton FlashAttention (forward and
backward, varlen, paged KV, GQA with PackGQA, sinks, sliding window with tile skipping, softcap,
dv != d up to MLA's 576/512) with its PyTorch references; `matrix`: the acceptance matrix that
checks it; `decode`: split-KV decode attention (adaptive or fixed split); `lean`: a stream-K
(Lean-Attention-like) decode kernel whose split depends on the whole batch. Other modules
here describe themselves; the chapters' measure modules live in `inferbook.chapters`."""
