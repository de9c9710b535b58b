"""The acceptance matrix: every path a FlashAttention upgrade must pass, checked the way
FlashAttention's own tests check it.

Tolerance rule (FlashAttention's `tests/test_flash_attn.py`): the kernel's error against a
float32 reference must be at most 2x (gradients: 3x) the error of PyTorch computing the same
attention in the same low precision, plus a rounding floor — 2x the rounding error of the
reference's own values near 0.3 in that dtype (for the sink gradient, which every such backward
derives from the rounded output, the floor is the spread that rounding O causes: `_dsinks_floor`;
for the float32 lse, 4 float32 ulps of its magnitude).
NaN never passes; a query that sees no key must
give exactly lse = -inf, and an empty tensor must come back empty.

Axes: head dim x causal x layout (fixed / varlen) x KV (contiguous / paged with page size) x
heads (MHA / GQA / MQA) x PackGQA x direction (fwd / bwd) x dtype x shape x sinks x sliding window
(none / left / two-sided band) x softcap x value head dim (same, half of d, or MLA's d 576 / dv 512,
forward only) — every one of them in the main kernel (`flash`), so they meet each other. The full
product is tens of thousands of cases; `run_matrix(..., mode="pairwise")` runs a covering
array in which every pair of axis values meets in at least one case (a few dozen cases), and
`mode="product"` the full product of whatever axes it is given.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass

import torch

from . import flash

AXES: dict[str, tuple] = {
    "head_dim": flash.HEAD_DIMS,
    "causal": (False, True),
    "layout": ("fixed", "varlen"),
    "kv": ("contiguous", "paged-1", "paged-16", "paged-128"),
    "heads": ("MHA", "GQA", "MQA"),
    "pack_gqa": (False, True),
    "direction": ("fwd", "bwd"),
    "dtype": ("bfloat16", "float16"),
    "shape": ("base", "113x203", "1023x1024", "q>k", "empty-q", "empty-k"),
    "sinks": (False, True),
    "window": ("none", "left", "band"),
    "softcap": (False, True),
    "dv": ("same", "half", "mla"),
}
SOFTCAP = 2.0        # logits of N(0, 1) inputs scaled by 1/sqrt(d) are O(1): a cap of 2 bends them
MLA_DIMS = (576, 512)  # DeepSeek's MLA decode: q/k 512 latent + 64 rope dims, v the 512 latent

# (seqlen_q, seqlen_k) of the named shapes; "base" and "q>k" scale with the preset
FIXED_SHAPES = {"113x203": (113, 203), "1023x1024": (1023, 1024)}

MATRIX_PRESETS = {
    # Triton interpreter on CPU: small sequences, few heads; every axis value still present
    "smoke": dict(batch=2, n_heads=4, base=(40, 56), mode="pairwise",
                  axes={"head_dim": (64, 96), "kv": ("contiguous", "paged-16"),
                        "shape": ("base", "q>k", "empty-q", "empty-k")}),
    # cpu: every head dim and axis value, sequences short enough for ~25 s on an idle 2-core machine
    # (113x203 runs in the named window-band case and in the gpu preset)
    "cpu": dict(batch=2, n_heads=4, base=(48, 64), mode="pairwise",
                axes={"shape": ("base", "q>k", "empty-q", "empty-k")}),
    "gpu": dict(batch=2, n_heads=8, base=(512, 512), mode="pairwise", axes={}),
}

FACTOR = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0, "dsinks": 3.0}


@dataclass(frozen=True)
class Case:
    head_dim: int
    causal: bool
    layout: str
    kv: str
    heads: str
    pack_gqa: bool
    direction: str
    dtype: str
    shape: str
    sinks: bool
    window: str = "none"
    softcap: bool = False
    dv: str = "same"

    @property
    def dims(self) -> tuple[int, int]:
        """(d, dv) of the case: MLA's (576, 512) overrides the head-dim axis."""
        if self.dv == "mla":
            return MLA_DIMS
        return self.head_dim, (max(16, self.head_dim // 2) if self.dv == "half" else self.head_dim)

    def window_size(self, seqlen_k: int) -> tuple[int, int]:
        """FlashAttention's (left, right) for this case's keys: a left window of a quarter of them,
        or a band of a fifth left and a seventh right (-1: unbounded)."""
        return {"none": (-1, -1), "left": (max(seqlen_k // 4, 1), -1),
                "band": (max(seqlen_k // 5, 1), max(seqlen_k // 7, 1))}[self.window]

    @property
    def label(self) -> str:
        heads = self.heads + ("+pack" if self.pack_gqa and self.heads != "MHA" else "")
        d, dv = self.dims
        dims = f"d{d}" + (f"/dv{dv}" if dv != d else "")
        return " · ".join([self.direction, self.dtype.replace("bfloat16", "bf16").replace("float16", "fp16"),
                           dims, "causal" if self.causal else "full", self.layout, self.kv,
                           heads, self.shape] + (["sinks"] if self.sinks else [])
                          + ([f"window-{self.window}"] if self.window != "none" else [])
                          + (["softcap"] if self.softcap else []))


def valid(assign: dict) -> bool:
    """Combinations that do not exist: paged KV is a forward-only (serving) path here, and so are
    MLA-sized heads (the backward takes head dims up to 256)."""
    bwd = assign.get("direction") == "bwd"
    return not (bwd and (str(assign.get("kv", "")).startswith("paged") or assign.get("dv") == "mla"))


def check_axes(axes: dict) -> dict[str, tuple]:
    """Full axes with `axes` overriding some; a ValueError names an unknown axis or value."""
    out = dict(AXES)
    for name, values in (axes or {}).items():
        if name not in AXES:
            raise ValueError(f"unknown matrix axis {name!r}; axes are {sorted(AXES)}")
        values = tuple(values)
        bad = [v for v in values if v not in AXES[name]]
        if not values or bad:
            raise ValueError(f"axis {name!r} got {bad or 'no values'}; allowed: {AXES[name]}")
        out[name] = values
    return out


def pairwise_cases(axes: dict[str, tuple], seed: int = 0, candidates: int = 30) -> list[Case]:
    """A covering array of strength 2: every valid pair of values of two axes appears in at
    least one case. Greedy (AETG-style): each new case starts from an uncovered pair and fills
    the other axes with the value covering most still-uncovered pairs; best of `candidates`."""
    names = list(axes)
    rng = random.Random(seed)
    uncovered = set()
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        for va in axes[a]:
            for vb in axes[b]:
                if valid({a: va, b: vb}):
                    uncovered.add((i, va, j, vb))

    def gain(assign: dict, i: int, v) -> int:
        n = 0
        for j, name in enumerate(names):
            if name in assign and j != i:
                key = (i, v, j, assign[name]) if i < j else (j, assign[name], i, v)
                n += key in uncovered
        return n

    cases = []
    while uncovered:
        best, best_gain = None, -1
        pool = sorted(uncovered, key=repr)
        for _ in range(candidates):
            i, va, j, vb = rng.choice(pool)
            assign = {names[i]: va, names[j]: vb}
            order = [k for k in range(len(names)) if k not in (i, j)]
            rng.shuffle(order)
            for k in order:
                opts = [v for v in axes[names[k]] if valid({**assign, names[k]: v})]
                scores = [(gain(assign, k, v), rng.random(), v) for v in opts]
                assign[names[k]] = max(scores, key=lambda t: (t[0], t[1]))[2]
            g = sum(1 for (a, x, b, y) in uncovered if assign[names[a]] == x and assign[names[b]] == y)
            if g > best_gain:
                best, best_gain = assign, g
        uncovered = {(a, x, b, y) for (a, x, b, y) in uncovered if not (best[names[a]] == x and best[names[b]] == y)}
        cases.append(Case(**best))
    return cases


def product_cases(axes: dict[str, tuple]) -> list[Case]:
    names = list(axes)
    out = []
    for values in itertools.product(*(axes[n] for n in names)):
        assign = dict(zip(names, values))
        if valid(assign):
            out.append(Case(**assign))
    return out


def shape_lengths(case: Case, base: tuple[int, int]) -> tuple[int, int]:
    sq, sk = base
    return {"base": (sq, sk), "q>k": (sk, max(sq // 2, 1)), "empty-q": (0, sk), "empty-k": (sq, 0),
            **FIXED_SHAPES}[case.shape]


# ---------------------------------------------------------------------------
# One case

def _heads(case: Case, n_heads: int) -> tuple[int, int]:
    return n_heads, {"MHA": n_heads, "GQA": max(n_heads // 2, 1), "MQA": 1}[case.heads]


def make_inputs(case: Case, *, batch: int, n_heads: int, base: tuple[int, int], device, generator) -> dict:
    """Fresh random q, k, v (and dO, sinks) for one case. Fixed-layout inputs are head-slices of a
    fused QKV buffer (non-contiguous, as a model's projection leaves them); varlen inputs are
    packed sequences of different lengths."""
    dt = getattr(torch, case.dtype)
    H, Hk = _heads(case, n_heads)
    D, DV = case.dims
    sq, sk = shape_lengths(case, base)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dt)

    out = {"H": H, "Hk": Hk, "seqlen_k": sk}
    if case.layout == "fixed":
        s = max(sq, sk)
        qkv = randn(batch, s, H + 2 * Hk, D)
        out["q"] = qkv[:, :sq, :H]
        out["k"] = qkv[:, :sk, H:H + Hk]
        out["v"] = qkv[:, :sk, H + Hk:] if DV == D else randn(batch, s, Hk, DV)[:, :sk]
        out["cu_q"] = torch.arange(batch + 1, dtype=torch.int32, device=device) * sq
        out["cu_k"] = torch.arange(batch + 1, dtype=torch.int32, device=device) * sk
    else:
        # three sequences of different lengths; the middle one is the shape itself, so an odd or
        # empty shape sits between non-empty neighbours (whose offsets it must not disturb)
        bq, bk = base
        lq = [bq // 2 + 1, sq, max(bq // 3, 1)]
        lk = [max(bk - 7, 1), sk, bk // 2 + 1]
        cq = torch.tensor([0] + list(itertools.accumulate(lq)), dtype=torch.int32, device=device)
        ck = torch.tensor([0] + list(itertools.accumulate(lk)), dtype=torch.int32, device=device)
        out["q"] = randn(sum(lq), H, D)
        out["k"] = randn(sum(lk), Hk, D)
        out["v"] = randn(sum(lk), Hk, DV)
        out["cu_q"], out["cu_k"] = cq, ck
    out["do"] = randn(*out["q"].shape[:-1], DV)
    out["sinks"] = (torch.randn(H, generator=generator, device=device) * 2).float() if case.sinks else None
    if case.kv.startswith("paged"):
        page = int(case.kv.split("-")[1])
        k, v = out["k"], out["v"]
        if case.layout == "fixed":
            k, v = k.reshape(-1, Hk, D), v.reshape(-1, Hk, DV)
        cpu_gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,), generator=generator, device=device)))
        out["paged"] = flash.paged_from_contiguous(k, v, out["cu_k"], page, generator=cpu_gen)
    return out


def _max_err(x: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """max |x - ref| over finite reference entries; inf for any NaN/inf in x where ref is finite,
    or a non-(-inf) where the reference is -inf (a query with no key); 0 for empty tensors."""
    if x is None or ref is None:
        return 0.0
    if x.shape != ref.shape:
        return float("inf")
    if x.numel() == 0:
        return 0.0
    x, ref = x.float(), ref.float()
    fin = torch.isfinite(ref)
    if not torch.equal(x[~fin], ref[~fin]) or not torch.isfinite(x[fin]).all():
        return float("inf")
    return float((x[fin] - ref[fin]).abs().max()) if fin.any() else 0.0


def _floor(ref: torch.Tensor, dtype) -> float:
    """FlashAttention's rounding floor: 2 * max |(r + 0.3) - 0.3 - r| with r the reference in the
    dtype the kernel stores (float32 for lse)."""
    if ref is None or ref.numel() == 0:
        return 0.0
    r = ref.detach().to(dtype)
    r = r[torch.isfinite(r)]
    if r.numel() == 0:
        return 0.0
    return 2.0 * float(((r + 0.3) - 0.3 - r).abs().max())


def _dsinks_floor(inp: dict, ref: dict, dtype) -> float:
    """Rounding floor of the sink gradient. A FlashAttention-style backward computes it as
    dsink_h = -sum_i exp(sink_h - lse_i) * delta_i with delta_i = rowsum(dO_i * O_i) taken from the
    *stored* output O, rounded to the input dtype; PyTorch's low-precision reference keeps its
    softmax in float32 and may land much closer by luck, so 3x its error is no yardstick here.
    Rounding O by a relative u = eps/2 (independent per element) moves dsink_h by a standard
    deviation of u * sqrt(sum_i p_i^2 * sum_d (dO_id * O_id)^2), p_i = exp(sink_h - lse_i);
    the floor is 4 such deviations."""
    out, do, lse, sinks = ref["out"].float(), inp["do"].float(), ref["lse"], inp["sinks"]
    H, D = out.shape[-2], out.shape[-1]
    if out.numel() == 0:
        return 0.0
    rows_lse = lse if lse.dim() == 2 else lse.permute(1, 0, 2).reshape(H, -1)
    s2 = ((do.reshape(-1, H, D) * out.reshape(-1, H, D)) ** 2).sum(-1).t()
    p = torch.exp(sinks.float()[:, None] - rows_lse)
    u = torch.finfo(dtype).eps / 2
    return float(4 * u * torch.sqrt((p ** 2 * s2).sum(1)).max())


def _run(case: Case, inp: dict, impl: str):
    """Returns {check: tensor} for impl in 'kernel', 'ref32', 'ref_lowp'."""
    causal, sinks = case.causal, inp["sinks"]
    varlen = case.layout == "varlen"
    q, k, v = inp["q"], inp["k"], inp["v"]
    kw = dict(cu_seqlens_q=inp["cu_q"], cu_seqlens_k=inp["cu_k"]) if varlen else {}
    # the window is sized from the case's own key length (the middle sequence of a varlen batch)
    opts = dict(window_size=case.window_size(inp.get("seqlen_k", k.shape[-3])), softcap=SOFTCAP if case.softcap else 0.0)
    bwd = case.direction == "bwd"
    if impl != "kernel":
        upcast = impl == "ref32"
        if not varlen:  # the references loop over sequences; give them contiguous copies
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    leaves = [t.detach().clone().requires_grad_(bwd) for t in (q, k, v)]
    s_leaf = sinks.detach().clone().requires_grad_(bwd) if sinks is not None else None
    with torch.set_grad_enabled(bwd):
        if impl == "kernel" and case.kv.startswith("paged"):
            pk = inp["paged"]
            with torch.no_grad():
                out, lse = flash.paged_attention(q, pk.k_cache, pk.v_cache, pk.kv_indptr, pk.kv_indices,
                                                 pk.kv_last_page_len, causal=causal, return_lse=True,
                                                 sinks=sinks, pack_gqa=case.pack_gqa,
                                                 cu_seqlens_q=inp["cu_q"] if varlen else None, **opts)
        elif impl == "kernel":
            out, lse = flash.attention(*leaves, causal=causal, return_lse=True, sinks=s_leaf,
                                       pack_gqa=case.pack_gqa, backend="auto", **kw, **opts)
        else:
            out, lse = flash.attention_reference(*leaves, causal=causal, sinks=s_leaf, upcast=upcast, **kw, **opts)
        res = {"out": out.detach(), "lse": lse.detach()}
        if bwd:
            out.backward(inp["do"].to(out.dtype))
            res.update(dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
            if s_leaf is not None:
                res["dsinks"] = s_leaf.grad
    return res


def run_case(case: Case, *, batch: int, n_heads: int, base: tuple[int, int], device, generator) -> list[dict]:
    """Kernel vs float32 reference vs low-precision PyTorch for one case: one row per checked tensor."""
    inp = make_inputs(case, batch=batch, n_heads=n_heads, base=base, device=device, generator=generator)
    kern = _run(case, inp, "kernel")
    ref = _run(case, inp, "ref32")
    low = _run(case, inp, "ref_lowp")
    dt = getattr(torch, case.dtype)
    sq, sk = shape_lengths(case, base)
    rows = []
    backend = flash.select_backend(inp["q"].device)[0]  # 'torch' only where Triton cannot run at all
    for name in ("out", "lse", "dq", "dk", "dv", "dsinks"):
        if name not in ref:
            continue
        store_dt = torch.float32 if name in ("lse", "dsinks") else dt
        err = _max_err(kern.get(name), ref[name])
        ref_err = _max_err(low.get(name), ref[name])
        if ref_err == float("inf"):  # PyTorch's own low-precision path broke: the rule needs it finite
            ref_err = float("nan")
        if name == "dsinks":
            floor = _dsinks_floor(inp, ref, dt)
        elif name == "lse":
            # lse is float32 and not O(1) like the output: the kernel keeps it in base 2 and
            # converts (x ln 2), two roundings of |lse|; the "+0.3" trick would ignore its size
            fin = ref[name][torch.isfinite(ref[name])]
            floor = max(_floor(ref[name], store_dt),
                        4 * torch.finfo(torch.float32).eps * (float(fin.abs().max()) if fin.numel() else 0.0))
        else:
            floor = _floor(ref[name], store_dt)
        tol = FACTOR[name] * (ref_err if ref_err == ref_err else 0.0) + floor
        passed = err == err and err <= tol
        rows.append({**asdict(case), "label": case.label, "check": name, "seqlen_q": sq, "seqlen_k": sk,
                     "error": err, "ref_error": ref_err, "tolerance": tol, "passed": bool(passed),
                     "backend": backend})
    return rows


def matrix_cases(axes: dict | None, preset: str, *, mode: str | None = None, seed: int = 0) -> list[Case]:
    """The cases `run_matrix` runs for these axes (overriding the preset's), preset and mode."""
    if preset not in MATRIX_PRESETS:
        raise ValueError(f"unknown matrix preset {preset!r}; choose {sorted(MATRIX_PRESETS)}")
    p = MATRIX_PRESETS[preset]
    mode = mode or p["mode"]
    if mode not in ("pairwise", "product"):
        raise ValueError(f"matrix mode must be 'pairwise' or 'product', got {mode!r}")
    full = check_axes({**p["axes"], **(axes or {})})
    return pairwise_cases(full, seed) if mode == "pairwise" else product_cases(full)


def run_matrix(axes: dict | None = None, preset: str = "smoke", *, device=None, seed: int = 0,
               mode: str | None = None, batch: int | None = None, n_heads: int | None = None,
               base: tuple[int, int] | None = None, progress=None) -> list[dict]:
    """Run the matrix; returns one row per (case, checked tensor) with error, the low-precision
    reference's error, the tolerance and pass/fail.

    `axes`: {axis: values} overriding the preset's (which override `AXES`); `preset`: smoke, cpu
    or gpu (sizes and default axes, `MATRIX_PRESETS`); `mode`: pairwise or product.
    """
    p = MATRIX_PRESETS.get(preset)
    cases = matrix_cases(axes, preset, mode=mode, seed=seed)
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for i, case in enumerate(cases):
        rows += run_case(case, batch=batch or p["batch"], n_heads=n_heads or p["n_heads"],
                         base=tuple(base or p["base"]), device=device, generator=g)
        if progress:
            progress(i + 1, len(cases), case)
    return rows


def failures(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["passed"]]


def coverage(rows: list[dict], axes: dict[str, tuple] | None = None) -> dict[str, dict]:
    """For each axis value: how many cases carried it and how many of those failed a check."""
    axes = axes or AXES
    cases = {r["label"]: r for r in rows}
    failed = {r["label"] for r in rows if not r["passed"]}
    out = {}
    for name, values in axes.items():
        out[name] = {v: (sum(1 for c in cases.values() if c[name] == v),
                         sum(1 for lbl, c in cases.items() if c[name] == v and lbl in failed)) for v in values}
    return out


# ---------------------------------------------------------------------------
# Named cases beyond the covering array, each with its own reference (FlashAttention's own tests
# cover these paths on purpose, not by the luck of a pairwise draw)

MIN_BACKWARD_CASES = 8


def _pick(values: tuple, i: int):
    return values[i % len(values)]


def special_cases(axes: dict[str, tuple]) -> list[tuple[str, Case]]:
    """(name, case) pairs run in every preset: head dim 256 with paged KV (forward, the only paged
    direction here), and MIN_BACKWARD_CASES backward cases spread over head dims, causal, layouts,
    heads, PackGQA, dtypes, shapes (empty Q and empty K included) and sinks. Head dims come from
    `axes` (the preset's), except 256 for the paged case, which is the point of that case."""
    dims = axes["head_dim"]
    out = [("head dim 256, paged KV", Case(256, True, "varlen", "paged-16", "GQA", True, "fwd", "bfloat16", "base",
                                           False)),
           ("head dim 256, paged KV (page 1)", Case(256, False, "fixed", "paged-1", "MQA", False, "fwd", "float16",
                                                    "base", True))]
    shapes = ("base", "q>k", "empty-q", "empty-k", "base", "base", "q>k", "base")
    heads = ("GQA", "MQA", "MHA", "GQA", "MQA", "MHA", "GQA", "MQA")
    for i in range(MIN_BACKWARD_CASES):
        out.append((f"backward {i + 1}", Case(_pick(dims, i), i % 2 == 0, ("varlen", "fixed")[i % 2 == 1 and i % 4 == 1],
                                              "contiguous", heads[i], i % 3 == 0 and heads[i] != "MHA", "bwd",
                                              ("bfloat16", "float16")[i % 2], shapes[i], i in (0, 5, 7))))
    return out


def _row(case: Case, name: str, check: str, err: float, ref_err: float, tol: float, passed: bool,
         seqlens: tuple[int, int], backend: str) -> dict:
    return {**asdict(case), "label": f"{name}: {case.label}" if name else case.label, "check": check,
            "seqlen_q": seqlens[0], "seqlen_k": seqlens[1], "error": err, "ref_error": ref_err, "tolerance": tol,
            "passed": bool(passed), "backend": backend, "special": name}


def deterministic_backward_rows(case: Case, *, batch: int, n_heads: int, base, device, generator,
                                repeats: int = 3) -> list[dict]:
    """FlashAttention's deterministic-backward test: the same backward `repeats` times gives the same
    bits for dQ, dK, dV (our backward has no atomics: each dK/dV tile and each dQ tile is one program's
    loop in a fixed order). Tolerance 0 elements."""
    inp = make_inputs(case, batch=batch, n_heads=n_heads, base=base, device=device, generator=generator)
    runs = [_run(case, inp, "kernel") for _ in range(repeats)]
    backend = flash.select_backend(inp["q"].device)[0]
    rows = []
    for name in ("dq", "dk", "dv"):
        diff = sum(int((r[name].view(torch.int16) != runs[0][name].view(torch.int16)).sum()) for r in runs[1:])
        rows.append(_row(case, "deterministic backward", f"{name} bitwise over {repeats} runs", float(diff), 0.0, 0.0,
                         diff == 0 and bool(torch.isfinite(runs[0][name].float()).all()),
                         shape_lengths(case, base), backend))
    return rows


def split_kv_rows(*, head_dim: int, dtype: str, device, seed: int, split_size: int = 32, ctas: int = 6) -> list[dict]:
    """Split-KV decoding with its combine, against the fp32 definition (decode.decode_attention_reference)
    with FlashAttention's rule: the fixed split (several splits per request, merged by log-sum-exp),
    the batch-adaptive split and the stream-K (Lean-like) split with its host-first merge."""
    from . import decode, lean

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed + 77)
    B, H, Hk, D, S = 4, 4, 2, head_dim, 4 * split_size + 9
    q = torch.randn(B, H, D, generator=g).to(dt).to(device)
    k = torch.randn(B, S, Hk, D, generator=g).to(dt).to(device)
    v = torch.randn(B, S, Hk, D, generator=g).to(dt).to(device)
    lens = torch.tensor([S, 0, split_size, split_size + 1], dtype=torch.int32).to(device)
    ref = decode.decode_attention_reference(q, k, v, lens).float()
    low = decode.decode_attention_reference(q, k, v, lens, compute_dtype=dt).float()
    ref_err = _max_err(low, ref)
    tol = FACTOR["out"] * ref_err + _floor(ref, dt)
    case = Case(head_dim if head_dim in flash.HEAD_DIMS else 64, False, "fixed", "contiguous", "GQA", False, "fwd",
                dtype, "base", False)
    backend = decode.select_backend(torch.device(device))[0]
    rows = []
    for name, fn in (("split-KV fixed split + combine",
                      lambda: decode.decode_attention(q, k, v, lens, True, split_size=split_size)),
                     ("split-KV adaptive split + combine",
                      lambda: decode.decode_attention(q, k, v, lens, False, split_size=split_size, sms=8)),
                     ("split-KV stream-K + host-first combine",
                      lambda: lean.lean_decode_attention(q, k, v, lens, ctas=ctas))):
        out = fn()
        err = _max_err(out, ref)
        ok = err == err and err <= tol and bool((out[1] == 0).all())
        rows.append(_row(case, name, "out", err, ref_err, tol, ok, (1, S), backend))
    return rows


def variant_cases(axes: dict[str, tuple]) -> list[tuple[str, Case]]:
    """(name, case) pairs for the variants FlashAttention's own tests cover on purpose (`window_size`,
    `softcap`, `d != dv`, MLA), all through the main kernel and mixed with its other paths: a causal
    left window backward (varlen, GQA, sinks), a two-sided band with softcap on paged KV with PackGQA,
    softcap backward, dv = d / 2 backward, and MLA's 576 / 512 decode over paged KV with PackGQA."""
    d0, d1 = _pick(axes["head_dim"], 0), _pick(axes["head_dim"], 1)
    return [
        ("sliding window (causal, left), backward", Case(d0, True, "varlen", "contiguous", "GQA", False, "bwd",
                                                         "bfloat16", "base", True, "left")),
        ("window band + softcap, paged, PackGQA", Case(d1, False, "varlen", "paged-16", "GQA", True, "fwd",
                                                        "float16", "113x203", False, "band", True)),
        ("softcap + causal, backward", Case(d1, True, "fixed", "contiguous", "MHA", False, "bwd", "float16", "base",
                                            False, "none", True)),
        ("dv = d/2, backward", Case(d0, False, "fixed", "contiguous", "GQA", False, "bwd", "bfloat16", "q>k", True,
                                    "band", False, "half")),
        ("MLA 576/512 decode, paged, PackGQA", Case(d0, False, "varlen", "paged-1", "MQA", True, "fwd", "bfloat16",
                                                    "q>k", False, "none", False, "mla")),
    ]


def run_special(axes: dict[str, tuple], *, batch: int, n_heads: int, base, device, seed: int = 0,
                progress=None) -> list[dict]:
    """Every named case (`special_cases`, `variant_cases`), the deterministic-backward repeat and the split-KV
    combines."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    rows = []
    named = special_cases(axes) + variant_cases(axes)
    for i, (name, case) in enumerate(named):
        for r in run_case(case, batch=batch, n_heads=n_heads, base=base, device=device, generator=g):
            rows.append({**r, "label": f"{name}: {r['label']}", "special": name})
        if progress:
            progress(i + 1, len(named) + 2, case)
    det = Case(_pick(axes["head_dim"], 1), True, "varlen", "contiguous", "GQA", True, "bwd", "bfloat16", "base", True)
    rows += deterministic_backward_rows(det, batch=batch, n_heads=n_heads, base=base, device=device, generator=g)
    rows += split_kv_rows(head_dim=_pick(axes["head_dim"], 0), dtype="bfloat16", device=device, seed=seed)
    return rows


# Launch builder (inferbook.compiled): the kernel launches one case makes on a GPU

def case_launches(case: Case, *, batch: int, n_heads: int, base: tuple[int, int]) -> list:
    """The Triton launches `run_case` makes for `case` on a GPU (forward, and backward for 'bwd'
    cases), with the tensors `make_inputs` and `_run` pass: storage-less `meta` stand-ins of the
    same shapes, strides and dtypes (fixed layout: head slices of a fused QKV buffer; the kernel
    path of `_run` gives `attention` clones of them and `paged_attention` the raw slice)."""
    from ..compiled import meta

    dt = getattr(torch, case.dtype)
    H, Hk = _heads(case, n_heads)
    D, DV = case.dims
    sq, sk = shape_lengths(case, base)
    paged = case.kv.startswith("paged")
    opts = dict(window_size=case.window_size(sk), softcap=SOFTCAP if case.softcap else 0.0)
    seqlens_q = seqlens_k = None
    if case.layout == "fixed":
        qkv = meta((batch, max(sq, sk), H + 2 * Hk, D), dt)
        q, k, v = qkv[:, :sq, :H], qkv[:, :sk, H:H + Hk], qkv[:, :sk, H + Hk:]
        if DV != D:
            v = meta((batch, max(sq, sk), Hk, DV), dt)[:, :sk]
        lens_k = [sk] * batch
    else:
        bq, bk = base
        seqlens_q = [bq // 2 + 1, sq, max(bq // 3, 1)]
        lens_k = seqlens_k = [max(bk - 7, 1), sk, bk // 2 + 1]
        q, k, v = meta((sum(seqlens_q), H, D), dt), meta((sum(lens_k), Hk, D), dt), meta((sum(lens_k), Hk, DV), dt)
    if paged:
        page = int(case.kv.split("-")[1])
        pages = sum(-(-n // page) for n in lens_k) + 2          # paged_from_contiguous's pool (2 spare pages)
        k, v = meta((pages, page, Hk, D), dt), meta((pages, page, Hk, DV), dt)
        return flash.attention_launches(q, k, v, causal=case.causal, seqlens_q=seqlens_q, seqlens_k=lens_k,
                                        sinks=case.sinks, pack_gqa=case.pack_gqa, paged=True, name=case.label, **opts)
    q, k, v = q.clone(), k.clone(), v.clone()                   # _run's leaves: clones (contiguous)
    return flash.attention_launches(q, k, v, causal=case.causal, seqlens_q=seqlens_q, seqlens_k=seqlens_k,
                                    sinks=case.sinks, pack_gqa=case.pack_gqa, backward=case.direction == "bwd",
                                    name=case.label, **opts)


def split_kv_launches(*, head_dim: int, dtype: str, split_size: int = 32, ctas: int = 6) -> list:
    """The Triton launches `split_kv_rows` makes on a GPU: fixed and adaptive split-KV, and stream-K."""
    from . import decode, lean

    B, H, Hk, S = 4, 4, 2, 4 * split_size + 9
    dt = getattr(torch, dtype)
    return (decode.decode_launches(B, H, Hk, head_dim, S, deterministic=True, split_size=split_size, dtype=dt,
                                   name="split-KV fixed")
            + decode.decode_launches(B, H, Hk, head_dim, S, deterministic=False, split_size=split_size, sms=8,
                                     dtype=dt, name="split-KV adaptive")
            + lean.lean_launches([S, 0, split_size, split_size + 1], H, Hk, head_dim, S, ctas=ctas, dtype=dt,
                                 name="split-KV"))
