"""Speculative decoding: a draft proposes k tokens, the target verifies them in one forward.

`rejection_sample` is the exact rule of Leviathan et al. (2023) and Chen et al. (2023):
accept draft token x at position i with probability min(1, p_i(x) / q_i(x)); at the first
rejection sample from the residual norm(max(0, p_i - q_i)); if all k are accepted, sample a
bonus token from p_k. The tokens it emits are distributed exactly as the target's own
samples, whatever the draft. With greedy target and draft (one-hot p and q) it reduces to
"keep the draft tokens while they equal the target's argmax, then take the target's argmax".

Acceptance is reported two ways, named apart:
- cumulative: P(accepted >= i), the share of rounds whose first i draft tokens all passed;
- conditional: P(accepted >= i | accepted >= i-1), the per-position pass rate;
and the mean acceptance length: tokens emitted per verification round (accepted + 1).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from .config import check_spec_tokens


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify k draft tokens for n requests.

    target_probs [n, k+1, V] (the target at each draft position, plus the bonus position),
    draft_probs [n, k, V] or None for a deterministic draft (one-hot q, as vLLM's rejection sampler
    takes `draft_probs=None` for n-gram proposals; no [n, k, V] tensor is built), draft_tokens [n, k] int64 ->
    (tokens [n, k+1] int64: accepted drafts then one target token, padded with -1; num_accepted [n]).
    """
    one_hot = draft_probs is None
    if target_probs.dim() != 3 or (not one_hot and draft_probs.dim() != 3) or draft_tokens.dim() != 2:
        raise UserError(f"expected target_probs [n, k+1, V], draft_probs [n, k, V] or None, draft_tokens [n, k]; "
                        f"got shapes {tuple(target_probs.shape)}, "
                        f"{None if one_hot else tuple(draft_probs.shape)}, {tuple(draft_tokens.shape)}")
    n, k = draft_tokens.shape
    check_spec_tokens(k)
    V = target_probs.shape[-1]
    draft_shape = (n, k, V) if one_hot else tuple(draft_probs.shape)
    if draft_shape[-1] != V:
        raise UserError(f"draft vocabulary ({draft_shape[-1]}) differs from the target's ({V})")
    if tuple(target_probs.shape) != (n, k + 1, V) or draft_shape != (n, k, V):
        raise UserError(f"shapes disagree: target_probs {tuple(target_probs.shape)} should be {(n, k + 1, V)}, "
                        f"draft_probs {draft_shape} should be {(n, k, V)}")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise UserError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    if n and (int(draft_tokens.min()) < 0 or int(draft_tokens.max()) >= V):
        raise UserError(f"draft_tokens must lie in [0, {V}); got values from {int(draft_tokens.min())} "
                        f"to {int(draft_tokens.max())}")
    device = target_probs.device
    draft_tokens = draft_tokens.long()
    idx = draft_tokens.unsqueeze(-1)
    p = target_probs[:, :k].gather(-1, idx).squeeze(-1).float()       # [n, k] p_i(x_i)
    q = (torch.ones(n, k, device=device) if one_hot
         else draft_probs.gather(-1, idx).squeeze(-1).float())          # [n, k] q_i(x_i)
    u = torch.rand(n, k, generator=generator, device=generator.device if generator is not None else device).to(device)
    accept = u * q < p                       # P(u < p/q) = min(1, p/q); q = 0 < p accepts, p = 0 rejects
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)             # [n] in 0..k
    rows = torch.arange(n, device=device)
    p_next = target_probs[rows, num_accepted].float()                  # [n, V]
    if one_hot:   # q_next is one-hot at the rejected draft token (zero at the bonus position)
        # zero p at the rejected draft token; rows that accepted all k keep p (no boolean indexing:
        # no host sync on a GPU)
        at = draft_tokens.gather(1, num_accepted.clamp_max(k - 1)[:, None])          # [n, 1]
        keep = (num_accepted >= k)[:, None].to(p_next.dtype)
        residual = p_next.scatter(1, at, p_next.gather(1, at) * keep)
    else:
        q_next = torch.nn.functional.pad(draft_probs, (0, 0, 0, 1))[rows, num_accepted].float()  # 0 at the bonus position
        residual = (p_next - q_next).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # mass == 0 only if p == q, where a rejection has probability 0; fall back to p for safety
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    gen_dev = generator.device if generator is not None else device
    extra = torch.multinomial(residual.to(gen_dev), 1, generator=generator).squeeze(-1).to(device)
    positions = torch.arange(k + 1, device=device)
    tokens = torch.full((n, k + 1), -1, dtype=torch.long, device=device)
    tokens[:, :k] = torch.where(positions[None, :k] < num_accepted[:, None], draft_tokens, -1)
    tokens[rows, num_accepted] = extra
    return tokens, num_accepted


def leviathan_expected_length(alpha: float, k: int) -> float:
    """Expected tokens per round when each draft token passes independently with rate alpha:
    (1 - alpha^(k+1)) / (1 - alpha)  (Leviathan et al., 2023, eq. 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class AcceptanceStats:
    """Accepted draft tokens per verification round, and the rates derived from them."""

    k: int
    accepted: list[int] = field(default_factory=list)
    # drafts put to verification per round: k, or fewer where a drafter cut its block (DSpark's
    # confidence head); a round can only accept what it verified
    proposed: list[int] = field(default_factory=list)

    def add(self, num_accepted, proposed=None) -> None:
        num_accepted = [int(a) for a in num_accepted]
        proposed = [self.k] * len(num_accepted) if proposed is None else [int(p) for p in proposed]
        if len(proposed) != len(num_accepted) or any(not 0 <= a <= p <= self.k for a, p in zip(num_accepted, proposed)):
            raise ValueError(f"accepted {num_accepted} must lie in 0..proposed {proposed} (<= k = {self.k})")
        self.accepted.extend(num_accepted)
        self.proposed.extend(proposed)

    def clear(self) -> None:
        self.accepted.clear()
        self.proposed.clear()

    @property
    def _proposed(self) -> list[int]:
        """`proposed` aligned with `accepted` (a caller that cleared only `accepted` keeps its last rounds)."""
        return self.proposed[len(self.proposed) - len(self.accepted):]

    def mean_proposed(self) -> float:
        """Drafts verified per round (k when no round was cut)."""
        return sum(self._proposed) / self.rounds if self.rounds else float("nan")

    def reached(self) -> list[float]:
        """[P(proposed >= i) for i = 1..k]: the share of rounds whose verified block reached slot i."""
        n = self.rounds
        return [sum(p >= i for p in self._proposed) / n if n else float("nan") for i in range(1, self.k + 1)]

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    def mean_acceptance_length(self) -> float:
        """Tokens emitted per round: accepted drafts + the one target token."""
        return 1.0 + sum(self.accepted) / self.rounds if self.rounds else float("nan")

    def cumulative(self) -> list[float]:
        """[P(accepted >= i) for i = 1..k]."""
        n = self.rounds
        return [sum(a >= i for a in self.accepted) / n if n else float("nan") for i in range(1, self.k + 1)]

    def conditional(self) -> list[float]:
        """[P(accepted >= i | accepted >= i-1) for i = 1..k], among the rounds that verified slot i (all
        of them unless a drafter cut its block before i); NaN where no such round reached i-1."""
        out = []
        for i in range(1, self.k + 1):
            reached = sum(a >= i - 1 and p >= i for a, p in zip(self.accepted, self._proposed))
            out.append(sum(a >= i for a in self.accepted) / reached if reached else float("nan"))
        return out

    def alpha(self) -> float:
        """Per-token pass rate pooled over positions: passes / draft tokens examined."""
        examined = sum(min(a + 1, p) for a, p in zip(self.accepted, self._proposed))
        return sum(self.accepted) / examined if examined else float("nan")


class NgramDrafter:
    """A model-free draft (prompt lookup): find the latest earlier occurrence of the last n
    tokens (n = max_ngram down to 1) and propose the k tokens that followed it. Its proposals
    are deterministic, so its probabilities are one-hot. When nothing matches it proposes the
    last token k times (speculation still costs k verified tokens: the budget is what we study).

    Vectorised over the batch and the context, like vLLM's `NgramProposer` (numpy + numba over the
    requests' token arrays): each request's tokens live in a growing int64 buffer that takes only
    the tokens added since the last call, the batch is one right-aligned [n, L] tensor, and each n
    is one `unfold` + compare + max over all windows — no Python loop over tokens or positions.
    Runs on the host (`runs_on_host`), so the engine counts its time as its own overhead.
    Differs from vLLM: vLLM searches `prompt_lookup_max` down to `prompt_lookup_min` with a KMP
    scan for the longest match; here the latest match of the longest n wins."""

    name = "n-gram prompt lookup"
    kind = "ngram"            # config.draft_slots_for: no extra input slots
    runs_on_host = True

    def __init__(self, vocab: int, max_ngram: int = 3):
        self.vocab, self.max_ngram = vocab, max_ngram
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # Sequence -> [ids tensor, length]

    def _tokens(self, seq) -> torch.Tensor:
        """The request's token ids as an int64 tensor, appending only what is new since last call."""
        ids = seq.token_ids
        entry = self._buffers.get(seq)
        if entry is None or entry[1] > len(ids):
            buf = torch.empty(max(64, 2 * len(ids)), dtype=torch.long)
            buf[:len(ids)] = torch.tensor(ids, dtype=torch.long)
            entry = self._buffers[seq] = [buf, len(ids)]
        buf, n = entry
        if n < len(ids):
            if len(ids) > buf.numel():
                grown = torch.empty(2 * len(ids), dtype=torch.long)
                grown[:n] = buf[:n]
                buf = entry[0] = grown
            buf[n:len(ids)] = torch.tensor(ids[n:], dtype=torch.long)
            entry[1] = len(ids)
        return buf[:len(ids)]

    def propose_ids(self, token_lists: list[torch.Tensor], k: int) -> torch.Tensor:
        """token_lists: n int64 tensors (each request's ids) -> proposals [n, k] int64 (CPU)."""
        n_req = len(token_lists)
        L = max(t.numel() for t in token_lists)
        ids = torch.full((n_req, L), -1, dtype=torch.long)         # right-aligned; -1 never matches a token
        for i, t in enumerate(token_lists):
            ids[i, L - t.numel():] = t
        lengths = torch.tensor([t.numel() for t in token_lists])
        found = torch.zeros(n_req, dtype=torch.bool)
        follow_at = torch.full((n_req,), L - 1, dtype=torch.long)   # no match: repeat the last token
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            windows = ids.unfold(1, n, 1)[:, :L - n]                   # [n_req, L-n, n]: starts 0..L-n-1, not the tail
            tail = ids[:, L - n:]                                      # [n_req, n]
            match = (windows == tail[:, None, :]).all(-1) & (lengths[:, None] > n)   # [n_req, L-n]
            starts = torch.arange(match.shape[1])
            latest = torch.where(match, starts, -1).max(dim=1).values  # latest earlier occurrence, -1: none
            new = (latest >= 0) & ~found
            follow_at = torch.where(new, latest + n, follow_at)
            found |= new
        pos = (follow_at[:, None] + torch.arange(k)).clamp_max(L - 1)  # past the end: the last token (as a pad)
        return ids.gather(1, pos)

    def propose(self, seqs, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (draft tokens [n, k] int64, None: the probabilities are one-hot at the tokens)."""
        toks = self.propose_ids([self._tokens(s) for s in seqs], k).to(device)
        return toks, None    # deterministic proposals: one-hot q, never materialised


def ngram_reference(ids: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """The drafter's rule written as plain loops over one request's ids: the tests' reference."""
    L = len(ids)
    for n in range(min(max_ngram, L - 1), 0, -1):
        tail = ids[L - n:]
        for start in range(L - n - 1, -1, -1):
            if ids[start:start + n] == tail:
                follow = ids[start + n:start + n + k]
                return follow + [follow[-1]] * (k - len(follow))
    return [ids[-1]] * k
