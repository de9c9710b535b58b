"""Hidden-state draft pipeline: corpora, shards written once, draft trained from the shards alone,
and a trained (or untrained) draft never changes greedy output."""
import pytest
import torch

from inferbook.errors import UserError
from inferbook.serving import corpora, train
from inferbook.serving.config import EngineConfig
from inferbook.serving.draft import DraftConfig, HiddenStateDraft, HiddenStateDrafter, load_draft
from inferbook.serving.engine import LLMEngine
from inferbook.serving.model import load_weights
from inferbook.serving.sequence import SamplingParams



def test_corpora_are_shipped_ascii_and_split():
    for task in corpora.TASKS:
        train_docs, test_docs = corpora.load_corpus(task, "train"), corpora.load_corpus(task, "test")
        assert len(train_docs) > 9 * len(test_docs) * 0.9 and test_docs
        assert max(corpora.encode(test_docs[0])) < corpora.VOCAB
    assert corpora.decode(corpora.encode("x = 1\n")) == "x = 1\n"
    with pytest.raises(ValueError, match="unknown task"):
        corpora.load_corpus("poetry")
    doc = corpora.make_math(3, seed=5)[0]
    answer = int(doc.rsplit(" ", 1)[1].rstrip("."))
    assert str(eval(doc.split("Q: ")[1].split(" = ?")[0])) == str(answer)   # left-to-right steps; '*' comes first


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    """A tiny target (a few steps), its hidden-state shards, and a draft trained from them via the CLI."""
    d = tmp_path_factory.mktemp("dspark")
    target = d / "target.safetensors"
    train.train_target(target, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn=64, max_seq=96, seq_len=32,
                       batch=6, steps=3, log=lambda *_: None)
    shards = d / "shards"
    train.main(["extract", "--target", str(target), "--shards", str(shards), "--windows-per-task", "4",
                "--seq-len", "32"])
    out = d / "draft.safetensors"
    train.main(["draft", "--target", str(target), "--shards", str(shards), "--out", str(out), "--steps", "3"])
    return target, shards, out


def test_shards_hold_the_targets_hidden_states(tiny_pipeline):
    target_path, shards, _ = tiny_pipeline
    H, X = train.load_shards(shards)
    assert H.shape[:2] == X.shape and H.shape[2] == 32 and len(H) == 12
    target = load_weights(target_path, "cpu").requires_grad_(False)
    k, v = target.new_cache(1)
    h = target.embed(X[:1])
    for j, layer in enumerate(target.layers):
        h = layer(h, torch.arange(X.shape[1]), target.cos, target.sin, k[j], v[j])
    ref = target.norm(h)[0]
    err = float((H[0] - ref).abs().max())
    assert err <= 2 * float(torch.finfo(torch.float16).eps) * float(ref.abs().max()) + 1e-3, err


@pytest.mark.parametrize("k", [2, 8])
def test_draft_proposals_and_greedy_equality(tiny_pipeline, k):
    target_path, _, draft_path = tiny_pipeline
    target = load_weights(target_path, "cpu")
    draft = load_draft(draft_path, target)
    g = torch.Generator().manual_seed(torch.randint(1 << 30, ()).item())
    prompts = torch.randint(256, (3, 20), generator=g).tolist()
    params = SamplingParams(max_tokens=30)
    plain = LLMEngine(target, EngineConfig(max_num_batched_tokens=128)).generate(prompts, params)
    engine = LLMEngine(target, EngineConfig(max_num_batched_tokens=128, max_num_seqs=4, num_spec_tokens=k),
                       drafter=HiddenStateDrafter(draft))
    assert engine.generate(prompts, params) == plain
    assert engine.acceptance.rounds > 0
    seqs = engine.finished[:2]
    toks, probs = HiddenStateDrafter(draft).propose(seqs, k, "cpu")
    assert toks.shape == (2, k) and probs is None        # greedy: one-hot, not materialised
    sampled, q = HiddenStateDrafter(draft, temperature=1.0, seed=3).propose(seqs, k, "cpu")
    assert sampled.shape == (2, k) and q.shape == (2, k, 256) and torch.allclose(q.sum(-1), torch.ones(2, k))


def test_sampled_proposals_follow_the_drafts_softmax_without_host_syncs(tiny_pipeline, monkeypatch):
    target_path, _, draft_path = tiny_pipeline
    target = load_weights(target_path, "cpu")
    draft = load_draft(draft_path, target)

    class Req:
        def __init__(self, h, last):
            self.draft_hidden, self.token_ids = h, [last]

    g = torch.Generator().manual_seed(torch.randint(1 << 30, ()).item())
    h = torch.randn(32, generator=g)
    n = 4000
    seqs = [Req(h, 7)] * n                                # the same state n times: n samples of position 1
    drafter = HiddenStateDrafter(draft, temperature=1.5, seed=1)
    for name in ("cpu", "item", "tolist", "numpy"):       # any of these inside propose would be a host sync
        def refuse(*a, _name=name, **kw):
            raise AssertionError(f"propose called Tensor.{_name}")
        monkeypatch.setattr(torch.Tensor, name, refuse)
    toks, q = drafter.propose(seqs, 2, "cpu")
    monkeypatch.undo()
    freq = torch.bincount(toks[:, 0], minlength=256).float() / n
    tv = 0.5 * float((freq - q[0, 0]).abs().sum())
    # total variation of n samples from the true distribution: about sqrt(support / n) / 2 at most
    support = int((q[0, 0] > 1e-4).sum())
    assert tv <= 1.5 * (support / n) ** 0.5 / 2 + 0.01, (tv, support)
    assert torch.equal(q[0, 0], q[-1, 0])                 # position 1 sees the same state in every row


def test_draft_must_fit_target(tiny_pipeline):
    target = load_weights(tiny_pipeline[0], "cpu")
    with pytest.raises(UserError, match="does not fit"):
        HiddenStateDraft(DraftConfig(d_model=48, vocab=256), target)
    with pytest.raises(UserError, match="n_layers"):
        DraftConfig(d_model=32, vocab=256, n_layers=6)


def test_exponential_race_draws_from_the_distribution():
    from inferbook.serving.sampler import exponential_race_sample

    g = torch.Generator().manual_seed(torch.randint(1 << 30, ()).item())
    p = torch.softmax(torch.randn(6, generator=g), -1)
    n = 40000
    toks = exponential_race_sample(p.expand(n, 6), torch.Generator().manual_seed(1))
    freq = torch.bincount(toks, minlength=6).float() / n
    assert 0.5 * float((freq - p).abs().sum()) < 0.02   # uniform noise instead of Exp(1) gives ~0.07


def test_the_draft_reads_several_target_layers_and_the_runner_hands_them_over(tiny_pipeline):
    target_path, shards, draft_path = tiny_pipeline
    target = load_weights(target_path, "cpu").requires_grad_(False)
    draft = load_draft(draft_path, target)
    assert draft.cfg.layers_read == (1, 2) and draft.cfg.n_features == 2      # low and last of a 2-layer target
    features, layers = train.load_features(shards)
    H, X = train.load_shards(shards)
    assert layers == "1,2" and features.shape[-1] == 2 * 32
    assert torch.equal(features[..., 32:], H)                                 # the last part is the final hidden
    # the engine's runner returns the same features as a dense forward, at the rows it returns
    from inferbook.serving.model_runner import ModelRunner
    runner = ModelRunner(target, num_blocks=8, block_size=16)
    runner.feature_layers = (1, 2)
    prompt = X[0, :20].tolist()
    _, got = runner.forward(runner.prepare([(prompt, 0, list(range(8)), False)]))
    k, v = target.new_cache(1)
    h = target.embed(torch.tensor([prompt]))
    outs = []
    for j, layer in enumerate(target.layers):
        h = layer(h, torch.arange(20), target.cos, target.sin, k[j], v[j])
        outs.append(h)
    ref = torch.cat([outs[0][0, -1], target.norm(outs[1])[0, -1]])
    assert got.shape == (1, 64)
    assert float((got[0] - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max()))
    # the shards (fp16) hold the same features for that window
    assert float((features[0, 19] - ref).abs().max()) <= 2e-3 * max(1.0, float(ref.abs().max()))
