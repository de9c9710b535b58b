"""Gated DeltaNet's chunked backward on tl.dot (numerics/gdn_chunk_bwd.py), in the Triton interpreter:
its gradients against autograd's of the fp64 recurrence, by the harness's rule, and broken ones rejected."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.numerics import gdn, gdn_chunk_bwd, small_op_threads

DEV = torch.device("cpu")
NAMES = ("q", "k", "v", "g", "beta")
FN = gdn_chunk_bwd.chunked_triton_autograd


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with small_op_threads("cpu"):
        yield


# head dims 32/64/128, lengths not a multiple of the chunk (17, 45; 70 = a full chunk + 6: the dh
# recurrence crosses a chunk), every gate, K != V and packed varlen with an empty sequence; bf16 and fp32
CASES = [dict(K=32, lengths=[17], gate="random"), dict(K=64, lengths=[45], gate="very_negative"),
         dict(K=128, lengths=[17], gate="zero"), dict(K=32, V=16, lengths=[20, 0, 70], varlen=True, gate="random")]


def test_chunked_backward_passes_the_harness():
    rep = gdn.check_backend(FN, head_dims=(), extra_cases=CASES, heads=1, dtypes=(torch.bfloat16, torch.float32))
    assert rep.passed and not rep.skipped and len(rep.rows) == 2 * len(CASES), rep.failures()
    assert all("err_dg" in r and "err_dh0" in r for r in rep.rows)   # judged on every gradient


def test_chunked_backward_without_initial_state_and_with_l2norm():
    inp = gdn.make_inputs(1, 80, 1, 32, 32, "random", seed=5, initial_state=False, normalize_k=False)
    leaves = {n: inp[n].float().requires_grad_(True) for n in NAMES}
    ref = {n: inp[n].clone().requires_grad_(True) for n in NAMES}
    gen = torch.Generator().manual_seed(1)
    do, dS = torch.randn(1, 80, 1, 32, generator=gen, dtype=torch.float64), torch.randn(1, 1, 32, 32, generator=gen,
                                                                                     dtype=torch.float64)
    outs = []
    for fn, x in ((FN, leaves), (gdn.recurrent, ref)):
        o, S = fn(*(x[n] for n in NAMES), use_qk_l2norm=True)
        outs.append(torch.autograd.grad((o.double() * do).sum() + (S.double() * dS).sum(), [x[n] for n in NAMES]))
    for n, a, b in zip(NAMES, *outs):
        assert a.dtype == torch.float32 and gdn.rel_rms(a, b) < 2e-5, n


def test_a_broken_backward_fails():
    kw = dict(head_dims=(32,), lengths=(45,), gates=("random",), heads=1)
    bad_dg = gdn.check_backend(gdn.scaled_gradient(FN, "g", 0.05), dtypes=(torch.bfloat16,), **kw)

    def drops_ds(q, k, v, g, beta, scale=None, initial_state=None, **kw):   # the final state's gradient is lost
        o, S = FN(q, k, v, g, beta, scale=scale, initial_state=initial_state, **kw)
        return o, S.detach()

    no_ds = gdn.check_backend(drops_ds, dtypes=(torch.float32,), **kw)
    assert bad_dg.rows and not any(r["passed"] for r in bad_dg.rows)
    assert "dg:" in bad_dg.rows[0]["reason"]
    assert no_ds.rows and not any(r["passed"] for r in no_ds.rows)


def test_chunked_backward_at_the_gpu_tiles():
    """The GPU tiles (`device.building_for('sm_90')`) in the interpreter: K 128 in two BK 64 blocks in dqkwg
    and wy (dg summed over them), V 96 in BV 64 blocks, the second masked (the state kernels in three of 32);
    K 64, V 40: the state kernels' BV 16 blocks, the last masked."""
    from inferbook import device

    with device.building_for("sm_90"):
        c = gdn_chunk_bwd.bwd_blocks(128, 96, DEV)
        assert (c["BK"], c["BV"], c["BV_STATE"]) == (64, 64, 32)     # dhu: V 96 in three BV 32 blocks
        rep = gdn.check_backend(FN, head_dims=(), extra_cases=[dict(K=128, V=96, lengths=[70]),
                                                                 dict(K=64, V=40, lengths=[70])], heads=1,
                                dtypes=(torch.bfloat16,))      # K 64: the state kernels' BV 16, V 40 -> 3 blocks
    assert rep.passed, rep.failures()


def test_sm100_takes_dqkwg_on_4_warps():
    """sm_100 (`_sm100_bwd`): dqkwg on 4 warps, the other kernels and tiles as on sm_90, whose dqkwg keeps 8."""
    from inferbook import device

    with device.building_for("sm_90"):
        c90 = gdn_chunk_bwd.bwd_blocks(128, 128, DEV)
    with device.building_for("sm_100"):
        c100 = gdn_chunk_bwd.bwd_blocks(128, 128, DEV)
    assert (c90["warps_dqkwg"], c100["warps_dqkwg"]) == (8, 4)
    assert {k: v for k, v in c100.items() if k != "warps_dqkwg"} == {k: v for k, v in c90.items() if k != "warps_dqkwg"}


def test_state_kernels_take_narrow_v_blocks_on_sm90_sm100_and_cdna():
    """sm_90/sm_100: the state kernel (forward) and dhu (backward) walk the chunks in order, so their V
    block sets how many programs share the work: BV 16 up to K 64, 32 at K 128; K 256 keeps 32 (16 in dhu);
    sm_80 keeps its own."""
    from inferbook import device
    from inferbook.numerics import gdn_chunk

    for target in ("sm_90", "sm_100", "gfx942", "gfx950"):
        with device.building_for(target):
            for K, want in ((32, 16), (64, 16), (128, 32), (256, 32)):
                assert gdn_chunk.chunk_blocks(K, K, DEV)["BV_STATE"] == want, (target, K)
                assert gdn_chunk_bwd.bwd_blocks(K, K, DEV)["BV_STATE"] == (16 if K == 256 else want), (target, K)
            assert gdn_chunk.chunk_blocks(64, 8, DEV)["BV_STATE"] == 16        # never below the dot's 16
    with device.building_for("sm_80"):
        assert gdn_chunk.chunk_blocks(64, 64, DEV)["BV_STATE"] == 64


def test_chunked_backward_at_the_sm80_tiles():
    """sm_80's config (`_sm80_bwd`, against spills): wy over BK = BV = 16 blocks, unpipelined, dhu at K 64
    and 128 over BV 32 (one stage at K 256), dqkwg and dv_local over BV 32; in the interpreter at K 64 (four
    wy K blocks), V 48 (two BV blocks in dqkwg's V loop, the last of each kernel masked). The other targets
    keep wy at dqkwg's tiles."""
    from inferbook import device

    with device.building_for("sm_90"):
        c90 = gdn_chunk_bwd.bwd_blocks(64, 48, DEV)
    assert (c90["BK_wy"], c90["BV_wy"], c90["stages_wy"], c90["BV_STATE"]) == (64, 64, None, 16)
    with device.building_for("sm_80"):
        c = gdn_chunk_bwd.bwd_blocks(64, 48, DEV)
        assert (c["BK"], c["BV"], c["BK_wy"], c["BV_wy"], c["stages_wy"], c["BV_STATE"]) == (64, 32, 16, 16, 1, 32)
        assert gdn_chunk_bwd.bwd_blocks(128, 128, DEV)["BV_STATE"] == 32
        assert gdn_chunk_bwd.bwd_blocks(256, 256, DEV)["stages_state"] == 1
        rep = gdn.check_backend(FN, head_dims=(), extra_cases=[dict(K=64, V=48, lengths=[70])], heads=1,
                                dtypes=(torch.bfloat16,))
    assert rep.passed, rep.failures()


def test_cdna_takes_dqkwg_wy_and_dhu_on_4_waves():
    """gfx942/gfx950 (`_cdna_bwd`): dqkwg, wy and dhu on 4 waves, the tiles as on sm_90 (whose dqkwg and wy keep 8)."""
    from inferbook import device

    with device.building_for("sm_90"):
        c90 = gdn_chunk_bwd.bwd_blocks(128, 128, DEV)
    changed = ("warps_dqkwg", "warps_wy", "warps_state")
    for t in ("gfx942", "gfx950"):
        with device.building_for(t):
            c = gdn_chunk_bwd.bwd_blocks(128, 128, DEV)
        assert tuple(c[k] for k in changed) == (4, 4, 4), t
        tiles = ("BK", "BV", "BK_wy", "BV_wy", "BK_STATE", "BV_STATE")
        assert {k: c[k] for k in tiles} == {k: c90[k] for k in tiles}, t
    assert (c90["warps_dqkwg"], c90["warps_wy"]) == (8, 8)
