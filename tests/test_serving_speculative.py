"""rejection_sample is exact: its tokens follow the target distribution, whatever the draft."""
import pytest
import torch

from inferbook.errors import UserError
from inferbook.serving.speculative import AcceptanceStats, leviathan_expected_length, rejection_sample



# chi-square critical values at significance 1e-4 (df = V - 1), so a correct sampler
# fails with probability 1e-4 per check; the seed is fixed, so the test is deterministic.
CHI2_CRIT_1E4 = {5: 25.74, 7: 29.88}


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def random_dists(rows, V, gen, sharpness=1.0):
    """Random distributions [rows, V] from the test's own generator (fixed seed: deterministic)."""
    w = (-torch.rand(rows, V, generator=gen).log()) ** sharpness
    return w / w.sum(-1, keepdim=True)


def correct_and_naive(p, q, n, k, gen):
    """Run rejection_sample on n rows sharing per-position p [k+1, V] and q [k, V]."""
    V = p.shape[-1]
    draft = torch.multinomial(q, n, replacement=True, generator=gen).T.contiguous()   # [n, k] from q
    target = p[None].expand(n, k + 1, V)
    draft_p = q[None].expand(n, k, V)
    return rejection_sample(target, draft_p, draft, gen), draft


@pytest.mark.parametrize("V,k", [(6, 3), (8, 1)])
def test_output_distribution_is_target(V, k):
    gen = torch.Generator().manual_seed(1234 + V)
    p = random_dists(k + 1, V, gen)
    q = random_dists(k, V, gen, sharpness=2.0)
    n = 60_000
    (tokens, acc), draft = correct_and_naive(p, q, n, k, gen)
    assert tokens.shape == (n, k + 1) and acc.shape == (n,)
    assert int(acc.min()) >= 0 and int(acc.max()) <= k
    # exactly acc + 1 valid tokens per row, the first acc of them the draft's
    valid = tokens >= 0
    assert torch.equal(valid.sum(1), acc + 1)
    for i in range(k):
        rows = acc > i
        assert torch.equal(tokens[rows, i], draft[rows, i])
    # the token emitted at position i (given the round reached it) is distributed as p_i
    crit = CHI2_CRIT_1E4[V - 1]
    for i in range(k + 1):
        rows = acc >= i
        assert int(rows.sum()) > 1000
        stat = chi2(tokens[rows, i], p[i])
        assert stat < crit, f"position {i}: chi2 {stat:.1f} >= {crit} (not the target distribution)"
    # negative control: the draft's own tokens do not follow p, and the test notices
    assert chi2(draft[:, 0], p[0]) > crit


def test_naive_resampling_is_detected():
    """Sampling from p (not the residual p - q) after a rejection biases the output: the same check fails."""
    V, k, n = 6, 1, 60_000
    gen = torch.Generator().manual_seed(7)
    p = random_dists(k + 1, V, gen)
    q = random_dists(k, V, gen, sharpness=2.0)
    (tokens, acc), draft = correct_and_naive(p, q, n, k, gen)
    naive = tokens[:, 0].clone()
    rejected = acc == 0
    naive[rejected] = torch.multinomial(p[0], int(rejected.sum()), replacement=True, generator=gen)
    assert chi2(naive, p[0]) > CHI2_CRIT_1E4[V - 1]
    assert chi2(tokens[:, 0], p[0]) < CHI2_CRIT_1E4[V - 1]


def test_greedy_is_prefix_match_then_argmax():
    V, k = 11, 5
    target_tok = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7]])
    draft_tok = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 9, 4, 5], [0, 7, 7, 7, 7]])
    target = torch.nn.functional.one_hot(target_tok, V).float()
    draft = torch.nn.functional.one_hot(draft_tok, V).float()
    tokens, acc = rejection_sample(target, draft, draft_tok, torch.Generator().manual_seed(0))
    assert acc.tolist() == [5, 2, 0]
    assert tokens.tolist() == [[1, 2, 3, 4, 5, 6], [1, 2, 3, -1, -1, -1], [7, -1, -1, -1, -1, -1]]


@pytest.mark.parametrize("bad", ["k0", "k9", "vocab", "shape", "range"])
def test_bad_input(bad):
    n, k, V = 2, 3, 5
    t, d, x = torch.rand(n, k + 1, V), torch.rand(n, k, V), torch.zeros(n, k, dtype=torch.long)
    if bad == "k0":
        t, d, x = torch.rand(n, 1, V), torch.rand(n, 0, V), torch.zeros(n, 0, dtype=torch.long)
    elif bad == "k9":
        t, d, x = torch.rand(n, 10, V), torch.rand(n, 9, V), torch.zeros(n, 9, dtype=torch.long)
    elif bad == "vocab":
        d = torch.rand(n, k, V + 1)
    elif bad == "shape":
        t = torch.rand(n, k, V)
    elif bad == "range":
        x[0, 0] = V
    with pytest.raises(UserError, match=r"k=|vocabulary|shapes|lie in"):
        rejection_sample(t, d, x)


def test_acceptance_stats_named_apart():
    s = AcceptanceStats(k=3)
    s.add([0, 1, 3, 3])
    assert s.mean_acceptance_length() == pytest.approx(1 + 7 / 4)
    assert s.cumulative() == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert s.conditional() == pytest.approx([3 / 4, 2 / 3, 2 / 2])
    assert s.alpha() == pytest.approx(7 / (1 + 2 + 3 + 3))
    assert leviathan_expected_length(0.0, 8) == 1.0
    assert leviathan_expected_length(1.0, 8) == 9.0
    assert leviathan_expected_length(0.5, 2) == pytest.approx(1.75)


def test_engine_speculative_sampling_matches_plain_sampling():
    """At temperature 1, the engine's (token 1, token 2) pairs with a random-token draft follow the same
    distribution as plain sampling: a two-sample chi-square over the 64 pairs of an 8-token vocabulary."""
    from inferbook.serving.config import EngineConfig
    from inferbook.serving.engine import LLMEngine
    from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights
    from inferbook.serving.sequence import SamplingParams

    class RandomDraft:
        vocab = 8

        def __init__(self):
            self.g = torch.Generator().manual_seed(11)

        def propose(self, seqs, k, device):
            q = random_dists(len(seqs) * k, 8, self.g).view(len(seqs), k, 8)
            t = torch.multinomial(q.view(-1, 8), 1, generator=self.g).view(len(seqs), k)
            return t, q

    cfg = TinyConfig(vocab=8, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn=32, max_seq=16)
    model = init_weights(TinyDecoder(cfg), 3).eval()
    n = 4000

    def pairs(spec: bool, offset: int):
        ecfg = EngineConfig(max_num_seqs=1000, max_num_batched_tokens=8000, num_spec_tokens=3 if spec else 0)
        engine = LLMEngine(model, ecfg, drafter=RandomDraft() if spec else None)
        outs = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=1.0, seed=offset + i))
                for i in range(n)]
        while engine.has_unfinished():
            engine.step()
        return torch.tensor([s.output_ids[0] * 8 + s.output_ids[1] for s in outs])

    a, b = pairs(False, 0), pairs(True, 10 * n)
    ca, cb = torch.bincount(a, minlength=64).double(), torch.bincount(b, minlength=64).double()
    keep = (ca + cb) >= 10
    expected = (ca + cb)[keep] / 2
    stat = float((((ca[keep] - expected) ** 2 + (cb[keep] - expected) ** 2) / expected).sum())
    df = int(keep.sum()) - 1
    z = 3.719  # one-sided 1e-4; Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    assert stat < crit, (stat, crit, df)
