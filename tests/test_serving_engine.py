"""The engine: paged KV == dense forward, chunked == unchunked, the budget is never exceeded,
both speculative reservations, prefix caching, greedy speculation == greedy, bad input."""
import pytest
import torch

from inferbook.errors import UserError
from inferbook.serving.block_manager import BlockManager
from inferbook.serving.config import EngineConfig
from inferbook.serving.engine import LLMEngine
from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights, reference_logits
from inferbook.serving.model_runner import ModelRunner
from inferbook.serving.sequence import SamplingParams



CFG = TinyConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, max_seq=192)


@pytest.fixture(scope="module")
def model():
    return init_weights(TinyDecoder(CFG), seed=torch.randint(1 << 30, ()).item()).eval()


def prompts(lengths, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else torch.randint(1 << 30, ()).item())
    return [torch.randint(CFG.vocab, (n,), generator=g).tolist() for n in lengths]


LENGTHS = (1, 17, 50, 16, 113, 33)


@pytest.mark.parametrize("chunks", [(113,), (16, 97), (1, 50, 62), (37, 37, 39)], ids=lambda c: "-".join(map(str, c)))
def test_paged_forward_matches_dense(model, chunks):
    """Logits of a prompt computed in chunks through shuffled pages vs one dense forward.
    Tolerance: twice the dense fp32 forward's own error against a float64 forward."""
    tokens = prompts([sum(chunks)])[0]
    bs = 16
    num_blocks = 20
    runner = ModelRunner(model, num_blocks, bs)
    table = torch.randperm(num_blocks)[: -(-len(tokens) // bs)].tolist()   # non-contiguous pages
    rows, start = [], 0
    for n in chunks:
        batch = runner.prepare([(tokens[start:start + n], start, table, True)])
        logits, _ = runner.forward(batch)
        rows.append(logits)
        start += n
    paged = torch.cat(rows)
    t = torch.tensor([tokens])
    dense = reference_logits(model, t)[0]
    exact = reference_logits(_double(model), t)[0]
    ref_err = float((dense.double() - exact).abs().max())
    err = float((paged.double() - exact).abs().max())
    assert torch.isfinite(paged).all()
    assert err <= 2 * ref_err + 1e-6 * float(exact.abs().max()), (err, ref_err)


def _double(model):
    m = TinyDecoder(CFG).double().eval()
    m.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return m


def run(model, ps, params=SamplingParams(max_tokens=20), **cfg):
    engine = LLMEngine(model, EngineConfig(**cfg))
    return engine.generate(ps, params), engine


def test_greedy_matches_dense_generation(model):
    p = prompts([23])[0]
    out, _ = run(model, [p], max_num_batched_tokens=64)
    x = torch.tensor([p])
    ref = []
    for _ in range(20):
        t = int(reference_logits(model, x)[0, -1].argmax())
        ref.append(t)
        x = torch.cat([x, torch.tensor([[t]])], 1)
    assert out[0] == ref


@pytest.mark.parametrize("budget,seqs", [(16, 2), (40, 3), (128, 8)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chunked_prefill_same_tokens(model, budget, seqs, temperature):
    ps = prompts(LENGTHS)
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=5)
    ref, _ = run(model, ps, params, max_num_batched_tokens=256, max_num_seqs=8, chunked_prefill=False)
    out, engine = run(model, ps, params, max_num_batched_tokens=budget, max_num_seqs=seqs)
    assert out == ref
    assert any(s.num_prefill_tokens and s.num_prefill_tokens < 113 for s in engine.steps)
    assert max(len(o) for o in out) == 12


class SlotDrafter:
    """Repeats the last token k times and declares `slots` draft slots: the budget test's drafter."""

    def __init__(self, vocab):
        self.vocab = vocab

    def propose(self, seqs, k, device):
        return torch.tensor([[s.token_ids[-1]] * k for s in seqs]), None


@pytest.mark.parametrize("policy", ["static", "adaptive", "decode-only"])
@pytest.mark.parametrize("k,slots", [(1, 0), (4, 0), (4, 3), (8, 7), (8, 8)])
def test_budget_never_exceeded_and_reservation(model, policy, k, slots):
    max_seqs, budget = 4, 4 * 9 + 4 * 8 + 7
    ps = prompts((5, 60, 31, 2, 47, 16, 90))
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, num_spec_tokens=k,
                                           spec_budget=policy, draft_slots=slots), drafter=SlotDrafter(CFG.vocab))
    out = engine.generate(ps, SamplingParams(max_tokens=9))
    assert all(len(o) == 9 for o in out)
    for s in engine.steps:
        if policy == "static":
            assert s.reserved == max_seqs * slots
            assert s.num_tokens <= budget - max_seqs * slots
        elif policy == "adaptive":   # every scheduled request is charged its slots
            assert s.reserved == s.num_scheduled * slots
            assert s.num_tokens + s.reserved <= budget
        else:                        # FastDeploy: decodes paid from num_decoding x (1 + k)
            assert s.reserved == s.num_decode * (1 + k)
            assert s.num_prefill_tokens <= budget - s.reserved
            assert s.num_tokens <= budget


def test_static_reservation_splits_a_prefill_that_adaptive_keeps_whole(model):
    p = prompts([100])
    # parallel drafter, k=2: 1 slot per request; static holds back 8 x 1 -> 96 < 100, adaptive 1 -> 103
    kw = dict(max_num_batched_tokens=104, max_num_seqs=8, num_spec_tokens=2, draft_slots=1)
    static = LLMEngine(model, EngineConfig(spec_budget="static", **kw), drafter=SlotDrafter(CFG.vocab))
    adaptive = LLMEngine(model, EngineConfig(spec_budget="adaptive", **kw), drafter=SlotDrafter(CFG.vocab))
    static.generate(p, SamplingParams(max_tokens=4))
    adaptive.generate(p, SamplingParams(max_tokens=4))
    assert static.finished[0].num_prefill_chunks == 2
    assert adaptive.finished[0].num_prefill_chunks == 1


def test_ngram_static_equals_adaptive(model):
    """vLLM reserves nothing for an n-gram drafter (0 slots): #51725 changes nothing for it."""
    p = prompts([100, 30])
    kw = dict(max_num_batched_tokens=104, max_num_seqs=8, num_spec_tokens=2)
    a = LLMEngine(model, EngineConfig(spec_budget="static", **kw))
    b = LLMEngine(model, EngineConfig(spec_budget="adaptive", **kw))
    assert a.generate(p, SamplingParams(max_tokens=6)) == b.generate(p, SamplingParams(max_tokens=6))
    assert [(s.num_tokens, s.reserved) for s in a.steps] == [(s.num_tokens, s.reserved) for s in b.steps]
    assert all(s.reserved == 0 for s in a.steps)


def test_drafter_kind_must_match_the_slots(model):
    with pytest.raises(UserError, match="draft slots"):
        LLMEngine(model, EngineConfig(max_num_batched_tokens=104, num_spec_tokens=2, draft_slots=1))


class RandomDrafter:
    """A deliberately poor draft: random tokens (one-hot). Greedy output must not change."""

    def __init__(self, vocab, seed):
        self.vocab, self.g = vocab, torch.Generator().manual_seed(seed)

    def propose(self, seqs, k, device):
        t = torch.randint(self.vocab, (len(seqs), k), generator=self.g)
        return t, torch.nn.functional.one_hot(t, self.vocab).float()


class OracleDrafter(RandomDrafter):
    """Proposes the target's own greedy continuation (from a reference run): all accepted."""

    def __init__(self, vocab, outputs):
        self.vocab, self.outputs = vocab, outputs

    def propose(self, seqs, k, device):
        rows = []
        for s in seqs:
            ref = self.outputs[tuple(s.prompt)]
            done = len(s.output_ids)
            cont = ref[done:done + k]
            rows.append(cont + [0] * (k - len(cont)))
        t = torch.tensor(rows)
        return t, torch.nn.functional.one_hot(t, self.vocab).float()


@pytest.mark.parametrize("drafter", ["ngram", "random", "oracle"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculative_equals_greedy(model, drafter, k):
    ps = prompts((9, 40, 70, 3))
    params = SamplingParams(max_tokens=24)
    ref, _ = run(model, ps, params, max_num_batched_tokens=256)
    d = {"ngram": None, "random": RandomDrafter(CFG.vocab, 3),
         "oracle": OracleDrafter(CFG.vocab, {tuple(p): o for p, o in zip(ps, ref)})}[drafter]
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=256, num_spec_tokens=k), drafter=d)
    out = engine.generate(ps, params)
    assert out == ref
    if drafter == "oracle":
        # every round accepts all k, except where max_tokens cut a request's last round short
        acc = engine.acceptance.accepted
        assert sum(a == k for a in acc) >= len(acc) - len(ps)
    if drafter == "random":
        assert engine.acceptance.mean_acceptance_length() < 1.2


def test_prefix_caching_reuses_blocks_and_keeps_tokens(model):
    shared = prompts([70])[0]
    ps = [shared + prompts([n])[0] for n in (5, 20, 1)]
    ref, _ = run(model, ps, max_num_batched_tokens=128)
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=128, max_num_seqs=1, enable_prefix_caching=True))
    out = engine.generate(ps, SamplingParams(max_tokens=20))
    assert out == ref
    cached = [s.num_cached_tokens for s in engine.finished]
    assert cached[0] == 0 and cached[1] == 64 and cached[2] == 64


def test_block_manager_refcounts_and_eviction():
    from inferbook.serving.sequence import Sequence

    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = Sequence(list(range(10)), SamplingParams(max_tokens=2))
    bm.allocate(a, 12)
    a.num_computed_tokens = 10
    bm.register_computed(a)
    b = Sequence(list(range(9)) + [99], SamplingParams(max_tokens=2))
    assert bm.allocate(b, 12) == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.ref_count[a.block_table[0]] == 2 and bm.num_free == 6 - 3 - 1
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 6 and all(r == 0 for r in bm.ref_count)


@pytest.mark.parametrize("case", ["too_long", "budget_below_block", "k9", "k_neg", "vocab", "bad_token", "no_chunk_fit",
                                  "bad_policy"])
def test_bad_input_is_a_clear_error(model, case):
    with pytest.raises(UserError) as e:
        if case == "too_long":
            LLMEngine(model).add_request([1] * 190, SamplingParams(max_tokens=8))
        elif case == "budget_below_block":
            EngineConfig(max_num_batched_tokens=8)
        elif case == "k9":
            EngineConfig(num_spec_tokens=9)
        elif case == "k_neg":
            EngineConfig(num_spec_tokens=-1)
        elif case == "vocab":
            LLMEngine(model, EngineConfig(num_spec_tokens=2), drafter=RandomDrafter(CFG.vocab + 1, 0))
        elif case == "bad_token":
            LLMEngine(model).add_request([CFG.vocab])
        elif case == "no_chunk_fit":
            LLMEngine(model, EngineConfig(max_num_batched_tokens=32, chunked_prefill=False)).add_request([1] * 40)
        elif case == "bad_policy":
            EngineConfig(spec_budget="greedy")
    msg = str(e.value)
    assert any(w in msg for w in ("exceeds the model's context", "smaller than one KV block", "k=", "vocabulary",
                                  "lie in", "chunked prefill off", "choose"))
