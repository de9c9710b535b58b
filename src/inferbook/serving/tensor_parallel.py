"""The serving engine at tensor parallelism N, with its KV tiers.

Each rank of a `torch.distributed` group (gloo on CPU, NCCL when every rank has a GPU; spawned on
loopback by `launch`, or under `torchrun`) holds one shard of the tiny decoder, as Megatron and vLLM
split it: the query heads `[r·H/N, (r+1)·H/N)`, the KV heads `kv_offload`'s `head_range` gives it
(replicated when N exceeds the KV heads, as MLA's one latent head is), the matching columns of the
output projection, and a slice of the SwiGLU hidden size. Its paged KV pool holds only its own KV
heads. Inside every step the partial outputs of attention's output projection and of the MLP's down
projection are summed across ranks (`all_reduce`, the merge of attention output), so every rank
holds the same hidden state and the same logits.

One scheduler, on rank 0, as in vLLM: rank 0 runs the `LLMEngine` (scheduler, block manager,
sampler, KV tiers); the other ranks run `worker_loop`, which executes what rank 0 sends, in order —
a forward over the step's batch, or a KV transfer. The tiers hold *merged* rows on rank 0: a block's
K/V of every KV head in the TP-1 layout (the seed's unified host representation), so the file and
peer tiers see one row per block whatever the TP size, and an engine at another TP size reads them.

- store (`gather_blocks`): the ranks send their heads of the blocks to store to rank 0, which
  merges them (each head once; replicas must agree in bits) into a staging tensor; rank 0's copy
  stream then copies it into host rows as at TP 1. The device blocks need not wait for that copy:
  their bytes are already in the staging tensor.
- load (`scatter_rows`): rank 0 cuts each restored row into the ranks' head slices and scatters
  them; each rank writes its slice into its own device blocks before the step's forward.

The control messages travel on a gloo group (a CPU group, as SGLang's `tp_cpu_group`), so a step's
plan never synchronises the compute stream; the engine's one sync per step stays its own.
"""
from __future__ import annotations

import datetime
import json
import os
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..errors import UserError
from .kv_offload.layout import BlockLayout
from .kv_tp_merge import head_range, merge_shards, shard_of
from .model import TinyConfig
from .model_runner import ModelRunner

# faults a check can inject to prove it catches them (`worker_loop` and `TPModelRunner` honour them)
FAULTS = (None, "no_attention_merge", "swap_restored_shards")


def check_tp(cfg: TinyConfig, tp: int) -> None:
    """The shapes a TP-`tp` split needs: query heads and SwiGLU width divisible by tp, KV heads
    divisible by tp or dividing it (replicated). One UserError, before any rank starts."""
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 8:
        raise UserError(f"tp={tp!r} must be an int in 1..8")
    if cfg.n_heads % tp:
        raise UserError(f"n_heads={cfg.n_heads} must be divisible by tp={tp} (each rank takes whole query heads)")
    if cfg.ffn % tp:
        raise UserError(f"ffn={cfg.ffn} must be divisible by tp={tp} (each rank takes a slice of the SwiGLU width)")
    head_range(cfg.n_kv_heads, tp, 0)


@dataclass
class LayerShard:
    wq: torch.Tensor      # [H/tp·D, d]   rows of this rank's query heads
    wk: torch.Tensor      # [Hkv_r·D, d]  rows of its KV heads
    wv: torch.Tensor
    wo: torch.Tensor      # [d, H/tp·D]   columns of its query heads: a partial sum of the output
    w_gate: torch.Tensor  # [ffn/tp, d]
    w_up: torch.Tensor
    w_down: torch.Tensor  # [d, ffn/tp]   columns: a partial sum

    @property
    def attn(self) -> SimpleNamespace:
        """The attention projections as `ModelRunner.attention` calls them (as a layer's `nn.Linear`s)."""
        return SimpleNamespace(**{n: partial(F.linear, weight=getattr(self, n)) for n in ("wq", "wk", "wv", "wo")})


class TPComm:
    """One rank's view of the TP group: the device group for the merges and the shard transfers,
    a gloo group for the plan rank 0 broadcasts (the same group on CPU). Counts what it sends."""

    def __init__(self, rank: int, world: int, device: torch.device):
        import torch.distributed as dist

        self.dist, self.rank, self.world, self.device = dist, rank, world, device
        self.cpu_group = dist.new_group(backend="gloo") if device.type == "cuda" else None
        self.counts = {"plans": 0, "all_reduce": 0, "gather": 0, "scatter": 0, "gather_bytes": 0, "scatter_bytes": 0}

    # -- the plan: rank 0 says what every rank does next ------------------------------------
    def send_plan(self, op: str, **kw) -> None:
        self.counts["plans"] += 1
        self.dist.broadcast_object_list([(op, kw)], src=0, group=self.cpu_group)

    def receive_plan(self) -> tuple[str, dict]:
        box = [None]
        self.dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    # -- the merges ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.counts["all_reduce"] += 1
        self.dist.all_reduce(t)
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape) on rank 0, in rank order; None elsewhere. NCCL has no
        gather: an all_gather there."""
        self.counts["gather"] += 1
        self.counts["gather_bytes"] += t.numel() * t.element_size()
        if self.device.type == "cuda":
            out = [torch.empty_like(t) for _ in range(self.world)]
            self.dist.all_gather(out, t)
            return out if self.rank == 0 else None
        out = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        self.dist.gather(t, out, dst=0)
        return out

    def scatter(self, out: torch.Tensor, chunks: list[torch.Tensor] | None) -> torch.Tensor:
        """Rank r receives `chunks[r]` (given on rank 0) into `out`. On NCCL: each chunk broadcast
        from rank 0 (no scatter there)."""
        self.counts["scatter"] += 1
        self.counts["scatter_bytes"] += out.numel() * out.element_size()
        if self.device.type == "cuda":
            for r in range(self.world):
                buf = chunks[r].contiguous() if self.rank == 0 else torch.empty_like(out)
                self.dist.broadcast(buf, src=0)
                if r == self.rank:
                    out.copy_(buf)
            return out
        self.dist.scatter(out, [c.contiguous() for c in chunks] if self.rank == 0 else None, src=0)
        return out


def shard_layers(model, tp: int, rank: int) -> list[LayerShard]:
    """This rank's slices of every layer's projections (copies: the full model can be dropped)."""
    cfg = model.cfg
    D, per_q, f = cfg.head_dim, cfg.n_heads // tp, cfg.ffn // tp
    a, b = head_range(cfg.n_kv_heads, tp, rank)
    q = slice(rank * per_q * D, (rank + 1) * per_q * D)
    kv = slice(a * D, b * D)
    ff = slice(rank * f, (rank + 1) * f)
    out = []
    for layer in model.layers:
        at = layer.attn
        out.append(LayerShard(wq=at.wq.weight[q].contiguous(), wk=at.wk.weight[kv].contiguous(),
                              wv=at.wv.weight[kv].contiguous(), wo=at.wo.weight[:, q].contiguous(),
                              w_gate=layer.w_gate.weight[ff].contiguous(), w_up=layer.w_up.weight[ff].contiguous(),
                              w_down=layer.w_down.weight[:, ff].contiguous()))
    return out


class TPModelRunner(ModelRunner):
    """`ModelRunner` for one rank of a TP group: its heads' KV pool, its weight shards, and the
    merges inside the forward. On rank 0 (the engine's runner) `forward` first sends the step's
    batch to the other ranks; `gather_blocks` / `scatter_rows` are the tiers' store and load."""

    def __init__(self, model, num_blocks: int, block_size: int, comm: TPComm, fault: str | None = None):
        if fault not in FAULTS:
            raise UserError(f"fault={fault!r} unknown; choose one of {FAULTS[1:]}")
        cfg = model.cfg
        check_tp(cfg, comm.world)
        self.model, self.block_size, self.comm, self.fault = model, block_size, comm, fault
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv_heads = head_range(cfg.n_kv_heads, comm.world, comm.rank)
        self.q_heads = cfg.n_heads // comm.world
        local = self.kv_heads[1] - self.kv_heads[0]
        shape = (cfg.n_layers, num_blocks * block_size, local, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v_cache = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.feature_layers = None
        self.shards = shard_layers(model, comm.world, comm.rank)
        self._items = None

    # -- what the engine calls ----------------------------------------------------------------
    def prepare(self, items):
        self._items = items
        return super().prepare(items)

    @torch.no_grad()
    def forward(self, batch):
        if self.comm.rank == 0 and self.comm.world > 1:
            self.comm.send_plan("forward", items=self._items)
        return self._forward(batch)

    @torch.no_grad()
    def _forward(self, batch):
        m, comm = self.model, self.comm
        cos, sin = m.cos[batch.positions], m.sin[batch.positions]
        x = m.embed(batch.tokens)
        for i, (layer, w) in enumerate(zip(m.layers, self.shards)):
            part = self.attention(w.attn, layer.attn_norm(x), batch, cos, sin, i)   # this rank's heads' partial sum
            if self.fault != "no_attention_merge":
                comm.all_reduce(part)          # the merge: every rank's heads summed into the full output
            x = x + part
            h = layer.mlp_norm(x)
            x = x + comm.all_reduce(F.linear(F.silu(F.linear(h, w.w_gate)) * F.linear(h, w.w_up), w.w_down))
        hidden = m.norm(x[batch.logit_rows])
        return m.lm_head(hidden).float(), hidden

    # -- the tiers' store and load ----------------------------------------------------------------
    def merged_layout(self) -> BlockLayout:
        """The host row of one block with every KV head: the TP-1 cross-layer layout."""
        cfg = self.model.cfg
        return BlockLayout((("kv", self.dtype, (cfg.n_layers, 2, self.block_size, cfg.n_kv_heads, cfg.head_dim)),))

    def gather_blocks(self, blocks: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's heads of `blocks`, merged into [n, layers, 2, block_size, kv_heads, D]
        on this device (None on the other ranks)."""
        if self.comm.rank == 0 and self.comm.world > 1:
            self.comm.send_plan("gather", blocks=list(blocks))
        mine = self.kv_blocks[torch.tensor(blocks, dtype=torch.long, device=self.device)].contiguous()
        shards = self.comm.gather(mine) if self.comm.world > 1 else [mine]
        if shards is None:
            return None
        return merge_shards(shards, self.model.cfg.n_kv_heads)

    def scatter_rows(self, blocks: list[int], full: torch.Tensor | None) -> None:
        """Rank 0 passes `full` [n, layers, 2, block_size, kv_heads, D] (the restored rows); every
        rank writes its heads of it into its device `blocks`."""
        comm = self.comm
        if comm.rank == 0 and comm.world > 1:
            comm.send_plan("scatter", blocks=list(blocks))
        a, b = self.kv_heads
        n = len(blocks)
        mine = torch.empty((n,) + tuple(self.kv_blocks.shape[1:]), dtype=self.dtype, device=self.device)
        chunks = None
        if comm.rank == 0:
            full = full.to(self.device, non_blocking=True)
            chunks = [shard_of(full, comm.world, r) for r in range(comm.world)]
            if self.fault == "swap_restored_shards":
                chunks = chunks[::-1]
        if comm.world > 1:
            comm.scatter(mine, chunks)
        else:
            mine.copy_(chunks[0])
        self.kv_blocks[torch.tensor(blocks, dtype=torch.long, device=self.device)] = mine


def worker_loop(runner: TPModelRunner) -> dict:
    """Ranks 1..N-1: execute rank 0's plans until it says stop. Returns what this rank did."""
    comm, steps = runner.comm, 0
    while True:
        op, kw = comm.receive_plan()
        if op == "stop":
            return {"steps": steps, **comm.counts}
        if op == "forward":
            runner._forward(runner.prepare(kw["items"]))
            steps += 1
        elif op == "gather":
            runner.gather_blocks(kw["blocks"])
        elif op == "scatter":
            runner.scatter_rows(kw["blocks"], None)
        else:
            raise RuntimeError(f"unknown plan {op!r} from rank 0")


def build_model(cfg_dict: dict, seed: int, device, dtype=torch.float32):
    from .model import TinyDecoder, init_weights

    return init_weights(TinyDecoder(TinyConfig(**cfg_dict)), seed).to(device=device, dtype=dtype).eval()


def tp_engine_worker(rank: int, world: int, init_method: str, args: dict, out_dir: str, timeout_s: float) -> None:
    """One rank of the TP engine. Rank 0 serves `args["prompts"]` through an `LLMEngine` whose runner is
    its shard (`run_tp_engine` builds it) and saves tokens, logits and tier counters; the others run
    `worker_loop`. Both variants of `args["variants"]` run in the one process group."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        use_cuda = bool(args.get("use_cuda")) and torch.cuda.is_available() and torch.cuda.device_count() >= world
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        results = []
        try:
            for variant in args.get("variants") or [{}]:
                va = {**args, **variant}
                comm = TPComm(rank, world, device)
                model = build_model(va["cfg"], int(va["seed"]), device)
                if rank == 0:
                    results.append(run_tp_engine(model, va, comm))
                else:
                    runner = TPModelRunner(model, int(va["num_blocks"]), int(va["block_size"]), comm,
                                           fault=va.get("fault"))
                    if va.get("tiers"):
                        from .kv_offload.block_copy import use_cross_layer_blocks
                        use_cross_layer_blocks(runner)
                    results.append(worker_loop(runner))
            dist.barrier()
        finally:
            dist.destroy_process_group()
        result = {"rank": rank, "world": world, "backend": "nccl" if use_cuda else "gloo"}
        torch.save({**result, "variants": results}, Path(out_dir) / f"rank{rank}.pt")
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def record_logits(engine, index: dict) -> dict:
    """Wrap `engine._sample` so that the logits of every token it samples are kept, keyed by
    (request index, output position): comparable across engines whatever their batches were."""
    log: dict = {}
    sample = engine._sample

    def _sample(chunks, logits, drafts):
        new, acc, rows = sample(chunks, logits, drafts)
        for c in chunks:
            sid = c.seq.seq_id
            if sid in new and sid in index:
                log[(index[sid], len(c.seq.output_ids))] = logits[rows[sid]].detach().to("cpu", torch.float64)
        return new, acc, rows
    engine._sample = _sample
    return log


def serve(engine, prompts, max_tokens: int, tiers=None) -> tuple[list[list[int]], dict]:
    """Every prompt through `engine`, in order, recording logits; -> (outputs, logits). With the engine's
    `tiers` (`EngineKVTiers`), each step waits for its device-to-host copies and its file writes: the TP
    check's claim is which tier serves each prefix, and a copy backlog on a loaded machine pins host rows,
    so fewer blocks reach the file tier and the prefixes meant to come back from it do not (seen on a
    machine running six book builds: 0 blocks from file). The overlap itself is the tier tests' subject."""
    from .sequence import SamplingParams

    seqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    log = record_logits(engine, {s.seq_id: i for i, s in enumerate(seqs)})
    while engine.has_unfinished():
        engine.step()
        if tiers is not None and not (tiers.copier.wait_idle(60) and tiers.store.flush(60)):
            raise RuntimeError("the KV tiers' copies or writes did not finish within 60 s")
    return [s.output_ids for s in seqs], log


def workload(seed: int) -> tuple[dict, list[list[int]]]:
    """The TP check's engine sizes and prompts: 14 requests over ten 48-token prefixes. Two prefixes come
    back after three other requests (gone from the 12-block device pool, still in a host tier of 24
    rows); two after nine others (some 30 blocks stored meanwhile: evicted from the host, so a file tier
    below it serves them)."""
    g = torch.Generator().manual_seed(seed + 61)
    base = dict(block_size=16, num_blocks=12, max_num_seqs=2, max_num_batched_tokens=96, max_tokens=6, seed=seed + 62)
    pre = [torch.randint(128, (48,), generator=g).tolist() for _ in range(10)]
    prompts = [pre[i] + torch.randint(128, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
               for i in (0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 2, 3)]
    return base, prompts


def engine_for(model, va: dict, runner_factory=None):
    """The engine of a TP check run: prefix caching on, a device pool small enough that prefixes are
    evicted between uses, and the tiers of `va["tiers"]` (host rows, a file folder) when given."""
    from .config import EngineConfig
    from .engine import LLMEngine
    from .kv_offload.engine_tiers import EngineKVTiers

    ecfg = EngineConfig(max_num_seqs=int(va["max_num_seqs"]), max_num_batched_tokens=int(va["max_num_batched_tokens"]),
                        block_size=int(va["block_size"]), num_blocks=int(va["num_blocks"]), enable_prefix_caching=True)
    engine = LLMEngine(model, ecfg, runner_factory=runner_factory)
    tiers = None
    if va.get("tiers"):
        t = va["tiers"]
        kw = {"host_capacity_blocks": int(t["host_blocks"]), "background": False}
        if t.get("file_dir"):
            kw.update(file_dir=t["file_dir"], file_secret=bytes.fromhex(t["file_secret"]), durable=False)
        tiers = EngineKVTiers(engine, kw, model_id=va["model_id"])
    return engine, tiers


def run_tp_engine(model, va: dict, comm: TPComm) -> dict:
    """Rank 0: the engine over its shard; serve the prompts, tell the workers to stop; -> results."""
    factory = lambda m, nb, bs: TPModelRunner(m, nb, bs, comm, fault=va.get("fault"))  # noqa: E731
    engine, tiers = engine_for(model, va, factory)
    try:
        outputs, logits = serve(engine, va["prompts"], int(va["max_tokens"]), tiers)
        out = {"outputs": outputs, "logits": logits, "steps": len(engine.steps), "idle_steps": engine.idle_steps,
               "compute_syncs": engine.compute_syncs}
        if tiers is not None:
            tiers.flush()
            st = tiers.stats
            out.update(restored_blocks=dict(st.restored_blocks), offloaded_blocks=st.offloaded_blocks,
                       transfers=st.transfers, tier_stats=tiers.store.stats(), row_bytes=tiers.layout.nbytes,
                       namespace=tiers.ns)
    finally:
        if tiers is not None:
            tiers.close()
        if comm.world > 1:
            comm.send_plan("stop")
    out["comm"] = dict(comm.counts)
    return out


def launch(args: dict, world_size: int = 2, timeout_s: float = 180.0) -> list[dict]:
    """Spawn `world_size` ranks of `tp_engine_worker` on loopback; -> each rank's results, rank order."""
    from ..dist import loopback_ranks

    for variant in args.get("variants") or [{}]:
        va = {**args, **variant}
        check_tp(TinyConfig(**va["cfg"]), world_size)
        if va.get("fault") not in FAULTS:
            raise UserError(f"fault={va.get('fault')!r} unknown; choose one of {FAULTS[1:]}")
    with loopback_ranks(tp_engine_worker, world_size, (args,), timeout_s=timeout_s, what="TP engine ranks",
                        prefix="inferbook-tp-engine-") as out_dir:
        return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point (RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun's environment):
    `torchrun --nproc-per-node 2 -m inferbook.serving.tensor_parallel --out DIR` serves a small
    shared-prefix workload through the TP engine with a host tier and saves rank 0's results."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m inferbook.serving.tensor_parallel")
    p.add_argument("--out", default=".")
    p.add_argument("--timeout", type=float, default=180.0)
    a = p.parse_args(argv)
    base, prompts = workload(0)
    args = dict(base, cfg=dict(vocab=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, max_seq=96),
                model_id="tp-torchrun", prompts=prompts, tiers={"host_blocks": 24})
    Path(a.out).mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    tp_engine_worker(rank, int(os.environ["WORLD_SIZE"]), "env://", args, a.out, a.timeout)
    if rank == 0:
        r = torch.load(Path(a.out) / "rank0.pt", weights_only=False)["variants"][0]
        print(f"rank 0: {r['steps']} steps with a batch, {r['idle_steps']} waiting, {r['compute_syncs']} compute-stream "
              f"syncs, blocks restored "
              f"{r['restored_blocks']}, {r['offloaded_blocks']} stored as merged rows; results in {a.out}")


if __name__ == "__main__":
    main()
