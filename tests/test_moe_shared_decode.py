"""The shared-expert layer at decode (minimax-m3-moe): both paths on the decode kernels (decode-packed
experts, `fused_moe_decode`; the shared MLP on `decode_linear`) against the fp32 definition, the fused
slot bit for bit equal to the separate path with the same rounding points, and checks that fail when the
kernel path is broken. Interpreter, small shapes."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.moe import fused_moe as FM, routing as R, w4a16 as W

H, I, E, K = 64, 32, 8, 2


def _layer(T, seed, dead=()):
    g = torch.Generator().manual_seed(seed)
    q = lambda *shape: W.quantize(torch.randn(*shape, generator=g) * 0.1)  # noqa: E731
    w13, w2, s13, s2 = q(E, 2 * I, H), q(E, H, I), q(1, 2 * I, H), q(1, H, I)
    logits = torch.randn(T, E, generator=g)
    logits[:, list(dead)] = -1e4                 # experts that receive no tokens
    tw, ids = logits.softmax(-1).topk(K)
    x = torch.randn(T, H, generator=g).bfloat16()
    return w13, w2, s13, s2, x, tw / tw.sum(-1, keepdim=True), ids.to(torch.int32)


def _refs(w13, w2, s13, s2, x, tw, ids, rsf):
    a13, a2, aw, aid = FM.with_shared_slot(w13, w2, s13, s2, tw, ids, rsf)
    return (FM.shared_reference(x, w13, w2, tw, ids, s13, s2, routed_scaling_factor=rsf),
            FM.fused_moe_torch(x, a13, a2, aw, aid))


def test_decode_rule_is_chords_bound_on_rows_per_expert():
    assert FM.decode_step(1) and FM.decode_step(FM.DECODE_MAX_ROWS) and not FM.decode_step(FM.DECODE_MAX_ROWS + 1)
    assert FM.DECODE_MAX_ROWS == W.DECODE_MAX_M
    _, _, _, _, _, tw, ids = _layer(FM.DECODE_MAX_ROWS, 3)
    _, aid = FM.shared_slot_routing(tw, ids, E)
    # the shared expert sees every token of the step: exactly T rows, the most any expert can see
    assert int(R.tokens_per_expert(aid, E + 1).max()) == FM.DECODE_MAX_ROWS


@pytest.mark.parametrize("T, dead", [(1, ()), (16, (2, 5)), (7, (0,))], ids=["M1", "M16-empty-experts", "M7-empty-expert0"])
def test_decode_paths_match_the_definition(T, dead):
    rsf = 2.5
    w13, w2, s13, s2, x, tw, ids = _layer(T, 10 + T, dead)
    assert all(int(R.tokens_per_expert(ids, E)[d]) == 0 for d in dead)
    dec = FM.SharedDecodeWeights(w13, w2, s13, s2)
    assert dec.all13.shape == (E + 1, 2 * I, H) and dec.shared13.shape == (2 * I, H) and dec.num_routed == E
    # the views are the packed table's own experts: the shared one unpacks to the shared weights
    assert torch.equal(W.dequantize_decode(dec.shared2), W.dequantize(W.expert(s2, 0), torch.float32))
    ref, pt = _refs(w13, w2, s13, s2, x, tw, ids, rsf)
    fused = FM.shared_fused_decode_step(x, dec, tw, ids, routed_scaling_factor=rsf)
    same = FM.shared_separate_decode(x, dec, tw, ids, routed_scaling_factor=rsf)
    assert fused.shape == (T, H) and fused.dtype == torch.bfloat16
    # the same kernel over the same rows in the same order, rounded at the same points: equal bits
    assert torch.equal(fused, same)
    sep = FM.routed_plus_shared_mlp_decode(x, dec, tw, ids, routed_scaling_factor=rsf)
    old = FM.shared_separate_decode(x, dec, tw, ids, round_each=True, routed_scaling_factor=rsf)
    for out, factor in ((fused, 2.0), (sep, 3.0), (old, 3.0)):
        err, tol, ok = FM.within_tolerance(out, ref, pt, factor=factor)
        assert ok, (err, tol, factor)


def test_decode_path_checks_fail_on_a_broken_kernel_path(monkeypatch):
    rsf = 2.5
    w13, w2, s13, s2, x, tw, ids = _layer(16, 4)
    dec = FM.SharedDecodeWeights(w13, w2, s13, s2)
    ref, pt = _refs(w13, w2, s13, s2, x, tw, ids, rsf)
    # the shared slot pointed at the last routed expert (an off-by-one in the table) fails
    bad = FM.SharedDecodeWeights(w13, w2, s13, s2)
    bad.all13 = FM._decode_experts(bad.all13, 0, E)
    bad.all13 = W.DecodeW4(torch.cat([bad.all13.qweight, bad.all13.qweight[-1:]]),
                           torch.cat([bad.all13.scales, bad.all13.scales[-1:]]), (E + 1, 2 * I, H), 32)
    assert not FM.within_tolerance(FM.shared_fused_decode_step(x, bad, tw, ids, routed_scaling_factor=rsf), ref, pt)[2]
    # the wrong order (the shared expert scaled by rsf too) fails
    assert FM.within_tolerance(FM.shared_fused_decode_step(x, dec, tw, ids, routed_scaling_factor=rsf), ref, pt)[2]
    wrong = FM.fused_moe_decode(x, dec.all13, dec.all2, *_scaled_shared(tw, ids, rsf), max_m=16)
    assert not FM.within_tolerance(wrong, ref, pt)[2]
    # a combine that drops the last slot (the shared expert's rows never reach the output) fails, and the
    # bitwise comparison against the separate path catches it too
    real = FM.combine
    monkeypatch.setattr(FM, "combine", lambda y, k, *a, **kw: real(
        y.reshape(-1, k, y.shape[-1])[:, :max(k - 1, 1)].reshape(-1, y.shape[-1]).contiguous(), max(k - 1, 1), *a, **kw))
    dropped = FM.shared_fused_decode_step(x, dec, tw, ids, routed_scaling_factor=rsf)
    monkeypatch.setattr(FM, "combine", real)
    assert not FM.within_tolerance(dropped, ref, pt)[2]
    assert not torch.equal(dropped, FM.shared_separate_decode(x, dec, tw, ids, routed_scaling_factor=rsf))


def _scaled_shared(tw, ids, rsf):
    w, i = FM.shared_slot_routing(tw, ids, E, rsf)
    return w * torch.tensor([1.0] * K + [rsf]), i


def test_chapter_check_records_the_decode_path_and_can_fail(monkeypatch):
    from inferbook.chapters import minimax_m3_moe as m3

    ctx = inferbook.setup("minimax-m3-moe", device="cpu", preset="smoke")
    rec = m3.decode_check(ctx, 64, 32, 8, 2, 2.5)
    names = [c["name"] for c in rec.checks]
    assert all(c["passed"] for c in rec.checks), rec.checks
    assert any("bitwise" in n for n in names) and any("dense decode kernel" in n for n in names)
    # a decode kernel whose output misses the shared expert: the record's checks fail
    real = FM.combine
    monkeypatch.setattr(FM, "combine", lambda y, k, *a, **kw: real(
        y.reshape(-1, k, y.shape[-1])[:, :max(k - 1, 1)].reshape(-1, y.shape[-1]).contiguous(), max(k - 1, 1), *a, **kw))
    broken = m3.decode_check(ctx, 64, 32, 8, 2, 2.5)
    assert not all(c["passed"] for c in broken.checks)


def _rank_map(ep, r, local):
    """vLLM's expert_map of rank r: physical id p -> p - r (local + 1) on this rank, -1 elsewhere."""
    p = torch.arange(ep * (local + 1))
    base = r * (local + 1)
    return torch.where((p >= base) & (p < base + local + 1), p - base, torch.full_like(p, -1)).to(torch.int32)


def test_expert_map_skips_other_ranks_slots():
    # EP 2 over the k+1 table: each rank's decode call sees only its own slots (at most T rows a local
    # expert, whatever the other rank's experts get), and the ranks' fp32 partials sum to the definition
    rsf, T, ep = 2.5, 12, 2
    w13, w2, s13, s2, x, tw, ids = _layer(T, 21)
    ref, pt = _refs(w13, w2, s13, s2, x, tw, ids, rsf)
    weights, logical = FM.shared_slot_routing(tw, ids, E, rsf)
    phys = FM.ep_physical_ids(logical, E, ep, torch.arange(T) % ep)
    local = E // ep
    total, held = torch.zeros(T, H), 0
    for r in range(ep):
        l13 = W.pack_decode(W.cat_experts(W.PackedW4(w13.qweight[r * local:(r + 1) * local], w13.scales[r * local:(r + 1) * local],
                                                      (local, 2 * I, H), 32, w13.layout), s13))
        l2 = W.pack_decode(W.cat_experts(W.PackedW4(w2.qweight[r * local:(r + 1) * local], w2.scales[r * local:(r + 1) * local],
                                                     (local, H, I), 32, w2.layout), s2))
        emap = _rank_map(ep, r, local)
        m = R.to_masked(x, emap.long()[phys.long()].to(torch.int32), local + 1, skip_negative=True)
        assert int(m.counts.max()) <= T and int((m.dest >= 0).sum()) == int((emap[phys.long()] >= 0).sum())
        held += int(m.counts.sum())
        total += FM.fused_moe_decode(x, l13, l2, weights, phys, max_m=T, out_dtype=torch.float32, expert_map=emap)
    assert held == phys.numel()                          # every slot on exactly one rank
    err, tol, ok = FM.within_tolerance(total.bfloat16(), ref, pt)
    assert ok, (err, tol)
    # the last rank's map missing its shared copy (those tokens lose the shared expert) fails, and so does
    # the same rank counted twice
    short = emap.clone()
    short[short == local] = -1
    part = FM.fused_moe_decode(x, l13, l2, weights, phys, max_m=T, out_dtype=torch.float32, expert_map=emap)
    lost = total - part + FM.fused_moe_decode(x, l13, l2, weights, phys, max_m=T, out_dtype=torch.float32, expert_map=short)
    assert not FM.within_tolerance(lost.bfloat16(), ref, pt)[2]
    assert not FM.within_tolerance((total + part).bfloat16(), ref, pt)[2]
    with pytest.raises(ValueError, match="expert_map"):
        FM.fused_moe_decode(x, l13, l2, weights, phys, max_m=T, expert_map=emap + local + 1)


def test_identity_expert_map_is_the_plain_call():
    # every expert held here: the same kernel over the same rows in the same order, bit for bit
    w13, w2, s13, s2, x, tw, ids = _layer(5, 8)
    d13, d2 = W.pack_decode(w13), W.pack_decode(w2)
    plain = FM.fused_moe_decode(x, d13, d2, tw, ids, max_m=5)
    mapped = FM.fused_moe_decode(x, d13, d2, tw, ids, max_m=5, expert_map=torch.arange(E, dtype=torch.int32))
    assert torch.equal(plain, mapped)
