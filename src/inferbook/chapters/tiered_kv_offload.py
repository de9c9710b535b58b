"""Chapter `tiered-kv-offload`: when does a host-centred KV tier pay, and what does it cost?

Seed section 五 (vLLM's write-up of 10 September on Tiered KV Offloading, a framework present
since v0.22): device KV goes to host DRAM first, slower tiers are fed from the host copy, the
host tier is a cache in its own right. The seed names three things to watch — per-tier hit
rate, bytes moved and their latency, device-memory free and re-allocation time — and warns that
when most requests share no prefix, slower storage only adds copying.

`measure(ctx, ...)` returns RunRecords for:

- `copy-<n>MB`: the host tier's offload copy of blocks of n MB (the engine's copy path) in the
  cross-layer layout (one copy per block) and in the layer-major one (2 x layers copies per
  block), against the memory-copy bandwidth measured in the same run (host->host on CPU:
  `measure.ceilings`; device->host into pinned memory on CUDA, measured here);
- `filesystem`: the file tier's durable writes (and warm reads) of 1 MB blocks against a
  sequential write of the same bytes to one file on the same disk;
- `<workload>/<config>`: the serving engine on two workloads — `shared` (requests draw one of a
  few long prefixes) and `none` (no shared prefix) — with no tiers, with a host tier, and with
  host + filesystem + peer tiers, once admitting every block below the host and once only blocks
  reused `admit_after` times: TTFT (every request's, all repeats, for `measure.compare_timings`),
  throughput, per-tier lookups/hits/bytes/latency, and device free / re-allocation times;
- `sweep/host=<blocks>`: the shared workload with a host tier of growing capacity (multiples of
  the device KV pool): blocks served by the host tier beyond what the device cache served.
"""
from __future__ import annotations

import math

import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..measure import Timing, benchmark, ceilings, compare_timings, significant
from ..presets import Param
from ..record import RunRecord
from ..serving.config import EngineConfig
from ..serving.engine import LLMEngine
from ..serving.kv_tiers import (CROSS_LAYER, LAYER_MAJOR, BlockLayout, EngineKVTiers, FileTier, HostTier, PeerProcess,
                                copy_blocks_to_rows)
from ..serving.metrics import run_closed_loop
from ..serving.model_runner import observed_paged_kernels, paged_kernels_label
from ..serving.model import TinyConfig, TinyDecoder, init_weights
from ..serving.sequence import SamplingParams

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('restore-host', 'first_token_time')

PARAMETERS = {
    "d_model": Param(int, help="model width"),
    "n_layers": Param(int, help="decoder layers"),
    "n_heads": Param(int, help="query heads"),
    "n_kv_heads": Param(int, help="key/value heads"),
    "ffn": Param(int, help="SwiGLU hidden size"),
    "vocab": Param(int, help="vocabulary size"),
    "dtype": Param(str, help="weights, activations and KV", choices=("float32", "bfloat16", "float16")),
    "block_size": Param(int, help="tokens per KV block"),
    "prefix_len": Param(int, help="tokens of each shared prefix (the 'none' workload: same prompt length, random)"),
    "suffix_len": Param(int, help="request-specific tokens after the prefix"),
    "output_len": Param(int, help="generated tokens per request"),
    "num_prefixes": Param(int, help="distinct shared prefixes in the 'shared' workload"),
    "num_requests": Param(int, help="requests per run"),
    "max_num_seqs": Param(int, help="requests in flight (closed-loop concurrency)"),
    "max_num_batched_tokens": Param(int, help="per-step token budget"),
    "device_blocks": Param(int, help="KV blocks in the device pool (running requests + device prefix cache)"),
    "host_blocks": Param(int, help="host tier capacity (blocks) in the workload comparison"),
    "host_sweep": Param(str, help="host capacities for the sizing sweep, as multiples of device_blocks"),
    "copy_block_mb": Param(str, help="block sizes (MB) of the host copy benchmark, comma-separated"),
    "copy_total_mb": Param(int, help="MB copied per block size in the copy benchmark"),
    "file_total_mb": Param(int, help="MB written through the file tier in the filesystem benchmark"),
    "use_peer": Param(bool, help="add the remote-peer tier (a second process on 127.0.0.1)"),
    "admit_after": Param(int, help="uses of a block before it is written below the host (the 'admit on reuse' config)"),
    "repeats": Param(int, min=2, help="runs of each engine configuration, interleaved; their median TTFTs are compared"),
    "restore_reps": Param(int, help="timed single requests per source in the restore-vs-recompute benchmark"),
    "cpu_threads": Param(int, 1, min=0, help="torch threads on CPU during the measurement (0: leave as is)"),
}

PRESETS = {
    "smoke": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, vocab=256, dtype="float32",
                  block_size=16, prefix_len=96, suffix_len=16, output_len=4, num_prefixes=6, num_requests=24,
                  max_num_seqs=2, max_num_batched_tokens=128, device_blocks=32, host_blocks=64,
                  host_sweep="0.5,1,2,3", copy_block_mb="1,4", copy_total_mb=32, file_total_mb=8, use_peer=True, admit_after=2, repeats=3, restore_reps=6),
    "cpu": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn=688, vocab=512, dtype="float32",
                block_size=16, prefix_len=384, suffix_len=32, output_len=8, num_prefixes=8, num_requests=48,
                max_num_seqs=4, max_num_batched_tokens=512, device_blocks=160, host_blocks=320,
                host_sweep="0.25,0.5,0.75,1,1.5", copy_block_mb="1,2,4,8", copy_total_mb=256, file_total_mb=64,
                use_peer=True, admit_after=2, repeats=4, restore_reps=15),
    "gpu": dict(d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, ffn=2816, vocab=32000, dtype="bfloat16",
                block_size=16, prefix_len=2048, suffix_len=128, output_len=32, num_prefixes=16, num_requests=64,
                max_num_seqs=8, max_num_batched_tokens=8192, device_blocks=2048, host_blocks=4096,
                host_sweep="0.25,0.5,0.75,1,1.5,2", copy_block_mb="1,2,4,8,16", copy_total_mb=1024, file_total_mb=512,
                use_peer=True, admit_after=2, repeats=5, restore_reps=15),
}

WORKLOADS = ("shared", "none")


def configs(P: dict) -> tuple[str, ...]:
    """The engine configurations compared: no tiers; host only; every tier, admitting every block
    below the host; every tier, admitting a block below the host only after `admit_after` uses."""
    full = "host+file+peer" if P["use_peer"] else "host+file"
    return ("no tiers", "host", f"{full}, admit all", f"{full}, admit on reuse")


def parse_floats(name: str, text) -> list[float]:
    try:
        values = [float(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):  # NaN passes `min(values) <= 0`
        raise UserError(f"{name}={text!r} must be comma-separated positive finite numbers, e.g. '1,2,4'")
    return values


def model_config(P: dict) -> TinyConfig:
    return TinyConfig(vocab=P["vocab"], d_model=P["d_model"], n_layers=P["n_layers"], n_heads=P["n_heads"],
                      n_kv_heads=P["n_kv_heads"], ffn=P["ffn"],
                      max_seq=P["prefix_len"] + P["suffix_len"] + P["output_len"])


def blocks_per_request(P: dict) -> int:
    return -(-(P["prefix_len"] + P["suffix_len"] + P["output_len"]) // P["block_size"])


def check_params(P: dict) -> None:
    """Every size the measurement relies on, checked before any work."""
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn", "vocab", "block_size", "prefix_len",
                 "suffix_len", "output_len", "num_prefixes", "num_requests", "max_num_seqs", "max_num_batched_tokens",
                 "device_blocks", "host_blocks", "copy_total_mb", "file_total_mb", "admit_after", "repeats",
                 "restore_reps"):
        if P[name] < 1:
            raise UserError(f"{name}={P[name]!r} must be a positive int")
    if P["repeats"] < 2 or P["restore_reps"] < 2:
        raise UserError(f"repeats={P['repeats']} and restore_reps={P['restore_reps']} must be at least 2: a "
                        "comparison needs at least two samples a side")
    if P["prefix_len"] < P["block_size"]:
        raise UserError(f"prefix_len={P['prefix_len']} is shorter than one block (block_size={P['block_size']}); "
                        "nothing could be reused")
    need = P["max_num_seqs"] * blocks_per_request(P)
    if P["device_blocks"] < need:
        raise UserError(f"device_blocks={P['device_blocks']} cannot hold max_num_seqs={P['max_num_seqs']} requests "
                        f"of {blocks_per_request(P)} blocks each; use at least {need}")
    parse_floats("host_sweep", P["host_sweep"])
    parse_floats("copy_block_mb", P["copy_block_mb"])


def make_workload(kind: str, P: dict, seed: int) -> list[list[int]]:
    """`shared`: each request = one of `num_prefixes` prefixes (uniformly at random) + a random suffix;
    `none`: random prompts of the same length."""
    if kind not in WORKLOADS:
        raise UserError(f"workload {kind!r} unknown; choose 'shared' or 'none'")
    g = torch.Generator().manual_seed(seed + (101 if kind == "shared" else 202))   # no accidental sharing
    V, n = P["vocab"], P["num_requests"]
    suffixes = torch.randint(V, (n, P["suffix_len"]), generator=g).tolist()
    if kind == "none":
        return [torch.randint(V, (P["prefix_len"],), generator=g).tolist() + s for s in suffixes]
    prefixes = torch.randint(V, (P["num_prefixes"], P["prefix_len"]), generator=g).tolist()
    which = torch.randint(P["num_prefixes"], (n,), generator=g).tolist()
    return [prefixes[w] + s for w, s in zip(which, suffixes)]


# ---------------------------------------------------------------------------
# Copy and filesystem benchmarks

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

    from ..serving.kv_tiers import engine_layout, use_cross_layer_blocks

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
    from ..device import synchronize

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
        from ..serving.kv_tiers import block_pieces
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


# ---------------------------------------------------------------------------
# The engine runs

def run_workload(model, prompts, P: dict, config: str, *, host_blocks: int, scratch: Path, peer_address, seed: int):
    """One closed-loop run on a fresh engine (device prefix caching on); tiers per `config`."""
    ecfg = EngineConfig(max_num_seqs=P["max_num_seqs"], max_num_batched_tokens=P["max_num_batched_tokens"],
                        block_size=P["block_size"], num_blocks=P["device_blocks"], enable_prefix_caching=True, seed=seed)
    engine = LLMEngine(model, ecfg)
    tiers = None
    if config != "no tiers":
        kw = {"host_capacity_blocks": host_blocks, "admit_after": P["admit_after"] if "on reuse" in config else 1}
        if "file" in config:
            kw["file_dir"] = scratch
        if "peer" in config and peer_address is not None:
            kw["peer_address"] = peer_address
        tiers = EngineKVTiers(engine, kw, model_id=f"tiny-seed{seed}")
        for t in tiers.store.lower:
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


def _median(xs):
    return statistics.median(xs) if xs else 0.0


def engine_record(ctx, name: str, variant: str, workload_kind: str, P: dict, cfg: TinyConfig, engine, tiers, run,
                  host_blocks: int | None) -> RunRecord:
    bs = P["block_size"]
    kv_block_bytes = 2 * cfg.n_layers * bs * cfg.n_kv_heads * cfg.head_dim * torch.empty((), dtype=getattr(torch, P["dtype"])).element_size()
    rec = ctx.new_record(name, variant=variant, workload={
        "model": f"tiny-decoder L{cfg.n_layers} d{cfg.d_model} h{cfg.n_heads}/{cfg.n_kv_heads} V{cfg.vocab} "
                 f"({cfg.n_params() / 1e6:.2f}M params)",
        "model_revision": f"random init, seed {ctx.seed}", "quantization": f"none ({P['dtype']})", "dtype": P["dtype"],
        "input_len": P["prefix_len"] + P["suffix_len"], "output_len": P["output_len"],
        "batch": f"concurrency {P['max_num_seqs']}", "workload": workload_kind, "num_requests": P["num_requests"],
        "num_prefixes": P["num_prefixes"] if workload_kind == "shared" else 0,
        "device_blocks": P["device_blocks"], "host_blocks": host_blocks, "block_size": bs,
        "kv_block_bytes": kv_block_bytes, "timer": "perf_counter wall, device synchronised",
    }, topology={"ranks": 1, "tp": 1})
    # the SDPA kernel observed running on this engine's own prefill and decode shapes, not a typed label
    prompt = P["prefix_len"] + P["suffix_len"]
    kernels = observed_paged_kernels(cfg, getattr(torch, P["dtype"]), ctx.device, prefill_len=prompt,
                                     context_len=prompt + P["output_len"])
    rec.set_backend("attention", paged_kernels_label(kernels), reason="PyTorch reference path of this engine",
                    dtype=P["dtype"], shapes={c: r["shapes"] for c, r in kernels.items()}, observed=True)
    rec.set_backend("kv_tiers", variant, reason="the variant under study",
                    shapes={"host_row_bytes": kv_block_bytes, "pinned": bool(tiers and tiers.store.host.pinned_memory)})
    rec.add("mean_ttft", run.mean("ttft_s"), "s", phase="ttft")
    rec.add("median_ttft", run.median("ttft_s"), "s", phase="ttft")
    rec.add("output_throughput", run.output_throughput, "output tok/s", phase="total")
    rec.add("total_throughput", run.total_throughput, "total tok/s", phase="total")
    rec.add("duration", run.duration_s, "s", phase="total")
    cached = sum(r_.input_len for r_ in run.requests)
    rec.add("prompt_tokens", cached, "tokens", phase="total")
    seqs = engine.finished[-P["num_requests"]:]
    rec.add("reused_prompt_share", sum(s.num_cached_tokens for s in seqs) / cached, "fraction of prompt tokens",
            phase="ttft")
    if tiers is not None:
        st = tiers.stats
        rec.add("device_hit_blocks", st.device_hit_blocks, "blocks", phase="ttft")
        rec.add("prompt_blocks", st.prompt_blocks, "blocks", phase="ttft")
        for tier, n in st.restored_blocks.items():
            rec.add(f"restored_blocks/{tier}", n, "blocks", phase="ttft")
        rec.add("offloaded_blocks", st.offloaded_blocks, "blocks", phase="total")
        rec.add("host_mirror_share", statistics.fmean(st.mirror_share) if st.mirror_share else 0.0, "fraction",
                phase="ttft", definition="mean over admissions: share of host-tier blocks the device prefix cache "
                                         "also held at that moment")
        rec.add("free_time_median", _median(st.free_s), "s", phase="total",
                definition="per finishing request: launch of its device->host copy until the copy completed and "
                           "its device blocks were handed back (off the engine thread)")
        rec.add("offload_call_median", _median(st.offload_call_s), "s", phase="total",
                definition="per finishing request: the engine thread's own time in offload (keys, host rows, launch)")
        rec.add("realloc_time_median", _median(st.realloc_s), "s", phase="ttft",
                definition="per restoring request: take device blocks once data is in host memory + host->device copy")
        rec.add("fetch_time_median", _median(st.fetch_s), "s", phase="ttft",
                definition="per restoring request, at admission: host-tier hits into rows (slow tiers: see fetch_wait)")
        rec.add("fetch_wait_median", _median(st.fetch_wait_s), "s", phase="ttft",
                definition="per request with a slow-tier fetch: fetch started until its rows were in host memory; "
                           "the request waited, the engine stepped others")
        rec.add("fetches", st.fetches_started, "requests", phase="ttft")
        rec.add("steps_with_fetch_in_flight", st.steps_with_fetch_in_flight, "steps", phase="total")
        rec.add("not_admitted_below_host", tiers.store.not_admitted, "blocks", phase="total",
                definition=f"blocks kept in host memory only: used fewer than admit_after="
                           f"{tiers.store.admit_after} times when offloaded")
        for tier, s in tiers.store.stats().items():
            for key, unit in (("lookups", "blocks"), ("hits", "blocks"), ("hit_rate", "fraction"),
                              ("bytes_written", "bytes"), ("bytes_read", "bytes"), ("writes", "blocks"),
                              ("reads", "blocks"), ("failures", "count"), ("corrupt", "count"), ("timeouts", "count"),
                              ("skipped", "count"), ("evictions", "blocks")):
                rec.add(f"{tier}/{key}", s[key], unit, phase="total")
            if s["reads"] and tier != "host":
                rec.add(f"{tier}/read_latency", s["read_s"] / s["reads"], "s per block", phase="ttft")
            if s["writes"] and tier != "host":
                rec.add(f"{tier}/write_latency", s["write_s"] / s["writes"], "s per block", phase="total",
                        definition="background writer thread, from the host copy")
    return rec


def measure(ctx, *, cpu_threads, **P) -> list[RunRecord]:
    """See the module docstring."""
    check_params(P)
    if ctx.device.type != "cpu" or cpu_threads <= 0:
        return _measure(ctx, P)
    before = torch.get_num_threads()
    torch.set_num_threads(cpu_threads)
    try:
        return _measure(ctx, P)
    finally:
        torch.set_num_threads(before)


def _measure(ctx, P: dict) -> list[RunRecord]:
    from ..context import results_dir

    dtype = getattr(torch, P["dtype"])
    records: list[RunRecord] = []
    scratch_root = results_dir() / "tiered-kv-offload-scratch"
    shutil.rmtree(scratch_root, ignore_errors=True)

    # 1. host copy vs memory-copy bandwidth
    ceil = copy_ceiling(ctx.device)
    for r in host_copy_benchmark(ctx.device, parse_floats("copy_block_mb", P["copy_block_mb"]), P["copy_total_mb"],
                                 dtype):
        mb, lay = r["block_mb"], r["kv_layout"]
        gbps = ceil["factor"] * r["bytes"] / r["timing"].median_s / 1e9
        shapes = (f"kv [8, 2, {r['block_size_tokens']}, 8, 128] per block (one piece)" if lay == CROSS_LAYER else
                  f"k,v [8, {r['block_size_tokens']}, 8, 128] per block (16 pieces)")
        rec = ctx.new_record(f"copy-{mb:g}MB-{lay}", variant=f"host tier offload copy, {lay}", workload={
            "block_bytes": r["block_bytes"], "blocks": r["blocks"], "dtype": P["dtype"], "block_mb": mb,
            "kv_layout": lay, "shapes": shapes, "pinned_host": r["pinned"],
            "ceiling": ceil["what"], "convention": ceil["convention"]}, topology={"ranks": 1})
        rec.set_backend("offload_copy", f"torch copy_ per contiguous piece, {r['copies_per_call'] // r['blocks']} per block"
                        + (", non_blocking into pinned" if r["pinned"] else ""),
                        reason="kv_tiers.copy_blocks_to_rows, the engine's path", dtype=P["dtype"])
        rec.add_timing("copy_time", r["timing"], phase="steady", bytes=r["bytes"])
        rec.add("copies_per_block", r["copies_per_call"] / r["blocks"], "copies", phase="steady")
        rec.add("copy_gbps", gbps, "GB/s", phase="steady", convention=ceil["convention"])
        rec.add("ceiling_gbps", ceil["gbps"], "GB/s", phase="steady", what=ceil["what"], convention=ceil["convention"])
        rec.add("fraction_of_ceiling", gbps / ceil["gbps"], "fraction", phase="steady", target=0.70)
        rec.add_check("offloaded rows equal the device blocks in bits", r["exact"])
        records.append(rec)

    # 2. filesystem tier vs a sequential write of the same disk
    fs = filesystem_benchmark(scratch_root / "fsbench", P["file_total_mb"])
    rec = ctx.new_record("filesystem", variant="file tier", workload={
        "block_bytes": fs["block_bytes"], "blocks": fs["blocks"], "disk": str(scratch_root),
        "durable": "fsync per block file (tier); one fsync at the end (sequential)"}, topology={"ranks": 1})
    rec.set_backend("file_tier", "one file per block, tmp + fsync + os.replace, sha256 verified on read",
                    reason="kv_tiers.FileTier")
    rec.add("tier_write_gbps", fs["bytes"] / fs["tier_write_s"] / 1e9, "GB/s", phase="steady")
    rec.add("sequential_write_gbps", fs["bytes"] / fs["sequential_write_s"] / 1e9, "GB/s", phase="steady")
    rec.add("tier_read_gbps", fs["bytes"] / fs["tier_read_s"] / 1e9, "GB/s", phase="steady",
            note="warm page cache: the files were just written")
    rec.add("tier_over_sequential", fs["sequential_write_s"] / fs["tier_write_s"], "fraction", phase="steady")
    rec.add_check("every block written and read back verified", fs["written"] == fs["blocks"] == fs["read_ok"])
    records.append(rec)

    # 3. two workloads x three configurations, and 4. the host-capacity sweep; repeats outermost and
    # configurations interleaved, so drift in machine load hits every configuration alike
    cfg = model_config(P)
    model = init_weights(TinyDecoder(cfg), ctx.seed).to(device=ctx.device, dtype=dtype).eval()
    peer = PeerProcess() if P["use_peer"] else None
    runs: dict[str, list] = {}
    first: dict[str, RunRecord] = {}
    try:
        addr = peer.address if peer else None
        plan = []
        for kind in WORKLOADS:
            for config in configs(P):
                plan.append((f"{kind}/{config}", kind, config, P["host_blocks"], None))
        sweep = []
        for mult in parse_floats("host_sweep", P["host_sweep"]):
            hb = max(1, round(mult * P["device_blocks"]))
            sweep.append((f"sweep/host={hb}", "shared", "host", hb, mult))
        prompts = {kind: make_workload(kind, P, ctx.seed) for kind in WORKLOADS}
        outputs = {}
        # the sweep counts blocks (the same every run), so it runs once; the comparisons repeat
        for rep in range(P["repeats"]):
            for name, kind, config, hb, mult in plan + (sweep if rep == 0 else []):
                engine, tiers, run = run_workload(model, prompts[kind], P, config, host_blocks=hb,
                                                  scratch=scratch_root / name.replace("/", "-").replace("+", "-"),
                                                  peer_address=addr, seed=ctx.seed)
                runs.setdefault(name, []).append(run)
                outputs.setdefault(name, run.outputs)
                if name not in first:
                    variant = config if mult is None else f"host x{mult:g}"
                    rec = engine_record(ctx, name, variant, kind, P, cfg, engine, tiers, run,
                                        hb if tiers else None)
                    if mult is not None:
                        rec.workload["host_over_device"] = mult
                    first[name] = rec
                if tiers is not None:
                    tiers.close()
                shutil.rmtree(scratch_root / name.replace("/", "-").replace("+", "-"), ignore_errors=True)
    finally:
        if peer is not None:
            peer.stop()
        shutil.rmtree(scratch_root, ignore_errors=True)
    for name, rec in first.items():
        # times: the median over repeats (every run kept); counts: the first run's (the same workload each time)
        rs = runs[name]
        # one sample per run: the run's median TTFT. The requests of one run share its machine load, so
        # they are not independent samples; comparisons go over runs (`verdicts`).
        rec.add_timing("ttft", Timing(label=f"{name} median ttft per run", samples_s=[r.median("ttft_s") for r in rs],
                                      timer="perf_counter", warmup=0), phase="ttft")
        for metric, fn in (("mean_ttft", lambda r: r.mean("ttft_s")), ("median_ttft", lambda r: r.median("ttft_s")),
                           ("output_throughput", lambda r: r.output_throughput),
                           ("total_throughput", lambda r: r.total_throughput), ("duration", lambda r: r.duration_s)):
            m = rec.get(metric)
            vals = [fn(r) for r in rs]
            m["value"], m["runs"], m["aggregate"] = statistics.median(vals), vals, f"median of {len(vals)} run(s)"
        ref = outputs[f"{rec.workload['workload']}/no tiers"]
        rec.add_check("same greedy tokens as without tiers", all(r.outputs == ref for r in rs))
        records.append(rec)

    # 5. one request: its prefix restored (host, file) against recomputed, on this model
    rv = restore_vs_recompute(model, P, scratch_root, ctx.seed)
    shutil.rmtree(scratch_root, ignore_errors=True)
    for src in RESTORE_SOURCES:
        rec = ctx.new_record(f"restore-{src}", variant=f"prefix from {src}", workload={
            "model": f"tiny-decoder L{cfg.n_layers} d{cfg.d_model} h{cfg.n_heads}/{cfg.n_kv_heads} V{cfg.vocab} "
                     f"({cfg.n_params() / 1e6:.2f}M params)", "dtype": P["dtype"], "prefix_len": P["prefix_len"],
            "suffix_len": P["suffix_len"], "requests": "one at a time, device prefix cache off"}, topology={"ranks": 1})
        rec.add_timing("first_token_time", rv[src], phase="ttft")
        rec.add("restored_tokens_median", statistics.median(rv["restored_tokens"][src]), "tokens", phase="ttft")
        want = 0 if src == "recompute" else P["prefix_len"] // P["block_size"] * P["block_size"]
        rec.add_check("the prefix came from this source", all(n == want for n in rv["restored_tokens"][src]))
        records.append(rec)
    return records


# ---------------------------------------------------------------------------
# Tables for the notebook

def _v(r: RunRecord, name: str, default=0.0):
    try:
        return r.value(name)
    except KeyError:
        return default


def workload_rows(records: list[RunRecord]) -> list[dict]:
    rows = []
    for r in records:
        if "/" not in r.name or r.name.startswith("sweep/"):
            continue
        rows.append({"workload": r.workload["workload"], "tiers": r.variant,
                     "mean TTFT ms": _ms(r.value("mean_ttft")),
                     "median TTFT ms (median of runs)": _ms(r.value("ttft")),
                     "runs": r.get("ttft")["n"],
                     "total tok/s": significant(r.value("total_throughput")),
                     "prompt reused": f"{100 * r.value('reused_prompt_share'):.0f}%",
                     "blocks from device": int(_v(r, "device_hit_blocks")),
                     "from host": int(_v(r, "restored_blocks/host")),
                     "from file": int(_v(r, "restored_blocks/file")),
                     "from peer": int(_v(r, "restored_blocks/peer")),
                     "offloaded": int(_v(r, "offloaded_blocks"))})
    return rows


def _ms(x: float) -> str:
    return significant(1e3 * x)


def tier_rows(records: list[RunRecord]) -> list[dict]:
    """The seed's three metrics, per tier: hit rate; bytes moved and latency; free / re-allocate time."""
    rows = []
    for r in records:
        if "/" not in r.name or r.name.startswith("sweep/") or r.variant == "no tiers":
            continue
        for tier in ("host", "file", "peer"):
            try:
                lookups = r.value(f"{tier}/lookups")
            except KeyError:
                continue
            rows.append({"workload": r.workload["workload"], "tiers": r.variant, "tier": tier,
                         "lookups": int(lookups), "hits": int(r.value(f"{tier}/hits")),
                         "hit rate": significant(r.value(f"{tier}/hit_rate")),
                         "MB written": significant(r.value(f"{tier}/bytes_written") / 1e6),
                         "MB read": significant(r.value(f"{tier}/bytes_read") / 1e6),
                         "read ms/block": _ms(_v(r, f"{tier}/read_latency")) if tier != "host" else None,
                         "write ms/block": _ms(_v(r, f"{tier}/write_latency")) if tier != "host" else None,
                         "free ms (median)": _ms(r.value("free_time_median")),
                         "engine-thread offload ms": _ms(r.value("offload_call_median")),
                         "fetch wait ms": _ms(r.value("fetch_wait_median")),
                         "re-alloc ms (median)": _ms(r.value("realloc_time_median")),
                         "not admitted": int(r.value("not_admitted_below_host")) if tier != "host" else None,
                         "skipped": int(r.value(f"{tier}/skipped")),
                         "failures": int(r.value(f"{tier}/failures")), "corrupt": int(r.value(f"{tier}/corrupt")),
                         "timeouts": int(r.value(f"{tier}/timeouts"))})
    return rows


def sweep_rows(records: list[RunRecord]) -> list[dict]:
    rows = []
    for r in records:
        if not r.name.startswith("sweep/"):
            continue
        rows.append({"host blocks": r.workload["host_blocks"], "host / device": r.workload["host_over_device"],
                     "blocks from device": int(r.value("device_hit_blocks")),
                     "blocks from host": int(r.value("restored_blocks/host")),
                     "host blocks also on device": f"{100 * r.value('host_mirror_share'):.0f}%",
                     "host hit rate": significant(r.value("host/hit_rate")),
                     "mean TTFT ms": _ms(r.value("mean_ttft"))})
    return rows


def restore_rows(records: list[RunRecord]) -> list[dict]:
    by = {r.name: r for r in records}
    rows = []
    for src in RESTORE_SOURCES:
        t = by[f"restore-{src}"].get("first_token_time")
        rows.append({"prefix from": src, "first token ms (median)": _ms(t["value"]), "p10 ms": _ms(t["p10_s"]),
                     "p90 ms": _ms(t["p90_s"]), "samples": t["n"],
                     "prompt tokens restored": int(by[f"restore-{src}"].value("restored_tokens_median"))})
    return rows


def copy_rows(records: list[RunRecord]) -> list[dict]:
    """Per block size: both layouts' offload rate, their ratio through `compare_timings`."""
    by = {r.name: r for r in records if r.name.startswith("copy-")}
    rows = []
    for name, r in by.items():
        if r.workload["kv_layout"] != CROSS_LAYER:
            continue
        lm = by[name.replace(CROSS_LAYER, LAYER_MAJOR)]
        c = compare_timings(r.get("copy_time"), lm.get("copy_time"))
        rows.append({"block MB": round(r.workload["block_bytes"] / (1 << 20), 2), "blocks": r.workload["blocks"],
                     "cross-layer GB/s": float(significant(r.value("copy_gbps"))),
                     "layer-major GB/s": float(significant(lm.value("copy_gbps"))),
                     "copies per block": f"{r.value('copies_per_block'):g} vs {lm.value('copies_per_block'):g}",
                     "cross / layer-major time": float(significant(c.ratio)), "90% interval": c.interval(),
                     "verdict": c.verdict, "samples": f"{c.n_a}, {c.n_b}",
                     "memory copy GB/s": float(significant(r.value("ceiling_gbps"))),
                     "fraction": float(significant(r.value("fraction_of_ceiling"))), "target": 0.70,
                     "meets target": r.value("fraction_of_ceiling") >= 0.70, "comparison": c})
    return rows


@dataclass(frozen=True)
class RunComparison:
    """`measure.compare_timings` over a handful of runs a side, with one more condition before a
    verdict: every run of one side below every run of the other. A percentile bootstrap of a
    median over 4 or 5 samples has few distinct values and states too narrow an interval; complete
    separation of n runs against n happens by chance with probability 2 / C(2n, n) under no
    difference (2/70 for n = 4)."""

    c: object
    a_runs: tuple
    b_runs: tuple

    @property
    def overlap(self) -> bool:
        return not (max(self.a_runs) < min(self.b_runs) or max(self.b_runs) < min(self.a_runs))

    @property
    def verdict(self) -> str:
        return self.c.verdict if not self.overlap else "no difference this run can see"

    @property
    def ratio(self) -> float:
        return self.c.ratio

    def sentence(self, a: str, b: str) -> str:
        if self.c.separated and self.overlap:
            ms = lambda xs: f"{significant(1e3 * min(xs))}–{significant(1e3 * max(xs))} ms"  # noqa: E731
            return (f"{a} and {b} show no difference this run can see ({a} at {significant(self.c.ratio)}× the time "
                    f"of {b}; the bootstrap interval {self.c.interval()} excludes 1, but the runs overlap: "
                    f"{ms(self.a_runs)} against {ms(self.b_runs)}, {len(self.a_runs)} and {len(self.b_runs)} runs)")
        return self.c.sentence(a, b)


def compare_runs(a: dict, b: dict) -> RunComparison:
    """`RunComparison` of two records' per-run timings (measurements kept with `samples_s`)."""
    return RunComparison(compare_timings(a, b), tuple(a["samples_s"]), tuple(b["samples_s"]))


def verdicts(records: list[RunRecord], P: dict) -> dict:
    """The comparisons the page states, each from `compare_timings`: workload TTFTs over runs (one
    median per run), with shared prefixes and without; and one request's first-token time with its
    prefix restored (host, file) against recomputed."""
    by = {r.name: r for r in records}
    cs = configs(P)
    pairs = {"shared_host": ("shared", cs[1], cs[0]), "shared_all": ("shared", cs[2], cs[0]),
             "shared_gated": ("shared", cs[3], cs[0]), "none_host": ("none", cs[1], cs[0]),
             "none_all": ("none", cs[2], cs[0]), "none_gated": ("none", cs[3], cs[0]),
             "none_gated_vs_all": ("none", cs[3], cs[2])}
    out = {}
    for key, (kind, a, b) in pairs.items():
        out[key] = compare_runs(by[f"{kind}/{a}"].get("ttft"), by[f"{kind}/{b}"].get("ttft"))
    for src in RESTORE_SOURCES[1:]:
        out[f"restore_{src}"] = compare_timings(by[f"restore-{src}"].get("first_token_time"),
                                                by["restore-recompute"].get("first_token_time"))
    return out


# ---------------------------------------------------------------------------
# Correctness checks the notebook runs (fresh random inputs) and asserts

CHECK_CFG = TinyConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, max_seq=160)


def restore_checks(seed: int, workdir: Path, peer_address=None) -> list[dict]:
    """For each tier: a small device pool (every prefix evicted between uses) with only that tier below;
    the greedy tokens must equal a run without any prefix cache, the restored KV must equal the
    device KV in bits, and that tier must have served blocks."""
    from ..serving.kv_tiers import prefix_keys

    g = torch.Generator().manual_seed(seed + 31)
    model = init_weights(TinyDecoder(CHECK_CFG), seed + 32).eval()
    pre = [torch.randint(256, (72,), generator=g).tolist() for _ in range(4)]
    prompts = [pre[i % 4] + torch.randint(256, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
               for i in range(10)]
    params = SamplingParams(max_tokens=10)
    ref = LLMEngine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=96)).generate(prompts, params)
    rows = []
    for tier in ("host", "file", "peer"):
        if tier == "peer" and peer_address is None:
            continue
        kw = {"host_capacity_blocks": 64 if tier == "host" else 1, "background": False}
        if tier == "file":
            kw["file_dir"] = Path(workdir) / "restore-check"
        if tier == "peer":
            kw["peer_address"] = peer_address
        engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=96, enable_prefix_caching=True,
                                               num_blocks=15))
        tiers = EngineKVTiers(engine, kw, model_id=f"check-{seed}")
        for t in tiers.store.lower:
            if t.name == "peer":
                t.clear()
        out = engine.generate(prompts, params)
        # the bits: a fresh prompt's first block, offloaded, fetched back, against the device block it was
        # copied from (still device-cached)
        tiers.flush()          # a one-row host tier refuses (counts as skipped) blocks while its row is busy
        fresh = torch.randint(256, (40,), generator=g).tolist()
        engine.generate([fresh], SamplingParams(max_tokens=1))
        tiers.flush()          # the offload copies run off the engine thread
        seq, bm = engine.finished[-1], engine.block_manager
        key = prefix_keys(seq.prompt[:16], 16, tiers.ns)[0]
        got = tiers.store.fetch([key])
        block = bm.hash_to_block[bm._chain_hash(None, seq.prompt[:16])]   # freed last: still device-cached
        dev = tiers.block_bytes(block)
        bits = bool(got.rows) and torch.equal(got.rows[0][:dev.numel()], dev)
        got.release()
        rows.append({"tier": tier, "blocks restored from it": tiers.stats.restored_blocks[tier],
                     "KV bits equal": bits, "greedy tokens equal": out == ref,
                     "passed": out == ref and bits and tiers.stats.restored_blocks[tier] > 0})
        tiers.close()
    return rows


def corruption_check(seed: int, workdir: Path) -> dict:
    """Flip one random bit of one stored block file: the read must be a counted miss."""
    from ..serving.kv_tiers import TieredKVStore, namespace, prefix_keys

    g = torch.Generator().manual_seed(seed + 41)
    layout = BlockLayout((("k", torch.float32, (2, 16, 2, 16)), ("v", torch.float32, (2, 16, 2, 16))))
    ns = namespace("corruption-check", 16, torch.float32, layout)
    keys = prefix_keys(torch.randint(256, (48,), generator=g).tolist(), 16, ns)
    rows = [torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, generator=g) for _ in keys]
    store = TieredKVStore(layout, ns, host_capacity_blocks=1, file_dir=Path(workdir) / "corruption", background=False)
    for key, row in zip(keys, rows):
        slot = store.reserve(key)
        store.host.row(slot).copy_(row)
        store.commit([(key, slot)])
    ft = store.tier("file")
    path = ft.path(keys[1])
    data = bytearray(path.read_bytes())
    pos = len(data) - layout.nbytes + int(torch.randint(layout.nbytes, (1,), generator=g))
    bit = int(torch.randint(8, (1,), generator=g))
    data[pos] ^= 1 << bit
    path.write_bytes(bytes(data))
    got = store.fetch(keys)
    n, first_ok = len(got.rows), bool(got.rows) and torch.equal(got.rows[0], rows[0])
    got.release()
    out = {"flipped byte": pos, "bit": bit, "blocks returned": n, "first block exact": first_ok,
           "corrupt counted": ft.stats.corrupt, "file removed": not path.exists()}
    out["passed"] = n == 1 and first_ok and ft.stats.corrupt == 1 and out["file removed"]
    store.close()
    return out


def hybrid_check(seed: int, workdir: Path) -> dict:
    """The hybrid model inside the serving engine (`serving.hybrid.hybrid_restore_check`): a prefix
    restored from the file tier with its recurrent state continues as the whole-sequence reference;
    restored without the state, it does not."""
    from ..serving.hybrid import hybrid_restore_check

    return hybrid_restore_check(seed + 51, workdir)


def tp_check(seed: int, workdir: Path, use_cuda: bool = False, timeout_s: float = 120.0) -> dict:
    """Two TP ranks (torch.distributed on loopback) store a prompt's KV merged and sharded; the merged
    rows are read back at TP 1, 2 and 4 and compared in bits with the reference shards. Twice: with
    4 KV heads (split 2 + 2) and with 1 KV head held whole by both ranks (replicated, as MLA's
    latent is), where the merge writes each head once and TP 4 reads replicas."""
    from ..serving import kv_tp_merge as tpm

    rows, exact, res0, passed = [], {}, None, True
    for kv_heads, what in ((4, "4 KV heads, split"), (1, "1 KV head, replicated")):
        cfg = dict(vocab=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads, ffn=96, max_seq=160)
        args = dict(cfg=cfg, block_size=16, prompt_len=128, seed=seed + 61, model_id=f"tp-check-{seed}-{kv_heads}",
                    dir=str(Path(workdir) / f"tp{kv_heads}"), mode=["merged", "sharded"], durable=True,
                    use_cuda=use_cuda)
        res = tpm.launch(args, world_size=2, timeout_s=timeout_s)
        res0 = res0 or res[0]
        _, k, v = tpm.full_kv(cfg, args["seed"], args["prompt_len"], 16)
        for tp in (1, 2, 4):
            back = tpm.restore_at(args["dir"], args, tp)
            exact[f"{what}, TP {tp}"] = all(
                back[r][i] is not None and torch.equal(back[r][i]["k"], tpm.shard_of(k[i], tp, r))
                and torch.equal(back[r][i]["v"], tpm.shard_of(v[i], tp, r))
                for r in range(tp) for i in range(k.shape[0]))
        merged = [r["modes"]["merged"] for r in res]
        sharded = [r["modes"]["sharded"] for r in res]
        rows += [{"KV heads": what, "layout": "merged on rank 0", "files written": sum(m["writes"] for m in merged),
                  "bytes per file": merged[0]["bytes_per_write"],
                  "seconds (slowest rank)": significant(max(m["seconds"] for m in merged))},
                 {"KV heads": what, "layout": "one shard per rank", "files written": sum(s_["writes"] for s_ in sharded),
                  "bytes per file": sharded[0]["bytes_per_write"],
                  "seconds (slowest rank)": significant(max(s_["seconds"] for s_ in sharded))}]
        factor = 2 if kv_heads == 4 else 1     # split: merged files are twice the size; replicated: the same size
        passed = passed and rows[-2]["files written"] * 2 == rows[-1]["files written"] \
            and rows[-2]["bytes per file"] == factor * rows[-1]["bytes per file"]
    return {"rows": rows, "restore exact at tp": exact, "backend": res0["backend"], "blocks": res0["blocks"],
            "passed": passed and all(exact.values())}
