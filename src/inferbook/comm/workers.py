"""Process entry points for the communication chapter: the same task functions run

- spawned from a notebook or a test: `launch("check", world_size=2, args={...})` starts
  `world_size` processes with torch.multiprocessing (spawn) on loopback (127.0.0.1, a free port),
  waits with a deadline, and returns each rank's result (a dict of tensors and numbers);
- under torchrun, across nodes: `torchrun --nproc-per-node 4 -m inferbook.comm.workers check
  --args '{"numel": 65536}' --out results/` (rank and rendezvous from torchrun's environment).

Backend: NCCL with one GPU per rank when `use_cuda` is asked and there are at least
`world_size` GPUs; otherwise gloo on CPU (a one-GPU machine runs its ranks on CPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import traceback
from pathlib import Path

import torch

from ..dist import loopback_ranks
from ..errors import UserError

TASKS = ("check", "bench", "all", "push-time")
MAX_WORLD = 8


# ---------------------------------------------------------------------------
# Tasks. Each rank builds the same global inputs from the seed and takes its own slice.

def rank_plan(world_size: int, use_cuda: bool) -> tuple[int, str, str]:
    """(ranks to start, backend, label) for a run that asks for `world_size` ranks.

    NCCL needs one GPU per rank. With at least `world_size` GPUs: NCCL on `world_size` ranks.
    With 2 <= GPUs < `world_size`: NCCL on as many ranks as there are GPUs (the label says the
    run is smaller than asked). Otherwise gloo on CPU, labelled as such: on one GPU the ranks'
    collectives run on CPU and say nothing about NVLink."""
    gpus = torch.cuda.device_count() if (use_cuda and torch.cuda.is_available()) else 0
    if gpus >= world_size:
        return world_size, "nccl", f"NCCL, {world_size} ranks on {world_size} GPUs"
    if gpus >= 2:
        return gpus, "nccl", (f"NCCL on {gpus} ranks, one per GPU present ({world_size} asked; "
                              "order effects need at least 3 ranks)")
    why = "no GPU" if gpus == 0 else "one GPU (NCCL needs one GPU per rank)"
    return world_size, "gloo", f"gloo on CPU, {world_size} ranks on loopback: {why}; not an NVLink measurement"


def _device_for(rank: int, world: int, use_cuda: bool) -> torch.device:
    if use_cuda and torch.cuda.is_available() and torch.cuda.device_count() >= world:
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def task_check(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """Correctness of every distributed piece on this rank; the launcher compares across ranks."""
    import torch.distributed as dist

    from . import allreduce as ar, tail, vocab_greedy as vg

    seed = int(args.get("seed", 0))
    out: dict = {"rank": rank, "world": world, "device": str(device), "backend": dist.get_backend()}
    # 1. all-reduce variants: equal in bits to the single-process simulation of this rank
    numel = int(args.get("numel", 1000))
    for dt in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(seed + 1)
        inputs = (torch.randn(world, numel, generator=g) * torch.logspace(-3, 3, numel)).to(dt)
        mine = inputs[rank].to(device)
        builtin = mine.clone()
        dist.all_reduce(builtin)
        out[f"builtin/{dt}"] = builtin.cpu()
        for alg in ar.ALGORITHMS:
            for mode in ar.MODES:
                for order in ar.ORDERS:
                    for acc in ar.ACCUMULATE:
                        got = ar.all_reduce(mine, alg, mode, order, acc).cpu()
                        out[f"allreduce/{dt}/{alg}/{mode}/{order}/{acc}"] = got
    # 2. vocab-parallel greedy over the tie / NaN / -inf matrix
    vocab, batch = int(args.get("vocab", 64)), int(args.get("batch", 4))
    logits, labels = vg.tie_nan_inf_matrix(batch, vocab, world, generator=torch.Generator().manual_seed(seed + 2))
    s, e = vg.shard_bounds(vocab, world)[rank]
    local = logits[:, s:e].to(device)
    out["greedy/pairs"] = vg.greedy_pairs(local, s).cpu()
    out["greedy/gather"] = vg.greedy_gather(local, vocab).cpu()
    # 3. the MoE tail: finalize here, push the partials, one fused pass; against the unfused chain
    T, H, K = int(args.get("tokens", 4)), int(args.get("hidden", 64)), int(args.get("topk_per_rank", 2))
    inp = tail.make_tail_inputs(world, T, H, K, generator=torch.Generator().manual_seed(seed + 3), device=device)
    backend, why = tail.select_backend(device)
    out["tail/backend"] = backend
    out["tail/backend_reason"] = why
    partial = tail.finalize(inp["expert_out"][rank], inp["topk_weights"][rank], backend=backend)
    parts = ar.exchange_all(partial, mode="push")
    rest = (inp["shared"], inp["residual"], inp["norm_weight"])
    fused = tail.fused_tail(torch.stack(parts), *rest, backend=backend)
    reduced = ar.all_reduce(partial, "one-shot", "pull", "fixed", "fp32")
    unfused = tail.after_allreduce(reduced, *rest, backend=backend)
    out["tail/fused"] = [t.cpu() for t in fused]
    out["tail/unfused"] = [t.cpu() for t in unfused]
    # 4. finalize before the exchange: the finalize stored into this rank's slot, pushed to the peers
    from . import fused_exchange as fx

    pre = fx.fused_moe_tail(inp["expert_out"][rank], inp["topk_weights"][rank], *rest, backend=backend)
    out["tail/fused_pre"] = [t.cpu() for t in pre]
    # 4b. the push path: the finalize stored into the peers' slots, epoch flags; the transport is the
    # group's: gloo on CPU -> one shared-memory segment, NCCL on CUDA -> symmetric memory (never run yet)
    from . import shm_push, symm_push

    out["push/transport"] = symm_push.SYMMETRIC if device.type == "cuda" else symm_push.SHARED
    try:
        slots, out["push/transport"] = symm_push.push_slots(T * H, inp["expert_out"].dtype, device)
        try:
            for epoch in (1, 2):   # twice through the same slots: the epochs, not a reset, separate steps
                pushed = shm_push.pushed_tail(slots, inp["expert_out"][rank], inp["topk_weights"][rank], *rest,
                                              epoch=epoch, backend=backend)
            out["tail/fused_shm"] = [t.cpu() for t in pushed]
        finally:
            slots.close()
    except Exception as e:   # a push path that fails is a failed check, not a dead worker
        if device.type == "cpu":
            raise
        out["push/error"] = f"{type(e).__name__}: {e}"
    # 5. vocab gather (full logits), both transports
    g5 = torch.Generator().manual_seed(seed + 5)
    full = torch.randn(batch, vocab, generator=g5).to(torch.bfloat16)
    s5, e5 = vg.shard_bounds(vocab, world)[rank]
    for transport in fx.GATHER_TRANSPORTS:
        out[f"gather/{transport}"] = fx.vocab_gather(full[:, s5:e5].to(device), vocab, transport).cpu()
    if vocab % world == 0 and "push/error" not in out:   # 5b. the pull path through the mapped peers' slots
        slots, _ = symm_push.push_slots(batch * (vocab // world), full.dtype, device)
        try:
            out["gather/shm-pull"] = shm_push.pull_gather(slots, full[:, s5:e5].contiguous().to(device), epoch=1).cpu()
        finally:
            slots.close()
    return out


def task_bench(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """Times on this rank: all-reduce variants over message sizes, greedy strategies over vocab
    sizes and batches. Every collective synchronizes the ranks, so rank times are comparable."""
    import torch.distributed as dist

    from ..measure import benchmark
    from . import allreduce as ar, vocab_greedy as vg

    reps = int(args.get("reps", 5))
    kw = dict(warmup=2, min_reps=reps, max_reps=reps, min_time_s=0.0)
    out: dict = {"rank": rank, "world": world, "device": str(device), "backend": dist.get_backend(),
                 "allreduce": [], "greedy": []}
    for numel in args.get("allreduce_numels", [1024]):
        x = torch.randn(int(numel), generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(device)
        variants = [("torch.distributed", None, None)] + [(alg, alg, mode) for alg in ar.ALGORITHMS for mode in ar.MODES]
        for label, alg, mode in variants:
            if alg is None:
                def fn(x=x):
                    y = x.clone()
                    dist.all_reduce(y)
            else:
                def fn(x=x, alg=alg, mode=mode):
                    ar.all_reduce(x, alg, mode, "fixed", "fp32")
            dist.barrier()
            t = benchmark(fn, device, label=label, **kw)
            out["allreduce"].append({"variant": label if mode is None else f"{alg} {mode}", "numel": int(numel),
                                     "bytes": int(numel) * 2, **t.summary(), "samples_s": list(t.samples_s)})
    from . import fused_exchange as fx

    out["gather"] = []
    for vocab in args.get("vocabs", [64]):
        s, e = vg.shard_bounds(int(vocab), world)[rank]
        for batch in args.get("batches", [1]):
            local = torch.randn(int(batch), e - s, generator=torch.Generator().manual_seed(2000 + rank)
                                ).to(torch.bfloat16).to(device)
            for transport in fx.GATHER_TRANSPORTS:
                def fn(local=local, vocab=int(vocab), transport=transport):
                    fx.vocab_gather(local, vocab, transport)
                dist.barrier()
                t = benchmark(fn, device, label=transport, **kw)
                out["gather"].append({"transport": transport, "vocab": int(vocab), "batch": int(batch),
                                      "bytes_sent": vg.exchanged_bytes("gather", int(batch), int(vocab), world, 2),
                                      **t.summary(), "samples_s": list(t.samples_s)})
    for vocab in args.get("vocabs", [64]):
        bounds = vg.shard_bounds(int(vocab), world)
        s, e = bounds[rank]
        for batch in args.get("batches", [1]):
            g = torch.Generator().manual_seed(1000 + rank)
            local = torch.randn(int(batch), e - s, generator=g).to(torch.bfloat16).to(device)
            for strategy in vg.STRATEGIES:
                if strategy == "pairs":
                    def fn(local=local, s=s):
                        vg.greedy_pairs(local, s)
                else:
                    def fn(local=local, vocab=int(vocab)):
                        vg.greedy_gather(local, vocab)
                dist.barrier()
                t = benchmark(fn, device, label=strategy, **kw)
                out["greedy"].append({"strategy": strategy, "vocab": int(vocab), "batch": int(batch),
                                      "bytes_sent": vg.exchanged_bytes(strategy, int(batch), int(vocab), world, 2),
                                      **t.summary(), "samples_s": list(t.samples_s)})
    if device.type == "cpu":
        out["push_time"] = time_push_against_gloo(rank, world, device, args)
    return out


PUSH_TIMED = ("gloo send/recv", "shared-memory push")


def time_push_against_gloo(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """The MoE tail with the finalize before the exchange, two transports, on CPU: gloo send/receive
    (`fused_exchange.fused_moe_tail`) against the push into the peers' shared-memory slots with epoch
    flags (`shm_push.pushed_tail`). The same finalize and fused pass (PyTorch's: on CPU the Triton kernels
    would run in the interpreter, which is never timed). Warmed up, then interleaved — each iteration
    runs both, in alternating order, every call after a barrier so the ranks start together; the
    launcher takes the slowest rank per iteration. CPU seconds of loopback processes, not GPU speed."""
    import time

    import torch.distributed as dist

    from . import fused_exchange as fx, shm_push, tail

    T, H, K = int(args.get("tokens", 4)), int(args.get("hidden", 64)), int(args.get("topk_per_rank", 2))
    inp = tail.make_tail_inputs(world, T, H, K, generator=torch.Generator().manual_seed(int(args.get("seed", 0)) + 7),
                                device=device)
    e, w = inp["expert_out"][rank], inp["topk_weights"][rank]
    rest = (inp["shared"], inp["residual"], inp["norm_weight"])
    slots = shm_push.ShmSlots(T * H, e.dtype)
    epoch = [0]

    def push():
        epoch[0] += 1
        return shm_push.pushed_tail(slots, e, w, *rest, epoch=epoch[0], backend="torch")

    fns = dict(zip(PUSH_TIMED, (lambda: fx.fused_moe_tail(e, w, *rest, backend="torch"), push)))
    warmup, reps = 3, max(2 * int(args.get("reps", 5)), 10)
    samples = {name: [] for name in fns}
    try:
        for i in range(warmup + reps):
            for name in (PUSH_TIMED if i % 2 == 0 else PUSH_TIMED[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                fns[name]()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    samples[name].append(dt)
    finally:
        slots.close()
    return {"tokens": T, "hidden": H, "topk_per_rank": K, "dtype": str(e.dtype).replace("torch.", ""),
            "warmup": warmup, "reps": reps, "timer": "perf_counter (wall, one rank)", "samples_s": samples}


def task_all(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """`check` then `bench` in one group (one process start-up instead of two)."""
    return {**task_check(rank, world, device, args), **task_bench(rank, world, device, args)}


def task_push_time(rank: int, world: int, device: torch.device, args: dict) -> dict:
    """Only the push path timed against gloo send/receive (CPU ranks)."""
    return {"rank": rank, "push_time": time_push_against_gloo(rank, world, device, args)}


_TASK_FUNCS = {"check": task_check, "bench": task_bench, "all": task_all, "push-time": task_push_time}


# ---------------------------------------------------------------------------
# The process side

def run_rank(rank: int, world: int, init_method: str, task: str, args: dict, out_dir: str,
             timeout_s: float = 120.0) -> None:
    """One rank: join the group, run the task, save its result to out_dir/rank{rank}.pt."""
    import torch.distributed as dist

    import inferbook  # noqa: F401  (turns the Triton interpreter on where there is no GPU)

    torch.set_num_threads(1)
    path = Path(out_dir)
    try:
        device = _device_for(rank, world, bool(args.get("use_cuda", False)))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            result = _TASK_FUNCS[task](rank, world, device, args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        torch.save(result, path / f"rank{rank}.pt")
    except BaseException:
        (path / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def launch(task: str, world_size: int, args: dict | None = None, timeout_s: float = 120.0) -> list[dict]:
    """Spawn `world_size` ranks on loopback, run `task`, return their results in rank order.

    Every wait is bounded: ranks join their group within `timeout_s` (collectives time out
    too), and the launcher kills its own processes when the deadline passes and raises."""

    if task not in TASKS:
        raise UserError(f"task must be one of {TASKS}, got {task!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD:
        raise UserError(f"world_size must be an int in 1..{MAX_WORLD}, got {world_size!r}")
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise UserError(f"timeout_s must be a positive number, got {timeout_s!r}")
    args = dict(args or {})
    json.dumps(args)  # the same args must travel to torchrun as JSON
    with loopback_ranks(run_rank, world_size, (task, args), timeout_s=timeout_s, what=f"comm task {task!r}",
                        prefix="inferbook-comm-") as out_dir:
        # our own ranks wrote these; weights_only keeps to tensors and plain containers all the same
        return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(world_size)]


# ---------------------------------------------------------------------------
# What the launcher checks after `launch("check", ...)`

def elements_where_ranks_disagree(per_rank: list[torch.Tensor]) -> int:
    """How many elements (not element-rank pairs) have bits on some rank that differ from rank 0's:
    at most numel, whatever the number of ranks. `per_rank`: one same-shaped tensor per rank."""
    from . import tail

    if not per_rank:
        return 0
    mask = torch.zeros(per_rank[0].shape, dtype=torch.bool)
    for t in per_rank[1:]:
        mask |= tail.bits_differ(t, per_rank[0]).cpu()
    return int(mask.sum())


def check_results(results: list[dict], args: dict | None = None) -> list[dict]:
    """Rows {check, passed, detail} from every rank's `task_check` result:

    - each all-reduce variant equals, in bits, the single-process `simulate` for that rank, and
      is within summation rounding of `torch.distributed.all_reduce` (N * eps * sum|x_i|);
    - ranks agree in bits wherever the order is fixed (and where they disagree, it is counted);
    - both greedy strategies equal `torch.argmax` of the full logits on every rank and row;
    - the fused tail equals the unfused chain in bits on every rank, every rank holds the same
      bits, and they equal the single-process chain's."""
    from . import allreduce as ar, tail, vocab_greedy as vg

    args = dict(args or {})
    world = len(results)
    seed = int(args.get("seed", 0))
    rows: list[dict] = []

    def row(check, passed, detail=""):
        rows.append({"check": check, "passed": bool(passed), "detail": detail})

    numel = int(args.get("numel", 1000))
    for dt in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(seed + 1)
        inputs = (torch.randn(world, numel, generator=g) * torch.logspace(-3, 3, numel)).to(dt)
        bound = world * torch.finfo(dt).eps * inputs.float().abs().sum(0)
        for alg in ar.ALGORITHMS:
            for order in ar.ORDERS:
                for acc in ar.ACCUMULATE:
                    sim = ar.simulate(list(inputs), alg, order, acc)
                    for mode in ar.MODES:
                        key = f"allreduce/{dt}/{alg}/{mode}/{order}/{acc}"
                        name = f"all-reduce {str(dt)[6:]} {alg} {mode} {order} {acc}"
                        got = [r[key] for r in results]
                        same_as_sim = all(torch.equal(g_.view(torch.int16 if dt != torch.float32 else torch.int32),
                                                      s_.view(torch.int16 if dt != torch.float32 else torch.int32))
                                          for g_, s_ in zip(got, sim))
                        row(f"{name}: bits equal the simulation", same_as_sim)
                        err = max(float(((g_.float() - r["builtin/" + str(dt)].float()).abs() - bound).max())
                                  for g_, r in zip(got, results))
                        finite = all(bool(torch.isfinite(g_).all()) for g_ in got)
                        row(f"{name}: within rounding of torch.distributed.all_reduce", finite and err <= 0,
                            f"max excess over the bound {err:.3g}")
                        disagree = elements_where_ranks_disagree(got)
                        if order == "fixed" or alg == "two-shot":
                            row(f"{name}: ranks agree in bits", disagree == 0, f"{disagree} elements differ")
    vocab, batch = int(args.get("vocab", 64)), int(args.get("batch", 4))
    logits, labels = vg.tie_nan_inf_matrix(batch, vocab, world, generator=torch.Generator().manual_seed(seed + 2))
    want = vg.greedy_reference(logits)
    for strategy in vg.STRATEGIES:
        bad = [(r["rank"], labels[i]) for r in results for i in range(len(labels))
               if int(r[f"greedy/{strategy}"][i]) != int(want[i])]
        row(f"greedy {strategy} == argmax of the full logits ({len(labels)} rows incl. ties, NaN, -inf)",
            not bad, f"wrong rows: {bad[:4]}" if bad else "")
    T, H, K = int(args.get("tokens", 4)), int(args.get("hidden", 64)), int(args.get("topk_per_rank", 2))
    backend = results[0]["tail/backend"]
    inp = tail.make_tail_inputs(world, T, H, K, generator=torch.Generator().manual_seed(seed + 3))
    single = tail.run_tail(inp, "unfused", backend=backend if tail.select_backend(torch.device("cpu"))[0] == backend else "torch")
    for i, what in enumerate(("out", "residual_out")):
        fused_vs_unfused = sum(int(tail.bits_differ(r["tail/fused"][i], r["tail/unfused"][i]).sum()) for r in results)
        row(f"tail {what}: fused == unfused chain in bits on every rank", fused_vs_unfused == 0,
            f"{fused_vs_unfused} elements differ")
        across = elements_where_ranks_disagree([r["tail/fused"][i] for r in results])
        row(f"tail {what}: every rank holds the same bits", across == 0, f"{across} elements differ")
        vs_single = int(tail.bits_differ(results[0]["tail/fused"][i], single[i]).sum())
        row(f"tail {what}: distributed == single-process chain in bits", vs_single == 0,
            f"{vs_single} elements differ (backend {backend})")
        if "tail/fused_pre" in results[0]:
            pre = sum(int(tail.bits_differ(r["tail/fused_pre"][i], r["tail/unfused"][i]).sum()) for r in results)
            row(f"tail {what}: finalize-before-exchange == unfused chain in bits on every rank", pre == 0,
                f"{pre} elements differ")
            pre_across = elements_where_ranks_disagree([r["tail/fused_pre"][i] for r in results])
            row(f"tail {what}: finalize-before-exchange, every rank holds the same bits", pre_across == 0,
                f"{pre_across} elements differ")
        label = results[0].get("push/transport", "shared-memory")
        if "push/error" in results[0]:
            row(f"tail {what}: {label} push (finalize into peers' slots, flags) ran", False, results[0]["push/error"])
        elif "tail/fused_shm" in results[0]:
            shm = sum(int(tail.bits_differ(r["tail/fused_shm"][i], r["tail/unfused"][i]).sum()) for r in results)
            row(f"tail {what}: {label} push (finalize into peers' slots, flags) == unfused chain in bits", shm == 0,
                f"{shm} elements differ")
    if "gather/ring" in results[0]:
        from . import fused_exchange as fx
        full = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed + 5)).to(torch.bfloat16)
        for transport in fx.GATHER_TRANSPORTS:
            bad = [r["rank"] for r in results if not torch.equal(r[f"gather/{transport}"].view(torch.int16),
                                                                full.view(torch.int16))]
            row(f"vocab gather {transport}: every rank holds the full logits, bit for bit", not bad,
                f"wrong on ranks {bad}" if bad else "")
        if "gather/shm-pull" in results[0]:
            bad = [r["rank"] for r in results if not torch.equal(r["gather/shm-pull"].view(torch.int16),
                                                                full.view(torch.int16))]
            row(f"vocab gather shm-pull ({results[0].get('push/transport', 'shared-memory')}: peers' mapped slots, "
                "flags): every rank holds the full logits, bit for bit",
                not bad, f"wrong on ranks {bad}" if bad else "")
    return rows


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from torchrun."""
    p = argparse.ArgumentParser(prog="python -m inferbook.comm.workers")
    p.add_argument("task", choices=TASKS)
    p.add_argument("--args", default="{}", help="task arguments as JSON")
    p.add_argument("--out", default=".", help="folder for rank{N}.pt results")
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    Path(a.out).mkdir(parents=True, exist_ok=True)
    run_rank(rank, world, "env://", a.task, json.loads(a.args), a.out, a.timeout)


if __name__ == "__main__":
    main()
