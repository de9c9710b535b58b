"""All-reduce orders and vocab-parallel greedy: single-process laws, then one real 4-rank run
(gloo on loopback) whose every check must pass. The 2-rank run is the chapter's smoke test."""
import pytest
import torch

import inferbook  # noqa: F401
from inferbook.comm import allreduce as ar, tail, vocab_greedy as vg, workers
from inferbook.errors import UserError


def _inputs(n, numel, dt, seed=0):
    return list(torch.randn(n, numel, generator=torch.Generator().manual_seed(seed)).to(dt))


@pytest.mark.parametrize("alg", ar.ALGORITHMS)
@pytest.mark.parametrize("acc", ar.ACCUMULATE)
def test_fixed_order_ranks_agree(alg, acc):
    res = ar.simulate(_inputs(4, 2000, torch.bfloat16), alg, "fixed", acc)
    assert all(not tail.bits_differ(r, res[0]).any() for r in res)


def test_owner_first_one_shot_disagrees_two_shot_agrees():
    xs = _inputs(4, 4000, torch.float32, seed=3)
    one = ar.simulate(xs, "one-shot", "owner-first", "fp32")
    assert tail.bits_differ(one[1], one[0]).any(), "owner-dependent order must change bits across ranks"
    two = ar.simulate(xs, "two-shot", "owner-first", "fp32")
    assert all(not tail.bits_differ(r, two[0]).any() for r in two)
    fixed = ar.simulate(xs, "one-shot", "fixed", "fp32")[0]
    assert tail.bits_differ(two[0], fixed).any()
    exact = torch.stack(xs).double().sum(0)
    for r in one + two:
        assert ((r.double() - exact).abs() <= 4 * torch.finfo(torch.float32).eps * torch.stack(xs).abs().sum(0)).all()


def test_chunks_and_bytes():
    assert ar.chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert ar.bytes_per_rank("one-shot", 1000, 4)["received"] == 3000
    assert ar.bytes_per_rank("two-shot", 1000, 4)["received"] == 1500
    with pytest.raises(UserError, match="order"):
        ar.simulate(_inputs(2, 4, torch.float32), "one-shot", "random")


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_pairs_equal_argmax_over_ties_nan_inf(tp, dt):
    logits, labels = vg.tie_nan_inf_matrix(6, 61, tp, dtype=dt, generator=torch.Generator().manual_seed(tp))
    got, want = vg.simulate_pairs(logits, tp), vg.greedy_reference(logits)
    assert [labels[i] for i in range(len(labels)) if got[i] != want[i]] == []
    assert want[labels.index("all -inf")] == 0
    assert want[labels.index("tie across a slice boundary")] < 61


def test_wrong_merge_would_be_caught():
    """A merge that breaks ties to the last rank fails on the tie rows: the test can fail."""
    logits, labels = vg.tie_nan_inf_matrix(2, 64, 4)
    vals, idxs = zip(*(vg.local_candidates(logits[:, s:e], s) for s, e in vg.shard_bounds(64, 4)))
    vals, idxs = torch.stack(vals), torch.stack(idxs)
    last = vals.shape[0] - 1 - torch.argmax(vals.flip(0), dim=0)
    wrong = idxs.gather(0, last[None])[0]
    assert (wrong != vg.greedy_reference(logits)).any()


def test_strategy_selector():
    assert vg.choose_strategy(163840, 1, 4, 2, crossover_bytes=1e6)[0] == "gather"
    assert vg.choose_strategy(163840, 64, 4, 2, crossover_bytes=1e6)[0] == "pairs"
    assert vg.choose_strategy(163840, 64, 1)[0] == "gather"
    assert vg.exchanged_bytes("pairs", 3, 163840, 4, 2) == 24
    assert vg.exchanged_bytes("gather", 1, 163840, 4, 2) == 81920
    with pytest.raises(UserError, match="tp"):
        vg.shard_bounds(3, 4)
    with pytest.raises(UserError, match="batch"):
        vg.choose_strategy(1000, -1, 2)


def test_launch_rejects_bad_input():
    with pytest.raises(UserError, match="world_size"):
        workers.launch("check", 0)
    with pytest.raises(UserError, match="task"):
        workers.launch("train", 2)


@pytest.mark.timeout(240)
def test_four_ranks_gloo_all_checks_pass():
    args = {"seed": 11, "numel": 301, "vocab": 64, "batch": 3, "tokens": 3, "hidden": 48, "topk_per_rank": 2}
    results = workers.launch("check", 4, args, timeout_s=180)
    assert [r["rank"] for r in results] == [0, 1, 2, 3] and results[0]["backend"] == "gloo"
    rows = workers.check_results(results, args)
    assert len(rows) > 90
    assert [r for r in rows if not r["passed"]] == []
    # with 4 ranks the owner-first one-shot order really does split the ranks (per-step bf16)
    key = "allreduce/torch.bfloat16/one-shot/push/owner-first/per-step"
    assert any(tail.bits_differ(r[key], results[0][key]).any() for r in results[1:])
    # and the checks can fail: one changed bit on one rank is caught
    bad = [dict(r) for r in results]
    out, res = bad[2]["tail/fused"]
    out = out.clone()
    out.view(torch.int16)[0, 0] ^= 1
    bad[2]["tail/fused"] = [out, res]
    bad[3]["greedy/pairs"] = bad[3]["greedy/pairs"].flip(0)
    failed = {r["check"] for r in workers.check_results(bad, args) if not r["passed"]}
    assert any("tail out" in c for c in failed) and any("greedy pairs" in c for c in failed)
    # finalize before the exchange and the vocab gather are checked too, and those checks can fail
    names = {r["check"] for r in rows}
    assert any("finalize-before-exchange == unfused" in n for n in names)
    assert {"vocab gather push-slot: every rank holds the full logits, bit for bit",
            "vocab gather ring: every rank holds the full logits, bit for bit"} <= names
    bad = [dict(r) for r in results]
    pre_out, pre_res = bad[1]["tail/fused_pre"]
    pre_res = pre_res.clone()
    pre_res.view(torch.int16)[0, 1] ^= 1
    bad[1]["tail/fused_pre"] = [pre_out, pre_res]
    bad[0]["gather/ring"] = bad[0]["gather/ring"].roll(1, dims=1)
    failed = {r["check"] for r in workers.check_results(bad, args) if not r["passed"]}
    assert any("residual_out: finalize-before-exchange == unfused" in c for c in failed)
    assert any("vocab gather ring" in c for c in failed)
    # the shared-memory push (finalize stored into the peers' slots, flags waited on) and pull paths
    assert any("shared-memory push" in n for n in names) and any("shm-pull" in n for n in names)
    bad = [dict(r) for r in results]
    shm_out, shm_res = bad[3]["tail/fused_shm"]
    shm_out = shm_out.clone()
    shm_out.view(torch.int16)[1, 0] ^= 1
    bad[3]["tail/fused_shm"] = [shm_out, shm_res]
    bad[2]["gather/shm-pull"] = bad[2]["gather/shm-pull"].roll(1, dims=1)
    failed = {r["check"] for r in workers.check_results(bad, args) if not r["passed"]}
    assert any("out: shared-memory push" in c for c in failed) and any("shm-pull" in c for c in failed)


def test_disagreement_counts_elements_not_element_rank_pairs():
    """Three ranks that all differ from rank 0 on the same 5 elements: 5 elements, not 10 pairs."""
    base = torch.randn(64, generator=torch.Generator().manual_seed(0))
    other = base.clone()
    other[:5] += 1.0
    assert workers.elements_where_ranks_disagree([base, other, other.clone()]) == 5
    assert workers.elements_where_ranks_disagree([base, base.clone()]) == 0


def test_selector_is_scored_out_of_sample():
    """Leave-one-out: a configuration whose own timing set the crossover is judged without it."""
    from inferbook.chapters import sglang_fused_comm as ch

    def cfg(vocab, batch, faster):
        return {"vocab": vocab, "batch": batch, "slice_bytes": vg.exchanged_bytes("gather", batch, vocab, 4, 2),
                "faster": faster, "gather_over_pairs": 1.0}
    configs = [cfg(4096, 1, "gather"), cfg(4096, 16, "gather"), cfg(163840, 64, "pairs")]
    scored = ch.selector_held_out(configs, 4)
    # in sample, crossover = 32768 B and all three agree; out of sample the 16-row config, the
    # largest gather win, is judged with the crossover of the 1-row config only, and misses
    assert [c["agrees"] for c in scored] == [True, False, True]
    assert scored[1]["held_out_crossover"] == configs[0]["slice_bytes"]
    undecided = ch.selector_held_out([cfg(4096, 1, "either"), cfg(4096, 16, "pairs")], 4)
    assert undecided[0]["agrees"] is None


def test_faster_needs_the_spread_to_separate():
    from inferbook.chapters import sglang_fused_comm as ch

    a = {"samples_s": [1.0, 1.01, 0.99, 1.02, 0.98] * 4, "p10_s": 0.98, "p90_s": 1.02}
    b = {"samples_s": [2.0, 2.02, 1.98, 2.01, 1.99] * 4, "p10_s": 1.98, "p90_s": 2.02}
    assert ch._faster(a, b) == "gather" and ch._faster(b, a) == "pairs"
    assert ch._faster(a, dict(a)) == "either"


def test_rank_plan_labels_the_run():
    ranks, backend, label = workers.rank_plan(4, use_cuda=False)
    assert (ranks, backend) == (4, "gloo") and "not an NVLink measurement" in label
