"""The parallel block draft (DSpark style): one forward per block, Markov bias and confidence heads,
its drafter in the engine (greedy output unchanged), strict save/load."""
import pytest
import torch

from inferbook.errors import UserError
from inferbook.serving import checks
from inferbook.serving.block_draft import (BlockDraft, BlockDraftConfig, BlockDrafter, load_block_draft,
                                           save_block_draft)
from inferbook.serving.config import EngineConfig, draft_slots_for
from inferbook.serving.engine import LLMEngine
from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights

CFG = TinyConfig(vocab=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn=64, max_seq=160)


@pytest.fixture(scope="module")
def target():
    return init_weights(TinyDecoder(CFG), seed=3).eval()


def make(target, k=4, markov=8, seed=0):
    torch.manual_seed(seed)
    d = BlockDraft(BlockDraftConfig(d_model=32, vocab=96, block=k, ffn=64, n_heads=4, n_kv_heads=2,
                                    markov_rank=markov, window=16), target)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return d.eval()


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_speculation_with_the_block_drafter_is_greedy(target, k):
    g = torch.Generator().manual_seed(k)
    prompts = torch.randint(96, (3, 20), generator=g).tolist()
    r = checks.greedy_speculation_matches(target, prompts, 12, k, drafter=BlockDrafter(make(target, k)))
    assert r["equal"], r


def test_picks_follow_the_markov_bias(target):
    """Each slot's pick is argmax(logits + W2 W1[previous pick]): recomputed here slot by slot. A huge
    bias towards token 5 after any token makes every pick 5 — a check that fails without the head."""
    d = make(target)
    B, C = 2, 6
    feats = torch.randn(B, C, 32)
    pos = torch.arange(C)[None].expand(B, -1)
    valid = torch.ones(B, C, dtype=torch.bool)
    anchor, apos = torch.tensor([3, 7]), torch.tensor([C, C])
    toks, conf, _ = d.draft(feats, pos, valid, anchor, apos)
    h, logits = d.backbone(feats, pos, valid, anchor, apos)
    prev = anchor
    for i in range(4):
        bias, _ = d.markov(prev)
        pick = (logits[:, i] + bias).argmax(-1)
        assert torch.equal(pick, toks[:, i])
        prev = pick
    assert conf.shape == (B, 4) and ((conf > 0) & (conf < 1)).all()
    with torch.no_grad():
        d.markov.markov_w2.weight.zero_()
        d.markov.markov_w2.weight[5] = 1e4
        d.markov.markov_w1.weight.copy_(torch.ones_like(d.markov.markov_w1.weight))
    assert (d.draft(feats, pos, valid, anchor, apos)[0] == 5).all()


def test_block_positions_see_each_other_not_only_the_past(target):
    """No causal mask inside the block: changing the last mask position's input changes slot 0."""
    d = make(target, markov=0)
    feats, pos = torch.randn(1, 4, 32), torch.arange(4)[None]
    valid = torch.ones(1, 4, dtype=torch.bool)
    a, _ = d.backbone(feats, pos, valid, torch.tensor([1]), torch.tensor([4]))
    with torch.no_grad():
        d.mask_embedding.add_(1.0)
    b, _ = d.backbone(feats, pos, valid, torch.tensor([1]), torch.tensor([4]))
    assert not torch.allclose(a[:, 0], b[:, 0])


def test_slots_and_engine_agree(target):
    d = BlockDrafter(make(target, 4))
    assert draft_slots_for(d.kind, 4) == 3
    with pytest.raises(UserError, match="draft slots"):
        LLMEngine(target, EngineConfig(max_num_batched_tokens=128, num_spec_tokens=4), drafter=d)


def test_save_load_strict(target, tmp_path):
    d = make(target)
    sha = save_block_draft(d, tmp_path / "b.safetensors")
    assert len(sha) == 64
    e = load_block_draft(tmp_path / "b.safetensors", target)
    for (n, p), (_, q) in zip(d.state_dict().items(), e.state_dict().items()):
        assert torch.equal(p, q), n
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(tmp_path / "bad.safetensors"), metadata={"format": "other"})
    with pytest.raises(UserError, match="not a block draft"):
        load_block_draft(tmp_path / "bad.safetensors", target)


def test_block_draft_loss_trains(target):
    """A few steps of `block_draft_loss` on synthetic hidden states lower it, and its confidence target
    is the cumulative greedy match (1 only while every earlier slot matched)."""
    from inferbook.serving.train import block_draft_loss

    torch.manual_seed(0)
    d = BlockDraft(BlockDraftConfig(d_model=32, vocab=96, block=4, ffn=64, n_heads=4, n_kv_heads=2, markov_rank=8,
                                    window=8), target)
    H = torch.randn(4, 40, 32)
    X = torch.randint(96, (4, 40))
    rows, anchors = torch.tensor([0, 1, 2, 3]), torch.tensor([9, 20, 3, 30])
    opt = torch.optim.Adam(d.parameters(), lr=1e-2)
    first = None
    for _ in range(15):
        loss, stats = block_draft_loss(d, H, X, rows, anchors)
        first = first if first is not None else float(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < first and 0 <= stats["match_rate"] <= 1


def test_committed_block_draft_is_exact_and_accepts_something():
    from pathlib import Path

    from inferbook.serving.model import load_weights

    root = Path(__file__).resolve().parents[1] / "data" / "models"
    tgt = load_weights(root / "dspark-target.safetensors", "cpu")
    d = load_block_draft(root / "dspark-block-draft.safetensors", tgt)
    prompts = [list(b"Q: 12 + 7 = ?\nA:"), list(b"def add(a, b):\n    return")]
    r = checks.greedy_speculation_matches(tgt, prompts, 16, d.cfg.block, drafter=BlockDrafter(d))
    assert r["equal"], r
    assert r["mean_acceptance_length"] > 1.0      # trained: better than nothing accepted


def test_confident_prefix_length_is_the_first_slot_under_the_threshold():
    from inferbook.serving.block_draft import confident_prefix_length

    conf = torch.tensor([[0.9, 0.8, 0.2, 0.9], [0.1, 0.9, 0.9, 0.9], [0.6, 0.6, 0.6, 0.6]])
    assert confident_prefix_length(conf, 0.5).tolist() == [2, 0, 4]
    assert confident_prefix_length(conf, 0.0).tolist() == [4, 4, 4]      # 0: no cut (DeepSpec's default)
    assert confident_prefix_length(conf, 0.95).tolist() == [0, 0, 0]


class _FixedConfidence(BlockDrafter):
    """The drafter with its confidences replaced by a fixed row (slot `cut` far below the rest)."""

    def __init__(self, draft, cut, **kw):
        super().__init__(draft, **kw)
        inner = draft.draft

        def draft_fn(*a, **k):
            toks, conf, probs = inner(*a, **k)
            fixed = torch.full_like(conf, 0.9)
            fixed[:, cut] = 0.05
            return toks, fixed, probs
        self.draft = type("D", (), {"draft": staticmethod(draft_fn), "cfg": draft.cfg,
                                    "embed_weight": draft.embed_weight})()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_engine_verifies_only_the_cut_block(target, temperature):
    """With the cut at slot 2 every round verifies anchor + 2 drafts: the verify forward runs 3 tokens, not
    1 + K, no round accepts more than 2, and greedy output is still plain greedy. Ignoring the cut (the
    engine verifying all K) fails every one of the length assertions."""
    from inferbook.serving.sequence import SamplingParams

    k, cut = 4, 2
    d = make(target, k)
    prompts = torch.randint(96, (2, 20), generator=torch.Generator().manual_seed(1)).tolist()
    cfg = EngineConfig(max_num_batched_tokens=128, max_num_seqs=1, num_spec_tokens=k,
                       draft_slots=draft_slots_for("parallel", k))
    drafter = _FixedConfidence(d, cut, confidence_threshold=0.5, temperature=temperature, seed=1)
    engine = LLMEngine(target, cfg, drafter=drafter)
    out = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=temperature, seed=2))
    acc = engine.acceptance
    assert acc.rounds > 0 and set(acc.proposed) == {cut}
    assert max(acc.accepted) <= cut and acc.reached()[cut:] == [0.0] * (k - cut)
    decode = [s for s in engine.steps if s.num_prefill_tokens == 0]
    assert decode and all(s.num_tokens == 1 + cut and s.cut_drafts == k - cut for s in decode)
    assert drafter.lengths_log and all(row == [cut] for row in drafter.lengths_log)
    if temperature == 0:
        ref = LLMEngine(target, EngineConfig(max_num_batched_tokens=128, max_num_seqs=1)).generate(
            prompts, SamplingParams(max_tokens=12))
        assert out == ref
    # a cut to zero drafts is a plain decode step
    zero = LLMEngine(target, cfg, drafter=_FixedConfidence(d, 0, confidence_threshold=0.5))
    z = zero.generate(prompts[:1], SamplingParams(max_tokens=6))
    assert set(zero.acceptance.proposed) == {0} and set(zero.acceptance.accepted) == {0}
    assert z == LLMEngine(target, EngineConfig(max_num_batched_tokens=128, max_num_seqs=1)).generate(
        prompts[:1], SamplingParams(max_tokens=6))


def test_threshold_is_checked():
    d = make(init_weights(TinyDecoder(CFG), seed=3).eval())
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(UserError, match="confidence_threshold"):
            BlockDrafter(d, confidence_threshold=bad)
