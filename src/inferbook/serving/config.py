"""What the engine is allowed to do in one step: the knobs a serving config names.

`max_num_batched_tokens` is the per-step token budget; `max_num_seqs` caps the requests in flight.
With speculation on (`num_spec_tokens` = k > 0) each decoding request verifies 1 + k tokens per step.
What the budget must also hold is the drafter's own input: the *draft slots* a drafter adds per
request beyond the tokens the target computes (vLLM's `SpeculativeConfig.max_num_new_slots_for_drafting`,
`draft_slots_for`): 0 for an n-gram lookup or an EAGLE/MTP chain (the draft re-reads the target's
rows), 1 for a separate draft model, K - 1 for a parallel drafter such as DSpark (an anchor that reuses
the bonus token's slot plus K - 1 mask queries), K for DFlash (its bonus query too, #51256).

Three policies for charging them (`spec_budget`):

- `"static"` (vLLM before #51725): `max_num_seqs x draft_slots` comes off the budget once, however
  few requests run (`VllmConfig._set_max_num_scheduled_tokens`); each request is then charged its
  new tokens (a decode: its 1 + k verify tokens, `num_tokens_with_spec`).
- `"adaptive"` (vLLM #51725): nothing comes off up front; each *scheduled* request is charged its new
  tokens + `draft_slots`, so the hold-back follows the requests actually in the batch.
- `"decode-only"` (FastDeploy #7499): reserve `num_decoding x (1 + k)` up front
  (`num_running_decode_reqs * tokens_per_seq`) and pay every decode's 1 + k verify tokens from it;
  prompts get the rest.

With an n-gram or chain drafter (`draft_slots = 0`) static and adaptive are the same policy, as in
vLLM: #51725 changes nothing for them. FastDeploy's unit is the verify tokens, vLLM's the drafter's.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError, choices

SPEC_BUDGETS = ("static", "adaptive", "decode-only")
MAX_SPEC_TOKENS = 8

# drafter kind -> draft slots per request for k speculative tokens (vLLM's max_num_new_slots_for_drafting)
DRAFTER_KINDS = ("ngram", "eagle", "draft-model", "parallel", "dflash")


def draft_slots_for(kind: str, k: int) -> int:
    """Extra token slots the drafter's input adds per scheduled request (vLLM
    `SpeculativeConfig.max_num_new_slots_for_drafting`): n-gram and EAGLE/MTP chains 0 (the draft
    reads the rows the target computed), a separate draft model 1 (its tokens are not sliced),
    parallel drafting (DSpark, P-EAGLE) K - 1 mask queries, DFlash K (#51256: its bonus query too)."""
    if kind not in DRAFTER_KINDS:
        raise UserError(f"drafter kind {kind!r} unknown; choose {choices(DRAFTER_KINDS)}")
    return {"ngram": 0, "eagle": 0, "draft-model": 1, "parallel": k - 1, "dflash": k}[kind]


def check_spec_tokens(k: int) -> int:
    """k draft tokens per round: an int in 1..8 (the seed's DSpark uses 8)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPEC_TOKENS:
        raise UserError(f"number of speculative tokens k={k!r} is not allowed; use an int from 1 to {MAX_SPEC_TOKENS}")
    return k


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int | None = None          # None: enough for max_num_seqs requests of the model's full context
    chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    num_spec_tokens: int = 0               # k; 0 turns speculation off
    spec_budget: str = "adaptive"
    draft_slots: int = 0                   # the drafter's extra input slots per request (`draft_slots_for`)
    seed: int = 0                          # seeds the generator of greedy verification rounds

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"{name}={v!r} must be a positive int")
        if self.max_num_batched_tokens < self.block_size:
            raise UserError(f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than one KV block "
                            f"(block_size={self.block_size}); use at least {self.block_size}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise UserError(f"num_blocks={self.num_blocks!r} must be a positive int or None")
        if self.spec_budget not in SPEC_BUDGETS:
            raise UserError(f"spec_budget={self.spec_budget!r} unknown; choose {choices(SPEC_BUDGETS)}")
        if isinstance(self.draft_slots, bool) or not isinstance(self.draft_slots, int) or self.draft_slots < 0:
            raise UserError(f"draft_slots={self.draft_slots!r} must be an int >= 0")
        if self.num_spec_tokens != 0:
            check_spec_tokens(self.num_spec_tokens)
            if self.draft_slots > self.num_spec_tokens:
                raise UserError(f"draft_slots={self.draft_slots} exceeds k={self.num_spec_tokens}: no drafter adds "
                                "more input slots than it drafts tokens (DFlash's K is the most)")
            # the budget must hold at least one decoding request's step under the policy
            one = {"static": self.max_num_seqs * self.draft_slots + 1 + self.num_spec_tokens,
                   "adaptive": 1 + self.num_spec_tokens + self.draft_slots,
                   # FastDeploy pays every decode from the reservation: all seats decoding must fit
                   "decode-only": self.max_num_seqs * (1 + self.num_spec_tokens)}[self.spec_budget]
            if self.max_num_batched_tokens < one:
                raise UserError(
                    f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one speculative step under "
                    f"spec_budget={self.spec_budget!r} with max_num_seqs={self.max_num_seqs}, k={self.num_spec_tokens}, "
                    f"draft_slots={self.draft_slots} (needs at least {one})")
        elif self.draft_slots:
            raise UserError(f"draft_slots={self.draft_slots} without speculation (num_spec_tokens=0)")

    @property
    def speculative(self) -> bool:
        return self.num_spec_tokens > 0

    def upfront_reservation(self, num_decoding: int) -> int:
        """Tokens taken off the step budget before anything is scheduled: static
        `max_num_seqs x draft_slots`, adaptive 0 (it charges per scheduled request instead),
        decode-only `num_decoding x (1 + k)`."""
        if not self.speculative:
            return 0
        if self.spec_budget == "static":
            return self.max_num_seqs * self.draft_slots
        if self.spec_budget == "adaptive":
            return 0
        return num_decoding * (1 + self.num_spec_tokens)

    @property
    def slots_per_scheduled_request(self) -> int:
        """Tokens charged per scheduled request on top of its new tokens: `draft_slots` under the
        adaptive policy (vLLM #51725), else 0."""
        return self.draft_slots if self.speculative and self.spec_budget == "adaptive" else 0

    @property
    def decode_cost(self) -> int:
        """Budget a decoding request's own tokens take as it is scheduled: 1 + k under vLLM's
        policies (num_tokens_with_spec), 0 under decode-only (paid from its reservation), 1 with
        speculation off."""
        if not self.speculative:
            return 1
        return 0 if self.spec_budget == "decode-only" else 1 + self.num_spec_tokens
