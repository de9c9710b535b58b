"""The SDPA kernel is observed by running it, and agrees with what the profiler saw."""
import pytest
import torch

from inferbook.sdpa import observed_sdpa_kernel, priority_order, profiled_sdpa_op, sdpa_record

OP_OF = {"flash": ("flash",), "math": ("math",), "efficient": ("efficient",), "cudnn": ("cudnn",)}


def qkv(shape=(1, 2, 8, 16), dtype=torch.float32):
    g = torch.Generator().manual_seed(torch.randint(1 << 30, ()).item())
    return [torch.randn(*shape, generator=g).to(dtype) for _ in range(3)]


def test_priority_order_names_known_backends():
    order = priority_order()
    assert "MATH" in order and "FLASH_ATTENTION" in order


@pytest.mark.parametrize("case", ["causal", "bool mask", "bf16", "3-D", "gqa"])
def test_observed_kernel_matches_the_profiled_op(case):
    q, k, v = qkv(dtype=torch.bfloat16 if case == "bf16" else torch.float32)
    kw = {}
    if case == "causal":
        kw["is_causal"] = True
    elif case == "bool mask":
        kw["attn_mask"] = torch.ones(8, 8, dtype=torch.bool).tril()
    elif case == "3-D":
        q, k, v = q[0], k[0], v[0]
    elif case == "gqa":
        q = torch.randn(1, 4, 8, 16)
        kw["enable_gqa"] = True
    kernel = observed_sdpa_kernel(q, k, v, **kw)
    op = profiled_sdpa_op(q, k, v, **kw)
    assert kernel in ("flash", "efficient", "math", "cudnn"), kernel
    assert any(word in op for word in OP_OF[kernel]), (kernel, op)


def test_cpu_uses_its_flash_kernel_for_4d_and_math_for_3d():
    q, k, v = qkv()
    assert observed_sdpa_kernel(q, k, v, True) == "flash"
    assert observed_sdpa_kernel(q[0], k[0], v[0], True) == "math"   # CPU's fused kernel needs 4-D inputs


def test_dropout_leaves_only_math():
    q, k, v = qkv()
    assert observed_sdpa_kernel(q, k, v, dropout_p=0.5) == "math"


def test_record_entry():
    q, k, v = qkv()
    rec = sdpa_record(q, k, v, True)
    assert rec["kernel"] == observed_sdpa_kernel(q, k, v, True) and rec["shapes"]["q"] == [1, 2, 8, 16]
    assert rec["device"] == "cpu" and rec["dtype"] == "float32"


def test_paged_attention_runs_the_kernel_observed_for_its_shapes():
    from torch.profiler import ProfilerActivity, profile

    from inferbook.serving.model import TinyConfig
    from inferbook.serving.model_runner import observed_paged_kernels, paged_attention

    cfg = TinyConfig(vocab=64, d_model=64, n_heads=4, n_kv_heads=2, max_seq=64)
    observed = observed_paged_kernels(cfg, torch.float32, torch.device("cpu"), prefill_len=12, context_len=20, k=3)
    assert set(observed) == {"prefill", "decode", "verify"}
    pool = torch.randn(40, 2, 16)
    slots = torch.randperm(40)[:20]
    for case, n in (("verify", 4), ("decode", 1)):
        q = torch.randn(4, n, 16)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
            paged_attention(q, pool, pool, slots, torch.arange(20 - n, 20))
        ops = [e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")]
        assert ops and ops[0] == observed[case]["op"], (case, ops, observed[case])
