"""What the tiered-KV chapter measures, as functions a second chapter could call: the host tier's
offload copy against the memory-copy bandwidth, the file tier's durable writes against one
sequential file, one closed-loop engine run with the tiers of a configuration, and one request's
first-token time with its prefix restored against recomputed."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from ...measure import Timing, benchmark, ceilings
from ..config import EngineConfig
from ..engine import LLMEngine
from ..metrics import run_closed_loop
from ..sequence import SamplingParams
from .block_copy import CROSS_LAYER, LAYER_MAJOR, block_pieces, copy_blocks_to_rows, engine_layout, use_cross_layer_blocks
from .engine_tiers import EngineKVTiers
from .file_tier import FileTier
from .host_cache import HostTier


def copy_ceiling(device: torch.device, nbytes: int = 1 << 28) -> dict:
    """The memory-copy bandwidth this run compares the host tier with.

    CPU: `measure.ceilings(device).copy_gbps`, a large host->host copy, counting bytes read +
    written. CUDA: a large device->host copy into pinned memory, counting bytes transferred."""
    if device.type != "cuda":
        c = ceilings(device)
        return {"gbps": c.copy_gbps, "what": f"host->host copy of {c.copy_bytes // 2 >> 20} MiB (measure.ceilings)",
                "convention": "bytes read + written", "factor": 2.0}
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t = benchmark(lambda: dst.copy_(src, non_blocking=True), device, label="d2h", warmup=2, min_reps=5)
    return {"gbps": nbytes / t.median_s / 1e9, "what": f"device->pinned host copy of {nbytes >> 20} MiB",
            "convention": "bytes transferred", "factor": 1.0}


COPY_LAYERS, COPY_HEADS, COPY_HEAD_DIM = 8, 8, 128


def copy_block_tokens(block_mb: float, dtype: torch.dtype) -> int:
    """Tokens per block so that one block (K and V of 8 layers x 8 KV heads x 128 head dim) is about `block_mb` MB."""
    per_token = 2 * COPY_LAYERS * COPY_HEADS * COPY_HEAD_DIM * dtype.itemsize
    return max(1, round(block_mb * (1 << 20) / per_token))


def copy_pool(device: torch.device, n: int, bs: int, dtype: torch.dtype, kv_layout: str):
    """A stand-in for the engine's runner holding a paged pool of `n` blocks in `kv_layout`, random
    values; `kv_tiers.copy_blocks_to_rows` reads it exactly as it reads the engine's pool."""
    from types import SimpleNamespace



    shape = (COPY_LAYERS, n * bs, COPY_HEADS, COPY_HEAD_DIM)
    runner = SimpleNamespace(block_size=bs, dtype=dtype, device=device,
                             k_cache=torch.empty(shape, dtype=dtype, device=device),
                             v_cache=torch.empty(shape, dtype=dtype, device=device))
    if kv_layout == CROSS_LAYER:
        use_cross_layer_blocks(runner)
        runner.kv_blocks.normal_()
    else:
        runner.k_cache.normal_(), runner.v_cache.normal_()
    return runner, engine_layout(runner)


def host_copy_setup(device: torch.device, block_mb: float, total_mb: int, dtype: torch.dtype,
                    kv_layout: str = CROSS_LAYER) -> dict:
    """A paged pool of about `total_mb` in `kv_layout` and a host tier with a row for each of its
    blocks; `fn` offloads every block through the engine's copy path (`copy_blocks_to_rows`: one
    copy per block cross-layer, 2 x layers layer-major) as one batch, and waits for it."""
    from ...device import synchronize

    bs = copy_block_tokens(block_mb, dtype)
    block_bytes = 2 * COPY_LAYERS * bs * COPY_HEADS * COPY_HEAD_DIM * dtype.itemsize
    n = max(2, int(total_mb * (1 << 20) // block_bytes))
    runner, layout = copy_pool(device, n, bs, dtype, kv_layout)
    host = HostTier(n, layout.nbytes, pin=device.type == "cuda")
    pairs = [(b, host.row(b)) for b in range(n)]
    copies = [0]

    def fn():
        copies[0] = copy_blocks_to_rows(runner, layout, pairs)
        synchronize(device)

    def exact() -> bool:   # the benchmarked path in bits: first and last block
    
        return all(torch.equal(host.row(b)[:block_bytes].cpu(),
                               torch.cat([p.contiguous().view(-1).view(torch.uint8).cpu()
                                          for p in block_pieces(runner, b)])) for b in (0, n - 1))
    return {"block_bytes": block_bytes, "blocks": n, "block_size_tokens": bs, "fn": fn, "exact": exact,
            "bytes": n * block_bytes, "pinned": host.pinned_memory, "copies": copies, "kv_layout": kv_layout}


def host_copy_benchmark(device: torch.device, block_mbs: list[float], total_mb: int, dtype: torch.dtype,
                        rounds: int = 3) -> list[dict]:
    """Every block size in both layouts, `rounds` times in turn (so a change in machine load hits all
    alike); each (size, layout)'s samples pooled into one Timing."""
    out = [{"block_mb": mb, "kv_layout": lay, "samples": []} for mb in block_mbs for lay in (CROSS_LAYER, LAYER_MAJOR)]
    for _ in range(rounds):
        for item in out:           # one pool at a time: the pools of all sizes need not fit together
            setup = host_copy_setup(device, item["block_mb"], total_mb, dtype, item["kv_layout"])
            t = benchmark(setup["fn"], device, label=f"offload {item['block_mb']} MB {item['kv_layout']}", warmup=1,
                          min_reps=3, max_reps=6, min_time_s=0.1)
            item["samples"] += t.samples_s
            item.update({k: v for k, v in setup.items() if k not in ("fn", "exact", "copies")}, timer=t.timer,
                        copies_per_call=setup["copies"][0], exact=item.get("exact", True) and setup["exact"]())
            del setup
    for item in out:
        item["timing"] = Timing(label=f"offload {item['block_mb']} MB {item['kv_layout']}",
                                samples_s=item.pop("samples"), timer=item.pop("timer"), warmup=1)
    return out


def filesystem_benchmark(directory: Path, total_mb: int, block_mb: float = 1.0) -> dict:
    """Durable writes of `block_mb` blocks through the file tier, warm reads back (verified), and a
    sequential write of the same bytes to one file (block-sized writes, one fsync) on the same disk."""
    directory.mkdir(parents=True, exist_ok=True)
    nbytes = int(block_mb * (1 << 20))
    n = max(2, total_mb * (1 << 20) // nbytes)
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) for _ in range(min(n, 8))]
    tier = FileTier(directory / "tier", "bench", nbytes, durable=True)
    keys = [f"{i:064x}" for i in range(n)]
    t0 = time.perf_counter()
    ok = sum(tier.put(key, rows[i % len(rows)]) for i, key in enumerate(keys))
    t_tier = time.perf_counter() - t0
    back = torch.empty(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    good = sum(tier.read_into(key, back) and torch.equal(back, rows[i % len(rows)]) for i, key in enumerate(keys))
    t_read = time.perf_counter() - t0
    seq = directory / "sequential.bin"
    t0 = time.perf_counter()
    with open(seq, "wb") as f:
        for i in range(n):
            f.write(memoryview(rows[i % len(rows)].numpy()))
        f.flush()
        os.fsync(f.fileno())
    t_seq = time.perf_counter() - t0
    shutil.rmtree(directory, ignore_errors=True)
    return {"blocks": n, "block_bytes": nbytes, "bytes": n * nbytes, "tier_write_s": t_tier, "tier_read_s": t_read,
            "sequential_write_s": t_seq, "written": ok, "read_ok": good}


def run_workload(model, prompts, P: dict, config: str, *, host_blocks: int, scratch: Path, peer_address, seed: int):
    """One closed-loop run on a fresh engine (device prefix caching on); tiers per `config`. "on reuse":
    vLLM's reuse gate before the host (a block crosses to the host once looked up `admit_after`
    times); otherwise every full block is stored as it fills."""
    ecfg = EngineConfig(max_num_seqs=P["max_num_seqs"], max_num_batched_tokens=P["max_num_batched_tokens"],
                        block_size=P["block_size"], num_blocks=P["device_blocks"], enable_prefix_caching=True, seed=seed)
    engine = LLMEngine(model, ecfg)
    tiers = None
    if config != "no tiers":
        kw = {"host_capacity_blocks": host_blocks}
        if "file" in config:
            kw["file_dir"] = scratch
        if "peer" in config and peer_address is not None:
            kw["peer_address"] = peer_address
        tiers = EngineKVTiers(engine, kw, model_id=f"tiny-seed{seed}",
                              store_threshold=P["admit_after"] if "on reuse" in config else 1)
        for t in tiers.store.lower:
            if t.name == "file" and P.get("file_blocks"):   # an LRU of that many block files (header < 1 KiB)
                t.capacity_bytes = P["file_blocks"] * (t.row_bytes + 1024)
            if t.name == "peer" and not t.clear():   # one peer process serves every run; each run starts empty
                raise RuntimeError(f"the KV peer could not be cleared: {t.stats.last_error}")
    # warm-up on a prompt no measured request shares (first-call costs are not the tiers')
    g = torch.Generator().manual_seed(seed + 999)
    engine.generate([torch.randint(P["vocab"], (P["block_size"] + 1,), generator=g).tolist()], SamplingParams(max_tokens=2))
    engine.steps.clear()
    if tiers is not None:
        tiers.flush()
        tiers.stats.__init__()
        for t in tiers.store.tiers:
            t.stats.__init__(t.name)
        tiers.store.not_admitted = 0
        tiers.reuse.counts.clear()          # the warm-up's lookups are not the workload's
    engine.compute_syncs = engine.idle_steps = 0
    run = run_closed_loop(engine, prompts, SamplingParams(max_tokens=P["output_len"]), P["max_num_seqs"])
    if tiers is not None:
        tiers.flush()
    return engine, tiers, run


RESTORE_SOURCES = ("recompute", "host", "file")


def first_token_time(engine, prompt: list[int]) -> float:
    """Seconds from admitting `prompt` (one request, engine otherwise idle) to its first token."""
    t0 = engine.clock()
    seq = engine.add_request(prompt, SamplingParams(max_tokens=1))
    while seq.first_token_s is None:
        engine.step()
    while engine.has_unfinished():
        engine.step()
    return seq.first_token_s - t0


def restore_vs_recompute(model, P: dict, scratch: Path, seed: int) -> dict:
    """One request with a shared prefix of `prefix_len` tokens and a fresh suffix, timed to its first
    token `restore_reps` times per source, the sources interleaved: `recompute` (no tiers; the
    device cache is off, so the prefix is prefilled every time), `host` (restored from the host
    tier), `file` (a one-block host tier over the file tier: the prefix comes from files). The
    device prefix cache is off in all three, so nothing but the source differs. Returns
    {source: Timing, "restored_tokens": {source: [...]}}."""
    g = torch.Generator().manual_seed(seed + 7)
    prefix = torch.randint(P["vocab"], (P["prefix_len"],), generator=g).tolist()
    ecfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=P["max_num_batched_tokens"],
                        block_size=P["block_size"], num_blocks=P["device_blocks"], enable_prefix_caching=False)
    engines, tiers = {}, {}
    for src in RESTORE_SOURCES:
        engines[src] = LLMEngine(model, ecfg)
        if src != "recompute":
            kw = {"host_capacity_blocks": P["host_blocks"] if src == "host" else 1}
            if src == "file":   # written in the copy's completion, so a one-row host tier passes every block down
                kw.update(file_dir=scratch / "restore-file", background=False)
            tiers[src] = EngineKVTiers(engines[src], kw, model_id=f"restore-{seed}")
    samples = {src: [] for src in RESTORE_SOURCES}
    cached = {src: [] for src in RESTORE_SOURCES}
    try:
        for src in RESTORE_SOURCES:      # warm-up; puts the prefix into the tiers
            first_token_time(engines[src], prefix + [0])
            if src in tiers:
                tiers[src].flush()
        for _ in range(P["restore_reps"]):
            for src in RESTORE_SOURCES:
                suffix = torch.randint(P["vocab"], (P["suffix_len"],), generator=g).tolist()
                samples[src].append(first_token_time(engines[src], prefix + suffix))
                cached[src].append(engines[src].finished[-1].num_cached_tokens)
                if src in tiers:
                    tiers[src].flush()     # the offload of this request, outside the timed region
    finally:
        for t in tiers.values():
            t.close()
    out = {src: Timing(label=f"first token, prefix from {src}", samples_s=samples[src], timer="perf_counter", warmup=1)
           for src in RESTORE_SOURCES}
    out["restored_tokens"] = cached
    return out

