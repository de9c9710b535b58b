"""The engine loop: schedule, draft, forward, sample, update — one step at a time.

    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=1024, num_spec_tokens=4))
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))

Each step's phases are timed apart (`StepStats`): scheduling and bookkeeping are the engine's
own overhead; draft, forward and sampling are model work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..device import synchronize
from ..errors import UserError
from .block_manager import BlockManager
from .config import EngineConfig, draft_slots_for
from .model import TinyDecoder
from .model_runner import ModelRunner
from .sampler import probs_from_logits, sample
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence
from .speculative import AcceptanceStats, NgramDrafter, rejection_sample


@dataclass
class StepStats:
    schedule_s: float
    draft_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    update_s: float
    num_tokens: int           # tokens through the forward, speculative ones included
    num_prefill_tokens: int
    num_decode: int
    num_running: int
    reserved: int
    num_scheduled: int = 0        # requests in the batch (each charged its draft slots under "adaptive")
    draft_on_host: bool = False   # a model-free drafter (n-gram lookup) is the engine's own CPU work
    cut_drafts: int = 0           # scheduled draft tokens a drafter's cut kept out of the verify forward

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.draft_s + self.prepare_s + self.forward_s + self.sample_s + self.update_s

    @property
    def overhead_s(self) -> float:
        """The engine's own work: scheduling, building the batch, updating request state, and
        drafting when the drafter is host code rather than a model (`draft_on_host`)."""
        return self.schedule_s + self.prepare_s + self.update_s + (self.draft_s if self.draft_on_host else 0.0)


class LLMEngine:
    def __init__(self, model: TinyDecoder, config: EngineConfig | None = None, drafter=None,
                 clock=time.perf_counter, runner_factory=None):
        self.model, self.config = model, config or EngineConfig()
        cfg, mcfg = self.config, model.cfg
        self.max_model_len = mcfg.max_seq
        if cfg.speculative and drafter is None:
            drafter = NgramDrafter(mcfg.vocab)
        if drafter is not None and drafter.vocab != mcfg.vocab:
            raise UserError(f"draft vocabulary ({drafter.vocab}) differs from the target's ({mcfg.vocab}); "
                            "speculative decoding needs one shared vocabulary")
        self.drafter = drafter if cfg.speculative else None
        kind = getattr(self.drafter, "kind", None)
        if kind is not None and cfg.draft_slots != draft_slots_for(kind, cfg.num_spec_tokens):
            raise UserError(f"a {kind} drafter adds {draft_slots_for(kind, cfg.num_spec_tokens)} draft slots per request "
                            f"at k={cfg.num_spec_tokens}; the config says draft_slots={cfg.draft_slots}")
        num_blocks = cfg.num_blocks or cfg.max_num_seqs * -(-(mcfg.max_seq + cfg.num_spec_tokens) // cfg.block_size)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg, self.block_manager)
        # `runner_factory(model, num_blocks, block_size)`: another runner over the same pages, e.g. one
        # rank's shard of a tensor-parallel engine (`tensor_parallel.TPModelRunner`)
        self.runner = (runner_factory or ModelRunner)(model, num_blocks, cfg.block_size)
        # a multi-layer draft (EAGLE-3 style) reads several target layers: the runner hands them over
        self.runner.feature_layers = getattr(self.drafter, "feature_layers", None)
        self.device = self.runner.device
        self.clock = clock
        self.generator = torch.Generator(device="cpu").manual_seed(cfg.seed)
        self.steps: list[StepStats] = []
        self.acceptance = AcceptanceStats(cfg.num_spec_tokens)
        self.finished: list[Sequence] = []
        # Phases are timed apart by synchronising the compute stream at each boundary (six per step).
        # With KV tiers attached the engine syncs once per step, at its start: the copies wait on events.
        self.sync_every_phase = True
        self.compute_syncs = 0
        self.idle_steps = 0      # step() calls that ran no batch (waiting for a KV fetch or copy): one sync each

    # -- requests ------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None) -> Sequence:
        params = params or SamplingParams()
        cfg, vocab = self.config, self.model.cfg.vocab
        prompt = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
        if not prompt:
            raise UserError("a prompt needs at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise UserError(f"prompt tokens must lie in [0, {vocab}); got {min(prompt)}..{max(prompt)}")
        need = len(prompt) + params.max_tokens + cfg.num_spec_tokens
        if need > self.max_model_len:
            raise UserError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens})"
                            + (f" + k ({cfg.num_spec_tokens})" if cfg.speculative else "")
                            + f" = {need} exceeds the model's context of {self.max_model_len} tokens")
        # the most a lone prompt can get in one step (the worst-case up-front reservation)
        if not cfg.chunked_prefill and len(prompt) > (cfg.max_num_batched_tokens - cfg.upfront_reservation(cfg.max_num_seqs)
                                                      - cfg.slots_per_scheduled_request):
            raise UserError(f"prompt of {len(prompt)} tokens cannot be prefilled in one step of "
                            f"{cfg.max_num_batched_tokens} tokens (minus the speculative reservation) with "
                            "chunked prefill off; turn chunked_prefill on or raise max_num_batched_tokens")
        if self.block_manager.blocks_for(need) > self.block_manager.num_blocks:
            raise UserError(f"request needs {self.block_manager.blocks_for(need)} KV blocks but the cache has "
                            f"{self.block_manager.num_blocks}")
        seq = Sequence(prompt, params, arrival_s=self.clock())
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # -- one step ------------------------------------------------------------------
    def _tick(self, phase: bool = True) -> float:
        # the compute stream only: the KV tiers' copies run on their own stream and must not hold the engine
        if phase and not self.sync_every_phase:
            return self.clock()
        self.compute_syncs += 1
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        else:
            synchronize(self.device)
        return self.clock()

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """Run one scheduled batch; return the requests that finished in it."""
        t0 = self._tick(phase=False)      # the step's one sync: the previous step's work is done
        num_running = len(self.scheduler.running)
        out = self.scheduler.schedule()
        tiers = self.block_manager.tiers
        if tiers is not None:
            tiers.note_step()
        if not out.chunks:
            self.idle_steps += 1
            if tiers is not None and tiers.busy():   # waiting for a KV fetch or for blocks under copy
                tiers.wait_for_progress(0.005)
                return []
            if self.has_unfinished():
                raise RuntimeError("scheduler made no progress: no budget, seat or KV blocks for any request")
            return []
        t1 = self._tick()
        spec = [c.seq for c in out.chunks if c.num_spec_tokens]
        drafts = self._drafts(self.drafter.propose(spec, self.config.num_spec_tokens, self.device)) if spec else None
        t2 = self._tick()
        batch = self.runner.prepare(self._batch_items(out.chunks, drafts))
        t3 = self._tick()
        logits, hidden = self.runner.forward(batch)
        t4 = self._tick()
        new_tokens, accepted, rows = self._sample(out.chunks, logits, drafts)
        t5 = self._tick()
        finished = self._update(out.chunks, new_tokens, accepted, rows, hidden, now=t5, drafts=drafts)
        t6 = self.clock()
        cut = 0 if drafts is None else sum(self.config.num_spec_tokens - n for n in drafts[2])
        self.steps.append(StepStats(schedule_s=t1 - t0, draft_s=t2 - t1, prepare_s=t3 - t2, forward_s=t4 - t3,
                                    sample_s=t5 - t4, update_s=t6 - t5, num_tokens=out.num_tokens - cut,
                                    cut_drafts=cut,
                                    num_prefill_tokens=out.num_prefill_tokens, num_decode=out.num_decode,
                                    num_running=num_running, reserved=out.reserved, num_scheduled=len(out.chunks),
                                    draft_on_host=bool(spec) and getattr(self.drafter, "runs_on_host", False)))
        return finished

    def _drafts(self, proposal):
        """A drafter's proposal as (tokens [n, k], probabilities [n, k, V] or None, lengths: the drafts
        of each row put to verification). A drafter that cuts its blocks (the DSpark-style block
        draft's confidence head) returns the lengths as a third element; the others verify all k."""
        k = self.config.num_spec_tokens
        toks, probs = proposal[0], proposal[1]
        lengths = [k] * toks.shape[0] if len(proposal) < 3 or proposal[2] is None else \
            [int(n) for n in proposal[2].tolist()]
        if len(lengths) != toks.shape[0] or any(not 0 <= n <= k for n in lengths):
            raise RuntimeError(f"drafter returned lengths {lengths} for {toks.shape[0]} rows of k = {k}")
        return toks, probs, lengths

    @staticmethod
    def _batch_items(chunks, drafts):
        """Each chunk's new tokens (plus the draft tokens it verifies: the first `lengths[j]` of row j),
        start position and block table. Draft row j belongs to the j-th speculative chunk, in schedule order."""
        items, j = [], 0
        for c in chunks:
            seq, start = c.seq, c.seq.num_computed_tokens
            toks = seq.token_ids[start:start + c.num_tokens]
            if c.num_spec_tokens:
                toks = toks + drafts[0][j, :drafts[2][j]].tolist()
                j += 1
            items.append((toks, start, seq.block_table, bool(c.num_spec_tokens)))
        return items

    def _sample(self, chunks, logits, drafts):
        """New tokens per request: one from each finishing prefill or plain decode, 1..n+1 from each
        verification of n drafts (n = k, or the length a drafter cut its block to). Returns
        ({seq_id: tokens}, {seq_id: accepted drafts}, {seq_id: first logit row})."""
        row, plain, verify, rows, j = 0, [], [], {}, 0
        for c in chunks:
            rows[c.seq.seq_id] = row
            completes = not c.is_prefill or c.seq.num_computed_tokens + c.num_tokens >= c.seq.num_prompt_tokens
            if c.num_spec_tokens:
                n = drafts[2][j]
                verify.append((c, row, j, n))
                row += 1 + n
                j += 1
                continue
            if completes:  # a prefill chunk that leaves prompt tokens behind samples nothing
                plain.append((c, row))
            row += 1
        new_tokens: dict[int, list[int]] = {}
        # a verification cut to 0 drafts is a plain decode step of its row
        plain += [(c, r) for c, r, _, n in verify if n == 0]
        verify = [v for v in verify if v[3] > 0]
        greedy = [(c, r) for c, r in plain if c.seq.params.temperature == 0]
        if greedy:   # one argmax for all greedy rows
            toks = logits[torch.tensor([r for _, r in greedy], device=self.device)].argmax(-1).tolist()
            new_tokens.update({c.seq.seq_id: [t] for (c, _), t in zip(greedy, toks)})
        for c, r in plain:  # temperature sampling: each request draws from its own seeded generator
            if c.seq.params.temperature > 0:
                new_tokens[c.seq.seq_id] = [int(sample(logits[r:r + 1], c.seq.params.temperature, c.seq.generator))]
        accepted: dict[int, int] = {sid: 0 for sid in (c.seq.seq_id for c, _ in plain if c.num_spec_tokens)}
        if verify:
            dtok, dprob, _ = drafts
            # greedy requests verify together (one group per verified length); a sampling request
            # with its own generator
            lengths = sorted({n for c, _, _, n in verify if c.seq.params.temperature == 0})
            groups = [([i for i, (c, _, _, n) in enumerate(verify) if c.seq.params.temperature == 0 and n == m],
                       0.0, self.generator, m) for m in lengths]
            groups += [([i], c.seq.params.temperature, c.seq.generator, n)
                       for i, (c, _, _, n) in enumerate(verify) if c.seq.params.temperature > 0]
            for idx, temp, gen, n in groups:
                target = torch.stack([logits[verify[i][1]:verify[i][1] + n + 1] for i in idx])     # [m, n+1, V]
                drow = torch.tensor([verify[i][2] for i in idx], device=dtok.device)
                toks, acc = rejection_sample(probs_from_logits(target, temp),
                                             None if dprob is None else dprob[drow, :n], dtok[drow, :n], gen)
                for i, t, a in zip(idx, toks.tolist(), acc.tolist()):
                    sid = verify[i][0].seq.seq_id
                    new_tokens[sid], accepted[sid] = t[:a + 1], a
        return new_tokens, accepted, rows

    def _update(self, chunks, new_tokens, accepted, rows, hidden, now: float, drafts=None) -> list[Sequence]:
        """Advance each request: computed tokens, new tokens, the hidden state a draft reads next, finish."""
        finished = []
        spec = [c.seq.seq_id for c in chunks if c.num_spec_tokens]
        verified = dict(zip(spec, drafts[2])) if drafts is not None else {}
        for c in chunks:
            seq = c.seq
            if c.is_prefill:
                seq.num_computed_tokens += c.num_tokens
                seq.num_prefill_chunks += 1
                self.block_manager.register_computed(seq)
                if seq.is_prefill:      # prompt not done yet: nothing was sampled
                    continue
                seq.first_token_s = now
            toks = new_tokens[seq.seq_id]
            if not c.is_prefill:
                seq.num_computed_tokens += len(toks)   # the previous token + the accepted drafts
            if c.num_spec_tokens:
                seq.accepted_per_round.append(accepted[seq.seq_id])
                self.acceptance.add([accepted[seq.seq_id]], [verified[seq.seq_id]])
            # the target's hidden state at the row that produced the last new token
            last_row = rows[seq.seq_id] + (len(toks) - 1 if c.num_spec_tokens else 0)
            seq.draft_hidden = hidden[last_row]
            # the features at every row that produced a new token: a draft with its own KV cache enters them all
            seq.draft_hidden_rows = hidden[rows[seq.seq_id]:last_row + 1]
            seq.token_ids.extend(toks)
            if len(seq.output_ids) >= seq.params.max_tokens:
                del seq.token_ids[seq.num_prompt_tokens + seq.params.max_tokens:]
                seq.finish_s = now
                self.scheduler.finish(seq)
                finished.append(seq)
        self.finished.extend(finished)
        return finished

    def generate(self, prompts, params: SamplingParams | None = None) -> list[list[int]]:
        """Run every prompt to completion; return the output token ids in prompt order."""
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [s.output_ids for s in seqs]
