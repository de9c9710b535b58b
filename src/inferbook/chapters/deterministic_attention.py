"""Chapter `deterministic-attention`: batch-invariant split-KV decode attention (seed §六, SGLang
#37740 — with deterministic inference on, AMD no longer takes Lean Attention, whose floating-point
grouping changes with the batch size).

`measure(ctx, ...)` returns these records:

- `decode-correctness` — the Triton kernel in both modes against the fp32 PyTorch definition, with
  FlashAttention's tolerance rule (at most twice PyTorch's own error in the same precision).
- `batch-invariance` — one request placed in batches of each size: distinct output bit patterns
  per mode (the switch `deterministic` is in the record's workload).
- `lean-invariance` — a Lean-Attention-like stream-K kernel (`attention.lean`) whose cuts depend on
  the whole batch, against the fixed-split path: one request first / middle / last in batches of
  each size, distinct bit patterns per kernel.
- `matmul-invariance` — `F.linear` (what the serving engine's linear layers call) and the fixed-tile
  Triton matmul: is mm(a[:1], w) == mm(a, w)[:1] in bits for every M?
- `decode-time` (GPU only) — both modes over batch sizes: the time cost of determinism.
- `engine-determinism` — the serving engine end to end in `ENGINE_MODES`: as built, then with
  everything but attention batch-invariant under #37740's switch (Lean / adaptive split with
  deterministic inference off, the forced standard path with it on).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..measure import benchmark
from ..presets import Param
from ..record import RunRecord
from ..attention import decode, lean

# The results page's headline: (record name prefix, measurement).
HEADLINE = ('engine-determinism', 'distinct_completions', 'Distinct hidden-state patterns of one request across batch sizes, engine as built')

PARAMETERS = {
    "batch_sizes": Param(tuple, help="batch sizes the same request is placed in (comma list)"),
    "heads": Param(int, help="query heads"),
    "kv_heads": Param(int, help="key/value heads"),
    "head_dim": Param(int, help="head dimension"),
    "max_seqlen": Param(int, help="cache capacity (the other requests' lengths are random up to it)"),
    "target_len": Param(int, help="length of the request that is followed across batches"),
    "split_size": Param(int, help="tokens per split in deterministic mode (multiple of 32)"),
    "sms": Param(int, help="SMs the adaptive plan fills (0: this GPU's count)"),
    "dtype": Param(str, "bfloat16", help="q/k/v dtype", choices=("bfloat16", "float16")),
    "mm_m_values": Param(tuple, help="row counts M of the matmul invariance check (comma list)"),
    "mm_k": Param(int, help="matmul K (input features)"),
    "mm_n": Param(int, help="matmul N (output features)"),
    "time_batches": Param(tuple, help="batch sizes timed on a GPU (comma list)"),
    "time_seqlen": Param(int, help="cache length of the timed batches"),
    "reps": Param(int, help="timed repetitions"),
    "e2e_requests": Param(int, help="identical greedy requests in the end-to-end run (0: skip)"),
    "e2e_new_tokens": Param(int, help="tokens each end-to-end request generates"),
    "e2e_layers": Param(int, help="decoder layers of the end-to-end model"),
}

def check_params(params: dict) -> None:
    """Every knob before any work: non-empty positive batch lists, head shapes, the followed request
    within the cache, the split size's rule."""
    for name in ("batch_sizes", "mm_m_values", "time_batches"):
        values = params[name]
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name}={values!r} must be a non-empty comma list of ints >= 1")
    for name in ("heads", "kv_heads", "head_dim", "max_seqlen", "target_len", "split_size", "mm_k", "mm_n",
                 "time_seqlen", "reps"):
        if params[name] < 1:
            raise ValueError(f"{name}={params[name]} must be >= 1")
    if params["heads"] % params["kv_heads"]:
        raise ValueError(f"heads={params['heads']} must be a multiple of kv_heads={params['kv_heads']}")
    if params["target_len"] > params["max_seqlen"]:
        raise ValueError(f"target_len={params['target_len']} must be <= max_seqlen={params['max_seqlen']}")
    if params["split_size"] % 32:
        raise ValueError(f"split_size={params['split_size']} must be a multiple of 32")


PRESETS = {
    "smoke": dict(batch_sizes=(1, 2, 3, 5, 8), heads=4, kv_heads=2, head_dim=32, max_seqlen=128, target_len=120,
                  split_size=32, sms=8, mm_m_values=(1, 3, 17, 64), mm_k=128, mm_n=64, time_batches=(1, 8),
                  time_seqlen=1024, reps=3, e2e_requests=4, e2e_new_tokens=3, e2e_layers=1),
    # cpu: every Triton kernel runs in the interpreter (one Python step per program and KV tile), so the
    # end-to-end run is 8 requests here (four engine modes); the gpu preset runs 24 (sized to the lent
    # machine's minutes by `inferbook budgets --preset gpu`: the engine's Python binds it). One KV head
    # (four query heads on it) and a 4-SM device: the adaptive plan's want = 2 x SMs / (B x KV heads) is
    # the same at every batch as with 2 KV heads on 8 SMs, so it takes the same split at each B, reaching
    # its last plan (one split per request) at B = 8, for half the tiles the interpreter walks in the sweeps
    "cpu": dict(batch_sizes=(1, 2, 3, 5, 8), heads=4, kv_heads=1, head_dim=64, max_seqlen=256,
                target_len=250, split_size=64, sms=4, mm_m_values=(1, 3, 17, 64, 128), mm_k=256, mm_n=128,
                time_batches=(1, 8), time_seqlen=1024, reps=5, e2e_requests=8, e2e_new_tokens=4, e2e_layers=1),
    "gpu": dict(batch_sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), heads=32, kv_heads=8, head_dim=128,
                max_seqlen=8192, target_len=8000, split_size=256, sms=0, mm_m_values=(1, 2, 3, 8, 17, 64, 128, 256, 1024),
                mm_k=4096, mm_n=4096, time_batches=(1, 2, 4, 8, 16, 32, 64), time_seqlen=8192, reps=20,
                e2e_requests=24, e2e_new_tokens=12, e2e_layers=2),
}


def _ints(values) -> list[int]:
    return [int(v) for v in values]


@functools.lru_cache(maxsize=4)
def correctness_rows(device, dtype, seed: int, split_size: int, sms: int | None) -> list[dict]:
    """Kernel (both modes) vs the fp32 definition on fresh random inputs, over a small matrix of
    shapes: GQA and MHA, an odd head dim, lengths 0, 1, a split boundary and the capacity.
    Tolerance (FlashAttention's rule): 2 x PyTorch's own error in `dtype` + a rounding floor.
    Cached per arguments: the notebook's correctness section and `measure` share one run."""
    rows = []
    g = torch.Generator().manual_seed(seed + 11)
    for B, H, Hk, D, S in ((4, 4, 2, 32, 2 * split_size + 5), (3, 6, 6, 40, split_size), (2, 8, 1, 64, 3 * split_size)):
        q = torch.randn(B, H, D, generator=g).to(dtype).to(device)
        k = torch.randn(B, S, Hk, D, generator=g).to(dtype).to(device)
        v = torch.randn(B, S, Hk, D, generator=g).to(dtype).to(device)
        lens = torch.tensor([S, 0, 1, split_size + 1][:B], dtype=torch.int32)
        lens = torch.cat([lens, torch.randint(0, S + 1, (B - len(lens),), generator=g, dtype=torch.int32)])[:B].to(device)
        ref = decode.decode_attention_reference(q, k, v, lens).float()
        low = decode.decode_attention_reference(q, k, v, lens, compute_dtype=dtype).float()
        floor = 2 * float(((ref + 0.3 - 0.3) - ref).abs().max())
        torch_err = float((low - ref).abs().max())
        for det in (False, True):
            out, plan = decode.decode_attention(q, k, v, lens, det, split_size=split_size, sms=sms, return_plan=True)
            err = float((out.float() - ref).abs().max())
            zero_ok = bool((out[lens == 0] == 0).all())
            rows.append({"shape": f"B{B} H{H}/{Hk} D{D} S{S}", "mode": plan["mode"], "num_splits": plan["num_splits"],
                         "max_err": err, "torch_err": torch_err, "tolerance": 2 * torch_err + floor,
                         "empty_rows_zero": zero_ok, "nan": bool(out.isnan().any()),
                         "passed": (err <= 2 * torch_err + floor) and zero_ok and not bool(out.isnan().any())})
    return rows


def lean_correctness_rows(device, dtype, seed: int, ctas: int) -> list[dict]:
    """The stream-K kernel against the fp32 definition on the correctness shapes (GQA, MHA, lengths 0
    and 1), FlashAttention's rule: 2 x PyTorch's error in `dtype` + a rounding floor."""
    rows = []
    g = torch.Generator().manual_seed(seed + 13)
    for B, H, Hk, D, S in ((4, 4, 2, 32, 77), (3, 6, 6, 40, 64)):
        q = torch.randn(B, H, D, generator=g).to(dtype).to(device)
        k = torch.randn(B, S, Hk, D, generator=g).to(dtype).to(device)
        v = torch.randn(B, S, Hk, D, generator=g).to(dtype).to(device)
        lens = torch.tensor([S, 0, 1, 33][:B], dtype=torch.int32).to(device)
        ref = decode.decode_attention_reference(q, k, v, lens).float()
        low = decode.decode_attention_reference(q, k, v, lens, compute_dtype=dtype).float()
        floor = 2 * float(((ref + 0.3 - 0.3) - ref).abs().max())
        tol = 2 * float((low - ref).abs().max()) + floor
        out = lean.lean_decode_attention(q, k, v, lens, ctas=ctas)
        err = float((out.float() - ref).abs().max())
        ok = err <= tol and not bool(out.isnan().any()) and bool((out[lens == 0] == 0).all())
        rows.append({"shape": f"B{B} H{H}/{Hk} D{D} S{S}", "max_err": err, "tolerance": tol, "passed": ok})
    return rows


def summarize_invariance(rows: list[dict]) -> dict[str, int]:
    """Distinct output bit patterns of the followed request, per mode."""
    out: dict[str, set] = {}
    for r in rows:
        out.setdefault(r["mode"], set()).add(r["bits"])
    return {mode: len(bits) for mode, bits in out.items()}


def measure(ctx, *, batch_sizes, heads, kv_heads, head_dim, max_seqlen, target_len, split_size, sms, dtype,
            mm_m_values, mm_k, mm_n, time_batches, time_seqlen, reps, e2e_requests, e2e_new_tokens,
            e2e_layers) -> list[RunRecord]:
    from ..errors import UserError

    dt = getattr(torch, dtype)
    sms = sms or None
    batch_sizes, mm_m_values, time_batches = _ints(batch_sizes), _ints(mm_m_values), _ints(time_batches)
    if not 1 <= target_len <= max_seqlen:
        raise UserError(f"target_len must be in 1..max_seqlen={max_seqlen}, got {target_len}")
    decode.plan_splits(1, 1, 1, deterministic=True, sms=1, split_size=split_size)  # validates split_size
    backend, why = decode.select_backend(ctx.device)
    shapes = {"q": ["B", heads, head_dim], "kv_cache": ["B", max_seqlen, kv_heads, head_dim]}
    label = f"triton ({'interpreter' if ctx.interpreted else 'compiled'})" if backend == "triton" else "torch reference"
    records = []

    corr = ctx.new_record("decode-correctness", variant="both modes", workload={
        "model": "split-KV decode attention", "dtype": dtype, "deterministic": "both",
        "shapes": {"split_size": split_size}}, topology={"ranks": 1})
    corr.set_backend("decode_attention", label, reason=why, dtype=dtype)
    for r in correctness_rows(ctx.device, dt, ctx.seed, split_size, sms):
        corr.add_check(f"{r['shape']} {r['mode']}: error <= 2 x PyTorch {dtype} error", r["passed"],
                       error=r["max_err"], tolerance=r["tolerance"], empty_rows_zero=r["empty_rows_zero"])
    records.append(corr)

    rows = decode.batch_invariance_sweep(batch_sizes=batch_sizes, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                         max_seqlen=max_seqlen, target_len=target_len, dtype=dt, device=ctx.device,
                                         seed=ctx.seed, split_size=split_size, sms=sms)
    distinct = summarize_invariance(rows)
    inv = ctx.new_record("batch-invariance", variant="adaptive vs deterministic", workload={
        "model": "split-KV decode attention", "dtype": dtype, "batch": batch_sizes, "input_len": target_len,
        "deterministic": "both (switch recorded per measurement)",
        "shapes": shapes}, topology={"ranks": 1})
    inv.set_backend("decode_attention", label, reason=why, shapes=shapes, dtype=dtype)
    for r in rows:
        inv.add("split_len", r["split_len"], "tokens", mode=r["mode"], deterministic=r["mode"] == "deterministic",
                batch=r["batch"], num_splits=r["num_splits"], target_splits=r["target_splits"], bits=r["bits"],
                max_err=r["max_err"])
    for mode, n in distinct.items():
        inv.add("distinct_bit_patterns", n, "patterns", mode=mode, deterministic=mode == "deterministic",
                batches=len(batch_sizes))
    inv.add_check("deterministic mode: one bit pattern across all batch sizes", distinct["deterministic"] == 1,
                  error=distinct["deterministic"], tolerance=1)
    inv.add_check("no NaN in the followed request's output", not any(r["nan"] for r in rows))
    records.append(inv)

    # the stream-K split: the same request first / in the middle / last of batches of each size
    ctas = sms or decode.sm_count(ctx.device)
    lrows = lean.position_sweep(batch_sizes=batch_sizes, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                max_seqlen=max_seqlen, target_len=target_len, dtype=dt, device=ctx.device,
                                seed=ctx.seed, split_size=split_size, ctas=ctas)
    lrec = ctx.new_record("lean-invariance", variant="stream-K vs fixed split", workload={
        "model": "decode attention", "dtype": dtype, "batch": batch_sizes, "input_len": target_len,
        "deterministic": "both (kernel recorded per measurement)", "shapes": shapes,
        "positions": ["first", "middle", "last"]}, topology={"ranks": 1, "ctas": ctas})
    lrec.set_backend("lean_decode_attention", label.replace("torch reference", "triton (interpreter)"), reason=why,
                     shapes={**shapes, "ctas": ctas}, dtype=dtype)
    for r in lrows:
        lrec.add("cuts", len(r["cuts"]), "cuts", kernel=r["kernel"], batch=r["batch"], position=r["position"],
                 cut_tiles=r["cuts"], bits=r["bits"], max_err=r["max_err"])
    lpatterns = {}
    for r in lrows:
        lpatterns.setdefault(r["kernel"], set()).add(r["bits"])
    for kernel, bits in lpatterns.items():
        lrec.add("distinct_bit_patterns", len(bits), "patterns", kernel=kernel, placements=len(lrows) // 2)
    lrec.add_check("fixed split: one bit pattern over every batch size and position",
                   len(lpatterns["fixed split"]) == 1, error=len(lpatterns["fixed split"]), tolerance=1)
    lrec.add_check("no NaN in the followed request's output", not any(r["nan"] for r in lrows))
    # the stream-K kernel against the fp32 definition, with the same rule as the split-KV kernel
    for row in lean_correctness_rows(ctx.device, dt, ctx.seed, ctas):
        corr.add_check(f"{row['shape']} lean (stream-K, {ctas} programs): error <= 2 x PyTorch {dtype} error",
                       row["passed"], error=row["max_err"], tolerance=row["tolerance"])
    records.append(lrec)

    mm = ctx.new_record("matmul-invariance", variant="F.linear vs fixed-tile Triton", workload={
        "model": "linear layer", "dtype": dtype, "shapes": {"k": mm_k, "n": mm_n, "m": mm_m_values}},
        topology={"ranks": 1})
    mm.set_backend("F.linear", "torch F.linear (the engine's linear layers)", shapes={"k": mm_k, "n": mm_n}, dtype=dtype)
    mm.set_backend("batch_invariant_matmul", label, reason=why, shapes={"k": mm_k, "n": mm_n}, dtype=dtype)
    # F.linear in the chapter's dtype and in the end-to-end engine's (float32 on CPU, bf16 on a GPU)
    cases = [("F.linear", F.linear, dt), ("batch_invariant_matmul", decode.batch_invariant_matmul, dt)]
    if engine_dtype(ctx.device) != dt:
        cases.insert(1, ("F.linear", F.linear, engine_dtype(ctx.device)))
    for name, fn, mdt in cases:
        res = decode.matmul_batch_invariance(fn, m_values=mm_m_values, k=mm_k, n=mm_n, dtype=mdt, device=ctx.device,
                                             seed=ctx.seed)
        varies = [m for m, same in res["same"].items() if not same]
        d = str(mdt).replace("torch.", "")
        mm.add("distinct_row0_patterns", res["distinct"], "patterns", op=name, dtype=d, varies_at=varies)
        mm.add("batch_sizes_varying", len(varies), "batch sizes", op=name, dtype=d, rows_checked=res["rows_checked"])
        if name == "batch_invariant_matmul":
            mm.add_check("fixed-tile matmul: every checked row equals the row computed alone, for every M",
                         not varies and res["distinct"] == 1, error=len(varies), tolerance=0)
    records.append(mm)

    if ctx.device.type == "cuda" and backend == "triton":
        t = ctx.new_record("decode-time", variant="adaptive vs deterministic", workload={
            "model": "split-KV decode attention", "dtype": dtype, "input_len": time_seqlen, "batch": time_batches,
            "shapes": {**shapes, "kv_cache": ["B", time_seqlen, kv_heads, head_dim]}}, topology={"ranks": 1})
        t.set_backend("decode_attention", label, reason=why, dtype=dtype)
        g = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
        for B in time_batches:
            q = torch.randn(B, heads, head_dim, device=ctx.device, generator=g).to(dt)
            k = torch.randn(B, time_seqlen, kv_heads, head_dim, device=ctx.device, generator=g).to(dt)
            v = torch.randn_like(k)
            lens = torch.full((B,), time_seqlen, dtype=torch.int32, device=ctx.device)
            bytes_moved = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
            for det in (False, True):
                _, plan = decode.decode_attention(q, k, v, lens, det, split_size=split_size, sms=sms, return_plan=True)
                tm = benchmark(lambda: decode.decode_attention(q, k, v, lens, det, split_size=split_size, sms=sms,
                                                               max_seqlen=time_seqlen),
                               ctx.device, label=f"decode B{B} det={det}", uses_triton=True, min_reps=max(reps, 20))
                t.add_timing("decode_time", tm, mode=plan["mode"], deterministic=det, batch=B,
                             num_splits=plan["num_splits"], gbps=bytes_moved / tm.median_s / 1e9)
            # the stream-K kernel (its plan is built on the host from the lengths, as Lean's is)
            prep = lean.prepare([time_seqlen] * B, kv_heads, ctas, ctx.device)   # the plan, outside the timing
            lplan = {k: v for k, v in prep.items() if not k.startswith("t_")}
            tm = benchmark(lambda: lean.lean_decode_attention(q, k, v, lens, prepared=prep), ctx.device,
                           label=f"lean B{B}", uses_triton=True, min_reps=max(reps, 20))
            t.add_timing("decode_time", tm, mode="lean (stream-K)", deterministic=False, batch=B,
                         num_splits=len(lplan["pieces"]), gbps=bytes_moved / tm.median_s / 1e9)
        records.append(t)

    if e2e_requests > 0:
        records.append(engine_record(ctx, requests=e2e_requests, new_tokens=e2e_new_tokens, layers=e2e_layers,
                                     split_size=split_size, sms=sms))
    return records


# ---------------------------------------------------------------------------
# End to end: the serving engine (inferbook.serving) with the determinism switch

def engine_dtype(device: torch.device):
    """The end-to-end model's dtype: bfloat16 on a GPU, float32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def engine_attention_path(deterministic_inference: bool, lean: bool) -> str:
    """The decode-attention path SGLang's Triton backend takes after #37740: with deterministic inference
    on, the standard Triton decode kernel with a fixed split tile (`split_tile_size`, 256 by default),
    whatever Lean's gate says; off, Lean (stream-K) where it is enabled (AMD), else the adaptive split."""
    if deterministic_inference:
        return "fixed split"
    return "lean" if lean else "adaptive split"


# The engine configurations compared end to end, on the same arrivals. The first is the engine as built
# (F.linear, chunked prefill, adaptive split). The next three make everything but attention batch-invariant
# (the persistent fixed-tile matmul for every linear, a row-wise RMSNorm kernel, each prompt prefilled in
# one piece) so that attention's effect shows alone; they differ only in the attention path that #37740's
# switch picks: Lean enabled with deterministic inference off, the adaptive split, and Lean enabled with
# deterministic inference on (the fix forces the standard fixed-split path).
ENGINE_MODES = {
    "engine as built": dict(deterministic_inference=False, lean=False, invariant_rest=False),
    "all but attention invariant, adaptive split": dict(deterministic_inference=False, lean=False,
                                                        invariant_rest=True),
    "all but attention invariant, Lean": dict(deterministic_inference=False, lean=True, invariant_rest=True),
    "all but attention invariant, deterministic inference (#37740)": dict(deterministic_inference=True, lean=True,
                                                                          invariant_rest=True),
}
DETERMINISTIC_MODE = "all but attention invariant, deterministic inference (#37740)"


def _switchable_runner_class():
    """A `ModelRunner` whose forward takes the switches. `invariant_rest`: linear layers through the
    persistent fixed-tile matmul and RMSNorm through a row-wise kernel (else F.linear and torch's
    reduction, whose split can follow the tensor's shape on a GPU). `attention`: the decode rows'
    attention batched through the adaptive split, the fixed split or the stream-K (Lean) kernel, one
    call per layer per step. Prefill spans keep the engine's attention, one request at a time."""
    from ..serving.model import apply_rope
    from ..serving.model_runner import ModelRunner, paged_attention

    class SwitchableRunner(ModelRunner):
        def __init__(self, model, num_blocks, block_size, *, attention: str, split_size: int, sms,
                     invariant_rest: bool = False):
            super().__init__(model, num_blocks, block_size)
            if attention not in ("adaptive split", "fixed split", "lean"):
                raise ValueError(f"attention must be 'adaptive split', 'fixed split' or 'lean', got {attention!r}")
            self.attention, self.split_size, self.sms = attention, split_size, sms
            self.invariant_rest = invariant_rest
            self.decode_plans: list[dict] = []
            self.kernels_ran: set[str] = set()     # what the launchers report running, per step

        def lin(self, mod, x):
            return decode.batch_invariant_matmul(x, mod.weight) if self.invariant_rest else F.linear(x, mod.weight)

        def norm(self, mod, x):
            if not self.invariant_rest:
                return mod(x)
            return decode.batch_invariant_rms_norm(x, mod.eps) * mod.weight

        def decode_attention(self, q, kc, vc, lens):
            if self.attention == "lean":
                ctas = self.sms or decode.sm_count(q.device)
                o, plan = lean.lean_decode_attention(q, kc, vc, lens, ctas=ctas, return_plan=True)
                self.kernels_ran.add("lean (stream-K)")
                return o, {"split_len": None, "pieces": len(plan["pieces"])}
            o, plan = decode.decode_attention(q, kc, vc, lens, self.attention == "fixed split",
                                              split_size=self.split_size, sms=self.sms, return_plan=True)
            self.kernels_ran.add(f"split-KV ({plan['mode']})")
            return o, plan

        @torch.no_grad()
        def forward(self, batch):
            m, cfg = self.model, self.model.cfg
            T = batch.tokens.shape[0]
            H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
            cos, sin = m.cos[batch.positions], m.sin[batch.positions]
            x = m.embed(batch.tokens)
            one = [(start, kv_slots) for start, n, kv_slots, _ in batch.spans if n == 1]
            lens = torch.tensor([len(s) for _, s in one], dtype=torch.int32, device=x.device)
            rows = torch.tensor([start for start, _ in one], dtype=torch.long, device=x.device)
            for i, layer in enumerate(m.layers):
                a = layer.attn
                h = self.norm(layer.attn_norm, x)
                q = apply_rope(self.lin(a.wq, h).view(T, H, D).transpose(0, 1)[None], cos, sin)[0]     # [H, T, D]
                k = apply_rope(self.lin(a.wk, h).view(T, Hkv, D).transpose(0, 1)[None], cos, sin)[0]
                v = self.lin(a.wv, h).view(T, Hkv, D)
                self.k_cache[i].index_copy_(0, batch.slots, k.transpose(0, 1))
                self.v_cache[i].index_copy_(0, batch.slots, v)
                out = torch.empty(H, T, D, dtype=x.dtype, device=x.device)
                for start, n, kv_slots, pos in batch.spans:
                    if n > 1:
                        out[:, start:start + n] = paged_attention(q[:, start:start + n], self.k_cache[i],
                                                                  self.v_cache[i], kv_slots, pos)
                if one:  # every one-token row of the step in one batched decode-attention call
                    S = int(lens.max())
                    kc = torch.zeros(len(one), S, Hkv, D, dtype=x.dtype, device=x.device)
                    vc = torch.zeros_like(kc)
                    for j, (_, slots) in enumerate(one):
                        kc[j, :len(slots)] = self.k_cache[i][slots]
                        vc[j, :len(slots)] = self.v_cache[i][slots]
                    o, plan = self.decode_attention(q[:, rows].transpose(0, 1).contiguous(), kc, vc, lens)
                    if i == 0:
                        self.decode_plans.append({"batch": len(one), "split_len": plan.get("split_len")})
                    out[:, rows] = o.transpose(0, 1)
                x = x + self.lin(a.wo, out.transpose(0, 1).reshape(T, cfg.d_model))
                h = self.norm(layer.mlp_norm, x)
                x = x + self.lin(layer.w_down, F.silu(self.lin(layer.w_gate, h)) * self.lin(layer.w_up, h))
            hidden = self.norm(m.norm, x[batch.logit_rows])
            return self.lin(m.lm_head, hidden).float(), hidden

    return SwitchableRunner


def run_engine(model, *, deterministic_inference: bool, lean: bool, invariant_rest: bool, requests: int,
               new_tokens: int, seed: int, split_size: int, sms, max_num_seqs: int = 16,
               max_steps: int = 100_000) -> dict:
    """`requests` copies of one greedy request, arriving in waves among random other requests
    (random prompt and output lengths), so each copy runs in different batches. Returns the
    copies' completions, their last hidden states' bit patterns, the step batch sizes seen and
    the decode-attention plans."""
    import hashlib
    import random

    from ..serving.config import EngineConfig
    from ..serving.engine import LLMEngine
    from ..serving.sequence import SamplingParams

    cfg = model.cfg
    # with the rest invariant, each prompt is prefilled in one piece: where chunk boundaries fall
    # depends on the other requests, and a chunk boundary can change a prompt's arithmetic
    engine = LLMEngine(model, EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, block_size=16,
                                           chunked_prefill=not invariant_rest))
    Runner = _switchable_runner_class()
    attention = engine_attention_path(deterministic_inference, lean)
    engine.runner = Runner(model, engine.block_manager.num_blocks, engine.config.block_size, attention=attention,
                           split_size=split_size, sms=sms, invariant_rest=invariant_rest)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    prompt_max = cfg.max_seq - new_tokens
    # the followed request spans several KV tiles, so a batch-dependent split can cut it in different places
    target_prompt = torch.randint(cfg.vocab, (min(56, prompt_max),), generator=g).tolist()
    target_params = SamplingParams(max_tokens=new_tokens)
    targets, left, steps = [], requests, 0
    while left or engine.has_unfinished():
        if left:
            for _ in range(min(left, rng.randint(1, 4))):
                targets.append(engine.add_request(target_prompt, target_params))
                left -= 1
            for _ in range(rng.randint(0, 4)):
                n = rng.randint(1, prompt_max)
                engine.add_request(torch.randint(cfg.vocab, (n,), generator=g).tolist(),
                                   SamplingParams(max_tokens=rng.randint(1, new_tokens)))
        for _ in range(rng.randint(1, 3) if left else 1):
            if engine.has_unfinished():
                engine.step()
                steps += 1
        if steps > max_steps:
            raise RuntimeError(f"engine did not finish within {max_steps} steps")
    completions = [tuple(s.output_ids) for s in targets]
    hidden = [hashlib.sha256(decode.output_bits(s.draft_hidden)).hexdigest()[:16] for s in targets]
    return {"completions": completions, "hidden_bits": hidden, "steps": steps,
            "step_tokens": sorted({st.num_tokens for st in engine.steps}),
            "decode_batches": sorted({p["batch"] for p in engine.runner.decode_plans}),
            "decode_split_lens": sorted({p["split_len"] for p in engine.runner.decode_plans if p["split_len"]}),
            "attention": attention, "kernels_ran": sorted(engine.runner.kernels_ran)}


def deterministic_checks(res: dict) -> list[tuple[str, bool, dict]]:
    """What #37740's deterministic mode must give on `run_engine`'s result: the fixed-split kernel is
    the one its launcher reports running (not Lean, not the adaptive split), and every identical
    request gets one completion and one hidden-state bit pattern."""
    n_comp, n_hidden = len(set(res["completions"])), len(set(res["hidden_bits"]))
    return [("deterministic inference: the standard fixed-split kernel ran, Lean did not",
             res["kernels_ran"] == ["split-KV (fixed split size)"], {"kernels": res["kernels_ran"]}),
            ("deterministic inference: one completion for all identical requests", n_comp == 1,
             {"error": n_comp, "tolerance": 1}),
            ("deterministic inference: one hidden-state bit pattern", n_hidden == 1,
             {"error": n_hidden, "tolerance": 1})]


def engine_record(ctx, *, requests: int, new_tokens: int, layers: int, split_size: int, sms) -> RunRecord:
    """The engine in each of `ENGINE_MODES` on the same arrivals: distinct completions and
    hidden-state bit patterns among the identical requests; on a GPU, the wall time of each run."""
    import time

    from ..device import synchronize
    from ..serving.model import TinyConfig, TinyDecoder, init_weights

    dtype = engine_dtype(ctx.device)
    cfg = TinyConfig(max_seq=64 + new_tokens, n_layers=layers)
    model = init_weights(TinyDecoder(cfg), ctx.seed).to(ctx.device, dtype).eval()
    rec = ctx.new_record("engine-determinism", variant="#37740's switch with everything but attention invariant",
                         workload={
        "model": f"tiny-decoder L{cfg.n_layers} d{cfg.d_model} (random init, seed {ctx.seed})",
        "quantization": f"none ({str(dtype)[6:]})", "output_len": new_tokens, "batch": "varying (waves)",
        "requests": requests, "dtype": str(dtype)[6:], "modes": ENGINE_MODES}, topology={"ranks": 1})
    backend, why = decode.select_backend(ctx.device)
    rec.set_backend("engine decode attention", "per mode: " + ", ".join(
        f"{m}: {engine_attention_path(f['deterministic_inference'], f['lean'])}" for m, f in ENGINE_MODES.items()),
        reason=why)
    rec.set_backend("engine linear / RMSNorm", "F.linear + torch RMSNorm ('engine as built'); persistent fixed-tile "
                    "matmul + row-wise RMSNorm kernel (the 'all but attention invariant' modes)")
    for mode, flags in ENGINE_MODES.items():
        synchronize(ctx.device)
        t0 = time.perf_counter()
        res = run_engine(model, requests=requests, new_tokens=new_tokens, seed=ctx.seed, split_size=split_size,
                         sms=sms, **flags)
        synchronize(ctx.device)
        wall = time.perf_counter() - t0
        n_comp, n_hidden = len(set(res["completions"])), len(set(res["hidden_bits"]))
        rec.add("distinct_completions", n_comp, "completions", mode=mode, **flags, attention=res["attention"],
                kernels_ran=res["kernels_ran"], requests=requests, steps=res["steps"],
                decode_batches=res["decode_batches"], decode_split_lens=res["decode_split_lens"])
        rec.add("distinct_hidden_bits", n_hidden, "patterns", mode=mode, **flags, attention=res["attention"],
                requests=requests)
        if ctx.device.type == "cuda":
            rec.add("engine_wall", wall, "s", phase="total", mode=mode, **flags, steps=res["steps"])
        if mode == DETERMINISTIC_MODE:
            for name, passed, extra in deterministic_checks(res):
                rec.add_check(name, passed, **extra)
    if ctx.device.type != "cuda":
        rec.notes = "No engine times on CPU: every mode runs Triton kernels in the interpreter."
    return rec


def gpu_launches(params: dict) -> list:
    """The Triton launches of this chapter at its gpu preset (`inferbook.compiled`): split-KV decode
    (both modes) and the stream-K kernel at every timed and swept batch size, the correctness shapes,
    and the batch-invariant matmul at every M of the invariance check; one per distinct compiled kernel."""
    from .. import compiled

    dt = getattr(torch, params["dtype"])
    H, Hk, D, split = params["heads"], params["kv_heads"], params["head_dim"], params["split_size"]
    sms = params["sms"] or 132                      # 0 = this GPU's count: an H100/H200 has 132 SMs
    launches = []
    for det in (False, True):
        for B in _ints(params["time_batches"]):
            launches += decode.decode_launches(B, H, Hk, D, params["time_seqlen"], deterministic=det,
                                               split_size=split, sms=sms, dtype=dt, name="timed")
        for B in _ints(params["batch_sizes"]):
            launches += decode.decode_launches(B, H, Hk, D, params["max_seqlen"], deterministic=det,
                                               split_size=split, sms=sms, dtype=dt, name="invariance")
        for B, Hc, Hkc, Dc, S in ((4, 4, 2, 32, 2 * split + 5), (3, 6, 6, 40, split), (2, 8, 1, 64, 3 * split)):
            launches += decode.decode_launches(B, Hc, Hkc, Dc, S, deterministic=det, split_size=split, sms=sms,
                                               dtype=dt, name="correctness")   # as correctness_rows
    # the stream-K kernel over `sms` programs: the position sweep, its correctness shapes, the timed batches
    for B in _ints(params["batch_sizes"]):
        launches += lean.lean_launches([params["target_len"]] + [params["max_seqlen"]] * (B - 1), H, Hk, D,
                                       params["max_seqlen"], ctas=sms, dtype=dt, name="position sweep")
    for B, Hc, Hkc, Dc, S in ((4, 4, 2, 32, 77), (3, 6, 6, 40, 64)):          # as lean_correctness_rows
        launches += lean.lean_launches([S, 0, 1, 33][:B], Hc, Hkc, Dc, S, ctas=sms, dtype=dt, name="correctness")
    for B in _ints(params["time_batches"]):
        launches += lean.lean_launches([params["time_seqlen"]] * B, H, Hk, D, params["time_seqlen"], ctas=sms,
                                       dtype=dt, name="timed")
    for m in _ints(params["mm_m_values"]):
        launches += decode.bi_matmul_launches(m, params["mm_n"], params["mm_k"], dt)
    return compiled.dedupe(launches)


def roofline_work(params: dict) -> list[dict]:
    """Timed decode steps as {name, bytes, flops}: bytes as the chapter counts them (the K and V
    caches read, q read and out written), flops 4·B·H·S·D; deterministic mode's record rows."""
    H, Hk, D, S = params["heads"], params["kv_heads"], params["head_dim"], params["time_seqlen"]
    out = []
    for B in sorted({_ints(params["time_batches"])[0], _ints(params["time_batches"])[-1]}):
        nbytes = 2 * (B * S * Hk * D) * 2 + 2 * (B * H * D) * 2
        out.append({"name": f"decode B{B} H{H}/{Hk} D{D} S{S}", "bytes": nbytes, "flops": 4 * B * H * S * D,
                    "record": "decode-time", "metric": "decode_time", "match": {"batch": B, "deterministic": True}})
    return out
