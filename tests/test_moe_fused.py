"""Fused MoE for every layout against the fp32 reference (FlashAttention's rule: at most 2x the
error PyTorch makes in BF16), routing layouts, the decode tail and the shared-expert slot."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.moe import fused_moe as FM, routing as R, w4a16 as W

H, I = 64, 32


def _experts(E, seed, layout):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.1
    w2 = torch.randn(E, H, I, generator=g) * 0.1
    return W.quantize(w13, layout=layout), W.quantize(w2, layout=layout)


def _routing(T, E, k, seed, dead=()):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    logits[:, list(dead)] = -1e4          # experts that receive no tokens
    w, ids = logits.softmax(-1).topk(k)
    return (w / w.sum(-1, keepdim=True)), ids.to(torch.int32)


def _x(T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).bfloat16()


# Every layout at E in {8, 64} x top-k in {2, 8} x T in {1, 13} (at T=13 with E=64 most experts get
# no token; E=8, k=2 has two experts forced empty), T=512 for every layout at E=8; the expensive
# big cases (the interpreter's cost is per program) once each, on different layouts.
CASES = [(layout, E, k, T) for layout in W.LAYOUTS for E in (8, 64) for k in (2, 8) for T in (1, 13)]
CASES += [(layout, 8, 2, 512) for layout in W.LAYOUTS]
CASES += [("indexed", 64, 8, 160), ("grouped_contiguous", 8, 8, 131), ("grouped_masked", 64, 2, 255)]


@pytest.mark.parametrize("layout, E, k, T", CASES, ids=[f"{lay}-E{E}-k{k}-T{T}" for lay, E, k, T in CASES])
def test_fused_moe_matches_reference(layout, E, k, T):
    w13, w2 = _experts(E, 100 + E, layout)
    dead = (1, 3) if E == 8 and k == 2 else ()
    tw, ids = _routing(T, E, k, T + E + k, dead)
    x = _x(T, T)
    counts = R.tokens_per_expert(ids, E)
    assert all(counts[d] == 0 for d in dead)
    out = FM.fused_moe(x, w13, w2, tw, ids)
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    err, tol, ok = FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids),
                                       FM.fused_moe_torch(x, w13, w2, tw, ids))
    assert ok, (err, tol)


def test_layouts_give_identical_bits_and_noncontiguous_x():
    E, k, T = 8, 2, 45
    tw, ids = _routing(T, E, k, 1, dead=(5,))
    big = torch.randn(T, 3 * H).bfloat16()
    x = big[:, H:2 * H]
    assert not x.is_contiguous()
    outs = []
    for layout in W.LAYOUTS:
        w13, w2 = _experts(E, 7, layout)
        outs.append(FM.fused_moe(x, w13, w2, tw, ids, block=dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)))
    # The layouts change addresses and row bookkeeping, not arithmetic.
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0], FM.fused_moe(x.contiguous(), w13, w2, tw, ids,
                                             block=dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)))


def test_empty_batch_and_masked_capacity():
    w13, w2 = _experts(8, 1, "grouped_masked")
    out = FM.fused_moe(torch.empty(0, H, dtype=torch.bfloat16), w13, w2, torch.empty(0, 2),
                       torch.empty(0, 2, dtype=torch.int32))
    assert out.shape == (0, H)
    tw, ids = _routing(9, 8, 2, 2)
    x = _x(9, 2)
    a = FM.fused_moe(x, w13, w2, tw, ids)
    b = FM.fused_moe(x, w13, w2, tw, ids, max_m=32)    # fixed decode capacity: more padding, same answer
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="max_m must be"):
        FM.fused_moe(x, w13, w2, tw, ids, max_m=1)


def test_wrong_layout_and_bad_routing_are_refused():
    w13, w2 = _experts(8, 1, "indexed")
    tw, ids = _routing(4, 8, 2, 3)
    x = _x(4, 3)
    with pytest.raises(W.LayoutError, match="'grouped_contiguous' fused MoE kernel"):
        FM.fused_moe(x, w13, w2, tw, ids, layout="grouped_contiguous")
    m13, _ = _experts(8, 1, "grouped_masked")
    with pytest.raises(W.LayoutError, match="packed as 'grouped_masked'"):
        FM.fused_moe(x, m13, w2, tw, ids)
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 8\)"):
        FM.fused_moe(x, w13, w2, tw, ids + 7)
    with pytest.raises(ValueError, match="bfloat16"):
        FM.fused_moe(x.float(), w13, w2, tw, ids)
    with pytest.raises(ValueError, match="finite"):
        FM.fused_moe(x, w13, w2, tw * float("nan"), ids)
    with pytest.raises(ValueError, match="unknown MoE layout"):
        FM.fused_moe(x, w13, w2, tw, ids, layout="dense")


def test_fused_moe_can_fail():
    w13, w2 = _experts(8, 1, "indexed")
    tw, ids = _routing(20, 8, 2, 4)
    x = _x(20, 4)
    wrong = ids.flip(1)                      # weights paired with the wrong experts
    out = FM.fused_moe(x, w13, w2, tw, wrong)
    _, _, ok = FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids),
                                   FM.fused_moe_torch(x, w13, w2, tw, ids))
    assert not ok


def test_routing_layouts_agree():
    E, k, T, BM = 8, 2, 21, 16
    tw, ids = _routing(T, E, k, 5, dead=(0,))
    x = _x(T, 5)
    al = R.align_indexed(ids, E, BM)
    counts = R.tokens_per_expert(ids, E)
    # worst-case size (no host sync); blocks past the last run are marked -1 and hold only sentinels
    assert al.sorted_ids.numel() == (T * k + E * (BM - 1) + BM - 1) // BM * BM
    used = int(((counts + BM - 1) // BM).sum())
    assert (al.block_expert[:used] >= 0).all() and (al.block_expert[used:] == -1).all()
    assert (al.sorted_ids.reshape(-1, BM)[used:] == T * k).all()
    real = al.sorted_ids[al.sorted_ids < T * k]
    assert sorted(real.tolist()) == list(range(T * k))
    blocks = al.sorted_ids.reshape(-1, BM)[:used]
    for b, e in zip(blocks, al.block_expert[:used].tolist()):   # each block holds one expert's slots
        slots = b[b < T * k].long()
        assert (ids.flatten()[slots] == e).all()
    pc = R.permute_contiguous(x, ids, E, BM)
    m = R.to_masked(x, ids, E)
    for rows, dest in ((pc.x, pc.dest), (m.x.reshape(-1, H), m.dest)):
        keep = dest >= 0
        assert torch.equal(rows[keep], x[dest[keep].long() // k])
        assert int(keep.sum()) == T * k
    # the contiguous layout is sized for the worst case too (no host sync): the tail is padding
    assert pc.x.shape[0] == al.sorted_ids.numel()
    assert (pc.block_expert[:used] >= 0).all() and (pc.block_expert[used:] == -1).all()
    back = R.to_contiguous_from_masked(m, BM)
    P = back.x.shape[0]
    assert torch.equal(back.x, pc.x[:P]) and torch.equal(back.dest, pc.dest[:P])
    assert (pc.dest[P:] == -1).all() and not pc.x[P:].any()
    w, i = R.route(torch.randn(T, 48), torch.randn(E, 48), 3)
    assert i.shape == (T, 3) and torch.allclose(w.sum(-1), torch.ones(T))
    with pytest.raises(ValueError, match="top_k must be"):
        R.route(torch.randn(T, 48), torch.randn(E, 48), 9)


@pytest.mark.parametrize("fmt", ["bf16", "w4a16"])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_tail_fusion_equals_separate_combine(fmt, T):
    E, k = 16, 8
    g = torch.Generator().manual_seed(T)
    w2f = torch.randn(E, H, I, generator=g) * 0.1
    w2 = w2f.bfloat16() if fmt == "bf16" else W.quantize(w2f)
    tw, ids = _routing(T, E, k, 9 + T)
    act = torch.randn(T * k, I, generator=g).bfloat16()
    ref = FM.moe_tail_reference(act, w2, tw, ids)
    pt = FM.moe_tail_torch(act, w2, tw, ids)
    # expert-major (tl.dot): the fused epilogue scatter-adds into token rows in fp32, in CTA order
    fused, launches_f, buf_f = FM.moe_tail(act, w2, tw, ids, fused=True)
    sep32, _, _ = FM.moe_tail(act, w2, tw, ids, fused=False, inter_dtype=torch.float32)
    sep16, launches_s, buf_s = FM.moe_tail(act, w2, tw, ids, fused=False)
    ok, worst = FM.reorder_bound(fused, sep32, act, w2, tw, ids)   # same terms, another order: the math's bound
    assert ok, worst
    # buffers the calls allocated, against the formula: [T*k, H] BF16 rows vs an fp32 [T, H] accumulator
    assert buf_s == {"rows": T * k * H * 2, "accumulator": 0} and buf_f == {"rows": 0, "accumulator": T * H * 4}
    assert (launches_f, launches_s) == (3, 2)
    for out in (fused, sep16):
        err, tol, ok = FM.within_tolerance(out, ref, pt)
        assert ok, (err, tol)
    # token-major GEMV: the k rows summed in registers in slot order, bit-identical to the fp32 pass
    tm_f, n_f, _ = FM.moe_tail(act, w2, tw, ids, fused=True, kernel="token-major")
    tm_s, _, _ = FM.moe_tail(act, w2, tw, ids, fused=False, inter_dtype=torch.float32, kernel="token-major")
    assert torch.equal(tm_f, tm_s) and n_f == 1
    assert FM.within_tolerance(tm_f, ref, pt)[2]
    # the check can fail: weights paired with the wrong slots
    assert not FM.within_tolerance(FM.moe_tail(act, w2, tw.flip(1), ids, fused=True)[0], ref, pt)[2]
    with pytest.raises(W.LayoutError):
        FM.moe_tail(act, W.to_layout(W.quantize(w2f), "grouped_masked"), tw, ids, fused=True)


@pytest.mark.parametrize("rsf", [1.0, 2.5], ids=["rsf1", "rsf2.5"])
@pytest.mark.parametrize("layout", ["indexed", "grouped_masked"])
def test_shared_expert_slot_is_exactly_the_separate_path(layout, rsf):
    E, k, T = 8, 2, 19
    w13, w2 = _experts(E, 3, layout)
    s13, s2 = _experts(1, 4, layout)
    tw, ids = _routing(T, E, k, 6, dead=(2,))
    x = _x(T, 6)
    a13, a2, aw, aid = FM.with_shared_slot(w13, w2, s13, s2, tw, ids, rsf)
    assert torch.equal(aw[:, -1], torch.ones(T)) and torch.equal(aid[:, -1], torch.full((T,), E, dtype=torch.int32))
    fused = FM.shared_fused(x, a13, a2, aw, aid)
    same_rounding = FM.shared_separate(x, w13, w2, tw, ids, s13, s2, routed_scaling_factor=rsf)
    assert torch.equal(fused, same_rounding)
    step = FM.shared_fused_step(x, a13, a2, tw, ids, routed_scaling_factor=rsf)   # the table built inside the step
    assert torch.equal(step, fused)
    old = FM.shared_separate(x, w13, w2, tw, ids, s13, s2, round_each=True, routed_scaling_factor=rsf)
    # reference from the definition: rsf * routed + shared, each computed on its own
    ref = FM.shared_reference(x, w13, w2, tw, ids, s13, s2, routed_scaling_factor=rsf)
    assert torch.allclose(ref, FM.fused_moe_reference(x, a13, a2, aw, aid), rtol=1e-5, atol=1e-5)
    pt = FM.fused_moe_torch(x, a13, a2, aw, aid)
    for out, factor in ((fused, 2.0), (old, 3.0)):
        err, tol, ok = FM.within_tolerance(out, ref, pt, factor=factor)
        assert ok, (err, tol)
    if rsf != 1.0:  # scaling the shared expert too (the wrong order) is caught
        wrong = FM.shared_fused(x, a13, a2, aw * torch.tensor([1.0] * k + [rsf]), aid)
        assert not FM.within_tolerance(wrong, ref, pt)[2]


def test_shared_mlp_path_matches_reference():
    E, k, T = 8, 2, 11
    w13, w2 = _experts(E, 3, "indexed")
    s13, s2 = _experts(1, 4, "indexed")
    tw, ids = _routing(T, E, k, 6)
    x = _x(T, 6)
    a13, a2, aw, aid = FM.with_shared_slot(w13, w2, s13, s2, tw, ids, 2.5)
    out = FM.routed_plus_shared_mlp(x, w13, w2, tw, ids, s13, s2, routed_scaling_factor=2.5)
    err, tol, ok = FM.within_tolerance(out, FM.shared_reference(x, w13, w2, tw, ids, s13, s2, routed_scaling_factor=2.5),
                                       FM.fused_moe_torch(x, a13, a2, aw, aid), factor=3.0)
    assert ok, (err, tol)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        FM.shared_slot_routing(tw, ids, E, 0.0)


def test_ep_places_a_shared_copy_on_every_rank():
    place = FM.ep_shared_placement(8, 4)
    assert [p["physical slots"] for p in place] == [3] * 4 and place[2]["shared copy"] == "physical id 8"
    ids = torch.tensor([[0, 5, 8], [7, 2, 8]], dtype=torch.int32)       # slot 2: the shared expert (id 8)
    phys = FM.ep_physical_ids(ids, 8, 4, torch.tensor([3, 1]))
    # routed e -> e + e // 2 (one shared slot after every 2 routed); shared -> the token's own rank
    assert phys.tolist() == [[0, 7, 3 * 3 + 2], [10, 3, 1 * 3 + 2]]
    with pytest.raises(ValueError, match="divisor"):
        FM.ep_shared_placement(8, 3)


def test_gpu_time_refuses_cpu():
    from inferbook.moe.timing import gpu_time

    with pytest.raises(ValueError, match="needs a CUDA device"):
        gpu_time(lambda: None, torch.device("cpu"), label="x", reps=1)


def test_tolerance_rule_rejects_nan_and_accepts_reference_quality():
    ref = torch.randn(4, 8)
    pt = ref.bfloat16()
    assert FM.within_tolerance(pt, ref, pt)[2]
    bad = pt.clone()
    bad[1, 2] = float("nan")
    assert not FM.within_tolerance(bad, ref, pt)[2]


@pytest.mark.parametrize("layout", W.LAYOUTS)
def test_fused_moe_group16_k48_every_layout(layout):
    # K = 48 (hidden and expert FFN) with groups of 16: not whole 32-runs, which the grouped specs pad
    E, k, T, Hs, Is = 6, 2, 9, 48, 48
    g = torch.Generator().manual_seed(21)
    w13 = W.quantize(torch.randn(E, 2 * Is, Hs, generator=g) * 0.1, group_size=16, layout=layout)
    w2 = W.quantize(torch.randn(E, Hs, Is, generator=g) * 0.1, group_size=16, layout=layout)
    x = torch.randn(T, Hs, generator=g).bfloat16()
    tw, ids = _routing(T, E, k, 22)
    out = FM.fused_moe(x, w13, w2, tw, ids)
    err, tol, ok = FM.within_tolerance(out, FM.fused_moe_reference(x, w13, w2, tw, ids),
                                       FM.fused_moe_torch(x, w13, w2, tw, ids))
    assert ok, (err, tol)


@pytest.mark.parametrize("n, E, bm", [(16, 896, 16), (128, 896, 16), (2048, 896, 16), (42, 8, 16), (3, 64, 64),
                                      (0, 8, 16), (1, 1, 16)])
def test_padded_rows_caps_at_one_block_a_slot_as_vllm(n, E, bm):
    P = R.padded_rows(n, E, bm)
    uncapped = (n + E * (bm - 1) + bm - 1) // bm * bm
    assert P == min(uncapped, n * bm) and P % bm == 0
    # the worst routing fits: every slot on its own expert (n <= E), or the experts filled one by one
    g = torch.Generator().manual_seed(n + E)
    for ids in (torch.randperm(E, generator=g)[:min(n, E)].repeat(-(-n // E) if n else 1)[:n],
                torch.randint(0, E, (n,), generator=g)):
        al = R.align_indexed(ids.reshape(-1, 1).to(torch.int32), E, bm)
        assert al.sorted_ids.numel() == P
        used = int(((al.counts + bm - 1) // bm).sum())
        assert used <= R.max_blocks(n, E, bm) <= P // bm
        assert sorted(al.sorted_ids[al.sorted_ids < n].tolist()) == list(range(n))


def test_kimi_decode_tail_grid_is_its_slots_not_its_experts():
    # K3's tail at T 1: 16 slots over 896 experts make at most 16 row blocks (vLLM's cap); the launch counts
    # the weights of those blocks' experts, not the whole [896, 3584, 256] table
    las = FM.moe_tail_launches(1, 16, 896, 3584, 256, "w4a16", fused=True, kernel="expert-major")
    assert las[0].grid[0] == 16
    table = 896 * W.weight_bytes(3584, 256, "w4a16")
    assert 16 * W.weight_bytes(3584, 256, "w4a16") < las[0].dram_bytes < table / 40
    dec = FM.moe_tail_launches(1, 16, 896, 3584, 256, "w4a16", fused=True, kernel="decode")
    assert dec[0].grid[1] == 16 and dec[0].kernel is FM.moe_decode_tail_kernel and len(dec) == 1
    assert dec[0].kwargs["BLOCK_M"] == 16 and not dec[0].kwargs.get("SWAP_AB")
    # B200's W4A16 tail swaps the operands: 8-slot row blocks, so T 128's 2048 slots over 896 experts
    # make at most 896 + (2048 - 896) // 8 blocks (each an expert's read), and the launch's bytes count them
    from inferbook.device import building_for

    with building_for("sm_100"):
        swapped = FM.moe_tail_launches(1, 16, 896, 3584, 256, "w4a16", fused=True, kernel="decode")[0]
        big = FM.moe_tail_launches(128, 16, 896, 3584, 256, "w4a16", fused=True, kernel="decode")[0]
        mx = FM.moe_tail_launches(1, 16, 896, 3584, 256, "mxfp4", fused=True, kernel="decode")[0]
    assert swapped.kwargs["SWAP_AB"] and swapped.kwargs["BLOCK_M"] == 8 and "swap-AB" in swapped.name
    assert swapped.grid[1] == 16      # 16 slots: 16 blocks at 8 rows as at 16
    assert big.grid[1] == R.padded_rows(2048, 896, 8) // 8
    assert big.dram_bytes == FM.tail_dram_bytes(128, 16, 896, 3584, 256, W.decode_weight_bytes(3584, 256), 8,
                                                torch.empty(128, 3584), atomic=True)
    assert not mx.kwargs.get("SWAP_AB") and mx.kwargs["BLOCK_M"] == 16
    with pytest.raises(ValueError, match="w4a16 or mxfp4 experts"):
        FM.moe_tail_launches(1, 16, 896, 3584, 256, "bf16", fused=True, kernel="decode")


# The decode tail (`moe_decode_tail_kernel`, decode-packed W4A16): K a multiple of 256 or not (the run's
# padding), H a multiple of the column block or not, fewer slots than experts (T*k < E), experts with more
# than 16 slots (several row blocks of one expert), dead experts, k = 1.
DECODE_TAIL = [(16, 8, 1, 64, 32), (16, 8, 7, 200, 96), (4, 2, 40, 130, 288), (64, 8, 3, 128, 256),
               (8, 1, 33, 96, 512), (8, 2, 21, 64, 32)]


@pytest.mark.parametrize("E, k, T, Hd, Id", DECODE_TAIL, ids=[f"E{E}-k{k}-T{T}-H{h}-I{i}" for E, k, T, h, i in DECODE_TAIL])
@pytest.mark.parametrize("block", [None, "gpu", FM.DECODE_TAIL_NVIDIA["sm_100"]],
                         ids=["interp-tiles", "gpu-tiles", "sm100-swap-AB-tiles"])
def test_decode_tail_matches_reference_and_its_separate_pass(E, k, T, Hd, Id, block):
    g = torch.Generator().manual_seed(E * T + Id)
    q = W.quantize(torch.randn(E, Hd, Id, generator=g) * 0.1, layout="indexed")
    d = W.pack_decode(q)
    tw, ids = _routing(T, E, k, T + k, dead=(1,) if E == 8 and k == 2 else ())
    act = torch.randn(T * k, Id, generator=g).bfloat16()
    ref = FM.moe_tail_reference(act, d, tw, ids)
    assert torch.equal(ref, FM.moe_tail_reference(act, q, tw, ids))    # the repack loses nothing
    pt = FM.moe_tail_torch(act, q, tw, ids)
    fused, n, buf = FM.moe_tail(act, d, tw, ids, fused=True, kernel="decode", block=block)
    assert n == 3 and buf == {"rows": 0, "accumulator": T * Hd * 4}
    sep32, _, _ = FM.moe_tail(act, d, tw, ids, fused=False, inter_dtype=torch.float32, kernel="decode", block=block)
    sep16, n_s, buf_s = FM.moe_tail(act, d, tw, ids, fused=False, kernel="decode", block=block)
    assert n_s == 2 and buf_s == {"rows": T * k * Hd * 2, "accumulator": 0}
    for out in (fused, sep16):
        err, tol, ok = FM.within_tolerance(out, ref, pt)
        assert ok, (err, tol)
    ok, worst = FM.reorder_bound(fused, sep32, act, q, tw, ids)    # the same terms, added in another order
    assert ok, worst


def test_decode_tail_can_fail_and_takes_only_decode_packed_weights():
    E, k, T = 8, 2, 9
    q = W.quantize(torch.randn(E, H, I) * 0.1, layout="indexed")
    d = W.pack_decode(q)
    tw, ids = _routing(T, E, k, 4)
    act = torch.randn(T * k, I).bfloat16()
    ref, pt = FM.moe_tail_reference(act, q, tw, ids), FM.moe_tail_torch(act, q, tw, ids)
    assert FM.within_tolerance(FM.moe_tail(act, d, tw, ids, fused=True, kernel="decode")[0], ref, pt)[2]
    # router weights paired with the wrong slots, or another expert's weights: the check catches both
    assert not FM.within_tolerance(FM.moe_tail(act, d, tw.flip(1), ids, fused=True, kernel="decode")[0], ref, pt)[2]
    assert not FM.within_tolerance(FM.moe_tail(act, d, tw, (ids + 1) % E, fused=True, kernel="decode")[0], ref, pt)[2]
    with pytest.raises(ValueError, match="decode-packed"):
        FM.moe_tail(act, q, tw, ids, fused=True, kernel="decode")
    with pytest.raises(ValueError, match="decode-packed"):
        FM.moe_tail(act, d, tw, ids, fused=True)


def test_decode_tail_config_per_target():
    from inferbook.device import building_for

    for t in ("sm_80", "sm_90", "sm_100"):
        with building_for(t):
            cfg = FM.decode_tail_config(False, programs=10 ** 6)
            exact, folded = (FM.decode_tail_config(False, programs=10 ** 6, fp4=True, fold=f) for f in (False, True))
        # W4A16: on sm_100 swap-AB, 8-slot row blocks on one warp of 64 columns; MXFP4 keeps 16-slot blocks, unswapped
        assert cfg == (dict(BLOCK_M=8, BLOCK_N=64, num_warps=1, num_stages=1, SWAP_AB=True) if t == "sm_100" else
                       dict(BLOCK_M=16, BLOCK_N=64, num_warps=2, num_stages=2)), t
        assert (exact["BLOCK_M"], exact["num_warps"], folded["BLOCK_M"], folded["num_warps"]) == (16, 2, 16, 1), t
        assert not exact.get("SWAP_AB") and not folded.get("SWAP_AB"), t
    for t in ("gfx942", "gfx950"):
        with building_for(t):
            small, big = FM.decode_tail_config(False, programs=448), FM.decode_tail_config(False, programs=3584)
        # one-wave CTAs: 128 columns for a big grid, 64 for a small one (the waves 2-wave CTAs of 128 had)
        assert small["CDNA_LOOP"] and big["CDNA_LOOP"] and (small["BLOCK_N"], big["BLOCK_N"]) == (64, 128)
        assert (small["num_warps"], big["num_warps"]) == (1, 1), t
        # the scales by scalar FMAs only where a wave holds 128 columns of W4A16 (w4a16._fma_amd)
        assert big.get("FMA_AMD") and not small.get("FMA_AMD"), t
        with building_for(t):
            assert not FM.decode_tail_config(False, programs=3584, fp4=True).get("FMA_AMD"), t
    for t in ("sm_80", "sm_90", "sm_100"):
        with building_for(t):
            assert "FMA_AMD" not in FM.decode_tail_config(False, programs=10 ** 6), t
    assert FM.decode_tail_config(True) == {"BLOCK_M": 16, "BLOCK_N": 64}
