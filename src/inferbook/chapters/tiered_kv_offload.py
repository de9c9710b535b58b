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
  looked up `admit_after` times before it may cross to the host (vLLM's reuse gate): TTFT (every request's, all repeats, for `measure.compare_timings`),
  throughput, per-tier lookups/hits/bytes/latency, and device free / re-allocation times;
- `sweep/host=<blocks>`: the shared workload with a host tier of growing capacity (multiples of
  the device KV pool): blocks served by the host tier beyond what the device cache served.
"""
from __future__ import annotations

import math
import shutil
import statistics
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..measure import Timing, compare_timings, significant
from ..presets import Param
from ..record import RunRecord
from ..serving.kv_offload import CROSS_LAYER, LAYER_MAJOR, PeerProcess
from ..serving.kv_offload.bench import (RESTORE_SOURCES, copy_ceiling, filesystem_benchmark, host_copy_benchmark,
                                       restore_vs_recompute, run_workload)

from ..serving.model_runner import observed_paged_kernels, paged_kernels_label
from ..serving.model import TinyConfig, TinyDecoder, init_weights

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('restore-host', 'first_token_time', 'Time to first token when the shared prefix is restored from the host tier')

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
    "file_blocks": Param(int, help="file tier capacity (blocks; LRU): beyond it, blocks are served by the peer"),
    "host_sweep": Param(str, help="host capacities for the sizing sweep, as multiples of device_blocks"),
    "copy_block_mb": Param(str, help="block sizes (MB) of the host copy benchmark, comma-separated"),
    "copy_total_mb": Param(int, help="MB copied per block size in the copy benchmark"),
    "file_total_mb": Param(int, help="MB written through the file tier in the filesystem benchmark"),
    "use_peer": Param(bool, help="add the remote-peer tier (a second process on 127.0.0.1)"),
    "admit_after": Param(int, help="lookups of a block before it may cross to the host (vLLM's store_threshold; the 'admit on reuse' config)"),
    "repeats": Param(int, min=2, help="runs of each engine configuration, interleaved; their median TTFTs are compared"),
    "restore_reps": Param(int, help="timed single requests per source in the restore-vs-recompute benchmark"),
    "cpu_threads": Param(int, 1, min=0, help="torch threads on CPU during the measurement (0: leave as is)"),
}

PRESETS = {
    "smoke": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, vocab=256, dtype="float32",
                  block_size=16, prefix_len=96, suffix_len=16, output_len=4, num_prefixes=6, num_requests=24,
                  max_num_seqs=2, max_num_batched_tokens=128, device_blocks=32, host_blocks=12, file_blocks=12,
                  host_sweep="0.5,1,2,3", copy_block_mb="1,4", copy_total_mb=32, file_total_mb=8, use_peer=True, admit_after=2, repeats=3, restore_reps=6),
    # the host tier holds a third of the working set of shared prefixes (num_prefixes x prefix blocks) and
    # the file tier half (more than the host: an LRU as large as the host's, fed from it, holds the same
    # blocks and never serves), so the file and peer tiers serve hits and requests wait for their fetches;
    # 24 requests (each prefix asked for four times on average, as at the gpu preset) and six restores a
    # source: the engine runs bind a cold `make book`
    "cpu": dict(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn=688, vocab=512, dtype="float32",
                block_size=16, prefix_len=192, suffix_len=16, output_len=4, num_prefixes=6, num_requests=24,
                max_num_seqs=4, max_num_batched_tokens=512, device_blocks=72, host_blocks=24, file_blocks=36,
                host_sweep="0.5,1,1.5", copy_block_mb="1,4", copy_total_mb=64, file_total_mb=16,
                use_peer=True, admit_after=2, repeats=3, restore_reps=6),
    # gpu: sized to the lent machine's minutes (`inferbook budgets --preset gpu`): every engine step's
    # Python and per-layer calls bind it, so fewer layers, requests and output tokens (4: TTFT is the
    # point); six prefixes, each still asked for four times, with the device, host and file tiers cut in
    # the same proportion so they hold the same shares of them; the copy benchmark's Python per block
    # and the file tier's per-block fsync bind their parts, so three block sizes of 256 MB and 32 MB
    # through the file tier
    "gpu": dict(d_model=1024, n_layers=2, n_heads=16, n_kv_heads=8, ffn=2816, vocab=32000, dtype="bfloat16",
                block_size=16, prefix_len=2048, suffix_len=128, output_len=4, num_prefixes=6, num_requests=24,
                max_num_seqs=4, max_num_batched_tokens=8192, device_blocks=768, host_blocks=384, file_blocks=192,
                host_sweep="0.5,1,1.5,2", copy_block_mb="1,4,16", copy_total_mb=256, file_total_mb=32,
                use_peer=True, admit_after=2, repeats=3, restore_reps=15),
}

WORKLOADS = ("shared", "none")


def configs(P: dict) -> tuple[str, ...]:
    """The engine configurations compared: no tiers; host only; every tier, admitting every block
    to the host (and on below it); every tier with vLLM's reuse gate, a block crossing to the host only
    once looked up `admit_after` times."""
    full = "host+file+peer" if P["use_peer"] else "host+file"
    return ("no tiers", "host", f"{full}, admit all", f"{full}, admit on reuse")


def parse_floats(name: str, text) -> list[float]:
    try:
        values = [float(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and 0 < v <= 1e6 for v in values):
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
                 "device_blocks", "host_blocks", "file_blocks", "copy_total_mb", "file_total_mb", "admit_after", "repeats",
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
    model_config(P)   # the tiny decoder's own rules (head dim even, GQA, sizes)
    from ..serving.config import EngineConfig

    # the engine as the workload builds it: a step's budget holds one KV block at least
    EngineConfig(max_num_seqs=P["max_num_seqs"], max_num_batched_tokens=P["max_num_batched_tokens"],
                 block_size=P["block_size"], num_blocks=P["device_blocks"], enable_prefix_caching=True)


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















# ---------------------------------------------------------------------------
# The engine runs









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
        rec.add("transfers", st.transfers, "batched copies", phase="total",
                definition="device<->host transfers launched, each one batched call for all its blocks")
        rec.add("stored_while_running", st.stored_while_running, "blocks", phase="total",
                definition="blocks whose store was launched as they filled, while their request still ran")
        rec.add("not_stored_unreused", st.not_stored_unreused, "blocks", phase="total",
                definition=f"full blocks kept off the host: looked up fewer than store_threshold="
                           f"{tiers.reuse.threshold} times (vLLM's FilterReusedOffloadingManager)")
        steps = max(1, len(engine.steps) + engine.idle_steps)   # every step() call, those that waited included
        rec.add("compute_syncs_per_step", engine.compute_syncs / steps, "syncs", phase="total",
                definition="compute-stream synchronisations per engine step (steps that only waited for a fetch "
                           "included)")
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
        rec.set_backend("offload_copy", f"one torch._foreach_copy_ per transfer, {r['copies_per_call'] // r['blocks']} piece(s) per block"
                        + (", non_blocking into pinned" if r["pinned"] else ""),
                        reason="kv_offload.block_copy.copy_blocks_to_rows, the engine's path", dtype=P["dtype"])
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
                    reason="kv_offload.FileTier")
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
                # its last run (the sweep runs once): the record is completed, and so saved, now
                if mult is not None or rep == P["repeats"] - 1:
                    finish_engine_record(first[name], runs[name], outputs, dtype)
    finally:
        if peer is not None:
            peer.stop()
        shutil.rmtree(scratch_root, ignore_errors=True)
    records += first.values()

    # 5. one request: its prefix restored (host, file) against recomputed, on this model; the records are
    # made first, so the dry run's counts after them are the restores' alone (`budgets.PHASE_KNOBS`)
    restore = {src: ctx.new_record(f"restore-{src}", variant=f"prefix from {src}", workload={
        "model": f"tiny-decoder L{cfg.n_layers} d{cfg.d_model} h{cfg.n_heads}/{cfg.n_kv_heads} V{cfg.vocab} "
                 f"({cfg.n_params() / 1e6:.2f}M params)", "dtype": P["dtype"], "prefix_len": P["prefix_len"],
        "suffix_len": P["suffix_len"], "requests": "one at a time, device prefix cache off"}, topology={"ranks": 1})
        for src in RESTORE_SOURCES}
    rv = restore_vs_recompute(model, P, scratch_root, ctx.seed)
    shutil.rmtree(scratch_root, ignore_errors=True)
    for src, rec in restore.items():
        rec.add_timing("first_token_time", rv[src], phase="ttft")
        rec.add("restored_tokens_median", statistics.median(rv["restored_tokens"][src]), "tokens", phase="ttft")
        want = 0 if src == "recompute" else P["prefix_len"] // P["block_size"] * P["block_size"]
        rec.add_check("the prefix came from this source", all(n == want for n in rv["restored_tokens"][src]))
        records.append(rec)
    return records


def finish_engine_record(rec: RunRecord, rs: list, outputs: dict, dtype) -> None:
    """An engine configuration's record once all its runs are done: times as the median over its runs,
    and its greedy tokens against the same workload's run without tiers (which runs first each repeat)."""
    name = rec.name
    # times: the median over repeats (every run kept); counts: the first run's (the same workload each time)
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
    if dtype == torch.float32:
        # restored KV is bit-equal (checked below); the suffix prefill then runs other shapes than the
        # recompute, which fp32 rounding differences cannot turn into another greedy token on these models
        rec.add_check("same greedy tokens as without tiers (fp32)", all(r.outputs == ref for r in rs))
    else:  # bf16/fp16: other batch shapes may round a near-tie the other way; a share, not a check
        same = sum(a == b for r in rs for a, b in zip(r.outputs, ref)) / max(1, sum(len(ref) for _ in rs))
        rec.add("same_output_share", same, "fraction of requests", phase="total",
                note=f"{dtype}: the suffix prefill runs other shapes than the recompute")


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
                         "not stored (unreused)": int(_v(r, "not_stored_unreused")) if tier == "host" else None,
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
                     "pieces per block": f"{r.value('copies_per_block'):g} vs {lm.value('copies_per_block'):g}",
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









