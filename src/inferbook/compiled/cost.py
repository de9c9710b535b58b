"""A kernel's predicted time on a card, from what the compiler made of it (one compile-table row).

The model, and every assumption it makes (the pages' "How the prediction is made" repeats this):

1. **Work.** One CTA (workgroup) executes `kernel_instrs − loop_instrs + loop_instrs × trips`
   warp-instructions per warp (wave-instructions on AMD; `kernel_instrs` less the padding nvdisasm lists after
   the last instruction, `machine.executable`) and `flops_per_cta` tensor-core FLOPs
   (2·M·N·K of each `tt.dot`, times the trips of the loops around it). The main loop is the
   innermost backward branch of the machine code moving the most global bytes per iteration
   (`machine.main_loop`); `trips` is the Triton IR's bound of the loop nest around it, evaluated on
   the launch's integer arguments for each program: where one grid axis changes it (an uneven
   split-K, a causal mask) every CTA gets its own (`trips_by_pid`), the average SM the mean and the
   busiest SM the CTAs it really holds (see `waves`); a row compiled before those were kept has the
   middle program's `trips` for every CTA, and a row whose trips vary along several axes the middle
   program's on average and the longest (`trips_max`) on the busiest SM. Dots run with the main
   loop (a CTA's FLOPs scale with its trips). Where a bound depends on memory (a persistent or routed
   kernel), `trips` = the launch's DRAM bytes per CTA over the loop's bytes per iteration (said in the
   row: `trips_from`). Other loops are counted once.
2. **DRAM bytes** = every tensor argument's extent moved once (re-reads hit L2), unless the builder
   states `Launch.dram_bytes` (e.g. only the routed experts' weights).
3. **Residency.** CTAs per SM (CU) = the least of: registers (65536 per SM, allocated per warp in
   units of 256), shared memory (the SM's capacity, 1 KB reserved per CTA), 64 warps, 32 CTAs; on
   CDNA, waves per SIMD from the unified VGPR file (512 per lane, VGPRs and AGPRs together, granule 8, at
   most 8 waves) and LDS per CU,
   a workgroup's waves spread over the CU's 4 SIMDs (so a CU holds 4 x waves-per-SIMD 1-wave workgroups).
4. **Bounds** (seconds; the prediction is the largest, and that one is named):
   - `memory`: DRAM bytes / the copy ceiling — the *measured* one of a committed `ceilings` record
     for that card (data/results/<card>/device-ceilings.json) if one exists, else the datasheet's
     HBM bandwidth; `ceiling` says which.
   - `issue`: the average SM's warp-instructions / (issue slots per cycle × clock): 4 per SM on
     NVIDIA (one per scheduler, and only as many schedulers as resident warps), 1 per CU on CDNA
     (4 SIMDs, a wave64 vector instruction every 4 cycles each, and only as many SIMDs as resident
     waves). No dependency stalls are counted: this is the best the instruction stream allows.
   - `compute`: the average SM's FLOPs / its share of the datasheet's dense tensor rate for the dot's
     operand type (bf16/f16; fp8 and int8 twice that; fp32 operands at the TF32 rate, half);
     `mma.sync` on sm_90/sm_100 at 2/3 of it (warp-level MMA does not reach wgmma/tcgen05 rates).
   - `latency`: each loop iteration waits one DRAM latency (600 ns NVIDIA, 800 ns CDNA, loaded
     HBM, assumed) divided by the iterations in flight (`num_stages − 1` when the loop's loads are
     asynchronous copies — cp.async, TMA, loads into LDS — or, on CDNA, when the loop has MFMA, which
     Triton's stream pipeliner prefetches; else 1) but never less than one latency in all (a loop of fewer
     trips than the pipeline is deep still waits for its first load), plus one latency, plus two for each
     synchronising atomic of the kernel (acquire or acq_rel in the Triton IR, `machine.sync_atomics`: a
     last-arrival count's round trip, then the reads of what the other CTAs published; counted on every CTA,
     though only the last arrival reads); resident CTAs overlap. Little's law is reported beside it: bytes
     in flight per SM vs latency × (bandwidth / SMs).
   - `waves`: the issue, compute and latency bounds recomputed for the *busiest* SM: wave
     quantization. CTAs are dispatched in launch order (x fastest), the first SMs × resident count
     breadth-first (CTA i to SM i mod SMs), each later one to the slot that frees first, a CTA
     taking as long as its instructions; the busiest SM is the one with the most instructions (FLOPs;
     for latency, the slot with the longest chain). With equal CTAs that is ceil(grid / SMs) CTAs in
     rounds of the resident count; with unequal ones, e.g. 9 splits of 3 or 4 runs, the long CTAs
     and the short ones beside them on the same SM. It binds only when it exceeds every other bound
     by more than 2 %.
   - `floor`: the old ideal roofline, max(DRAM bytes / datasheet bandwidth, FLOPs / peak) — shown as
     the floor, never as the prediction.
Not modelled: L2 and shared-memory bandwidth, bank conflicts, local memory (a spill's traffic: a spilling
launch's prediction is a floor), launch overhead, clocks below boost, contention on atomics, waiting for
other CTAs beyond the synchronising atomics' round trips; L2 hits (every latency charged is a DRAM one) and
the work a warp issues between a load and its first use; and the load latencies a trip waits one after another
beyond the first. Those are counted from the machine code (`machine.load_rounds`: a load whose address or
predicate comes from an earlier load — the slot ids, then the rows they gather — or that follows a barrier
waiting on an earlier load's tile staged through shared memory) and recorded in every row
(`load_rounds`, `outside_load_rounds`); a prediction whose trip waits more than one names them
(`bound_sentence`), but the bound charges one latency a trip: which of those loads hit L2, at a fraction
of a DRAM latency, the code does not say. Every number is labelled *predicted* wherever it
is shown.
"""
from __future__ import annotations

import math
from pathlib import Path

# Published figures (dense, no sparsity). NVIDIA: A100 SXM4 80 GB, H100 SXM5, H200 SXM and HGX B200
# datasheets (SMs and boost clocks from the architecture whitepapers); AMD: Instinct MI300X and MI355X
# data sheets (CUs, peak engine clock, HBM bandwidth, MFMA rates).
CARDS = {
    "A100": dict(vendor="nvidia", target="sm_80", sms=108, clock_ghz=1.41, hbm_tbps=2.039, bf16_tflops=312.0,
                 fp8_tflops=624.0, source="NVIDIA A100 SXM4 80GB datasheet (int8 rate for 8-bit)"),
    "H100": dict(vendor="nvidia", target="sm_90", sms=132, clock_ghz=1.98, hbm_tbps=3.35, bf16_tflops=989.4,
                 fp8_tflops=1978.9, source="NVIDIA H100 SXM5 datasheet"),
    "H200": dict(vendor="nvidia", target="sm_90", sms=132, clock_ghz=1.98, hbm_tbps=4.8, bf16_tflops=989.4,
                 fp8_tflops=1978.9, source="NVIDIA H200 SXM datasheet"),
    "B200": dict(vendor="nvidia", target="sm_100", sms=148, clock_ghz=1.965, hbm_tbps=8.0, bf16_tflops=2250.0,
                 fp8_tflops=4500.0, source="NVIDIA HGX B200 datasheet (dense)"),
    "MI300X": dict(vendor="amd", target="gfx942", sms=304, clock_ghz=2.1, hbm_tbps=5.3, bf16_tflops=1307.4,
                   fp8_tflops=2614.9, source="AMD Instinct MI300X data sheet"),
    "MI355X": dict(vendor="amd", target="gfx950", sms=256, clock_ghz=2.4, hbm_tbps=8.0, bf16_tflops=2516.6,
                   fp8_tflops=5033.2, source="AMD Instinct MI355X data sheet"),
}

# Per-SM (per-CU) limits of each target. NVIDIA: CUDA programming guide, "Technical specifications
# per compute capability"; AMD: CDNA3/CDNA4 ISA guides (512 VGPRs+AGPRs per lane per SIMD on gfx90a+).
SM_LIMITS = {
    "sm_80": dict(vendor="nvidia", regs=65536, smem_kb=164, warps=64, ctas=32, issue=4, lanes=32),
    "sm_90": dict(vendor="nvidia", regs=65536, smem_kb=228, warps=64, ctas=32, issue=4, lanes=32),
    "sm_100": dict(vendor="nvidia", regs=65536, smem_kb=228, warps=64, ctas=32, issue=4, lanes=32),
    "gfx942": dict(vendor="amd", vgprs=512, lds_kb=64, waves_per_simd=8, simds=4, issue=1, lanes=64),
    "gfx950": dict(vendor="amd", vgprs=512, lds_kb=160, waves_per_simd=8, simds=4, issue=1, lanes=64),
}

LATENCY_NS = {"nvidia": 600.0, "amd": 800.0}     # loaded DRAM latency, assumed (see the docstring)
MMA_SYNC_FRACTION = 2 / 3                          # mma.sync on sm_90 / sm_100 against the wgmma / tcgen05 rate
BOUND_ORDER = ("memory", "compute", "issue", "latency", "waves")
WAVES_MARGIN = 1.02
_CARD_KEYS = {"A100": ("a100",), "H100": ("h100",), "H200": ("h200",), "B200": ("b200",),
              "MI300X": ("mi300x", "mi300"), "MI355X": ("mi355x", "mi355", "mi350")}


def measured_copy_gbps(card: str, root: Path | None = None) -> tuple[float, str] | None:
    """(GB/s, record path) of the committed `ceilings` record for `card`
    (data/results/<hardware>/device-ceilings.json whose folder or GPU name names the card), or None."""
    from ..context import reference_dir
    from ..record import load_records

    base = Path(root) if root is not None else reference_dir()
    keys = _CARD_KEYS[card]
    for path in sorted(base.glob("*/device-ceilings.json")):
        try:
            records = load_records(path)
        except Exception:
            continue
        for r in records:
            label = (path.parent.name + " " + " ".join(str(v) for v in (r.hardware or {}).values())).lower()
            if not any(k in label for k in keys):
                continue
            for m in r.measurements:
                if m["name"] == "copy_bandwidth" and m.get("value"):
                    return float(m["value"]), str(path)
    return None


def residency(row: dict) -> dict:
    """CTAs (workgroups) per SM (CU) and what bounds it; warps (waves) resident per SM."""
    lim = SM_LIMITS[row["target"]]
    warps = max(int(row.get("num_warps") or 4), 1)
    if lim["vendor"] == "nvidia":
        regs = max(int(row.get("regs") or 1), 1)
        per_warp = -(-regs * 32 // 256) * 256
        smem = float(row.get("shared_kb") or 0.0)
        by = {"registers": lim["regs"] // (per_warp * warps), "warps": lim["warps"] // warps,
              "shared memory": int(lim["smem_kb"] // (smem + 1)) if smem else lim["ctas"], "CTAs": lim["ctas"]}
    else:
        # `.vgpr_count` is the unified file's allocation on gfx90a+ (arch VGPRs to the accum offset, then the
        # AGPRs): the AGPRs are in it already
        vg = int(row.get("vgprs") or 0)
        alloc = max(-(-max(vg, 1) // 8) * 8, 8)
        waves_simd = min(lim["waves_per_simd"], lim["vgprs"] // alloc)
        # a workgroup's waves spread over the CU's SIMDs, each wave on one: a CU holds SIMDs x waves a SIMD
        # wave slots, so four 1-wave workgroups fit where one 4-wave workgroup does
        lds = float(row.get("shared_kb") or 0.0)
        by = {"registers": waves_simd * lim["simds"] // warps,
              "shared memory": int(lim["lds_kb"] // lds) if lds else 32,
              "warps": lim["waves_per_simd"] * lim["simds"] // warps}
    limit = min(by, key=lambda k: (by[k], list(by).index(k)))
    ctas = max(by[limit], 0)
    return {"ctas_per_sm": ctas, "limit": limit, "warps_per_sm": ctas * warps, "by": by}


def _dot_rate(row: dict, card: dict) -> float:
    """FLOP/s of the whole card for this row's dots."""
    dts = {d[3] for d in row.get("dots") or []}
    rate = card["bf16_tflops"]
    if dts and all(dt.startswith(("f8", "i8", "f4", "i4")) for dt in dts):
        rate = card["fp8_tflops"]
    elif dts and all(dt == "f32" for dt in dts):
        rate = card["bf16_tflops"] / 2
    if row.get("mma_family") == "mma.sync" and row["target"] in ("sm_90", "sm_100"):
        rate *= MMA_SYNC_FRACTION
    return rate * 1e12


SIMULATED_CTAS_MAX = 1 << 18     # unequal CTAs dispatched one by one up to this grid (else: all the longest)


def _spread(row: dict, trips: int, grid: int) -> tuple[float, list[int] | None, int]:
    """(a CTA's mean trips, each CTA's trips in launch order (x fastest) or None where they are all
    `trips` or not each known, the longest) from the row's `trips_by_pid` / `trips_max`
    (`machine.program_trips`); a row without them: every CTA runs the middle program's `trips`."""
    dist = row.get("trips_by_pid")
    dims = [max(int(g), 1) for g in row.get("grid") or [grid]]
    if dist and 0 <= int(dist["axis"]) < len(dims) and len(dist["trips"]) == dims[int(dist["axis"])] \
            and math.prod(dims) == grid:
        a, per = int(dist["axis"]), [max(int(t), 0) for t in dist["trips"]]
        mean = sum(per) / len(per)
        if min(per) == max(per) or grid > SIMULATED_CTAS_MAX:
            return mean, None, max(per)
        stride = math.prod(dims[:a])
        return mean, [per[(i // stride) % dims[a]] for i in range(grid)], max(per)
    tmax = row.get("trips_max")
    return trips, None, max(trips, int(tmax)) if tmax is not None else trips


def _busiest_sm(work: list[tuple[float, float, float]], sms: int, occ: int) -> tuple[float, float, float]:
    """Each CTA's (instructions, FLOPs, latency chain) in launch order -> the busiest SM's instructions,
    its FLOPs (each the SM with the most) and the longest chain of one resident slot: the first
    sms * occ CTAs breadth-first (CTA i to SM i mod sms), each later one to the slot that frees first
    (ties: the lowest slot), a CTA lasting as long as its instructions."""
    import heapq

    first = sms * occ
    sm_i, sm_f = [0.0] * sms, [0.0] * sms
    slot_c = [0.0] * min(len(work), first)
    free: list[tuple[float, int]] = []
    for i, (ins, fl, ch) in enumerate(work):
        start, slot = (0.0, i) if i < first else heapq.heappop(free)
        sm_i[slot % sms] += ins
        sm_f[slot % sms] += fl
        slot_c[slot] += ch
        heapq.heappush(free, (start + ins, slot))
    return max(sm_i), max(sm_f), max(slot_c, default=0.0)


def predict(row: dict, card: str, *, copy_gbps: float | None = None) -> dict:
    """The model of the module docstring for one compile-table row on `card`: {'seconds', 'bound',
    'ceiling' ('measured'|'datasheet'), 'bounds': {name: seconds}, and what went into it}.
    `copy_gbps`: a measured copy ceiling (else the datasheet bandwidth)."""
    c = CARDS[card]
    if not row.get("ok"):
        raise ValueError(f"{row.get('launch')} on {row.get('target')} did not compile")
    if "sass" not in row and "isa_loop" not in row:
        raise ValueError(f"{row.get('launch')} on {row.get('target')}: the compile table has no machine-code "
                         f"facts (regenerate it with `inferbook inspect SLUG --target all --save`)")
    lim = SM_LIMITS[row["target"]]
    loop = row.get("sass") or row.get("isa_loop")
    warps = max(int(row.get("num_warps") or 4), 1)
    grid = max(int(row.get("ctas") or 1), 1)
    dram = float(row.get("dram_bytes") or 0.0)
    sms = c["sms"]
    clock = c["clock_ghz"] * 1e9
    bw = (copy_gbps * 1e9) if copy_gbps else c["hbm_tbps"] * 1e12
    bytes_iter_cta = loop["global_bytes_per_warp"] * warps
    trips, trips_from = row.get("trips"), "ttir"
    if trips is None or not row.get("trips_known", True):
        trips = math.ceil(dram / grid / bytes_iter_cta) if bytes_iter_cta and loop["instrs"] else (1 if loop["instrs"] else 0)
        trips_from = "bytes"
    trips = max(int(trips), 1 if loop["instrs"] else 0)
    mean, each, longest = _spread(row, trips, grid) if trips_from == "ttir" else (trips, None, trips)

    def instrs(t: float) -> float:          # one CTA's warp-instructions when its main loop runs t times
        return (loop["kernel_instrs"] - loop["instrs"] + loop["instrs"] * t) * warps

    # dots whose loop trips the IR could not evaluate run once per main-loop trip
    flops_cta = float(sum(2 * d[0] * d[1] * d[2] * (d[4] if d[4] is not None else trips)
                          for d in row.get("dots") or [])) or float(row.get("flops_per_cta") or 0.0)

    def flops(t: float) -> float:           # the dots run with the main loop
        return flops_cta * t / trips if trips else flops_cta

    res = residency(row)
    occ = max(res["ctas_per_sm"], 1)
    used = min(grid, sms)
    avg = grid / used                           # CTAs on the average SM in use
    busiest = math.ceil(grid / sms)             # CTAs on the busiest SM
    resident = min(occ, busiest)
    if lim["vendor"] == "nvidia":   # one instruction a cycle per scheduler that has a warp
        slots = min(lim["issue"], resident * warps) * clock
    else:                           # a wave64 instruction every 4 cycles per SIMD that has a wave
        slots = lim["issue"] * min(lim["simds"], resident * warps) / lim["simds"] * clock
    sm_flops = _dot_rate(row, c) / sms
    # loads in flight per loop: the pipeline's depth when the loop's loads are asynchronous copies, or on
    # CDNA when the loop has MFMA (Triton's stream pipeliner prefetches the next iterations into registers)
    pipelined = loop.get("async") or (lim["vendor"] == "amd" and loop.get("mma"))
    async_depth = max(1, int(row.get("num_stages") or 1) - 1) if pipelined else 1
    lat = LATENCY_NS[c["vendor"]] * 1e-9
    sync_lat = 2 * int(row.get("sync_atomics") or 0) * lat      # a last-arrival count, then the partials' reads

    def chain(t: float) -> float:
        # one CTA's chain of dependent latencies: the loop's, or (straight-line code) one load and one store.
        # A pipeline deeper than the loop still waits one whole latency for its first load: at least 1.
        # A trip's load rounds beyond one (`machine.load_rounds`) are recorded, not charged: see "Not modelled"
        return ((max(t / async_depth, 1.0 if t else 0.0) + 1) * lat if loop["instrs"] else 2 * lat) + sync_lat

    bounds = {
        "memory": dram / bw,
        "compute": avg * flops(mean) / sm_flops if sm_flops else 0.0,
        "issue": avg * instrs(mean) / slots,
        "latency": max(1.0, avg / occ) * chain(mean),
    }
    if each is not None:        # unequal CTAs, each known: the SM that really gets the most
        top_i, top_f, top_c = _busiest_sm([(instrs(t), flops(t), chain(t)) for t in each], sms, occ)
    else:                       # equal CTAs (or only the longest known: all of the busiest SM's that long)
        top_i, top_f, top_c = busiest * instrs(longest), busiest * flops(longest), math.ceil(busiest / occ) * chain(longest)
    bounds["waves"] = max(top_f / sm_flops if sm_flops else 0.0, top_i / slots, top_c)
    pick = [b for b in BOUND_ORDER if b != "waves"]
    bound = max(pick, key=lambda b: (bounds[b], -BOUND_ORDER.index(b)))
    if bounds["waves"] > WAVES_MARGIN * bounds[bound]:
        bound = "waves"
    seconds = bounds[bound]
    total_flops = flops(mean) * grid
    floor = max(dram / (c["hbm_tbps"] * 1e12), total_flops / (c["bf16_tflops"] * 1e12))
    in_flight = resident * bytes_iter_cta * async_depth
    return {
        "kernel": row.get("kernel", ""), "launch": row.get("launch", ""), "target": row["target"], "card": card,
        "seconds": seconds, "bound": bound, "ceiling": "measured" if copy_gbps else "datasheet",
        "bounds": bounds, "floor_s": floor, "ctas": grid, "ctas_per_sm": res["ctas_per_sm"],
        "residency_limit": res["limit"], "warps_per_sm": res["warps_per_sm"],
        "waves": math.ceil(grid / (sms * occ)), "trips": trips, "trips_from": trips_from,
        "trips_mean": mean, "trips_max": longest, "busiest_sm_instrs": top_i,
        "loop_instrs": loop["instrs"], "instr_per_byte": (instrs(mean) * grid / dram) if dram else None,
        "bytes_in_flight_per_sm": in_flight, "bytes_in_flight_needed": lat * bw / sms,
        "dram_bytes": dram, "flops": total_flops, "frac_of_copy": (dram / bw) / seconds if seconds else None,
        "spill_bytes": int(row.get("spill_bytes") or 0),     # not charged: see "Not modelled"
        "load_rounds": loop.get("load_rounds"), "outside_load_rounds": loop.get("outside_load_rounds"),
    }


def latency_floor_fraction(p: dict) -> float:
    """The most of the copy ceiling *any* kernel moving prediction `p`'s DRAM bytes can be predicted at on
    its card: the model gives no CTA a chain shorter than one load and one store latency, so no launch is
    predicted under two latencies. 1.0 for a launch big enough to hide them (5.3 MB on B200: 0.55)."""
    lat = LATENCY_NS[CARDS[p["card"]]["vendor"]] * 1e-9
    return min(1.0, p["bounds"]["memory"] / (2 * lat))


def bar_columns(p: dict) -> dict:
    """A prediction's columns in the pages' decode-bound tables (issue 21's bar: issue time at most memory
    time / 0.9, >= 80 % of the copy ceiling): issue over memory time, the binding bound, the share of the
    copy ceiling and which ceiling that is, and the loads its loop's trip waits one after another
    (`machine.load_rounds`; more than one is a latency the bound does not charge)."""
    b = p["bounds"]
    return {"issue / memory time": round(b["issue"] / b["memory"], 2), "bound": p["bound"],
            "% of copy ceiling": round(100 * p["frac_of_copy"]), "ceiling": p["ceiling"],
            "loads in turn a trip (not charged)": p.get("load_rounds")}


def bound_sentence(p: dict) -> str:
    """'issue-bound: 8.22 µs predicted, 42 % of the datasheet copy ceiling' for prose, and where the loop's trip
    waits more than one load in turn (`machine.load_rounds`), how many, since the bound does not charge them."""
    from ..measure import significant

    frac = p.get("frac_of_copy")
    rounds = p.get("load_rounds") or 0
    return (f"{p['bound']}-bound: {significant(p['seconds'] * 1e6)} µs predicted"
            + (f", {significant(100 * frac, 2)} % of the {p['ceiling']} copy ceiling" if frac is not None else "")
            + (f" (its loop's trip waits {rounds} loads one after another, which the model does not charge)"
               if rounds > 1 else ""))
