"""Gated DeltaNet: chunked vs recurrent, gradients in fp64, and the harness that must flag NaN."""
import math

import pytest
import torch

import inferbook  # noqa: F401
from inferbook.numerics import gdn, small_op_threads


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread (on a loaded 2-core machine OpenMP waits made these tests ~10x slower)."""
    with small_op_threads("cpu"):
        yield


NAMES = ("q", "k", "v", "g", "beta")


def _inputs(B, T, H, K, V, gate="random", seed=0, dtype=torch.float32, h0=True):
    inp = gdn.make_inputs(B, T, H, K, V, gate, seed=seed, initial_state=h0)
    return {n: (t.to(dtype).requires_grad_(True) if t is not None else None) for n, t in inp.items()}


def _grads(fn, inp, seed=0, **kw):
    o, S = fn(*(inp[n] for n in NAMES), initial_state=inp["h0"], **kw)
    g = torch.Generator().manual_seed(seed + 99)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64)
    dS = torch.randn(S.shape, generator=g, dtype=torch.float64)
    loss = (o.double() * do).sum() + (S.double() * dS).sum()
    leaves = [inp[n] for n in NAMES] + ([inp["h0"]] if inp["h0"] is not None else [])
    return o, S, torch.autograd.grad(loss, leaves)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("T,chunk", [(1, 16), (7, 4), (33, 16), (70, 64), (45, 64)], ids=lambda v: str(v))
@pytest.mark.parametrize("gate", gdn.GATES)
def test_chunked_matches_recurrent_fp32(T, chunk, gate):
    inp = _inputs(2, T, 2, 32, 16, gate, seed=T)
    o_r, S_r, g_r = _grads(gdn.recurrent, inp)
    o_c, S_c, g_c = _grads(gdn.chunked, inp, chunk_size=chunk)
    assert o_c.dtype == torch.float32 and S_c.shape == (2, 2, 32, 16)
    assert _rel(o_c, o_r) <= 5e-3 and _rel(S_c, S_r) <= 5e-3
    for name, a, b in zip(NAMES + ("h0",), g_c, g_r):
        assert torch.isfinite(a).all(), name
        if b.abs().max() > 0:
            assert _rel(a, b) <= 8e-3, name


def test_chunked_matches_recurrent_bf16_no_initial_state():
    inp = _inputs(1, 50, 3, 64, 64, "random", seed=4, dtype=torch.bfloat16, h0=False)
    ref = {n: (t.detach().double().requires_grad_(True) if t is not None else None) for n, t in inp.items()}
    o_ref, _, g_ref = _grads(gdn.recurrent, ref)
    o_c, _, g_c = _grads(gdn.chunked, inp, chunk_size=16)
    assert o_c.dtype == torch.bfloat16
    assert gdn.recurrent(*(inp[n] for n in NAMES))[0].dtype == torch.bfloat16
    assert _rel(o_c, o_ref) <= 5e-3
    for name, a, b in zip(NAMES, g_c, g_ref):
        assert _rel(a, b) <= 8e-3, name


@pytest.mark.parametrize("fn", [gdn.recurrent, lambda *a, **k: gdn.chunked(*a, chunk_size=2, **k)],
                         ids=["recurrent", "chunked"])
def test_gradcheck_fp64(fn):
    inp = _inputs(1, 5, 1, 3, 2, "random", seed=1, dtype=torch.float64)

    def f(q, k, v, g, beta, h0):
        o, S = fn(q, k, v, g, beta, scale=0.7, initial_state=h0)
        return o, S

    assert torch.autograd.gradcheck(f, tuple(inp[n] for n in NAMES + ("h0",)), eps=1e-6, atol=1e-7)


def test_recurrent_matches_a_hand_computed_step():
    """One step, one head, K = V = 1: S = e^g * s0; u = b (v - S k); S += k u; o = S q / 1."""
    q, k, v = (torch.tensor([[[[x]]]]) for x in (2.0, 0.5, 3.0))
    g, beta = torch.tensor([[[math.log(0.5)]]]), torch.tensor([[[0.8]]])
    s0 = torch.tensor([[[[4.0]]]])
    o, S = gdn.recurrent(q, k, v, g, beta, scale=1.0, initial_state=s0)
    s = 0.5 * 4.0
    u = 0.8 * (3.0 - s * 0.5)
    s = s + 0.5 * u
    assert torch.allclose(S.flatten(), torch.tensor([s])) and torch.allclose(o.flatten(), torch.tensor([s * 2.0]))
    o_c, S_c = gdn.chunked(q, k, v, g, beta, scale=1.0, initial_state=s0)
    assert torch.allclose(o_c, o) and torch.allclose(S_c, S)


def test_empty_sequence_and_very_negative_gates_stay_finite():
    inp = _inputs(1, 0, 2, 8, 8, h0=True)
    o, S = gdn.chunked(*(inp[n] for n in NAMES), initial_state=inp["h0"])
    assert o.shape == (1, 0, 2, 8) and torch.equal(S, inp["h0"].detach())
    # exp of an unmasked gate difference would overflow (G_t - G_j = +1e4 * (j - t)): mask first.
    inp = _inputs(1, 40, 2, 16, 16, "very_negative", seed=3)
    with torch.no_grad():
        inp["g"].fill_(-1e4)
    _, _, grads = _grads(gdn.chunked, inp, chunk_size=32)
    assert all(torch.isfinite(g).all() for g in grads)


def test_bad_input_is_a_clear_error():
    inp = _inputs(1, 4, 2, 8, 8, h0=False)
    args = [inp[n] for n in NAMES]
    with pytest.raises(ValueError, match="g and beta must be"):
        gdn.chunked(*args[:3], args[3][..., :1], args[4])
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        gdn.chunked(*args, chunk_size=0)
    with pytest.raises(ValueError, match="initial_state must be"):
        gdn.recurrent(*args, initial_state=torch.zeros(1, 2, 8, 4))
    with pytest.raises(ValueError, match="unknown gate"):
        gdn.make_inputs(1, 4, 1, 4, 4, "positive")
    with pytest.raises(ValueError, match="head_dims must be positive"):
        gdn.check_backend(gdn.chunked, head_dims=(0,))


SMALL = dict(head_dims=(32, 48), lengths=(13,), gates=("random", "very_negative"))


def test_harness_passes_ours_and_flags_injected_nan():
    reports = gdn.check_backends({"chunked": gdn.chunked, "nan@32": gdn.inject_backward_nan(gdn.chunked, 32)},
                                 **SMALL)
    assert reports["chunked"].passed, reports["chunked"].failures()
    bad = reports["nan@32"]
    assert not bad.passed
    assert {r["head_dim"] for r in bad.failures()} == {32}
    assert all("dq" in r["nonfinite"] for r in bad.failures())
    assert len(bad.rows) == 2 * 2 * 2  # head dims x gates x dtypes


def test_harness_flags_a_finite_but_wrong_backend_and_one_that_raises():
    def wrong_scale(q, k, v, g, beta, scale=None, initial_state=None):
        return gdn.chunked(q, k, v, g, beta, scale=1.01 * q.shape[-1] ** -0.5, initial_state=initial_state)

    def raises(q, k, v, g, beta, scale=None, initial_state=None):
        raise RuntimeError("no kernel for this shape")

    reports = gdn.check_backends({"wrong": wrong_scale, "raises": raises}, head_dims=(32,), lengths=(9,),
                                 gates=("random",), dtypes=(torch.float32,))
    (w,), (r,) = reports["wrong"].rows, reports["raises"].rows
    assert not w["passed"] and w["nonfinite"] == "" and "o:" in w["reason"]
    assert not r["passed"] and "no kernel" in r["reason"]


def test_bf16_tolerance_rejects_a_bf16_state_and_noise_on_o():
    """The BF16 tolerance is anchored to an fp32-state recurrence in the same input precision: a
    backend that keeps its state in BF16, or adds 1 % noise to o, fails; the chunked form passes.
    (With the old BF16-state baseline, both wrong backends passed.)"""
    reports = gdn.check_backends({"chunked": lambda *a, **kw: gdn.chunked(*a, chunk_size=8, **kw),
                                  "bf16 state": gdn.bf16_state_recurrent,
                                  "noisy o": gdn.noisy_output(lambda *a, **kw: gdn.chunked(*a, chunk_size=8, **kw))},
                                 head_dims=(32,), lengths=(45,), gates=("random",), dtypes=(torch.bfloat16,))
    assert reports["chunked"].passed, reports["chunked"].failures()
    (s_row,), (n_row,) = reports["bf16 state"].rows, reports["noisy o"].rows
    assert not s_row["passed"] and s_row["nonfinite"] == "", s_row
    assert not n_row["passed"] and "o:" in n_row["reason"], n_row


def test_forward_only_rows_have_no_gradient_errors_and_nonfinite_has_no_number():
    rep = gdn.check_backends({"fwd": gdn.chunked, "nan@32": gdn.inject_backward_nan(gdn.chunked, 32)},
                             head_dims=(32,), lengths=(9,), gates=("random",), dtypes=(torch.float32,),
                             forward_only=("fwd",))
    (f,), (n,) = rep["fwd"].rows, rep["nan@32"].rows
    assert "err_dq" not in f and f["passed"]
    assert n["err_dq"] is None and "dq" in n["nonfinite"] and not n["passed"]


def test_harness_catches_exp_before_mask_only_with_extreme_gates():
    def buggy(q, k, v, g, beta, scale=None, initial_state=None):
        return gdn.chunked(q, k, v, g, beta, chunk_size=8, scale=scale, initial_state=initial_state,
                           _exp_before_mask=True)

    rep = gdn.check_backend(buggy, head_dims=(16,), lengths=(19,), gates=gdn.GATES, dtypes=(torch.float32,))
    failed = rep.failures()
    assert {r["gate"] for r in failed} == {"very_negative"}
    assert all(r["nonfinite"] == "dg" for r in failed)  # the forward is finite: only the gate's gradient breaks


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("B,T,H,K,V,h0", [(2, 13, 3, 32, 16, True), (1, 9, 2, 48, 40, False), (1, 4, 1, 256, 64, True),
                                         (1, 0, 2, 8, 8, True)], ids=lambda v: str(v))
def test_triton_forward_matches_recurrent(B, T, H, K, V, h0):
    inp = gdn.make_inputs(B, T, H, K, V, "random", seed=K + T, initial_state=h0)
    args = [inp[n].float() for n in NAMES]
    h = inp["h0"].float() if h0 else None
    o_r, S_r = gdn.recurrent(*args, initial_state=h)
    o_t, S_t = gdn.recurrent_triton(*(a.to(DEV) for a in args), initial_state=h.to(DEV) if h0 else None)
    assert o_t.shape == o_r.shape and S_t.shape == S_r.shape
    if T:
        assert _rel(o_t.cpu(), o_r) <= 1e-5
    assert _rel(S_t.cpu(), S_r) <= 1e-5 if (h0 or T) else torch.equal(S_t.cpu(), S_r)
    # bf16 inputs: output in bf16, rounded to nearest (not truncated) from the fp32 result
    o_b, _ = gdn.recurrent_triton(*(a.bfloat16().to(DEV) for a in args), initial_state=h.to(DEV) if h0 else None)
    o_f, _ = gdn.recurrent_triton(*(a.bfloat16().float().to(DEV) for a in args), initial_state=h.to(DEV) if h0 else None)
    assert o_b.dtype == torch.bfloat16 and torch.equal(o_b, o_f.bfloat16())
    o_ref, _ = gdn.recurrent(*(a.bfloat16() for a in args), initial_state=h)
    assert T == 0 or _rel(o_b.cpu(), o_ref) <= 8e-3


def test_triton_forward_in_the_harness_and_refuses_autograd():
    rep = gdn.check_backend(gdn.recurrent_triton, forward_only=True, head_dims=(32,), lengths=(7,),
                            gates=("random", "very_negative"), device=DEV)
    assert rep.passed and all("err_dq" not in r for r in rep.rows)
    inp = _inputs(1, 4, 1, 8, 8, h0=False)
    with pytest.raises(ValueError, match="forward-only"):
        gdn.recurrent_triton(*(inp[n] for n in NAMES))


COVER = [dict(K=32, V=48, lengths=[19]), dict(K=16, lengths=[1, 9, 20], varlen=True),
         dict(K=16, lengths=[21], l2norm=True), dict(K=16, lengths=[130])]


def test_coverage_cases_pass_the_chunked_form():
    """K != V, packed varlen (THD), in-kernel L2 norm and a long sequence: the chunked form passes."""
    rep = gdn.check_backends({"chunked": lambda *a, **kw: gdn.chunked(*a, chunk_size=8, **kw)}, head_dims=(),
                             lengths=(), gates=(), extra_cases=COVER, dtypes=(torch.bfloat16, torch.float32))
    r = rep["chunked"]
    assert len(r.rows) == 2 * len(COVER) and r.passed, r.failures()
    assert {row["case"] for row in r.rows} >= {"K=32 V=48 T=19 random", "K=16 varlen [1, 9, 20] random",
                                               "K=16 T=21 random l2norm in kernel"}


def test_coverage_cases_catch_their_bugs_and_skip_what_a_backend_cannot_take():
    def leaky_varlen(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False):
        # ignores the boundaries: the state of one sequence flows into the next
        o, S = gdn.chunked(q, k, v, g, beta, chunk_size=8, scale=scale, initial_state=initial_state[:1])
        return o, S.expand(initial_state.shape[0], *S.shape[1:])

    def no_l2norm(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False):
        return gdn.chunked(q, k, v, g, beta, chunk_size=8, scale=scale, initial_state=initial_state,
                           cu_seqlens=cu_seqlens)            # takes the flag, does not normalize

    def plain(q, k, v, g, beta, scale=None, initial_state=None):
        return gdn.chunked(q, k, v, g, beta, chunk_size=8, scale=scale, initial_state=initial_state)

    rep = gdn.check_backends({"leaky": leaky_varlen, "no l2norm": no_l2norm, "plain": plain}, head_dims=(),
                             lengths=(), gates=(), extra_cases=COVER[1:3], dtypes=(torch.float32,))
    by = {n: {r["case"]: r["passed"] for r in rep[n].rows} for n in rep}
    assert by["leaky"]["K=16 varlen [1, 9, 20] random"] is False
    assert by["no l2norm"]["K=16 T=21 random l2norm in kernel"] is False
    assert by["no l2norm"]["K=16 varlen [1, 9, 20] random"] is True
    assert rep["plain"].rows == [] and len(rep["plain"].skipped) == 2
    assert all(s["reason"].startswith("not run") for s in rep["plain"].skipped)


def test_varlen_equals_separate_sequences_and_fla_says_why_not():
    inp = gdn.make_inputs(1, 12, 2, 8, 8, "random", seed=4, n_states=2)
    args = [inp[n] for n in NAMES]
    o, S = gdn.recurrent(*args, initial_state=inp["h0"], cu_seqlens=[0, 5, 12])
    o1, S1 = gdn.recurrent(*(a[:, :5] for a in args), initial_state=inp["h0"][:1])
    assert torch.equal(o[:, :5], o1) and torch.equal(S[:1], S1)
    fns, why = gdn.fla_backends("cpu")
    assert fns == {} and why
    with pytest.raises(ValueError, match="cu_seqlens"):
        gdn.recurrent(*args, cu_seqlens=[0, 5, 11])


def test_harness_accepts_fla_precision_and_rejects_noise_dg_error_and_a_bf16_state():
    """The BF16 baseline is the chunked form at fla's working precision (bf16 intermediates, fp32 sums
    and state): fla's rounding (emulated op by op) passes, while 0.4 % noise on o, a 5 % error on dg
    and a state kept in BF16 between steps fail. Against the old fp32-state baseline fla's own
    precision failed (its S error ~1e3x the tolerance)."""
    fns = {"fla": gdn.fla_precision, "noise": gdn.noisy_output(gdn.fla_precision, 0.004),
           "dg": gdn.scaled_gradient(gdn.fla_precision, "g", 0.05), "bf16 state": gdn.bf16_state_recurrent}
    rep = gdn.check_backends(fns, head_dims=(32,), lengths=(45,), gates=("random", "zero"), dtypes=(torch.bfloat16,))
    assert rep["fla"].passed, rep["fla"].failures()
    assert all(not r["passed"] and "o:" in r["reason"] for r in rep["noise"].rows), rep["noise"].rows
    assert all(not r["passed"] and "dg:" in r["reason"] and "o:" not in r["reason"] for r in rep["dg"].rows)
    assert all(not r["passed"] and r["nonfinite"] == "" for r in rep["bf16 state"].rows)
    f = rep["fla"].rows[0]
    inp = gdn.make_inputs(1, 45, 2, 32, 32, "random", seed=0)
    b = [inp[n].bfloat16() for n in NAMES]
    ref_S = gdn.recurrent(*(x.double() for x in b), initial_state=inp["h0"].bfloat16().double())[1]
    fp32_state = _rel(gdn.recurrent(*b, initial_state=inp["h0"].bfloat16())[1], ref_S)   # the old baseline
    assert f["err_S"] > 100 * (2 * fp32_state + gdn.FLOOR[torch.float32])
    with pytest.raises(ValueError, match="name must be one of"):
        gdn.scaled_gradient(gdn.chunked, "h")


def test_working_precision_chunked_rounds_and_fla_precision_matches_the_recurrence():
    inp = gdn.make_inputs(1, 70, 2, 16, 24, "random", seed=7)
    b = [inp[n].bfloat16() for n in NAMES]
    ref = gdn.recurrent(*(x.double() for x in b), initial_state=inp["h0"])
    full = gdn.chunked(*b, chunk_size=64, initial_state=inp["h0"].float())
    low = gdn.chunked(*b, chunk_size=64, initial_state=inp["h0"].float(), working_dtype=torch.bfloat16)
    fla = gdn.fla_precision(*b, initial_state=inp["h0"].float())
    e = {n: _rel(x[1], ref[1]) for n, x in (("full", full), ("low", low), ("fla", fla))}
    assert e["full"] < 1e-5 < 1e-3 < e["low"] < 1e-2 and 1e-3 < e["fla"] < 1e-2, e
    f32 = gdn.fla_precision(*(x.float() for x in b), initial_state=inp["h0"].float())   # no rounding in fp32
    assert _rel(f32[0], ref[0]) < 1e-5 and _rel(f32[1], ref[1]) < 1e-5


# -- the chunked forward on tl.dot (numerics/gdn_chunk.py) -------------------------------------------------------
from inferbook.numerics import gdn_chunk  # noqa: E402

CHUNK_CASES = [  # (B, T, H, K, V, dtype, l2norm, cu_seqlens): odd T, K != V, varlen with 1 and 0 tokens, long T
    (2, 70, 2, 32, 16, torch.float32, False, None),
    (1, 45, 2, 64, 64, torch.bfloat16, False, None),
    (1, 31, 2, 16, 24, torch.float32, True, [0, 1, 1, 9, 31]),
    (1, 150, 1, 48, 40, torch.bfloat16, True, [0, 129, 150]),
    (1, 200, 1, 16, 32, torch.float32, False, None),
]


@pytest.mark.parametrize("B,T,H,K,V,dtype,l2,cu", CHUNK_CASES, ids=lambda v: str(v))
def test_chunked_triton_matches_the_recurrence(B, T, H, K, V, dtype, l2, cu):
    n = len(cu) - 1 if cu else B
    inp = gdn.make_inputs(B, T, H, K, V, "random", seed=K + T, n_states=n, normalize_k=not l2)
    args = [inp[x].to(dtype) for x in NAMES]
    with torch.no_grad():
        o, S = gdn_chunk.chunked_triton(*(a.to(DEV) for a in args), initial_state=inp["h0"].float().to(DEV),
                                        cu_seqlens=cu, use_qk_l2norm=l2)
    o_r, S_r = gdn.recurrent(*(a.double() for a in args), initial_state=inp["h0"].float().double(), cu_seqlens=cu,
                             use_qk_l2norm=l2)
    assert o.dtype == dtype and S.dtype == torch.float32 and o.shape == o_r.shape and S.shape == S_r.shape
    if cu and 0 in [b - a for a, b in zip(cu, cu[1:])]:   # an empty sequence keeps its initial state
        i = [b - a for a, b in zip(cu, cu[1:])].index(0)
        assert torch.equal(S[i].cpu(), inp["h0"][i].float())
    tol = 1e-5 if dtype == torch.float32 else 6e-3      # bf16: the working precision's error (~3e-3)
    assert gdn.rel_rms(o.cpu(), o_r) <= tol and gdn.rel_rms(S.cpu(), S_r) <= tol


def test_chunked_triton_in_the_harness_and_a_misread_chunk_state_is_caught(monkeypatch):
    kw = dict(head_dims=(16,), lengths=(67,), gates=("random",), device=DEV, heads=1,
              dtypes=(torch.bfloat16, torch.float32), extra_cases=[dict(K=16, V=32, lengths=[1, 66, 5], varlen=True)])
    rep = gdn.check_backend(gdn_chunk.chunked_triton, forward_only=True, **kw)
    assert rep.passed and not rep.skipped, rep.failures()
    real = gdn_chunk.chunk_tables

    def reversed_chunks(lengths, chunk=gdn_chunk.CHUNK):   # the output kernel then reads another chunk's state
        idx, offs = real(lengths, chunk)
        pairs = [idx[i:i + 2] for i in range(0, len(idx), 2)][::-1]
        return [x for p in pairs for x in p], offs

    monkeypatch.setattr(gdn_chunk, "chunk_tables", reversed_chunks)
    bad = gdn.check_backend(gdn_chunk.chunked_triton, forward_only=True, **{**kw, "extra_cases": [],
                                                                          "dtypes": (torch.float32,)}, name="broken")
    assert bad.rows and not any(r["passed"] for r in bad.rows)
    with pytest.raises(ValueError, match="forward-only"):
        inp = _inputs(1, 4, 1, 8, 8, h0=False)
        gdn_chunk.chunked_triton(*(inp[n] for n in NAMES))
    with pytest.raises(ValueError, match="K, V <= 256"):
        gdn_chunk.chunked_triton(*(torch.zeros(1, 2, 1, 264),) * 2, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1),
                                 torch.zeros(1, 2, 1))


def test_chunked_triton_at_the_amd_gpu_config():
    """The chunked kernels at the GPU tiles of the AMD config (`device.pick_config`'s 'hip' entry, which
    `inferbook inspect --target gfx942` compiles) in the interpreter: at K 128 the state kernel splits
    V into BV 32 blocks (three programs, the third masked at V 80) and runs one stage; the NVIDIA build
    keeps its three stages and tf32."""
    from inferbook import device
    from inferbook.numerics import gdn_chunk

    with device.building_for("gfx942"):
        c = gdn_chunk.chunk_blocks(128, 80, torch.device("cpu"))
        (amd_state,) = [la for la in gdn_chunk.chunked_launches(1, 70, 1, 128, 80) if "state" in la.name]
    with device.building_for("sm_90"):
        (nv_state,) = [la for la in gdn_chunk.chunked_launches(1, 70, 1, 128, 80) if "state" in la.name]
    assert c["BV_STATE"] == 32 and amd_state.grid[0] == 3 and c["BV_O"] == 64 and c["stages_state"] == 1 and c["gpu_precision"] == "ieee"
    assert (amd_state.kwargs["num_stages"], amd_state.kwargs["PRECISION"], amd_state.kwargs["num_warps"]) == (1, "ieee", 4)
    assert (nv_state.kwargs["num_stages"], nv_state.kwargs["PRECISION"], nv_state.kwargs["num_warps"]) == (3, "tf32", 8)
    inp = gdn.make_inputs(1, 70, 1, 128, 80, "random", seed=3)
    args = [inp[x].bfloat16() for x in NAMES]
    with device.building_for("gfx942"), torch.no_grad():
        o, S = gdn_chunk.chunked_triton(*(a.to(DEV) for a in args), initial_state=inp["h0"].float().to(DEV))
    o_r, S_r = gdn.recurrent(*(a.double() for a in args), initial_state=inp["h0"].double())
    assert gdn.rel_rms(o.cpu(), o_r) <= 6e-3 and gdn.rel_rms(S.cpu(), S_r) <= 6e-3
