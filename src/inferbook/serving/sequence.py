"""One request's state: its tokens, how many are in the KV cache, its blocks and its clock.

`token_ids` is prompt + output. `num_computed_tokens` of them have their K/V in the cache;
a step processes some of the rest. While the prompt is not all computed the request is
prefilling (possibly in chunks); afterwards exactly one token (the last sampled one) is
uncomputed each step, and speculation appends k draft tokens behind it for verification.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

_ids = itertools.count()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0        # 0: greedy
    seed: int | None = None         # per-request generator for temperature > 0

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a positive int")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0 or self.temperature != self.temperature:
            raise ValueError(f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy)")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    arrival_s: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0               # prompt tokens served from the prefix cache
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    status: Status = Status.WAITING
    num_prefill_chunks: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    generator: torch.Generator | None = None
    draft_hidden: torch.Tensor | None = None  # target hidden state feeding a hidden-state draft
    draft_hidden_rows: torch.Tensor | None = None  # [m, F*d]: features of the last step's m new tokens' rows
    accepted_per_round: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.prompt = list(self.prompt)
        self.token_ids = list(self.prompt)
        if self.params.temperature > 0:
            self.generator = torch.Generator().manual_seed(self.params.seed if self.params.seed is not None else self.seq_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt):]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
