"""Who runs this step, and how many tokens each: continuous batching under a token budget.

Each step the scheduler spends at most `max_num_batched_tokens` tokens (see `config.py` for the
three speculative policies):

1. it takes the up-front reservation off the budget (`EngineConfig.upfront_reservation`: static
   `max_num_seqs x draft_slots`, adaptive nothing, decode-only `num_decoding x (1 + k)`);
2. running requests go first, decoding ones before prefilling ones: a decoding request is charged
   its 1 + k verify tokens (`decode_cost`; 0 under decode-only, whose reservation pays them) and, under
   the adaptive policy, its drafter's `draft_slots`; a request still prefilling takes the next chunk of
   its prompt, as much as the budget left allows (chunked prefill), plus its draft slots when adaptive;
3. waiting requests are admitted, first come first served, while there is budget, a free seat
   (`max_num_seqs`) and KV blocks for the whole request.

`schedulable_tokens(n)` is the budget left for new tokens when n requests are scheduled — the
column of vLLM #51725's table — computed by the same rules `schedule` spends.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, Status


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int        # tokens of seq.token_ids processed this step, from num_computed_tokens on
    num_spec_tokens: int   # draft tokens appended for verification (decode only)
    is_prefill: bool       # decided when scheduled: the request's state changes after the step


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    reserved: int = 0          # held back for speculation this step: up front + draft slots charged per request
    budget: int = 0            # max_num_batched_tokens
    draft_slots: int = 0       # of `reserved`, the drafter's slots charged per scheduled request (adaptive)

    @property
    def num_tokens(self) -> int:
        """Every token the forward processes, speculative ones included: never above the budget."""
        return sum(c.num_tokens + c.num_spec_tokens for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if c.is_prefill)

    @property
    def num_decode(self) -> int:
        return sum(1 for c in self.chunks if not c.is_prefill)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config, self.block_manager = config, block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, seq: Sequence) -> int:
        """Positions the request can ever write: prompt + output + k draft slots."""
        return seq.num_prompt_tokens + seq.params.max_tokens + self.config.num_spec_tokens

    def schedulable_tokens(self, num_scheduled: int) -> int:
        """New tokens a step can schedule when `num_scheduled` requests share it (vLLM #51725's column):
        the budget less the up-front reservation less the slots charged per scheduled request."""
        cfg = self.config
        return (cfg.max_num_batched_tokens - cfg.upfront_reservation(num_scheduled)
                - num_scheduled * cfg.slots_per_scheduled_request)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        k = cfg.num_spec_tokens
        num_decoding = sum(1 for s in self.running if not s.is_prefill)
        upfront = cfg.upfront_reservation(num_decoding)
        slots = cfg.slots_per_scheduled_request
        out = SchedulerOutput(reserved=upfront, budget=cfg.max_num_batched_tokens)
        left = cfg.max_num_batched_tokens - upfront
        decode_cost = cfg.decode_cost

        def charge_slots() -> None:
            nonlocal left
            left -= slots
            out.reserved += slots
            out.draft_slots += slots

        # decoding requests first (their latency is the user's), then prefills. A decode that does not
        # fit whole (1 + k verify tokens + its slots) waits a step, as vLLM leaves a running request
        # unscheduled when the budget is spent; under decode-only it is paid from the reservation.
        for seq in [s for s in self.running if not s.is_prefill] + [s for s in self.running if s.is_prefill]:
            if seq.is_prefill:
                n = min(seq.num_prompt_tokens - seq.num_computed_tokens, left - slots)
                if n <= 0 or (n < seq.num_prompt_tokens - seq.num_computed_tokens and not cfg.chunked_prefill):
                    continue
                out.chunks.append(ScheduledChunk(seq, n, 0, True))
                left -= n
                charge_slots()
            else:
                if decode_cost + slots > left:
                    continue
                out.chunks.append(ScheduledChunk(seq, 1, k, False))
                left -= decode_cost
                charge_slots()

        # requests whose prefix is still on its way from the KV tiers: they wait (each holding a seat), others go
        loading = []
        while self.waiting and left - slots > 0 and len(self.running) + len(loading) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if self.block_manager.kv_loading(seq):
                loading.append(self.waiting.popleft())
                continue
            if not self.block_manager.can_allocate(self.blocks_needed(seq)):
                break
            remaining = seq.num_prompt_tokens  # before a prefix-cache hit
            if not cfg.chunked_prefill and remaining > left - slots:
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, self.blocks_needed(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_prompt_tokens - seq.num_computed_tokens, left - slots)
            out.chunks.append(ScheduledChunk(seq, n, 0, True))
            left -= n
            charge_slots()
        self.waiting.extendleft(reversed(loading))
        return out

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self.block_manager.free(seq)
