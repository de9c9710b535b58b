"""Probe every class of bad input issue 27 lists, as a careless or hostile user would, through the real
commands (one subprocess each): CLI knobs, record files, workflows, model files, the KV peer's CLI, odd
environments. Each case must end with its expected exit code (2 for a refusal) and exactly one line on
stderr, no traceback, no hang, nothing written; a run must not start work (the `measure` functions and the
notebook executor are replaced by a guard that exits 99 and says so).

    PYTHONPATH=src python scripts/probe_bad_input.py [--only SUBSTRING] [--markdown]

Prints one row per case and exits 1 if any case misbehaves. Takes a few minutes (a Python start per case).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180

GUARD = r'''
import os, sys
def _refuse(*a, **k):
    sys.stderr.write("PROBE: work started before the input was refused\n"); sys.stderr.flush(); os._exit(99)
try:
    import papermill
    papermill.execute_notebook = _refuse
except ImportError:
    pass
from inferbook import context
if os.environ.get("PROBE_ALLOW_WORK") != "1":
    context.Context.measure = _refuse
from inferbook.cli import main
sys.exit(main(sys.argv[1:]))
'''

MODEL_PROBE = r'''
import math, shutil, sys, os
from pathlib import Path
import torch
from inferbook.errors import UserError
from inferbook.serving.model import TinyConfig, TinyDecoder, init_weights, load_weights, save_weights
from inferbook.serving.draft import load_draft, save_draft
from inferbook.serving.weights import save_model_file
case, tmp, models = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
target = load_weights(models / "dspark-target.safetensors", "cpu")

def bad_target(field, value, nan_weight=False):
    cfg = TinyConfig()
    object.__setattr__(cfg, field, value) if field else None
    m = init_weights(TinyDecoder(TinyConfig()), 0)
    state = m.state_dict()
    if nan_weight:
        state["embed.weight"][0, 0] = float("nan")
    p = tmp / "dspark-target.safetensors"
    save_model_file(p, state, cfg, kind="target")
    return p

try:
    if case == "large-draft-as-small":
        p = tmp / "dspark-draft-small.safetensors"
        shutil.copy(models / "dspark-draft-large.safetensors", p)
        load_draft(p, target)
    elif case == "draft-nan-weights":
        d = load_draft(models / "dspark-draft-small.safetensors", target)
        with torch.no_grad():
            next(iter(d.parameters())).view(-1)[0] = float("nan")
        p = tmp / "dspark-draft-small.safetensors"
        save_draft(d, p)
        load_draft(p, target)
    elif case == "target-nan-weights":
        load_weights(bad_target(None, None, nan_weight=True), "cpu")
    elif case == "target-nan-rope-theta":
        load_weights(bad_target("rope_theta", float("nan")), "cpu")
    elif case == "target-negative-norm-eps":
        load_weights(bad_target("norm_eps", -1e-6), "cpu")
    elif case == "target-zero-eps":
        load_weights(bad_target("norm_eps", 0.0), "cpu")
    elif case == "target-zero-heads":
        load_weights(bad_target("n_heads", 0), "cpu")
    elif case == "target-negative-vocab":
        load_weights(bad_target("vocab", -5), "cpu")
    elif case == "target-missing":
        load_weights(tmp / "dspark-target.safetensors", "cpu", rebuild="python -m inferbook.serving.train all")
    elif case == "target-fifo":
        p = tmp / "dspark-target.safetensors"
        os.mkfifo(p)
        load_weights(p, "cpu")
    else:
        raise SystemExit(f"unknown case {case}")
except UserError as e:
    print(f"inferbook: error: {e}", file=sys.stderr)
    sys.exit(2)
print("loaded", file=sys.stderr)
sys.exit(0)
'''


def record_files(files: Path) -> None:
    """The hostile results files, written into `files` (tests/test_bad_input_probe.py uses the same ones
    in-process): out-of-range and mistyped fields, nesting past the parser's limits, random bytes, one byte
    over the size limit, a FIFO, and good files to compare against."""
    from inferbook import record

    good = record.RunRecord(chapter="upgrade-record", name="a", hardware={"device_type": "cpu", "cpu_model": "x"})
    good.add("t", 1.0, "s")
    base = {"inferbook_results": 1, "complete": True, "records": [good.to_dict()]}

    def variant(name, edit):
        d = json.loads(json.dumps(base))
        edit(d["records"][0])
        (files / name).write_text(json.dumps(d))

    variant("huge-int.json", lambda r: r["measurements"][0].__setitem__("value", 10 ** 400))
    variant("list-name.json", lambda r: r.__setitem__("name", ["a"]))
    variant("dict-unit.json", lambda r: r["measurements"][0].__setitem__("unit", {"s": 1}))
    variant("list-commit.json", lambda r: r.__setitem__("git", {"commit": ["x"]}))
    variant("list-lifecycle.json", lambda r: r["measurements"][0].__setitem__("lifecycle", ["steady"]))
    variant("list-workload.json", lambda r: r.__setitem__("workload", {"batch": [[1], {"x": 2}]}))
    (files / "deep.json").write_text("[" * 100 + "]" * 100)
    (files / "deeper.json").write_text("[" * 100_000 + "]" * 100_000)   # past the parser's own recursion limit
    (files / "big.json").write_bytes(os.urandom(record.MAX_RESULTS_BYTES + 1))
    (files / "random-4k.json").write_bytes(os.urandom(4096))
    os.mkfifo(files / "fifo.json")
    (files / "good.json").write_text(json.dumps(base))
    r = record.RunRecord(chapter="upgrade-record", name="x\n\x1b[31mred", variant="\u00e9",
                         hardware={"device_type": "cpu", "cpu_model": "x"}, workload={"steps": float("nan")})
    r.add("t", 1.0, "s")
    (files / "nan-workload.json").write_text(json.dumps({"inferbook_results": 1, "complete": True,
                                                          "records": [r.to_dict()]}, allow_nan=True))
    r = record.RunRecord(chapter="upgrade-record", name="na\u00efve\u2014\u540d", hardware={"device_type": "cpu",
                                                                                              "cpu_model": "x"})
    r.add("t", 1.0, "s")
    (files / "results-c").mkdir()
    record.save_complete(files / "results-c" / "upgrade-record.json", [r])


def workflows(files: Path) -> None:
    def chain(n, cls, inputs_of):
        g = ({"0": {"class_type": "Int", "inputs": {"value": 1}}} if cls == "MakeList" else
             {"0": {"class_type": "String", "inputs": {"value": "ab"}}})
        for i in range(1, n + 1):
            g[str(i)] = {"class_type": cls, "inputs": inputs_of(str(i - 1))}
        return g

    deep = 1
    for _ in range(200):
        deep = [deep]
    scene = {"c": {"class_type": "ToyScene", "inputs": {"width": 32, "height": 32, "prompt": "x"}}}
    w = {
        "dup-ids": '{"1": {"class_type": "Int", "inputs": {"value": 1}}, "1": {"class_type": "Int", "inputs": {"value": 2}}}',
        "format-doubling-40": chain(40, "FormatText", lambda p: {"template": "{}{}", "value": [p, 0]}),
        "makelist-shared-60": chain(60, "MakeList", lambda p: {"a": [p, 0], "b": [p, 0]}),
        "makelist-depth-200": {**chain(200, "MakeList", lambda p: {"a": [p, 0]}),
                               "p": {"class_type": "Preview", "inputs": {"value": ["200", 0]}}},
        "literal-nesting-200": {"1": {"class_type": "Preview", "inputs": {"value": deep}}},
        "superscript-digit": {"s": {"class_type": "StartLoop", "inputs": {}},
                              "1": {"class_type": "EndLoop", "inputs": {"loop": ["s", 5],
                                                                         "termination\u00b2": ["s", 0]}}},
        "segment-10000x10000": {**scene, "g": {"class_type": "GenerateSegment", "inputs": {
            "context": ["c", 0], "prompt": "x", "frames": 10_000, "steps": 10_000}}},
        "cycle": {"1": {"class_type": "Preview", "inputs": {"value": ["2", 0]}},
                  "2": {"class_type": "Preview", "inputs": {"value": ["1", 0]}}},
    }
    for name, g in w.items():
        (files / f"wf-{name}.json").write_text(g if isinstance(g, str) else json.dumps(g))
    os.mkfifo(files / "wf-fifo.json")


def cases(files: Path, tmp: Path):
    """(id, argv after `python`, extra env, expected rc, needle that the one line (or stdout) must hold)."""
    f = lambda n: str(files / n)  # noqa: E731
    ib = ["-c", GUARD]
    m = lambda ch, *a: ib + ["measure", ch, "--device", "cpu", "--preset", "smoke", *a]  # noqa: E731
    r = lambda ch, *a: ib + ["run", ch, "--device", "cpu", "--preset", "smoke", *a]  # noqa: E731
    out = [
        # CLI knobs
        ("dup -p (run)", ib + ["run", "upgrade-record", "-p", "batch", "1", "-p", "batch", "2"], {}, 2, "given twice"),
        ("dup -p (measure)", m("upgrade-record", "-p", "batch", "1", "-p", "batch", "2"), {}, 2, "given twice"),
        ("--preset bogus -p preset smoke", ib + ["measure", "upgrade-record", "--preset", "bogus", "-p", "preset",
                                                 "smoke"], {}, 2, "preset given twice"),
        ("--budget 0", ib + ["measure", "upgrade-record", "--budget", "0"], {}, 2, "budget"),
        ("--budget nan", ib + ["measure", "upgrade-record", "--budget", "nan"], {}, 2, "budget"),
        ("budgets --part 1/1000000000", ib + ["budgets", "--part", "1/1000000000"], {}, 2, "N must be"),
        ("prompts_per_task beyond corpus", m("kimi-dspark-acceptance", "-p", "prompts_per_task", "500"), {}, 2,
         "prompts_per_task"),
        ("output_len 1", m("kimi-dspark-acceptance", "-p", "output_len", "1"), {}, 2, "output_len"),
        ("num_spec_tokens vs committed block", m("kimi-dspark-acceptance", "-p", "num_spec_tokens", "4"), {}, 2,
         "num_spec_tokens"),
        ("target_len > max_seqlen", m("deterministic-attention", "-p", "target_len", "999"), {}, 2, "max_seqlen"),
        ("empty batch_sizes", m("deterministic-attention", "-p", "batch_sizes", ","), {}, 2, "batch_sizes"),
        ("host_sweep nan", r("tiered-kv-offload", "-p", "host_sweep", "nan"), {}, 2, "host_sweep"),
        ("head dim 33 (upgrade-record)", r("upgrade-record", "-p", "d_model", "66", "-p", "n_heads", "2", "-p",
                                           "n_kv_heads", "1"), {}, 2, "head dim 33"),
        ("head dim 33 (kimi-spec-budget)", m("kimi-spec-budget", "-p", "d_model", "66", "-p", "n_heads", "2", "-p",
                                             "n_kv_heads", "1"), {}, 2, "head dim 33"),
        ("head dim 33 (tiered-kv)", m("tiered-kv-offload", "-p", "d_model", "66", "-p", "n_heads", "2", "-p",
                                      "n_kv_heads", "1"), {}, 2, "head dim 33"),
        ("max_num_batched_tokens < block (spec)", m("kimi-spec-budget", "-p", "max_num_batched_tokens", "8"), {}, 2,
         "one KV block"),
        ("max_num_batched_tokens < block (tiered)", r("tiered-kv-offload", "-p", "max_num_batched_tokens", "8"), {}, 2,
         "one KV block"),
        ("eps 0 (minimax)", m("minimax-m3-moe", "-p", "eps", "0"), {}, 2, "eps"),
        ("VAE width not a factor (h3-vae)", m("h3-vae-fusion", "-p", "video", "5,18,16"), {}, 2, "multiples"),
        ("VAE check_video too small", m("h3-vae-fusion", "-p", "check_video", "3,4,4"), {}, 2, "check_video"),
        ("VAE latent too small (tiled)", m("h3-tiled-decode", "-p", "vit_latent", "3,1,4"), {}, 2, "vit_latent"),
        ("loop width not a factor (comfy)", m("comfy-generic-loops", "-p", "width", "30"), {}, 2, "multiples"),
        ("omni width off preset", m("omni-h3-workflows", "-p", "width", "100"), {}, 2, "presets"),
        ("omni frames off the lattice", m("omni-h3-workflows", "-p", "duration", "100"), {}, 2, "duration"),
        ("world_size 1 (sglang)", m("sglang-fused-comm", "-p", "world_size", "1"), {}, 2, "world_size"),
        ("vocab < ranks (sglang)", m("sglang-fused-comm", "-p", "vocabs", "1"), {}, 2, "vocab size 1"),
        ("request_rate 0 (upgrade)", m("upgrade-record", "-p", "request_rate", "0"), {}, 2, "request_rate"),
        ("burstiness 0 (upgrade)", m("upgrade-record", "-p", "burstiness", "0"), {}, 2, "burstiness"),
        ("ep layout (te)", m("te-mxfp8-recipes", "-p", "ep_experts", "3"), {}, 2, "experts=3"),
        ("reps 1 (h3-vae)", m("h3-vae-fusion", "-p", "reps", "1"), {}, 2, "reps"),
        ("decode_m 0 (chord)", m("chord-w4a16", "-p", "decode_m", "0"), {}, 2, "decode_m"),
        ("seed -1", r("upgrade-record", "--seed", "-1"), {}, 2, "seed"),
        # record files
        ("compare huge int", ib + ["results", "--compare", f("huge-int.json"), f("good.json")], {}, 2, "out of range"),
        ("compare list name", ib + ["results", "--compare", f("list-name.json"), f("good.json")], {}, 2, "name"),
        ("compare dict unit", ib + ["results", "--compare", f("dict-unit.json"), f("good.json")], {}, 2, "unit"),
        ("compare nested workload", ib + ["results", "--compare", f("list-workload.json"), f("good.json")], {}, None,
         ""),
        ("compare 100-deep", ib + ["results", "--compare", f("deep.json"), f("good.json")], {}, 2, "deeper"),
        ("compare 100000-deep", ib + ["results", "--compare", f("deeper.json"), f("good.json")], {}, 2, "deeper"),
        ("compare /dev/zero", ib + ["results", "--compare", "/dev/zero", f("good.json")], {}, 2, "device"),
        ("compare FIFO", ib + ["results", "--compare", f("fifo.json"), f("good.json")], {}, 2, "FIFO"),
        ("compare 32 MiB + 1 random", ib + ["results", "--compare", f("big.json"), f("good.json")], {}, 2,
         "at most"),
        ("compare 4 kB random", ib + ["results", "--compare", f("random-4k.json"), f("good.json")], {}, 2,
         "results file"),
        ("compare NaN workload with itself", ib + ["results", "--compare", f("nan-workload.json"),
                                                   f("nan-workload.json")], {}, 0, "OUT:\\x1b"),
        ("results, LANG=C, non-ASCII name", ib + ["results"], {"LANG": "C", "LC_ALL": "C", "PYTHONIOENCODING": "ascii",
                                                              "INFERBOOK_RESULTS": f("results-c")}, 0,
         "OUT:na\\xefve"),
        # workflows: validate and run
        *[(f"workflow {cmd} {name}", ib + ["workflow", cmd, f(f"wf-{name}.json")] +
           (["--output-dir", str(tmp / "wf-out"), "--device", "cpu"] if cmd == "run" else []), {}, 2, needle)
          for name, needle in (("dup-ids", "twice"), ("format-doubling-40", "at most 1000000"),
                               ("makelist-shared-60", "at most 100000"), ("makelist-depth-200", "at most 64"),
                               ("literal-nesting-200", "at most 64"), ("superscript-digit", "termination\\xb2"),
                               ("segment-10000x10000", "at most 100000 per node"), ("fifo", "is a FIFO"),
                               ("cycle", "cycle"))
          for cmd in ("validate", "run")],
        ("workflow validate /dev/zero", ib + ["workflow", "validate", "/dev/zero"], {}, 2, "is a device"),
        # the KV peer's CLI
        ("peer --port 99999", ["-m", "inferbook.serving.kv_offload", "peer", "--port", "99999"], {}, 2, "--port"),
        ("peer --max-connections 0", ["-m", "inferbook.serving.kv_offload", "peer", "--max-connections", "0"], {}, 2,
         "--max-connections"),
        ("peer --capacity-bytes -1", ["-m", "inferbook.serving.kv_offload", "peer", "--capacity-bytes", "-1"], {}, 2,
         "--capacity-bytes"),
        ("peer --port x", ["-m", "inferbook.serving.kv_offload", "peer", "--port", "x"], {}, 2, "--port"),
        # environments
        ("INFERBOOK_BUILD_DIR is a file", r("upgrade-record"), {"INFERBOOK_BUILD_DIR": f("good.json")}, 2,
         "is a file"),
        ("read-only build folder", r("upgrade-record"), {"INFERBOOK_BUILD_DIR": "/proc/inferbook-probe"}, 2,
         "not writable"),
        ("TRITON_INTERPRET=off on CPU", m("gdn-backward-check"), {"TRITON_INTERPRET": "off"}, 2, "TRITON_INTERPRET"),
    ]
    for name in ("large-draft-as-small", "draft-nan-weights", "target-nan-weights", "target-nan-rope-theta",
                 "target-negative-norm-eps", "target-zero-eps", "target-zero-heads", "target-negative-vocab",
                 "target-missing", "target-fifo"):
        out.append((f"model file: {name}", ["-c", MODEL_PROBE, name, "{TMP}", str(ROOT / "data" / "models")], {}, 2,
                    ""))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="inferbook-probe-"))
    files = work / "files"
    files.mkdir()
    record_files(files)
    workflows(files)
    snapshot = sorted((p.name, p.stat().st_size) for p in files.iterdir())
    bad = 0
    rows = []
    for cid, argv, env_extra, want_rc, needle in cases(files, work):
        if a.only and a.only not in cid:
            continue
        tmp = Path(tempfile.mkdtemp(prefix="case-", dir=work))
        build = tmp / "build"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "INFERBOOK_BUILD_DIR": str(build),
               "INFERBOOK_REFERENCE_DIR": str(tmp / "ref"), "INFERBOOK_RESULTS": str(build / "results"),
               **env_extra}
        if "INFERBOOK_BUILD_DIR" in env_extra and "INFERBOOK_RESULTS" not in env_extra:
            env.pop("INFERBOOK_RESULTS")
        argv = [x.replace("{TMP}", str(tmp)) for x in argv]
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                               cwd=str(tmp))
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired:
            rc, out, err = "hang", "", ""
        dt = time.time() - t0
        lines = [x for x in err.strip().splitlines() if x.strip()]
        made = sorted(str(q.relative_to(tmp)) for q in tmp.rglob("*") if q.is_file())
        if cid.startswith("model file"):
            made = [x for x in made if not x.startswith("dspark-")]   # the case's own bad file
        written = bool(made) or (build.exists() and any(build.rglob("*")))
        if want_rc == 0:   # a clean answer: stdout holds the escaped text, no raw escape, no traceback
            ok = rc == 0 and "Traceback" not in err and needle[4:] in out and "\x1b" not in out
            line = "stdout: " + (out.strip().splitlines() or [""])[-1][:100]
        elif want_rc is None:   # either a clean refusal or a clean comparison
            ok = rc in (0, 2) and "Traceback" not in err and (rc == 0 or len(lines) == 1)
            line = (lines[0] if lines else (out.strip().splitlines() or [""])[0])[:110]
        else:
            ok = rc == want_rc and len(lines) == 1 and needle in lines[0] and "Traceback" not in err
            line = lines[0][:160] if len(lines) == 1 else f"{len(lines)} lines: " + " | ".join(lines[:3])[:160]
        ok = ok and not written
        bad += not ok
        rows.append((cid, rc, line, "yes: " + ", ".join(made[:3]) if written else "no", f"{dt:.1f}", ok))
        print(f"{'ok ' if ok else 'BAD'} {cid:42} rc={rc!s:4} {dt:5.1f}s written={'yes' if written else 'no'}  {line}",
              flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if sorted((p.name, p.stat().st_size) for p in files.iterdir()) != snapshot:
        print("BAD the probe's input files changed")
        bad += 1
    if a.markdown:
        print("\n| case | exit | line printed | written | s | ok |\n|---|---|---|---|---|---|")
        for cid, rc, line, written, dt, ok in rows:
            print(f"| {cid} | {rc} | `{line.replace('|', '/')}` | {written} | {dt} | {'yes' if ok else 'NO'} |")
    shutil.rmtree(work, ignore_errors=True)
    print(f"{len(rows)} cases, {bad} misbehaved")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
