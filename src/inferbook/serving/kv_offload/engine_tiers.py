"""The engine's side of the tiers: offload a finishing request's blocks and restore a new
request's prefix, without holding up the engine thread."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ...errors import UserError
from . import block_copy
from .block_copy import (CROSS_LAYER, KV_LAYOUTS, block_pieces, engine_layout, model_fingerprint, staged_source,
                         runner_kv_layout, use_cross_layer_blocks)
from .copy_stream import CopyJob, CopyStream
from .layout import namespace, prefix_keys
from .reuse import ReuseTracker
from .store import Fetched, TieredKVStore
from .tiers import TIER_NAMES


@dataclass
class EngineTierStats:
    """Per-request timings the seed says to watch: time to free device blocks (offload), time to
    re-allocate and fill them (restore), and how many prompt blocks came from where.

    free_s: per offloaded request, submission of its device->host copy until the copy completed
    and its blocks were handed back (off the engine thread). offload_call_s: what the engine
    thread spent in `offload` (keys, host rows, launching the copy). fetch_wait_s: per request
    with a slow-tier fetch, from starting the fetch until its rows were in host memory (the
    request waits; the engine steps). realloc_s: taking device blocks once the data is in host
    memory and copying it in (on CUDA: launching the copy; the forward waits on its event)."""

    offloads: int = 0
    offloaded_blocks: int = 0
    free_s: list = field(default_factory=list)
    offload_call_s: list = field(default_factory=list)
    restores: int = 0
    restored_blocks: dict = field(default_factory=lambda: {t: 0 for t in TIER_NAMES})
    fetch_s: list = field(default_factory=list)
    fetch_wait_s: list = field(default_factory=list)
    realloc_s: list = field(default_factory=list)
    device_hit_blocks: int = 0
    prompt_blocks: int = 0
    fetches_started: int = 0
    steps_with_fetch_in_flight: int = 0
    copy_failures: int = 0
    transfers: int = 0            # device->host and host->device copies launched, each one batched call
    stored_while_running: int = 0  # blocks stored (copy completed) from a store launched while their request ran
    not_stored_unreused: int = 0   # full blocks not copied to host: looked up fewer than store_threshold times
    mirror_share: list = field(default_factory=list)   # at each admission: host blocks also in the device cache



@dataclass(eq=False)
class _Fetch:
    """A request's prefix on its way from the slow tiers into host rows (fetch thread)."""

    keys: list[str]
    start_block: int
    t_start: float
    got: Fetched | None = None
    t_ready: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class EngineKVTiers:
    """Offload a finishing request's full prompt blocks; restore a new request's prefix — both
    without holding up the engine thread.

    Installed on an engine's block manager (`attach` in `__init__`). Offload: `BlockManager.free`
    calls `offload(seq)`, which launches the device->host copy (`CopyStream`) and returns the
    blocks under copy; the block manager holds them (a reference each) until `completed_blocks`
    hands them back, after the copy completed, and only then can they be reused. Restore: the
    scheduler asks `loading(seq)` before admitting a request; if a slow tier holds part of its
    prefix, a fetch thread brings it into host rows while the engine keeps stepping other
    requests, and the request waits. Once the rows are in host memory, `BlockManager.allocate`
    calls `restore`, which takes device blocks only then and copies the rows in.

    kv_layout: "cross_layer" (default; one copy per block, see `use_cross_layer_blocks`) or
    "layer_major" (the runner's own pool; 2 x layers copies per block)."""

    def __init__(self, engine, store_kwargs: dict, model_id: str | None = None, kv_layout: str = CROSS_LAYER,
                 store_threshold: int = 1):
        if kv_layout not in KV_LAYOUTS:
            raise UserError(f"kv_layout={kv_layout!r} unknown; choose one of {', '.join(KV_LAYOUTS)}")
        self.engine, self.runner, self.bm = engine, engine.runner, engine.block_manager
        # a tensor-parallel runner (`tensor_parallel.TPModelRunner`, rank 0): the host rows hold every
        # rank's heads, merged (`gather_blocks`), and restores are scattered back (`scatter_rows`)
        self.tp = getattr(self.runner, "comm", None) is not None
        if self.tp and kv_layout != CROSS_LAYER:
            raise UserError("a tensor-parallel engine's tiers use the cross-layer KV layout")
        if kv_layout == CROSS_LAYER and runner_kv_layout(self.runner) != CROSS_LAYER:
            if engine.finished or engine.has_unfinished():
                raise UserError("the cross-layer KV layout is set before the engine serves any request")
            use_cross_layer_blocks(self.runner)
        self.layout = self.runner.merged_layout() if self.tp else engine_layout(self.runner)
        self.ns = namespace(model_id or model_fingerprint(engine.model), self.runner.block_size, self.runner.dtype,
                            self.layout)
        pin = self.runner.device.type == "cuda"
        self.store = TieredKVStore(self.layout, self.ns, pin=pin, **store_kwargs)
        self.stats = EngineTierStats()
        # vLLM's FilterReusedOffloadingManager: a block crosses to the host only once looked up
        # `store_threshold` times (each admission that had to look beyond the device cache counts)
        self.reuse = ReuseTracker(store_threshold)
        self._unlaunched: list[int] = []
        self._stored: dict[int, int] = {}       # seq_id -> leading full blocks already stored (or passed over)
        # the engine's one compute-stream sync per step is its own; phase syncs would add five more
        engine.sync_every_phase = False
        self._device_hash: dict[str, int | None] = {}
        self._released: queue.SimpleQueue = queue.SimpleQueue()   # blocks whose copy completed
        self._held = 0                                             # blocks handed to the copier, not yet back
        self._lock = threading.Lock()
        self._progress = threading.Condition()
        self.copier = CopyStream(self.runner.device, "kv-offload-copy")
        self._fetches: dict[int, _Fetch] = {}                      # seq_id -> its fetch
        self._fetch_jobs: queue.Queue = queue.Queue()
        self._fetcher = threading.Thread(target=self._fetch_loop, name="kv-tier-fetch", daemon=True)
        self._fetcher.start()
        self.bm.tiers = self

    # -- what the block manager and the scheduler ask ---------------------------------
    def mirrored_share(self) -> float:
        """Share of the host tier's blocks that the device prefix cache also holds right now: a host
        tier that only mirrors the device can never serve a hit (the device is asked first)."""
        with self.store.host.lock:
            keys = list(self.store.host.index)
        if not keys:
            return 0.0
        h2b = self.bm.hash_to_block
        return sum(1 for k in keys if self._device_hash.get(k) is not None and self._device_hash[k] in h2b) / len(keys)

    def completed_blocks(self) -> list[int]:
        """Device blocks whose device->host copy has completed since the last call (engine thread;
        never waits)."""
        out = []
        while True:
            try:
                out.append(self._released.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._held -= len(out)
        return out

    def busy(self) -> bool:
        """A copy or a fetch is in flight: the engine may have nothing to run until it completes."""
        with self._lock:
            held = self._held
        return held > 0 or any(not f.done.is_set() for f in self._fetches.values())

    def wait_for_progress(self, timeout_s: float = 0.05) -> None:
        """Sleep until a copy or fetch completes (or `timeout_s`): for an engine with nothing to run."""
        with self._progress:
            self._progress.wait(timeout=timeout_s)

    def _notify(self) -> None:
        with self._progress:
            self._progress.notify_all()

    # -- offload -----------------------------------------------------------------------
    def offload(self, seq) -> list[int]:
        """Called by `BlockManager.free` while the request still owns its blocks: store its full blocks
        not stored yet (the last ones of its decode; see `store_filled`). The blocks under copy are
        held here (a reference each) until `completed_blocks` returns them, so this returns []."""
        t0 = time.perf_counter()
        self._store_upto(seq, seq.num_computed_tokens, t0, final=True)
        self._stored.pop(seq.seq_id, None)
        self.stats.offloads += 1
        self.stats.offload_call_s.append(time.perf_counter() - t0)
        return []

    def store_filled(self) -> None:
        """Each step, before the forward: launch the store of every block that filled in the steps
        before (prompt chunks and decode tokens alike), as vLLM's offloading connector stores a
        request's blocks as they fill rather than when it finishes. The copy waits for the compute
        stream that wrote the KV; the next forward writes other slots."""
        bs = self.runner.block_size
        t0 = time.perf_counter()
        for seq in list(self.engine.scheduler.running):
            if seq.num_computed_tokens // bs > self._stored.get(seq.seq_id, 0):
                self._store_upto(seq, seq.num_computed_tokens, t0)

    def _store_upto(self, seq, num_tokens: int, t0: float, final: bool = False) -> int:
        """Launch the device->host copy of `seq`'s full blocks below `num_tokens` that were not handled
        yet and that pass the reuse gate; returns the blocks launched. While the request runs, a host
        tier with no free row now is asked again next step; at its finish, what finds no row is
        skipped (counted)."""
        bs = self.runner.block_size
        start, full = self._stored.get(seq.seq_id, 0), min(num_tokens, len(seq.token_ids)) // bs
        if full <= start:
            return 0
        self._stored[seq.seq_id] = full
        keys = prefix_keys(seq.token_ids[:full * bs], bs, self.ns)[start:]
        want = []
        for i, key in enumerate(keys, start):   # which device-cache entry holds the same block (`mirror_share`)
            block = seq.block_table[i]
            self._device_hash[key] = self.bm.block_hash[block]
            self.store.note_use(key)
            if self.store.host.touch(key):
                self.store.admit_if_reused(key)      # reused often enough now: write it below, from host
            elif not self.reuse.eligible(key):
                self.stats.not_stored_unreused += 1  # never crossed to the host: not reused (yet)
            else:
                want.append((key, block))
        if not want:
            return 0
        state = {"want": want, "t0": t0, "done": 0, "final": final, "src": self.runner, "hold": not self.tp}
        if self.tp:
            # the TP merge, inside the step: every rank's heads of these blocks gathered into one staging
            # tensor on rank 0; the copies below read it, so the device blocks need not be held
            state["src"] = staged_source(self.runner.gather_blocks([b for _, b in want]))
            state["want"] = want = [(key, i) for i, (key, _) in enumerate(want)]
        else:
            for _, block in want:                    # held until the copy completed (`completed_blocks`)
                self.bm.ref_count[block] += 1
            with self._lock:
                self._held += len(want)
        n = len(want)
        if not self._offload_round(state, first=True):
            if not final:
                self._stored[seq.seq_id] = start     # try again next step
            if state["hold"]:
                for block in self._unlaunched:       # nothing launched: not held after all
                    self.bm.ref_count[block] -= 1
                with self._lock:
                    self._held -= len(self._unlaunched)
            n = 0
        return n

    def _offload_round(self, state: dict, first: bool) -> bool:
        """Reserve host rows for as many wanted blocks as the host can give now and launch their
        copy; blocks that get no row are skipped (counted) and handed back. A host tier smaller
        than the request takes it in rounds: each round starts when the one before completed."""
        want = state["want"]
        todo = []
        while want:
            slot = self.store.reserve(want[0][0], count=False)
            if slot is None:
                break
            key, block = want.pop(0)
            todo.append((key, slot, block))
        if not todo:
            self._unlaunched = []
            if want:
                if not first or state.get("final", True):
                    self.store.host.stats.skipped += len(want)   # host full of rows still being written or read
                if first:                                    # the caller lets go of them at once
                    self._unlaunched = [block for _, block in want]
                elif state["hold"]:
                    for _, block in want:
                        self._released.put(block)
                want.clear()
            if state["done"] or state.get("final", True):
                self.stats.free_s.append(time.perf_counter() - state["t0"])
            self.stats.offloaded_blocks += state["done"]
            self._notify()
            return False
        pairs = [(b, self.store.host.row(s)) for _, s, b in todo]

        self.stats.transfers += 1

        def copy():
            block_copy.copy_blocks_to_rows(state["src"], self.layout, pairs)

        def done(job: CopyJob):
            if job.error is not None:
                self.stats.copy_failures += 1
                for key, slot, _ in todo:
                    self.store.host.abandon(key, slot)
            else:
                self.store.commit([(k, s) for k, s, _ in todo])   # visible only now: the copy completed
                state["done"] += len(todo)
                if not state.get("final", True):
                    self.stats.stored_while_running += len(todo)
            if state["hold"]:
                for _, _, block in todo:
                    self._released.put(block)
            self._offload_round(state, first=False)

        if first:
            self.copier.submit(copy, done)
        else:
            self.copier.submit_from_worker(copy, done)
        return True

    # -- restore -----------------------------------------------------------------------
    def _device_prefix_blocks(self, seq) -> int:
        """Prompt blocks the device prefix cache holds for `seq` now (the block manager's own lookup)."""
        bm, bs = self.bm, self.runner.block_size
        if not bm.enable_prefix_caching:
            return 0
        prev, n = None, 0
        for i in range((seq.num_prompt_tokens - 1) // bs):
            prev = bm._chain_hash(prev, seq.prompt[i * bs:(i + 1) * bs])
            if prev not in bm.hash_to_block:
                break
            n += 1
        return n

    def _restorable_keys(self, seq, start_block: int) -> list[str]:
        bs = self.runner.block_size
        limit = (seq.num_prompt_tokens - 1) // bs      # never the block holding the last prompt token
        if start_block >= limit:
            return []
        return prefix_keys(seq.prompt[:limit * bs], bs, self.ns)[start_block:]

    def _needs_slow_tier(self, keys: list[str]) -> bool:
        """Does the prefix continue, past what the host tier holds, in a slower tier? Checked on the
        engine thread without I/O waits: host membership (a dict), the file tier's (a stat), the
        peer's from the keys this client stored there (`PeerTier.maybe_contains`, no round trip).
        The fetch thread then asks the tiers themselves."""
        for key in keys:
            if self.store.host.contains(key):
                continue
            for t in self.store.lower:
                if getattr(t, "disabled", False):
                    continue
                if (t.maybe_contains(key) if hasattr(t, "maybe_contains") else t.contains(key)):
                    return True
            return False
        return False

    def loading(self, seq) -> bool:
        """Scheduler, before admitting `seq`: True while part of its prefix is still on its way from a
        slow tier into host rows (it waits; others run). Starts that fetch on first sight."""
        f = self._fetches.get(seq.seq_id)
        if f is not None:
            return not f.done.is_set()
        start = self._device_prefix_blocks(seq)
        keys = self._restorable_keys(seq, start)
        if not keys or not self._needs_slow_tier(keys):
            return False
        f = _Fetch(keys=keys, start_block=start, t_start=time.perf_counter())
        self._fetches[seq.seq_id] = f
        self.stats.fetches_started += 1
        self._fetch_jobs.put(f)
        return True

    def note_step(self) -> None:
        """The engine, after scheduling a step: count a step taken while a fetch is in flight, and
        store the blocks that filled before it (`store_filled`)."""
        if any(not f.done.is_set() for f in self._fetches.values()):
            self.stats.steps_with_fetch_in_flight += 1
        self.store_filled()

    def _fetch_loop(self) -> None:
        while True:
            f = self._fetch_jobs.get()
            if f is None:
                return
            try:
                f.got = self.store.fetch(f.keys)
            except BaseException as e:      # a tier must never take the engine down: a miss
                f.got = Fetched(self.store, [], [], [])
                self.store.host.stats.last_error = f"fetch: {type(e).__name__}: {e}"
            f.t_ready = time.perf_counter()
            f.done.set()
            self._notify()

    def restore(self, seq, start_block: int, take_block) -> list[int]:
        """Blocks `start_block..` of `seq`'s prompt from the tiers: rows already in host memory (a
        completed fetch, or host-tier hits fetched now), then device blocks (`take_block()`) taken
        and filled. Returns the device blocks filled, in order."""
        bs = self.runner.block_size
        limit = (seq.num_prompt_tokens - 1) // bs
        self.stats.prompt_blocks += max(limit, 0)
        self.stats.device_hit_blocks += start_block
        self.stats.mirror_share.append(self.mirrored_share())
        if self.reuse.threshold > 1:       # the lookup the reuse gate counts: blocks past the device cache
            for key in self._restorable_keys(seq, start_block):
                self.reuse.note(key)
        f = self._fetches.pop(getattr(seq, "seq_id", None), None)
        t0 = time.perf_counter()
        if f is not None:
            if not f.done.wait(timeout=60):      # not reached: the scheduler admits only finished fetches
                raise RuntimeError("restore called while the request's fetch is in flight")
            got = f.got
            self.stats.fetch_wait_s.append(f.t_ready - f.t_start)
            skip = start_block - f.start_block   # the device cache may have gained (or lost) blocks meanwhile
            if skip < 0:
                got.release()
                return []
            got = Fetched(self.store, got.keys[skip:], got.rows[skip:], got.sources[skip:], got._slots[skip:]) \
                if skip else got
            if skip:
                for s in f.got._slots[:skip]:
                    if s is not None:
                        self.store.host.unpin(s)
        else:
            keys = self._restorable_keys(seq, start_block)
            if not keys:
                return []
            got = self.store.fetch(keys)     # host hits only, unless the scheduler skipped `loading`
        t1 = time.perf_counter()
        if not got.rows:
            got.release()
            return []
        blocks = [take_block() for _ in got.rows]   # allocated only now that the data is in host memory
        self.stats.transfers += 1
        pairs = list(zip(blocks, got.rows))
        if self.tp:
            # the rows hold every rank's heads: copied out of the pinned rows, then each rank's slice
            # scattered to it and written into its device blocks (`TPModelRunner.scatter_rows`)
            try:
                full = torch.stack([self.layout.views(row)["kv"] for row in got.rows])
            finally:
                got.release()
            if self.runner.device.type == "cuda":
                full = full.pin_memory()
            self.runner.scatter_rows(blocks, full)
        elif self.runner.device.type == "cuda":
            # on the copy stream; the compute stream waits on its event (no host synchronisation),
            # and the pinned rows are released once the copy completed
            job = self.copier.submit(lambda: block_copy.copy_rows_to_blocks(self.runner, self.layout, pairs),
                                     lambda job: got.release(), after_compute=True)
            torch.cuda.current_stream(self.runner.device).wait_event(job.event)
        else:
            try:
                block_copy.copy_rows_to_blocks(self.runner, self.layout, pairs)
            finally:
                got.release()
        self.stats.restores += 1
        for s in got.sources:
            self.stats.restored_blocks[s] += 1
        self.stats.fetch_s.append(t1 - t0)
        self.stats.realloc_s.append(time.perf_counter() - t1)
        return blocks

    def forget(self, seq) -> None:
        """A request leaves before admission: release its fetched rows."""
        f = self._fetches.pop(seq.seq_id, None)
        if f is not None and f.done.wait(timeout=60) and f.got is not None:
            f.got.release()

    def block_bytes(self, block: int) -> torch.Tensor:
        """One device block's KV as bytes, in the host row's order (tests and checks)."""
        return torch.cat([p.contiguous().view(-1).view(torch.uint8).cpu() for p in block_pieces(self.runner, block)])

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait for every copy in flight, hand its blocks back to the block manager, then wait for the
        slow-tier writes."""
        ok = self.copier.wait_idle(timeout_s)
        self.bm.reclaim()
        return self.store.flush(timeout_s) and ok

    def close(self) -> None:
        self.flush(30.0)
        self.copier.close()
        self._fetch_jobs.put(None)
        self._fetcher.join(timeout=10)
        for f in list(self._fetches.values()):
            if f.done.is_set() and f.got is not None:
                f.got.release()
        self._fetches.clear()
        self.store.close()
