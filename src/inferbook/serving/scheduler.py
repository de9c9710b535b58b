"""Who runs this step, and how many tokens each: continuous batching under a token budget.

Each step the scheduler spends at most `max_num_batched_tokens` tokens:

1. it holds back the speculative reservation (`EngineConfig.spec_reservation`: static
   `max_num_seqs * (1 + k)`, adaptive `len(running) * (1 + k)`, decode-only
   `num_decoding * (1 + k)`);
2. running requests go first, decoding ones before prefilling ones: a decoding request takes its 1 + k
   verify tokens from the reservation (as FastDeploy #7499 pre-deducts them); a request still prefilling takes the next
   chunk of its prompt, as much as the budget left allows (chunked prefill);
3. waiting requests are admitted, first come first served, while there is budget, a free seat
   (`max_num_seqs`) and KV blocks for the whole request.

A prefill that does not fit the budget left is *split* into chunks over several steps; the
static reservation makes that happen even when only one request is running — the waste the
adaptive policy removes.
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
    reserved: int = 0          # speculative reservation held back this step
    budget: int = 0            # max_num_batched_tokens

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

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        k = cfg.num_spec_tokens
        num_decoding = sum(1 for s in self.running if not s.is_prefill)
        reserved = cfg.spec_reservation(len(self.running), num_decoding)
        out = SchedulerOutput(reserved=reserved, budget=cfg.max_num_batched_tokens)
        # without speculation nothing is reserved and each decode token is paid from the budget
        left = cfg.max_num_batched_tokens - reserved
        decode_cost = 0 if cfg.speculative else 1

        # decoding requests first (their latency is the user's), then prefills; with speculation a
        # decode is paid from the reservation, so only prompt chunks are limited by what is left
        for seq in [s for s in self.running if not s.is_prefill] + [s for s in self.running if s.is_prefill]:
            if left <= 0 and (seq.is_prefill or not cfg.speculative):
                break
            if seq.is_prefill:
                n = seq.num_prompt_tokens - seq.num_computed_tokens
                if n > left:
                    if not cfg.chunked_prefill:
                        continue
                    n = left
                out.chunks.append(ScheduledChunk(seq, n, 0, True))
                left -= n
            else:
                out.chunks.append(ScheduledChunk(seq, 1, k, False))
                left -= decode_cost

        # requests whose prefix is still on its way from the KV tiers: they wait (each holding a seat), others go
        loading = []
        while self.waiting and left > 0 and len(self.running) + len(loading) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if self.block_manager.kv_loading(seq):
                loading.append(self.waiting.popleft())
                continue
            if not self.block_manager.can_allocate(self.blocks_needed(seq)):
                break
            remaining = seq.num_prompt_tokens  # before a prefix-cache hit
            if not cfg.chunked_prefill and remaining > left:
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, self.blocks_needed(seq))
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_prompt_tokens - seq.num_computed_tokens, left)
            out.chunks.append(ScheduledChunk(seq, n, 0, True))
            left -= n
        self.waiting.extendleft(reversed(loading))
        return out

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self.block_manager.free(seq)
