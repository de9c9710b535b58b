"""Communication building blocks (seed section 六, SGLang #39653): a fused MoE tail that keeps the
reference's BF16 rounding points, one-shot and two-shot all-reduce with fixed or owner-dependent
summation order, and vocab-parallel greedy sampling that exchanges (max, index) pairs.

`fused_exchange` finalizes into the peers' buffer slots before the exchange and gathers full
vocab logits by push-slot or ring. `tail` and `vocab_greedy` hold single-process math (references and Triton kernels); `allreduce`
and `vocab_greedy` hold the `torch.distributed` versions; `workers` holds the process entry
points (spawned from a notebook or test, or run under torchrun)."""
