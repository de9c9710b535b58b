"""Correctness checks of the tiers on fresh random inputs, each returning rows with `passed`: restore
exact from every tier, a damaged file is a miss, a hybrid model's state travels with its KV, TP
shards merged and restored at another TP size."""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import EngineConfig
from ..engine import LLMEngine
from ..model import TinyConfig, TinyDecoder, init_weights
from ..sequence import SamplingParams
from ...measure import significant
from .engine_tiers import EngineKVTiers
from .layout import BlockLayout, namespace, prefix_keys
from .store import TieredKVStore


CHECK_CFG = TinyConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, max_seq=160)


def restore_checks(seed: int, workdir: Path, peer_address=None) -> list[dict]:
    """For each tier: a small device pool (every prefix evicted between uses) with only that tier below;
    the greedy tokens must equal a run without any prefix cache, the restored KV must equal the
    device KV in bits, and that tier must have served blocks."""


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
    from ..hybrid import hybrid_restore_check

    return hybrid_restore_check(seed + 51, workdir)


def tp_check(seed: int, workdir: Path, use_cuda: bool = False, timeout_s: float = 120.0) -> dict:
    """Two TP ranks (torch.distributed on loopback) store a prompt's KV merged and sharded; the merged
    rows are read back at TP 1, 2 and 4 and compared in bits with the reference shards. Twice: with
    4 KV heads (split 2 + 2) and with 1 KV head held whole by both ranks (replicated, as MLA's
    latent is), where the merge writes each head once and TP 4 reads replicas."""
    from .. import kv_tp_merge as tpm

    rows, exact, passed = [], {}, True
    variants = []
    for kv_heads in (4, 1):
        cfg = dict(vocab=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads, ffn=96, max_seq=160)
        variants.append(dict(cfg=cfg, model_id=f"tp-check-{seed}-{kv_heads}", dir=str(Path(workdir) / f"tp{kv_heads}")))
    args = dict(block_size=16, prompt_len=128, seed=seed + 61, mode=["merged", "sharded"], durable=True,
                use_cuda=use_cuda, variants=variants, **variants[0])
    res = tpm.launch(args, world_size=2, timeout_s=timeout_s)    # both variants in one process group
    res0 = res[0]
    for i, (variant, what) in enumerate(zip(variants, ("4 KV heads, split", "1 KV head, replicated"))):
        va = {**args, **variant}
        kv_heads = va["cfg"]["n_kv_heads"]
        _, k, v = tpm.full_kv(va["cfg"], va["seed"], va["prompt_len"], 16)
        for tp in (1, 2, 4):
            back = tpm.restore_at(va["dir"], va, tp)
            exact[f"{what}, TP {tp}"] = all(
                back[r][j] is not None and torch.equal(back[r][j]["k"], tpm.shard_of(k[j], tp, r))
                and torch.equal(back[r][j]["v"], tpm.shard_of(v[j], tp, r))
                for r in range(tp) for j in range(k.shape[0]))
        merged = [r["runs"][i]["modes"]["merged"] for r in res]
        sharded = [r["runs"][i]["modes"]["sharded"] for r in res]
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

