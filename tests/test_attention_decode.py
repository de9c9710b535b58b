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


def test_engine_modes_switch_attention_alone_as_37740_does():
    """Everything but attention is batch-invariant in the last three modes, which differ only in the
    path #37740's switch picks: Lean or the adaptive split with deterministic inference off, the
    standard fixed-split path with it on (even with Lean enabled)."""
    from inferbook.chapters import deterministic_attention as ch

    inv = {m: f for m, f in ch.ENGINE_MODES.items() if f["invariant_rest"]}
    assert len(inv) == 3 and not ch.ENGINE_MODES["engine as built"]["invariant_rest"]
    assert {ch.engine_attention_path(f["deterministic_inference"], f["lean"]) for f in inv.values()} == \
        {"adaptive split", "lean", "fixed split"}
    assert ch.engine_attention_path(True, True) == "fixed split" == ch.engine_attention_path(True, False)


def test_engine_deterministic_mode_checks_what_ran(monkeypatch):
    """The end-to-end check names the kernel, so it tests the launcher's own report: deterministic
    inference passes; the same run with Lean left on (the bug #37740 fixed) fails it."""
    from inferbook.chapters import deterministic_attention as ch
    from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights

    model = init_weights(TinyDecoder(TinyConfig(max_seq=40, n_layers=1)), 0).eval()
    kw = dict(requests=4, new_tokens=3, seed=0, split_size=32, sms=8, invariant_rest=True)
    good = ch.run_engine(model, deterministic_inference=True, lean=True, **kw)
    assert all(passed for _, passed, _ in ch.deterministic_checks(good)), ch.deterministic_checks(good)
    monkeypatch.setattr(ch, "engine_attention_path", lambda det, lean: "lean")   # the switch ignored
    bad = ch.run_engine(model, deterministic_inference=True, lean=True, **kw)
    assert bad["kernels_ran"] == ["lean (stream-K)"]
    assert not ch.deterministic_checks(bad)[0][1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_rms_norm_matches_the_model_and_is_row_invariant(dtype):
    from inferbook.serving.model import RMSNorm

    g = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(2 * decode.BI_RMS_ROWS + 5, 96, generator=g)).to(dtype)   # three programs' tiles
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    got = (decode.batch_invariant_rms_norm(x, 1e-6) * norm.weight.to(dtype)).float()
    want = norm.to(dtype)(x).float()
    eps = torch.finfo(dtype).eps
    assert (got - want).abs().max() <= 4 * eps * want.abs().max()           # the model's norm, to rounding
    full = decode.batch_invariant_rms_norm(x, 1e-6)
    alone = decode.batch_invariant_rms_norm(x[4:5], 1e-6)
    assert torch.equal(alone, full[4:5])   # one kernel, one row: bits
    # a row at another place in another program's tile, among other rows: the same bits
    i = decode.BI_RMS_ROWS + 3
    assert torch.equal(decode.batch_invariant_rms_norm(x[i - 5:], 1e-6)[5], full[i])
