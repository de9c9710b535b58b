"""Split-KV decode attention: both modes against the fp32 definition (FlashAttention's tolerance
rule), bitwise batch invariance of the fixed-split mode (and the adaptive mode's failure of it, so
the check can fail), the batch-invariant matmul, and clear errors on bad input."""
import pytest
import torch
import torch.nn.functional as F

import inferbook  # noqa: F401  (Triton interpreter on CPU)
from inferbook.attention import decode
from inferbook.errors import UserError

SHAPES = [  # B, H, Hk, D, S, seqlens
    (3, 4, 2, 32, 70, [70, 0, 1]),          # full, empty, a single key
    (2, 6, 6, 40, 33, [33, 32]),            # MHA, odd head dim, one past a split boundary
    (2, 8, 1, 64, 96, [96, 65]),            # MQA
]


CASES = [(s, torch.bfloat16) for s in SHAPES] + [(SHAPES[1], torch.float16)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-H{}-Hk{}-D{}-S{}-".format(*c[0][:5]) + str(c[1])[6:])
@pytest.mark.parametrize("deterministic", [False, True], ids=["adaptive", "fixed"])
def test_matches_reference(case, deterministic):
    shape, dtype = case
    B, H, Hk, D, S, lens = shape
    g = torch.Generator().manual_seed(B * 100 + D)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    k = torch.randn(B, S, Hk, D, generator=g).to(dtype)
    v = torch.randn(B, S, Hk, D, generator=g).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    out, plan = decode.decode_attention(q, k, v, seqlens, deterministic, split_size=32, sms=8, return_plan=True)
    assert plan["backend"] == "triton" and out.dtype == dtype and out.shape == (B, H, D)
    ref = decode.decode_attention_reference(q, k, v, seqlens).float()
    low = decode.decode_attention_reference(q, k, v, seqlens, compute_dtype=dtype).float()
    floor = 2 * float(((ref + 0.3 - 0.3) - ref).abs().max())
    assert not out.isnan().any()
    assert float((out.float() - ref).abs().max()) <= 2 * float((low - ref).abs().max()) + floor
    assert (out[seqlens == 0] == 0).all()


def test_fixed_split_is_batch_invariant_adaptive_is_not():
    rows = decode.batch_invariance_sweep(batch_sizes=[1, 2, 3, 6], heads=4, kv_heads=2, head_dim=32, max_seqlen=128,
                                         target_len=120, split_size=32, sms=8, seed=3)
    det = {r["bits"] for r in rows if r["mode"] == "deterministic"}
    adaptive = {r["bits"] for r in rows if r["mode"] == "adaptive"}
    assert len(det) == 1
    assert len(adaptive) > 1, "the adaptive plan should change the bits here, or this test proves nothing"
    assert not any(r["nan"] for r in rows)


def test_plans():
    fixed = {decode.plan_splits(b, 8, 4000, deterministic=True, sms=132)["split_len"] for b in (1, 7, 64)}
    assert fixed == {decode.DEFAULT_SPLIT_SIZE}
    adaptive = [decode.plan_splits(b, 8, 4000, deterministic=False, sms=132)["num_splits"] for b in (1, 4, 16, 64)]
    assert adaptive == sorted(adaptive, reverse=True) and adaptive[0] > adaptive[-1] == 1
    with pytest.raises(UserError, match="split_size"):
        decode.plan_splits(1, 1, 10, deterministic=True, sms=1, split_size=48)


def test_batch_invariant_matmul():
    a = torch.randn(37, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w = torch.randn(80, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = decode.batch_invariant_matmul(a, w).float()
    ref = F.linear(a.double(), w.double())
    low = F.linear(a, w).double()
    assert float((out - ref).abs().max()) <= 2 * float((low - ref).abs().max()) + 1e-6
    res = decode.matmul_batch_invariance(decode.batch_invariant_matmul, m_values=[1, 5, 17, 40], k=64, n=48,
                                         dtype=torch.float32)
    assert res["distinct"] == 1 and all(res["same"].values())


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.zeros(2, 4)), "q must be"),
    (dict(k_cache=torch.zeros(2, 8, 3, 16, dtype=torch.bfloat16), v_cache=torch.zeros(2, 8, 3, 16, dtype=torch.bfloat16)),
     "multiple of key/value heads"),
    (dict(v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.float16)), "v_cache dtype"),
    (dict(seqlens=torch.tensor([9, 1])), "seqlens must lie in 0..8"),
    (dict(seqlens=torch.tensor([1.0, 2.0])), "int32/int64"),
    (dict(deterministic="yes"), "deterministic must be True or False"),
])
def test_bad_input(bad, match):
    args = dict(q=torch.zeros(2, 4, 16, dtype=torch.bfloat16), k_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16),
                v_cache=torch.zeros(2, 8, 2, 16, dtype=torch.bfloat16), seqlens=torch.tensor([8, 1]))
    args.update(bad)
    with pytest.raises(UserError, match=match):
        decode.decode_attention(**args)


def test_engine_comparison_switches_attention_alone():
    """SGLang #37740 changed attention only: the adaptive and deterministic-attention engine
    configurations must share linear layers, chunked prefill and sampling; only the fully fixed
    configuration changes more."""
    from inferbook.chapters import deterministic_attention as ch

    a, d, full = (ch.ENGINE_MODES[k] for k in ("adaptive", "deterministic attention", "all batch-invariant"))
    assert {k for k in a if a[k] != d[k]} == {"deterministic_attention"}
    assert full["deterministic_attention"] and full["fixed_linear"] and not full["chunked_prefill"]
    Runner = ch._switchable_runner_class()
    import inspect
    assert "fixed_linear" in inspect.signature(Runner.__init__).parameters
