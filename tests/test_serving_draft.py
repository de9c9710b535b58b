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


class _Req:
    """What the drafter reads of a request: its tokens and the target's features of its new rows."""

    def __init__(self, token_ids, rows):
        self.token_ids, self.draft_hidden_rows = list(token_ids), rows
        self.draft_hidden = rows[-1]


def _random_draft(tiny_pipeline, n_layers=2, token_input="eagle3"):
    target = load_weights(tiny_pipeline[0], "cpu")
    torch.manual_seed(torch.randint(1 << 30, ()).item())
    cfg = DraftConfig(d_model=32, vocab=256, n_layers=n_layers, ffn=64, n_heads=2, n_kv_heads=1, feature_layers="1,2",
                      token_input=token_input)
    return HiddenStateDraft(cfg, target).eval(), target


def _rounds(drafter, k, g):
    """Three draft/verify rounds for two requests, accepting 2 then k (all) then 0 of request 0's
    drafts and 0, 1, k - 1 of request 1's; the target's features are random, as the target is not run.
    -> (the requests, every feature row each was handed since its first round, last q)."""
    reqs = [_Req(torch.randint(256, (11,), generator=g).tolist(), torch.randn(1, 64, generator=g)),
            _Req(torch.randint(256, (5,), generator=g).tolist(), torch.randn(1, 64, generator=g))]
    history = [[r.draft_hidden_rows] for r in reqs]
    for accepted in ([2, 0], [k, 1], [0, k - 1]):
        toks, _ = drafter.propose(reqs, k, "cpu")
        for r, hist, a, t in zip(reqs, history, accepted, toks.tolist()):
            r.token_ids += t[:a] + [int(torch.randint(256, (), generator=g))]       # accepted drafts + bonus
            r.draft_hidden_rows = torch.randn(a + 1, 64, generator=g)
            hist.append(r.draft_hidden_rows)
    drafter.generator = None                       # the same sampling noise as a fresh drafter's first call
    return reqs, history, drafter.propose(reqs, k, "cpu")


@pytest.mark.parametrize("token_input", ["eagle3", "eagle1"])
def test_draft_kv_cache_rolls_back_to_the_accepted_prefix(tiny_pipeline, monkeypatch, token_input):
    """After rounds of drafting and (partial) acceptance, the proposals equal those of a fresh drafter
    that enters the whole accepted prefix at once: the drafted entries were rolled back and the
    accepted positions entered from the target's features. Without the rollback they differ."""
    from inferbook.serving.draft import DraftKVCache

    draft, _ = _random_draft(tiny_pipeline, token_input=token_input)
    k, seed = 4, torch.randint(1 << 30, ()).item()
    reqs, history, (toks, q) = _rounds(HiddenStateDrafter(draft, temperature=1.0, seed=5), k,
                                       torch.Generator().manual_seed(seed))
    fresh = [_Req(r.token_ids, torch.cat(h)) for r, h in zip(reqs, history)]
    ref_toks, ref_q = HiddenStateDrafter(draft, temperature=1.0, seed=5).propose(fresh, k, "cpu")
    assert torch.equal(toks, ref_toks)
    assert float((q - ref_q).abs().max()) <= 1e-5, float((q - ref_q).abs().max())
    # the same rounds with the rollback skipped: stale drafted entries stay in the cache
    monkeypatch.setattr(DraftKVCache, "truncate", lambda self, end: None)
    _, _, (_, q_stale) = _rounds(HiddenStateDrafter(draft, temperature=1.0, seed=5), k,
                                 torch.Generator().manual_seed(seed))
    assert float((q_stale - ref_q).abs().max()) > 1e-3


@pytest.mark.parametrize("token_input", ["eagle3", "eagle1"])
@torch.no_grad()
def test_draft_attends_to_its_earlier_positions_causally(tiny_pipeline, token_input):
    draft, _ = _random_draft(tiny_pipeline, n_layers=2, token_input=token_input)
    g = torch.Generator().manual_seed(torch.randint(1 << 30, ()).item())
    h, x, pos = torch.randn(1, 6, 64, generator=g), torch.randint(256, (1, 6), generator=g), torch.arange(3, 9)[None]
    out, logits, kv = draft(h, x, pos)
    h2 = h.clone()
    h2[0, 2] += 1.0
    out2, logits2, _ = draft(h2, x, pos)
    assert torch.equal(logits[0, :2], logits2[0, :2])                     # earlier positions: untouched
    assert float((logits[0, 3:] - logits2[0, 3:]).abs().max()) > 1e-4     # later positions read position 2
    # entering the last position against the cache of the first five gives the same output
    past = [(k_[:, :, :5], v_[:, :, :5]) for k_, v_ in kv]
    out_step, logits_step, _ = draft(h[:, 5:], x[:, 5:], pos[:, 5:], past)
    assert float((logits_step[0, 0] - logits[0, 5]).abs().max()) <= 1e-4
    assert sum(p.numel() for p in draft.parameters()) == draft.cfg.n_params()


def test_an_old_format_draft_is_refused_by_name(tiny_pipeline, tmp_path):
    from safetensors.torch import save_file

    old = tmp_path / "old-draft.safetensors"
    save_file({"fc.weight": torch.randn(32, 64), "blocks.0.w_gate.weight": torch.randn(64, 32),
               "norm.weight": torch.ones(32)}, str(old),
              metadata={"d_model": "32", "vocab": "256", "n_layers": "1", "ffn": "64"})
    target = load_weights(tiny_pipeline[0], "cpu")
    with pytest.raises(UserError, match=r"no draft_format.*blocks\.0\.w_gate\.weight, fc\.weight.*MLP-only"):
        load_draft(old, target)
    # a current-format draft with a tensor renamed is refused by strict loading, naming it
    from safetensors import safe_open

    current = tiny_pipeline[2]
    with safe_open(str(current), framework="pt") as f:
        meta, state = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    state["layers.0.self_attn.q_proj.wrong"] = state.pop("layers.0.self_attn.q_proj.weight")
    renamed = tmp_path / "renamed.safetensors"
    save_file(state, str(renamed), metadata=meta)
    with pytest.raises(UserError, match="missing tensors: layers.0.self_attn.q_proj.weight"):
        load_draft(renamed, target)


@torch.no_grad()
def test_the_drafter_computes_what_the_training_time_test_trained(tiny_pipeline):
    """The drafter's path at inference (one causal pass over the accepted rows, then drafted positions
    against its cache) gives the distributions the training-time-test forward computes for that chain."""
    target_path, shards, draft_path = tiny_pipeline
    target = load_weights(target_path, "cpu")
    draft = load_draft(draft_path, target)
    H, X = train.load_shards(shards)
    feats, _ = train.load_features(shards)
    r = int(torch.randint(len(X), ()))
    S, k, temp = 20, 3, 1.3
    req = _Req(X[r, :S + 1].tolist(), feats[r, :S])     # tokens at 0..S; features at 0..S-1
    toks, q = HiddenStateDrafter(draft, temperature=temp, seed=2).propose([req], k, "cpu")
    x = torch.cat([X[r, 1:S + 1], toks[0, :k - 1]])[None]   # chain S-1 continues with the drafted tokens
    outs = train.training_time_test(draft, feats[r, :S][None], x, torch.arange(1, S + 1)[None], k)
    for j, (_, logits) in enumerate(outs):
        ref = torch.softmax(logits[0, S - 1] / temp, -1)
        assert float((q[0, j] - ref).abs().max()) <= 1e-5, (j, float((q[0, j] - ref).abs().max()))


def test_the_engine_hands_over_the_features_of_every_accepted_position():
    """At every round, each request's `draft_hidden_rows` are the target's features at the positions
    before the tokens the drafter enters (the last step's new tokens), as a dense forward gives them;
    with the committed (trained) models, so that rounds accept drafts and hand over several rows."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "data" / "models"
    target = load_weights(root / "dspark-target.safetensors", "cpu").requires_grad_(False)
    draft = load_draft(root / "dspark-draft-small.safetensors", target)
    read = draft.cfg.layers_read

    def dense_features(tokens):
        k, v = target.new_cache(1)
        h = target.embed(torch.tensor([tokens]))
        outs = []
        for j, layer in enumerate(target.layers):
            h = layer(h, torch.arange(len(tokens)), target.cos, target.sin, k[j], v[j])
            outs.append(h[0])
        return torch.cat([outs[i - 1] for i in read[:-1]] + [target.norm(outs[-1])], dim=-1)

    checked = []

    class Checking(HiddenStateDrafter):
        def propose(self, seqs, k, device):
            for s in seqs:
                rows, n = s.draft_hidden_rows, len(s.token_ids)
                ref = dense_features(s.token_ids[:-1])[n - 1 - rows.shape[0]:]
                assert rows.shape == ref.shape
                assert float((rows - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max()))
                checked.append(rows.shape[0])
            return super().propose(seqs, k, device)

    prompts = [corpora.encode(d[:d.index("\nA:") + 3]) for d in corpora.load_corpus("math", "test")[:2]]
    engine = LLMEngine(target, EngineConfig(max_num_batched_tokens=256, max_num_seqs=2, num_spec_tokens=4),
                       drafter=Checking(draft))
    with torch.no_grad():
        engine.generate(prompts, SamplingParams(max_tokens=24))
    assert max(checked) > 1, checked          # some rounds accepted drafts: several rows entered at once
