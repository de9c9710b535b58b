"""TP shards of a KV block merged into one host layout, and restored at another TP size.

With tensor parallelism each rank holds the K/V of its own heads. The seed: "the fragments of
several TP ranks are gathered into one unified layout, so secondary storage sees fewer, larger
I/Os; nodes with a different TP configuration can use the same cached data through that host
representation." Here:

- `merge_shards` / `shard_of`: heads are split as vLLM splits them (`head_range`). When the KV
  heads divide by tp, rank r owns heads [r*H/tp, (r+1)*H/tp). When tp is a multiple of H (more
  ranks than KV heads, e.g. GQA with few KV heads, or MLA's single latent "head" that every rank
  holds whole), each head is *replicated* on tp/H consecutive ranks: rank r holds head
  r // (tp/H). The merged row keeps each head once (replicas are checked equal in bits and
  dropped), in the full-head layout, so any TP size — replicating or not — can slice it.
  Other combinations (kv_heads % tp != 0 and tp % kv_heads != 0) are refused, as vLLM refuses them.
- `tp_worker`: one rank of a `torch.distributed` group (gloo on CPU, NCCL on GPUs) computes its
  shard of a prompt's KV, then either gathers the shards to rank 0, which writes one merged file
  per block ("merged"), or writes its own shard files ("sharded": tp times as many, tp times smaller).
- `launch(...)`: spawns the ranks on 127.0.0.1 (a free port) with a deadline on every wait;
  `torchrun --nproc-per-node 2 -m inferbook.serving.kv_tp_merge --dir D` runs the same worker.

Each rank's shard is the slice of the model's K/V projections for its heads (what a
column-parallel projection computes), taken from one reference forward so that the check is
exact in bits; the point here is the storage layout, not the parallel matmul.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import time
import traceback
from pathlib import Path

import torch

from ..dist import loopback_ranks
from ..errors import UserError
from .kv_offload import BlockLayout, FileTier, namespace, prefix_keys

MODES = ("merged", "sharded")


def head_range(kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """KV heads [a, b) that rank `rank` of a TP-`tp` group holds: an even split when tp divides
    kv_heads, one replicated head (rank // (tp // kv_heads)) when kv_heads divides tp."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or (kv_heads % tp and tp % kv_heads):
        raise UserError(f"tp={tp!r} must divide kv_heads={kv_heads} or be a multiple of it "
                        "(more ranks than KV heads replicate them)")
    if not 0 <= rank < tp:
        raise UserError(f"rank={rank!r} must lie in 0..{tp - 1}")
    if kv_heads % tp == 0:
        per = kv_heads // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // kv_heads)
    return head, head + 1


def replicas(kv_heads: int, tp: int) -> int:
    """How many ranks hold each KV head (1 when tp divides kv_heads)."""
    head_range(kv_heads, tp, 0)
    return 1 if kv_heads % tp == 0 else tp // kv_heads


def merge_shards(shards: list[torch.Tensor], kv_heads: int | None = None) -> torch.Tensor:
    """[..., heads of rank r, D] per rank (rank order) -> [..., kv_heads, D], each head once.

    kv_heads None: the shards partition the heads (concatenated). Otherwise the ranks' head
    ranges come from `head_range(kv_heads, len(shards), r)`; a replicated head is taken from its
    first rank, and every other replica must equal it in bits (else RuntimeError: the ranks'
    caches disagree, and no merged row is made)."""
    if kv_heads is None:
        return torch.cat(shards, dim=-2)
    tp = len(shards)
    first: dict[tuple[int, int], torch.Tensor] = {}
    for r, shard in enumerate(shards):
        rng = head_range(kv_heads, tp, r)
        if shard.shape[-2] != rng[1] - rng[0]:
            raise UserError(f"rank {r}'s shard has {shard.shape[-2]} heads; TP {tp} of {kv_heads} KV heads gives it "
                            f"{rng[1] - rng[0]}")
        if rng in first:
            if not torch.equal(first[rng].flatten().view(torch.uint8), shard.contiguous().flatten().view(torch.uint8)):
                raise RuntimeError(f"replicas of KV heads {rng} differ between ranks (rank {r}); refusing to merge")
            continue
        first[rng] = shard.contiguous()
    return torch.cat([first[k] for k in sorted(first)], dim=-2)


def shard_of(full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The heads rank `rank` of a TP-`tp` group holds, from a merged [..., H, D] tensor (a replicated
    head when tp > H)."""
    a, b = head_range(full.shape[-2], tp, rank)
    return full[..., a:b, :]


def full_kv(cfg_dict: dict, seed: int, prompt_len: int, block_size: int):
    """The reference: K/V of a random prompt through the tiny decoder, as blocks.
    Returns (tokens, k [blocks, layers, bs, H, D], v [same])."""
    from .model import TinyConfig, TinyDecoder, init_weights

    cfg = TinyConfig(**cfg_dict)
    model = init_weights(TinyDecoder(cfg), seed).eval()
    tokens = torch.randint(cfg.vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    k, v = model.new_cache(1)                       # [L, 1, H, T, D]
    with torch.no_grad():
        model(torch.tensor([tokens]), torch.arange(prompt_len), k, v)
    nblk = prompt_len // block_size

    def blocks(c):
        c = c[:, 0, :, :nblk * block_size].permute(0, 2, 1, 3)         # [L, T, H, D]
        return c.reshape(cfg.n_layers, nblk, block_size, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1).contiguous()
    return tokens, blocks(k), blocks(v)


def layout_for(cfg_dict: dict, block_size: int, heads: int) -> BlockLayout:
    shape = (cfg_dict["n_layers"], block_size, heads, cfg_dict["d_model"] // cfg_dict["n_heads"])
    return BlockLayout((("k", torch.float32, shape), ("v", torch.float32, shape)))


def tp_worker(rank: int, world: int, init_method: str, args: dict, out_dir: str, timeout_s: float) -> None:
    """One rank: compute its shard, store it merged (via rank 0) or sharded; save a summary."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        use_cuda = bool(args.get("use_cuda")) and torch.cuda.is_available() and torch.cuda.device_count() >= world
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            runs = []
            # several models in one process group (`args["variants"]`: dicts over `args`), so one spawn serves all
            for variant in args.get("variants") or [{}]:
                va = {**args, **variant}
                cfg, bs, mode = va["cfg"], int(va["block_size"]), va["mode"]
                tokens, k, v = full_kv(cfg, int(va["seed"]), int(va["prompt_len"]), bs)
                H = cfg["n_kv_heads"]
                a, b = head_range(H, world, rank)
                mine_k, mine_v = k[..., a:b, :].contiguous().to(device), v[..., a:b, :].contiguous().to(device)
                full_layout = layout_for(cfg, bs, H)
                ns_full = namespace(va["model_id"], bs, torch.float32, full_layout)
                keys = prefix_keys(tokens, bs, ns_full)
                summary = {}
                for mode in ([mode] if isinstance(mode, str) else list(mode)):
                    summary[mode] = _store(mode, rank, world, va, cfg, bs, tokens, keys, mine_k, mine_v, full_layout,
                                           ns_full, use_cuda, a, b)
                runs.append({"blocks": len(keys), "modes": summary})
            dist.barrier()
        finally:
            dist.destroy_process_group()
        result = {"rank": rank, "world": world, "backend": "nccl" if use_cuda else "gloo", "runs": runs, **runs[0]}
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _store(mode, rank, world, args, cfg, bs, tokens, keys, mine_k, mine_v, full_layout, ns_full, use_cuda, a, b) -> dict:
    """Write this rank's shard of every block: gathered and merged by rank 0, or as its own files."""
    import torch.distributed as dist

    dist.barrier()
    writes, nbytes, t0 = 0, 0, time.perf_counter()
    if mode == "merged":
        if use_cuda:   # NCCL has no gather: all_gather instead
            gk = [torch.empty_like(mine_k) for _ in range(world)]
            gv = [torch.empty_like(mine_v) for _ in range(world)]
            dist.all_gather(gk, mine_k)
            dist.all_gather(gv, mine_v)
        else:
            gk = [torch.empty_like(mine_k) for _ in range(world)] if rank == 0 else None
            gv = [torch.empty_like(mine_v) for _ in range(world)] if rank == 0 else None
            dist.gather(mine_k, gk, dst=0)
            dist.gather(mine_v, gv, dst=0)
        if rank == 0:
            tier = FileTier(args["dir"], ns_full, full_layout.nbytes, durable=bool(args.get("durable", True)),
                            secret=file_secret(args))
            merged_k = merge_shards([t.cpu() for t in gk], cfg["n_kv_heads"])
            merged_v = merge_shards([t.cpu() for t in gv], cfg["n_kv_heads"])
            row = torch.empty(full_layout.nbytes, dtype=torch.uint8)
            views = full_layout.views(row)
            for i, key in enumerate(keys):
                views["k"].copy_(merged_k[i])
                views["v"].copy_(merged_v[i])
                writes += int(tier.put(key, row))
                nbytes += full_layout.nbytes
    else:
        shard_layout = layout_for(cfg, bs, b - a)
        ns = namespace(args["model_id"], bs, torch.float32, shard_layout) + f"|tp={world}|rank={rank}"
        tier = FileTier(Path(args["dir"]) / f"tp{world}-rank{rank}", ns, shard_layout.nbytes,
                        durable=bool(args.get("durable", True)), secret=file_secret(args))
        row = torch.empty(shard_layout.nbytes, dtype=torch.uint8)
        views = shard_layout.views(row)
        for i, key in enumerate(prefix_keys(tokens, bs, ns)):
            views["k"].copy_(mine_k[i].cpu())
            views["v"].copy_(mine_v[i].cpu())
            writes += int(tier.put(key, row))
            nbytes += shard_layout.nbytes
    return {"writes": writes, "bytes": nbytes, "seconds": time.perf_counter() - t0,
            "bytes_per_write": nbytes / writes if writes else 0}


def file_secret(args: dict) -> bytes:
    """The key the block files of one TP run are authenticated with (`FileTier`'s `secret`), drawn by
    `launch` and carried in `args`."""
    if not isinstance(args.get("file_secret"), str):
        raise UserError("args has no 'file_secret': run `launch(args)` first, it draws the files' key")
    return bytes.fromhex(args["file_secret"])


def launch(args: dict, world_size: int = 2, timeout_s: float = 120.0) -> list[dict]:
    """Spawn `world_size` ranks of `tp_worker` on loopback; return their summaries in rank order."""

    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= 8:
        raise UserError(f"world_size={world_size!r} must be an int in 1..8")
    modes = [args.get("mode")] if isinstance(args.get("mode"), str) else list(args.get("mode") or [None])
    if not modes or any(m not in MODES for m in modes):
        raise UserError(f"mode={args.get('mode')!r} unknown; choose 'merged', 'sharded' or a list of them")
    for variant in args.get("variants") or [{}]:
        head_range({**args, **variant}["cfg"]["n_kv_heads"], world_size, 0)
    args.setdefault("file_secret", secrets.token_hex(32))   # the ranks and `restore_at` share the files' key
    json.dumps(args)
    with loopback_ranks(tp_worker, world_size, (args,), timeout_s=timeout_s, what="TP KV workers",
                        prefix="inferbook-kvtp-") as out_dir:
        return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def restore_at(directory: str | os.PathLike, args: dict, tp: int) -> list[list[dict]]:
    """Read the merged rows back as a TP-`tp` node would: for each rank, its heads of every block.
    Returns [rank][block] -> {"k", "v"} (None where a block is missing)."""
    cfg, bs = args["cfg"], int(args["block_size"])
    layout = layout_for(cfg, bs, cfg["n_kv_heads"])
    ns = namespace(args["model_id"], bs, torch.float32, layout)
    tokens = torch.randint(cfg["vocab"], (int(args["prompt_len"]),),
                           generator=torch.Generator().manual_seed(int(args["seed"]) + 1)).tolist()
    tier = FileTier(directory, ns, layout.nbytes, secret=file_secret(args))
    out = [[] for _ in range(tp)]
    row = torch.empty(layout.nbytes, dtype=torch.uint8)
    for key in prefix_keys(tokens, bs, ns):
        ok = tier.read_into(key, row)
        views = layout.views(row)
        for r in range(tp):
            out[r].append({"k": shard_of(views["k"], tp, r).clone(), "v": shard_of(views["v"], tp, r).clone()}
                          if ok else None)
    return out


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point: RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun's environment."""
    p = argparse.ArgumentParser(prog="python -m inferbook.serving.kv_tp_merge")
    p.add_argument("--dir", required=True)
    p.add_argument("--mode", choices=MODES, default="merged")
    p.add_argument("--args", default="{}", help="JSON: cfg, block_size, prompt_len, seed, model_id")
    p.add_argument("--out", default=".")
    p.add_argument("--timeout", type=float, default=120.0)
    a = p.parse_args(argv)
    args = {"cfg": dict(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, max_seq=256),
            "block_size": 16, "prompt_len": 128, "seed": 0, "model_id": "tp-demo", **json.loads(a.args),
            "dir": a.dir, "mode": a.mode}
    # the files' key comes from the environment every rank shares (never the command line, which /proc shows)
    args["file_secret"] = os.environ.get("INFERBOOK_KV_FILE_SECRET")
    if not args["file_secret"] or len(args["file_secret"]) < 32:
        raise SystemExit("error: set INFERBOOK_KV_FILE_SECRET (64 hex characters, the same on every rank) to "
                         "authenticate the block files")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    tp_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args, a.out, a.timeout)


if __name__ == "__main__":
    main()
