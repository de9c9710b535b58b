"""What the engine is allowed to do in one step: the knobs a serving config names.

`max_num_batched_tokens` is the per-step token budget (prefill chunks + decode tokens +
speculative tokens); `max_num_seqs` caps the requests in flight. With speculation on
(`num_spec_tokens` = k > 0), each decoding request verifies 1 + k tokens per step, and the
scheduler reserves budget for them, 1 + k tokens per reserved request, before it spends the rest
on prompts:

- `spec_budget="static"`: reserve `max_num_seqs * (1 + k)`, however few requests are running (vLLM
  before #51725, which took `max_num_seqs` x the drafting slots off `max_num_scheduled_tokens` in
  `VllmConfig._set_max_num_scheduled_tokens`; FastDeploy #7438);
- `spec_budget="adaptive"`: reserve `len(running) * (1 + k)` (the seed's vLLM #51725);
- `spec_budget="decode-only"`: reserve `num_decoding * (1 + k)`, only for running requests that have
  finished their prompt (FastDeploy #7499, `num_running_decode_reqs * tokens_per_seq`): a request
  still prefilling verifies nothing this step.

Where vLLM differs: its reservation covers the slots the *drafter* inserts, and each decoding
request's 1 + k verify tokens (`num_tokens_with_spec`) are charged to the token budget as it is
scheduled. Here, as in FastDeploy #7499, the decode tokens are paid from the reservation, so the
three policies differ only in how many requests they reserve for.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError, choices

SPEC_BUDGETS = ("static", "adaptive", "decode-only")
MAX_SPEC_TOKENS = 8


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
        if self.num_spec_tokens != 0:
            check_spec_tokens(self.num_spec_tokens)
            # every decoding request needs 1 token of budget beyond the reservation
            worst = self.max_num_seqs * (self.num_spec_tokens + 1)
            if self.max_num_batched_tokens < worst:
                raise UserError(
                    f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one speculative step of "
                    f"max_num_seqs={self.max_num_seqs} requests with k={self.num_spec_tokens} "
                    f"(needs at least {worst})")

    @property
    def speculative(self) -> bool:
        return self.num_spec_tokens > 0

    def spec_reservation(self, num_running: int, num_decoding: int | None = None) -> int:
        """Tokens of the step budget held back for decoding requests' 1 + k verify tokens.
        `num_decoding` (running requests past their prompt) defaults to `num_running`."""
        if not self.speculative:
            return 0
        per_request = 1 + self.num_spec_tokens
        if self.spec_budget == "static":
            return self.max_num_seqs * per_request
        if self.spec_budget == "adaptive":
            return num_running * per_request
        return (num_running if num_decoding is None else num_decoding) * per_request
