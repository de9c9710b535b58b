"""A chapter page's "What the compiler made of it": three lines and a folded table.

1. What binds the kernels, from the cost model (`compiled.cost`) on each target's default card.
2. Their resources (shared memory against the limit, registers, spills, MMA), one clause per group of
   targets with the same facts, so that every clause is true for every target it names.
3. What it means for the chapter's claim (the chapter passes `claim`, else the predicted total against
   the ideal roofline floor).
Then the compile table (rows identical on several targets merged) and the per-launch predictions,
both folded. Nothing here compiles: it reads data/compiled/<slug>.json.
"""
from __future__ import annotations

import html
from pathlib import Path

from ..words import count
from . import (TARGET_CARD, TARGETS, load_table, occupancy, predict_rows, predicted_roofline, reference_times,
               table_facts)


def plural(n: int, one: str, many: str | None = None) -> str:
    """'1 launch', '3 launches' (never 'launch(es)'): `words.count`."""
    return count(n, one, many)


def _us(seconds: float) -> str:
    from ..measure import significant

    return f"{significant(seconds * 1e6)} µs"


def _targets_in(doc: dict) -> list[str]:
    order = list(TARGETS) + [t for t in TARGET_CARD if t not in TARGETS]
    present = {r["target"] for r in doc.get("rows", [])}
    return [t for t in order if t in present]


def _group(values: dict[str, str]) -> list[tuple[list[str], str]]:
    """{target: text} -> [(targets, text)] with targets sharing a text merged, in target order."""
    out: list[tuple[list[str], str]] = []
    for t, v in values.items():
        for ts, w in out:
            if w == v:
                ts.append(t)
                break
        else:
            out.append(([t], v))
    return out


class CompilerSection:
    """The section's three lines (`lines`), glued facts (`glue`), the deduplicated compile table
    (`table`), the per-launch predictions (`predictions`: {target: [cost.predict dicts]}) and the
    ideal roofline floor of the chapter's own counts (`roofline`, from `work`)."""

    def __init__(self, slug: str, work: list[dict] | None = None, root: Path | None = None, claim: str | None = None):
        self.slug, self.root, self.claim = slug, root, claim
        self.doc = load_table(slug, root) or {"rows": []}
        self.targets = _targets_in(self.doc)
        self.work = work or []
        self.roofline = predicted_roofline(slug, self.work, reference_times(slug, self.work)) if self.work else None
        self.facts = table_facts(slug, root)
        self.predictions = {}
        for t in self.targets:
            rows = sorted((r for r in self.doc["rows"] if r["target"] == t), key=lambda r: r["index"])
            try:
                self.predictions[t] = predict_rows(rows, TARGET_CARD[t],
                                                   (root / "data" / "results") if root is not None else None)
            except Exception:                                    # a row the model cannot read: no prediction
                self.predictions[t] = []
        self.table = self._table()
        self.lines = self._lines()
        self.glue = self._glue_values()

    # -- the three lines ----------------------------------------------------------------------------
    def _binds(self) -> str:
        parts = []
        for t, preds in self.predictions.items():
            if not preds:
                continue
            total = sum(p["seconds"] for p in preds)
            top = max(preds, key=lambda p: p["seconds"])
            frac = top.get("frac_of_copy")
            parts.append(f"on {TARGET_CARD[t]} ({t}) {plural(len(preds), 'launch', 'launches')} take {_us(total)} "
                         f"predicted in all; the longest, {top['launch']}, is {top['bound']}-bound at {_us(top['seconds'])}"
                         + (f" ({round(100 * frac)} % of the {top['ceiling']} copy ceiling)" if frac is not None else ""))
        if not parts:
            return "What binds the kernels: no machine-code facts in the compile table yet (regenerate it)."
        return "What binds the kernels (cost model, predicted, not measured): " + "; ".join(parts) + "."

    def _resources(self) -> str:
        per = {}
        for t in self.targets:
            tf = self.facts["targets"].get(t)
            if tf is None:
                continue
            sp = tf["spilling"]
            spills = ("no launch spills registers" if not sp else
                      f"{plural(len(sp), 'launch', 'launches')} spill{'s' if len(sp) == 1 else ''} (most "
                      f"{max(b for _, b in sp)} B, {max(sp, key=lambda x: x[1])[0]})")
            ok = [r for r in self.doc["rows"] if r["target"] == t and r.get("ok")]
            occ = ""
            if ok:
                worst = min(ok, key=lambda r: occupancy(r)["warps_per_sm"])
                o = occupancy(worst)
                unit = "CTA" if not t.startswith("gfx") else "workgroup"
                occ = (f", fewest resident {plural(o['ctas_per_sm'], unit)} of {worst['num_warps']} "
                       f"{'warps' if unit == 'CTA' else 'waves'} per {'SM' if unit == 'CTA' else 'CU'} "
                       f"({worst['launch']}, by {o['limit']})")
            mma = ", ".join(tf["mma_families"]) or "no MMA instruction"
            per[t] = (f"{mma}; at most {tf['max_shared_kb']:.1f} KB shared of {ok[0]['smem_limit_kb'] if ok else '?'} KB, "
                      f"{tf['max_regs']} registers; {spills}{occ}")
        if not per:
            return "Resources: no compile table."
        return "Resources: " + "; ".join(f"{', '.join(ts)}: {v}" for ts, v in _group(per)) + "."

    def _meaning(self) -> str:
        if self.claim:
            return self.claim
        parts = []
        for t, preds in self.predictions.items():
            if not preds:
                continue
            total = sum(p["seconds"] for p in preds)
            floor = sum(p["floor_s"] for p in preds)
            bounds = sorted({p["bound"] for p in preds}, key=lambda b: -sum(p["seconds"] for p in preds if p["bound"] == b))
            if floor > 0:
                parts.append(f"{TARGET_CARD[t]} {total / floor:.1f}× the ideal roofline floor, mostly {bounds[0]}-bound")
        if not parts:
            return ""
        return ("What it means for this chapter: a GPU run of these launches should take about the predicted total, "
                "not the roofline floor: " + "; ".join(parts) + ".")

    def _peers(self) -> str:
        """'Beside fla-core (same shape, same model, H200, predicted): ours / fla-core = <shape> 1.23× (ours
        latency-bound, fla-core issue-bound).' from data/compiled/peers/<slug>.json (compiled by
        `inferbook.compiled.peers`), or ''."""
        from .peers import load, sentence, spill_sentence

        doc = load(self.slug, self.root)
        if doc is None:
            return ""
        try:
            said = sentence(self.slug, doc["rows"], "sm_90", "H200", self.root)
            return " ".join(x for x in (said, said and spill_sentence(self.slug, doc["rows"], self.root)) if x)
        except Exception:
            return ""

    def _lines(self) -> list[str]:
        lines = [x for x in (self._binds(), self._resources(), self._meaning()) if x]
        peer = self._peers()
        if peer and len(lines) == 3:
            lines[2] += " " + peer
        return lines

    # -- tables -------------------------------------------------------------------------------------
    def _table(self):
        import pandas as pd

        rows, index = [], {}
        for r in sorted(self.doc["rows"], key=lambda r: (r.get("index", 0), self.targets.index(r["target"])
                                                           if r["target"] in self.targets else 99)):
            if not r.get("ok"):
                cells = {"shared KB": "—", "regs": "—", "spill B": "—", "MMA": "compile error",
                         "global loads": r.get("error", "")[:80]}
            else:
                regs = r.get("regs")
                if r["target"].startswith("gfx"):       # the unified file's allocation, its AGPRs named
                    regs = f"{r.get('vgprs')}" + (f" ({r['agprs']} AGPRs)" if r.get("agprs") else "")
                cells = {"shared KB": f"{r['shared_kb']:.1f} / {r['smem_limit_kb']}" + ("" if r.get("smem_ok", True) else " ✗"),
                         "regs": regs, "spill B": r.get("spill_bytes"), "MMA": r.get("mma"),
                         "global loads": r.get("loads_summary")}
            key = (r["launch"], tuple(sorted((k, str(v)) for k, v in cells.items())))
            if key in index:
                rows[index[key]]["targets"] += f", {r['target']}"
                continue
            index[key] = len(rows)
            rows.append({"launch": r["launch"], "targets": r["target"], **cells})
        if not rows:
            return pd.DataFrame([{"launch": f"no compile record: run `inferbook inspect {self.slug} --target all --save`"}])
        return pd.DataFrame(rows)

    def prediction_table(self):
        import pandas as pd

        from ..measure import significant

        by_launch: dict[str, dict] = {}
        for t, preds in self.predictions.items():
            for p in preds:
                row = by_launch.setdefault(p["launch"], {"launch": p["launch"]})
                row[f"{TARGET_CARD[t]} µs"] = significant(p["seconds"] * 1e6)
                row[f"{TARGET_CARD[t]} bound"] = p["bound"]
        return pd.DataFrame(list(by_launch.values()))

    # -- glue ---------------------------------------------------------------------------------------
    def _glue_values(self) -> dict[str, str]:
        f = self.facts
        p = "cc_" + self.slug.replace("-", "_")
        out = {f"{p}_launches": str(f["launches"]), f"{p}_binds": self.lines[0],
               f"{p}_resources": self.lines[1] if len(self.lines) > 1 else ""}
        if len(self.lines) > 2:
            out[f"{p}_meaning"] = self.lines[2]
        for t in TARGET_CARD:
            short = t.replace("_", "")
            tf = f["targets"].get(t)
            if tf is None:
                for k in ("mma", "max_smem", "max_regs", "spills", "limit", "bound", "predicted"):
                    out[f"{p}_{short}_{k}"] = "not compiled"
                continue
            out[f"{p}_{short}_mma"] = ", ".join(tf["mma_families"]) or "no MMA instruction"
            out[f"{p}_{short}_max_smem"] = f"{tf['max_shared_kb']:.1f} KB ({tf['max_shared_launch']})"
            out[f"{p}_{short}_max_regs"] = f"{tf['max_regs']} ({tf['max_regs_launch']})"
            sp = tf["spilling"]
            out[f"{p}_{short}_spills"] = ("no launch spills" if not sp else
                                          f"{plural(len(sp), 'launch', 'launches')} spill, most {max(b for _, b in sp)} B "
                                          f"({max(sp, key=lambda x: x[1])[0]})")
            ok = [r for r in self.doc["rows"] if r["target"] == t and r.get("ok")]
            out[f"{p}_{short}_limit"] = "not compiled"
            if ok:
                worst = min(ok, key=lambda r: occupancy(r)["warps_per_sm"])
                occ = occupancy(worst)
                out[f"{p}_{short}_limit"] = (f"{worst['launch']}: {plural(occ['ctas_per_sm'], 'CTA')} of "
                                             f"{worst['num_warps']} warps per SM, bounded by {occ['limit']}")
            preds = self.predictions.get(t) or []
            if preds:
                top = max(preds, key=lambda q: q["seconds"])
                out[f"{p}_{short}_bound"] = f"{top['bound']}-bound ({top['launch']})"
                out[f"{p}_{short}_predicted"] = f"{_us(sum(q['seconds'] for q in preds))} predicted on {TARGET_CARD[t]}"
            else:
                out[f"{p}_{short}_bound"] = out[f"{p}_{short}_predicted"] = "no prediction (table without machine code)"
        names = [f"{t} ({TARGET_CARD[t]})" for t in self.targets]
        out[f"{p}_targets"] = (", ".join(names[:-1]) + " and " + names[-1]) if len(names) > 1 else "".join(names)
        out[f"{p}_amd_configs"] = amd_config_sentence(self.slug, self.root)
        out[f"{p}_failures"] = ("none" if not f["failures"] else
                                f"{len(f['failures'])}: " + "; ".join(f["failures"][:4]) +
                                (" …" if len(f["failures"]) > 4 else ""))
        return out

    # -- display ------------------------------------------------------------------------------------
    def _repr_html_(self) -> str:
        lines = "".join(f"<p>{html.escape(x)}</p>" for x in self.lines)
        note = (f"<p><small>Compiled ahead of time with Triton {html.escape(str(self.doc.get('triton', '?')))} on a machine "
                f"without a GPU (<code>inferbook inspect {self.slug} --target all</code>); predictions from the machine "
                f"code (main-loop instructions per byte, residency, waves, bytes in flight) at the datasheet ceilings "
                f"unless a committed <code>ceilings</code> record is named. The model's assumptions: "
                f"<code>inferbook.compiled.cost</code>.</small></p>")
        table = (f"<details><summary>Compile table ({plural(len(self.table), 'row')}; rows identical on several targets "
                 f"merged)</summary>{self.table.to_html(index=False, escape=True)}</details>")
        pred = self.prediction_table()
        if len(pred):
            table += (f"<details><summary>Predicted time per launch (predicted, not measured)</summary>"
                      f"{pred.to_html(index=False, escape=True)}</details>")
        from . import cost

        model = cost.__doc__.split("The model, and every assumption it makes", 1)[-1].split("\n", 1)[-1]
        table += (f"<details><summary>How the prediction is made (the model's assumptions)</summary>"
                  f"<pre style='white-space: pre-wrap'>{html.escape(model.strip())}</pre></details>")
        if self.roofline is not None:
            table += ("<details><summary>Ideal roofline floor of the chapter's own byte and flop counts (a floor, "
                      "not a prediction)</summary>" + self.roofline.to_html(index=False, escape=True) + "</details>")
        return lines + note + table

    def __repr__(self) -> str:
        out = "\n".join(self.lines) + "\n\n" + self.table.to_string(index=False)
        pred = self.prediction_table()
        if len(pred):
            out += "\n\npredicted (not measured):\n" + pred.to_string(index=False)
        return out


def chapter_section(slug: str, work: list[dict] | None = None, glue=None, claim: str | None = None) -> CompilerSection:
    """Build the section and glue its facts (`glue(name, value)`, e.g. `notebook.glue`)."""
    sec = CompilerSection(slug, work, claim=claim)
    if glue is not None:
        for k, v in sec.glue.items():
            glue(k, v)
    return sec


def targets_sentence(slug: str, targets=("sm_90", "gfx950"), root: Path | None = None) -> str:
    """'Predicted (not measured), datasheet ceilings: all 21 launches take 1.2 ms on H200 (sm_90) and
    0.9 ms on MI355X (gfx950)', or a sentence saying which target's table is missing."""
    from . import TARGET_CARD, predict_launches
    from ..errors import UserError

    parts, missing = [], []
    for t in targets:
        try:
            preds = predict_launches(slug, t, TARGET_CARD[t], root)
        except UserError:
            preds = []
        if not preds:
            missing.append(t)
            continue
        ceil = "measured" if all(p["ceiling"] == "measured" for p in preds) else "datasheet"
        parts.append(f"{_us(sum(p['seconds'] for p in preds))} on {TARGET_CARD[t]} ({t}, {ceil} ceiling)")
    out = ""
    if parts:
        out = f"Predicted, not measured: this chapter's gpu-preset launches take " + " and ".join(parts) + " in all"
    if missing:
        out += ("; " if out else "") + f"not compiled with machine-code facts for {', '.join(missing)} yet " \
               f"(inferbook inspect {slug} --target {missing[0]} --save)"  # glued as plain text: no backticks
    return out + "."


def _values(vals) -> str:
    return " or ".join(dict.fromkeys(str(v) for v in vals))


def amd_config_sentence(slug: str, root: Path | None = None) -> str:
    """How the NVIDIA configs fare on CDNA, from the AMD rows' `nvidia_config` (what the NVIDIA config
    of the same launch made on that target, compiled beside the AMD one by `inferbook inspect`): one
    clause per target and kind of change, e.g. 'on gfx942 (MI300X, 64 KB of LDS) 2 launches run
    num_stages 1 where the NVIDIA config has 3, 2: the NVIDIA config needs up to 80.0 KB of LDS (2 over
    the limit), the AMD one up to 32.0 KB'. Where no AMD row differs: a sentence saying so."""
    from . import AMD_TARGETS, SMEM_LIMIT_KB, TARGET_GPUS

    doc = load_table(slug, root) or {"rows": []}
    amd = [t for t in AMD_TARGETS if any(r["target"] == t for r in doc["rows"])]
    if not amd:
        return "not compiled for gfx942 or gfx950"
    clauses, where_said = [], None
    for t in amd:
        groups: dict[tuple, list[dict]] = {}
        for r in doc["rows"]:
            nv = r.get("nvidia_config")
            if r["target"] == t and nv and r.get("ok"):
                groups.setdefault(tuple(sorted(nv["differ"])), []).append(r)
        for keys, rows in groups.items():
            ours = " and ".join(f"{k} {_values(r['nvidia_config']['differ'][k][1] for r in rows)}" for k in keys)
            theirs = " and ".join(f"{k} {_values(r['nvidia_config']['differ'][k][0] for r in rows)}" for k in keys)
            where = f"on {t} ({TARGET_GPUS[t]}, {SMEM_LIMIT_KB[t]} KB of LDS) " if where_said != t else ""
            where_said = t
            head = (f"{where}{plural(len(rows), 'launch', 'launches')} "
                    f"run{'s' if len(rows) == 1 else ''} {ours} where the NVIDIA config has {theirs}")
            nvs = [r["nvidia_config"] for r in rows if r["nvidia_config"].get("compiled", True)]
            some = "" if len(nvs) == len(rows) else f", compiled for {len(nvs)} of them,"
            failed = [n for n in nvs if not n["ok"]]
            if failed:
                err = failed[0].get("error", "").rsplit(" … ", 1)[-1].strip()
                clauses.append(f"{head}: the NVIDIA config{some} does not compile there for "
                               f"{count(len(failed), 'launch', 'launches')} ({err[-120:]})")
                continue
            if not nvs:
                continue
            over = sum(1 for n in nvs if not n.get("smem_ok", True))
            nv_scr = max(n.get("scratch_bytes") or 0 for n in nvs)
            our_scr = max(r.get("scratch_bytes") or 0 for r in rows)
            clauses.append(f"{head}: the NVIDIA config{some} needs up to {max(n['shared_kb'] for n in nvs):.1f} KB of LDS"
                           + (f" ({over} over the limit)" if over else "")
                           + (f" and spills ({nv_scr} B of scratch)" if nv_scr else "")
                           + f", the AMD one up to {max(r['shared_kb'] for r in rows):.1f} KB"
                           + (f" with {our_scr} B of scratch" if our_scr else ", no scratch"))
    if not clauses:
        return f"on {' and '.join(amd)} every launch runs the NVIDIA config (it fits)"
    return "; ".join(clauses)
