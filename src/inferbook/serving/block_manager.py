"""Paged KV cache bookkeeping: which physical blocks hold which request's tokens.

The cache is `num_blocks` blocks of `block_size` token slots. A request's block table maps
its logical block i (tokens i*bs .. i*bs+bs-1) to a physical block. Token at position p lives
in slot `block_table[p // bs] * bs + p % bs`.

Admission reserves every block the request can ever need (prompt + max_tokens + k), so a
running request never runs out of blocks and nothing is preempted — a simplification of
vLLM, which allocates lazily and preempts.

Prefix caching (a switch, off in the Kimi chapters as in the seed's table): a full prompt
block is named by a hash chained over all tokens up to its end; a new request whose first
blocks have known hashes shares those physical blocks (reference counts) and skips computing
them. Freed blocks keep their hash until they are reused for something else.
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Optional KV tiers (`kv_offload.EngineKVTiers`): `free` launches the offload of a request's
        # prompt blocks and holds the blocks under copy until `reclaim` gets them back; `kv_loading`
        # lets a request wait while its prefix comes from a slow tier; `allocate` restores further
        # prefix blocks after the device lookup.
        self.tiers = None

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        self.reclaim()
        return self.blocks_for(num_tokens) <= len(self.free_blocks)  # worst case: no prefix hit

    def reclaim(self) -> None:
        """Take back the blocks whose device -> host copy has completed (never waits)."""
        if self.tiers is not None:
            for block in self.tiers.completed_blocks():
                self._release(block)

    def kv_loading(self, seq: Sequence) -> bool:
        """True while the KV tiers are still bringing `seq`'s prefix into host memory."""
        return self.tiers is not None and self.tiers.loading(seq)

    def _release(self, block: int) -> None:
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if not self.enable_prefix_caching:
                self.block_hash[block] = None
            self.free_blocks.append(block)

    def _chain_hash(self, prev: int | None, tokens: list[int]) -> int:
        return hash((prev, tuple(tokens)))

    def _take_free(self) -> int:
        block = self.free_blocks.popleft()
        old = self.block_hash[block]
        if old is not None:  # evict: this block's old content is about to be overwritten
            if self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.block_hash[block] = None
        self.ref_count[block] = 1
        return block

    def allocate(self, seq: Sequence, num_tokens: int) -> int:
        """Give `seq` blocks for `num_tokens` positions; return prompt tokens found in the prefix cache."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
        if not self.can_allocate(num_tokens):
            raise RuntimeError(f"not enough free KV blocks for {num_tokens} tokens")
        bs, cached, prev = self.block_size, 0, None
        if self.enable_prefix_caching:
            # never hit the block holding the last prompt token: its logits are needed
            for i in range((seq.num_prompt_tokens - 1) // bs):
                h = self._chain_hash(prev, seq.prompt[i * bs:(i + 1) * bs])
                block = self.hash_to_block.get(h)
                if block is None:
                    break
                if self.ref_count[block] == 0:
                    self.free_blocks.remove(block)
                self.ref_count[block] += 1
                seq.block_table.append(block)
                cached += bs
                prev = h
            seq.num_hashed_blocks = len(seq.block_table)
        if self.tiers is not None:
            for block in self.tiers.restore(seq, len(seq.block_table), self._take_free):
                seq.block_table.append(block)
                cached += bs
            if self.enable_prefix_caching:   # restored blocks are device-cached from now on
                self.register_computed_upto(seq, cached)
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self._take_free())
        seq.num_cached_tokens = seq.num_computed_tokens = cached
        return cached

    def register_computed(self, seq: Sequence) -> None:
        """Name the prompt blocks whose K/V are now computed, so later requests can share them."""
        self.register_computed_upto(seq, seq.num_computed_tokens)

    def register_computed_upto(self, seq: Sequence, num_computed: int) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_computed, seq.num_prompt_tokens) // bs
        prev = None
        if seq.num_hashed_blocks:
            prev = self.block_hash[seq.block_table[seq.num_hashed_blocks - 1]]
        for i in range(seq.num_hashed_blocks, full):
            h = self._chain_hash(prev, seq.prompt[i * bs:(i + 1) * bs])
            block = seq.block_table[i]
            self.block_hash[block] = h
            self.hash_to_block.setdefault(h, block)
            prev = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free(self, seq: Sequence) -> None:
        if self.tiers is not None and seq.block_table:
            for block in self.tiers.offload(seq):   # under an asynchronous copy: held until `reclaim`
                self.ref_count[block] += 1
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
