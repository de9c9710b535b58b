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
