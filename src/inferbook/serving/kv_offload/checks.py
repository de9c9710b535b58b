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


def tp_engine_check(seed: int, workdir: Path, use_cuda: bool = False, faults: tuple = ("swap_restored_shards",),
                    timeout_s: float = 180.0) -> dict:
    """The serving engine at TP 2 (`serving.tensor_parallel`: two ranks on loopback, gloo on CPU, NCCL
    when each has a GPU) against the same engine at TP 1, on a shared-prefix workload whose device pool
    evicts the prefixes, so they come back from the host and file tiers through the merged rows.

    Twice: 2 KV heads (one per rank) and 1 KV head (replicated on both, as MLA's latent is). Passes when
    the TP-2 logits lie within the tolerance rule
    (`tolerance.within_reference_error`: |TP 2 - gold| <= 2 x |TP 1 - gold| + fp32 rounding floor,
    gold = the TP-1 engine in float64, no tiers) at every sampled token whose context all three share,
    the greedy choices agree wherever they are decisive (`tolerance.decisive_agreement`; whether the
    token lists are equal is reported, not asserted), the tiers served blocks from host and file, a TP-1
    engine reading the TP-2 run's files restores them with the same tokens, and rank 0 synchronised
    its compute stream at most once per step. Each of `faults` (`tensor_parallel.FAULTS`) runs once more
    with that bug injected into the 2-KV-head engine; `passed` needs every such run to fail the check."""
    import secrets

    from .. import tensor_parallel as tpe
    from ...tolerance import decisive_agreement, within_reference_error

    base, prompts = tpe.workload(seed)
    base["use_cuda"] = use_cuda
    variants, what = [], {2: "2 KV heads, one per rank", 1: "1 KV head, replicated"}
    for kv_heads, f in [(2, None), (1, None)] + [(2, f) for f in faults]:
        cfg = dict(vocab=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads, ffn=176, max_seq=96)
        name = f"kv{kv_heads}" + (f"-{f}" if f else "")
        variants.append(dict(cfg=cfg, model_id=f"tp-engine-{seed}-{name}", prompts=prompts, fault=f, tiers=dict(
            host_blocks=24, file_dir=str(Path(workdir) / f"tp2-{name}"), file_secret=secrets.token_hex(32))))
    # every variant in one process group: one spawn
    res = tpe.launch({**base, **variants[0], "variants": variants}, world_size=2, timeout_s=timeout_s)
    rows, passed, refs = [], True, {}
    for i, variant in enumerate(variants):
        va = {**base, **variant}
        tp2, worker = res[0]["variants"][i], res[1]["variants"][i]
        model = tpe.build_model(va["cfg"], va["seed"], "cpu")
        kv_heads = va["cfg"]["n_kv_heads"]
        if kv_heads not in refs:     # the TP-1 engine with the same tiers, and the float64 gold (no tiers)
            ref_va = {**va, "tiers": {**va["tiers"], "file_dir": str(Path(workdir) / f"tp1-kv{kv_heads}")}}
            e1, t1 = tpe.engine_for(model, ref_va)
            out1, log1 = tpe.serve(e1, prompts, va["max_tokens"], t1)
            t1.close()
            eg, _ = tpe.engine_for(tpe.build_model(va["cfg"], va["seed"], "cpu", torch.float64), {**va, "tiers": None})
            refs[kv_heads] = (out1, log1) + tpe.serve(eg, prompts, va["max_tokens"])
        out1, log1, outg, logg = refs[kv_heads]
        # a TP-1 engine reading what the TP-2 engine wrote below the host: the merged rows serve any TP size
        er, tr = tpe.engine_for(model, {**va, "tiers": {**va["tiers"], "host_blocks": 4}})
        outr, _ = tpe.serve(er, prompts, va["max_tokens"], tr)
        from_files = tr.stats.restored_blocks["file"]
        tr.close()
        keys = []
        for r, (a, b, c) in enumerate(zip(tp2["outputs"], out1, outg)):
            same = next((j for j in range(len(c)) if not (a[j] == b[j] == c[j])), len(c))
            keys += [(r, j) for j in range(min(same + 1, len(c)))]       # logits of the same context in all three
        cand, ref, gold = (torch.stack([log[k] for k in keys]) for log in (tp2["logits"], log1, logg))
        tol = within_reference_error(cand, ref, gold, torch.float32)
        # greedy choices compared where more than rounding decides them (the gold's top-2 gap > 2 x tolerance)
        agree = decisive_agreement(cand.argmax(-1), ref.argmax(-1), gold, tol["tolerance"])
        syncs = tp2["compute_syncs"] / max(1, tp2["steps"] + tp2["idle_steps"])   # per step() call
        row = {"KV heads": what[kv_heads], "fault injected": va["fault"] or "none", "backend": res[0]["backend"],
               "greedy tokens = TP 1": tp2["outputs"] == out1,
               "decisive positions agree": f"{agree['agree_decisive']}/{agree['decisive']}",
               "max |logit - gold|, TP 2": float(significant(tol["error"])),
               "same, TP 1": float(significant(tol["reference_error"])),
               "tolerance": float(significant(tol["tolerance"])),
               "blocks from host": tp2["restored_blocks"]["host"], "blocks from file": tp2["restored_blocks"]["file"],
               "blocks gathered to rank 0": tp2["offloaded_blocks"], "MB gathered": tp2["comm"]["gather_bytes"] / 1e6,
               "MB scattered": tp2["comm"]["scatter_bytes"] / 1e6, "all-reduces": tp2["comm"]["all_reduce"],
               "steps": tp2["steps"], "worker forwards": worker["steps"], "syncs per step (rank 0)": syncs,
               "TP-1 engine: blocks from TP-2 files": from_files, "its tokens = TP 1": outr == out1}
        row["passed"] = bool(agree["passed"] and tol["passed"] and row["blocks from host"] > 0
                             and row["blocks from file"] > 0 and from_files > 0 and row["its tokens = TP 1"]
                             and syncs <= 1 and worker["steps"] == tp2["steps"])
        # a clean run must pass; a run with a fault injected must be caught
        passed = passed and (row["passed"] if va["fault"] is None else not row["passed"])
        rows.append(row)
    return {"rows": rows, "passed": passed, "backend": res[0]["backend"]}
