"""The `inferbook` command.

    inferbook list
    inferbook run CHAPTER [-p NAME VALUE]... [--device D] [--preset P] [--seed N] [--save-reference]
    inferbook measure CHAPTER [-p NAME VALUE]... [--device D] [--preset P] [--budget S|none] [--save-reference]
    inferbook book [--force] [--keep-going] [--chapters SLUG ...] [--jobs N|auto]
    inferbook results [--chapter C] [--compare A B]
    inferbook ceilings [--device D] [--save-reference]
    inferbook budgets [--preset P] [--part K/N] [--table] [--dry-run [--save]]
    inferbook inspect CHAPTER|--all [--target sm_80|sm_90|sm_100|gfx942|gfx950|all] [--save] [--jobs N]
    inferbook sweep CHAPTER TARGET CONFIG --kernel NAME [--launch TEXT ...] --set KEY=V1,V2 ... [--jobs N] [--each]
    inferbook workflow run FILE.json [--output-dir D] [--input-dir D] [--device D] [--no-cache]
    inferbook workflow validate FILE.json

User errors (bad chapter, device, preset, parameter, file) print one line and exit 2;
a failed chapter prints the chapter, cell and error and exits 1. No tracebacks for either.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .words import count


def _params(pairs) -> dict:
    """`-p NAME VALUE` pairs; a name given twice is refused (which one was meant is unknowable)."""
    from .errors import UserError

    out: dict = {}
    for name, value in pairs or []:
        if name in out:
            raise UserError(f"parameter {name!r} given twice (-p {name} {out[name]!r} and -p {name} {value!r}); "
                            "give it once")
        out[name] = value
    return out


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("chapter")
    p.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="set a chapter parameter (repeatable)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--preset", default="auto", help="auto (default), smoke, cpu or gpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-reference", action="store_true",
                   help="also write data/results/<hardware>/<chapter>.json (commit it)")


def _split_device_param(args) -> dict:
    """`-p device cuda`, `-p preset gpu` and `-p seed 1` are accepted as the flags they mirror."""
    from .errors import UserError

    params = _params(args.param)
    for flag in ("device", "preset"):  # given both as --flag and as -p: refused, not one silently dropped
        if flag in params and getattr(args, flag) != "auto":
            raise UserError(f"{flag} given twice (--{flag} {getattr(args, flag)!r} and -p {flag} {params[flag]!r}); "
                            "give it once")
    if "device" in params:
        args.device = params.pop("device")
    if "preset" in params:
        args.preset = params.pop("preset")
    if "seed" in params:
        seed = params.pop("seed")
        try:
            args.seed = int(seed)
        except ValueError:
            raise UserError(f"seed must be an int, got {seed!r}") from None
    return params


def cmd_list(args) -> int:
    from . import book, toc

    built = {c.slug for c in book.built_chapters()}
    rp = book.run_parameters()
    print(f"{'chapter':26} {'part':9} {'status':13} last device")
    for c in toc.CHAPTERS.values():
        if c.slug not in built:
            print(f"{c.slug:26} {c.part:9} {'planned':13}")
            continue
        meta = book.read_meta(c.slug) or {}
        print(f"{c.slug:26} {c.part:9} {book.chapter_status(c.slug, rp):13} {meta.get('device') or ''}")
    return 0


def cmd_run(args) -> int:
    from . import book

    params = _split_device_param(args)
    from .context import check_output_dirs

    check_output_dirs(reference=args.save_reference)
    meta = book.execute(args.chapter, device=args.device, preset=args.preset, seed=args.seed, params=params,
                        save_reference=args.save_reference, progress=sys.stderr.isatty())
    p = book.paths()
    print(f"{args.chapter}: ok in {meta['seconds']:.1f} s on {meta.get('device')}")
    print(f"  notebook: {p['executed'] / (args.chapter + '.ipynb')}")
    print(f"  records:  {p['results'] / (args.chapter + '.json')}")
    return 0


def cmd_measure(args) -> int:
    import os

    from .context import setup

    params = _split_device_param(args)
    if args.save_reference:
        os.environ["INFERBOOK_SAVE_REFERENCE"] = "1"
    from . import book

    from .errors import printable

    typed = book._typed_for_notebook(args.chapter, params)
    from .context import check_output_dirs

    check_output_dirs(reference=args.save_reference)
    ctx = setup(args.chapter, device=args.device, preset=args.preset, seed=args.seed, budget_s=args.budget, **typed)
    budget = f", budget {ctx.budget_s:g} s" if ctx.budget_s is not None else ""
    print(f"{args.chapter}: measuring on {ctx.hardware_label} (preset {ctx.preset}{budget})", flush=True)
    records = ctx.measure()
    for r in records:
        print(f"  {r.name}: {len(r.measurements)} measurements, {sum(c['passed'] for c in r.checks)}/{len(r.checks)} checks passed")
    print(f"  records: {ctx.results_path()}")
    if args.save_reference:
        from .context import reference_dir

        print(f"  reference: {reference_dir() / ctx.hardware_slug / (args.chapter + '.json')}")
    failed = [f"{r.name}: {c['name']}" for r in records for c in r.checks if not c["passed"]]
    if failed:  # the records are kept (they say which), but a chapter whose checks fail has failed
        total = sum(len(r.checks) for r in records)
        print(f"inferbook: {args.chapter}: {len(failed)} of {total} checks failed (first: {printable(failed[0])})",
              file=sys.stderr)
        return 1
    return 0


def cmd_ceilings(args) -> int:
    """Measure this device's copy bandwidth and matmul rate; with --save-reference keep them
    as data/results/<hardware>/device-ceilings.json beside the chapters' reference runs."""
    from .context import git_state, package_versions, reference_dir, results_dir
    from .device import hardware_info, hardware_label, hardware_slug, resolve_device
    from .measure import ceilings
    from .record import RunRecord, save_records

    from .context import check_output_dirs

    device = resolve_device(args.device)
    check_output_dirs(reference=args.save_reference)
    c = ceilings(device)
    info = hardware_info(device)
    r = RunRecord(chapter="device-ceilings", name="ceilings", git=git_state(), packages=package_versions(),
                  hardware=info, device=str(device), workload={"dtype": c.matmul_dtype})
    r.add("copy_bandwidth", c.copy_gbps, "GB/s (read+write)", bytes=c.copy_bytes)
    r.add("matmul_rate", c.matmul_tflops, f"TFLOP/s ({c.matmul_dtype})", shape=list(c.matmul_shape))
    print(f"{hardware_label(info)}: copy {c.copy_gbps:.1f} GB/s, {c.matmul_dtype} matmul {c.matmul_tflops:.2f} TFLOP/s")
    print(f"  record: {save_records(results_dir() / 'device-ceilings.json', [r])}")
    if args.save_reference:
        print(f"  reference: {save_records(reference_dir() / hardware_slug(info) / 'device-ceilings.json', [r])}")
    return 0


def cmd_budgets(args) -> int:
    """Each chapter's time budget at a preset with its predicted wall time (`inferbook.budgets`: the CPU
    dry run's step counts through the cost model); exit 1 when a prediction exceeds its budget or a
    chapter has no dry-run counts. `--table`: the machine form `scripts/gpu_measure.sh` reads, one line
    per chapter `SLUG MEASURE_S COMPILE_S TIMEOUT_S`, then the total. `--dry-run`: run the rehearsal of
    each chapter here first (`--save` keeps its counts in data/budgets/gpu-dry-run.json)."""
    from . import presets, toc
    from .errors import UserError

    if args.preset not in presets.PRESETS:
        raise UserError(f"unknown preset {args.preset!r}; choose {', '.join(presets.PRESETS)}")
    chosen = list(toc.CHAPTERS)
    if args.part:
        try:
            k, n = (int(x) for x in args.part.split("/"))
        except ValueError:
            raise UserError(f"--part must be K/N, e.g. 1/2, got {args.part!r}") from None
        if not 1 <= n <= len(chosen):
            raise UserError(f"--part {args.part!r}: N must be in 1..{len(chosen)} (one part per chapter at most)")
        if not 1 <= k <= n:
            raise UserError(f"--part {args.part!r}: K must be in 1..N")
        chosen = presets.budget_parts(args.preset, n)[k - 1]
    if args.table:
        part_s = presets.CEILINGS_S + presets.PACKING_S + presets.WARM_TIMEOUT_S
        for slug in chosen:
            b = presets.budget_for(slug, args.preset)
            if b is None:
                continue
            part_s += sum(b) + presets.STARTUP_ALLOWANCE_S + presets.KILL_GRACE_S
            print(f"{slug} {b[0]:g} {b[1]:g} {int(round(sum(b) + presets.STARTUP_ALLOWANCE_S))}")
        if args.part:
            print(f"# part {args.part}: worst case {part_s:g} s")
        print(f"# worst case {presets.worst_case_total_s(args.preset, presets.RUN_PARTS):g} s of {presets.GPU_RUN_TOTAL_S} s "
              f"in {presets.RUN_PARTS} parts (each: ceilings {presets.CEILINGS_S} s, warm step {presets.WARM_TIMEOUT_S} s, "
              f"packing {presets.PACKING_S} s; {presets.STARTUP_ALLOWANCE_S} s start-up and {presets.KILL_GRACE_S} s "
              f"kill grace per chapter)")
        return 0
    return _budget_predictions(args, chosen)


def _budget_predictions(args, chosen) -> int:
    from . import budgets, presets

    if args.preset != "gpu":
        print(f"# no predictions at preset {args.preset!r}: the step-count model prices the gpu preset only")
        return 0
    counts = budgets.load_dry_run()
    if args.dry_run:
        from . import rehearsal

        for slug in chosen:
            print(f"# dry run: {slug} ...", flush=True)
            counts[slug] = rehearsal.rehearse(slug)
        if args.save:
            budgets.save_dry_run(counts)
    print(f"{'chapter':<24} {'budget_s':>8} {'predicted_s':>11} {'host_s':>7} {'compile_s':>9} {'device_s':>8}  "
          f"binds (all predicted)")
    over, missing, preds, dry_cpu, dry_proc = [], [], {}, 0.0, 0.0
    for slug in chosen:
        b = presets.budget_for(slug, args.preset)
        if b is None:
            continue
        if slug not in counts or "error" in counts[slug]:
            missing.append(slug)
            why = counts.get(slug, {}).get("error", "no dry-run counts")
            print(f"{slug:<24} {sum(b):>8g} {'—':>11}  ({why})")
            continue
        p = budgets.predict(slug, counts[slug], sum(b))
        preds[slug] = p
        dry_cpu += p.dry_run_cpu_s or 0.0
        dry_proc += float(counts[slug].get("process_cpu_s", counts[slug].get("cpu_s", 0.0)) or 0.0)
        flag = "" if p.fits else "  OVER BUDGET"
        print(f"{slug:<24} {p.budget_s:>8g} {p.total_s:>11.3g} {p.host_s:>7.3g} {p.compile_s:>9.3g} {p.device_s:>8.3g}  "
              f"{p.binds} (steps x{p.scale:.3g}){flag}")
        if not p.fits:
            over.append(slug)
    # the run: each part is one scripts/gpu_measure.sh call (ceilings, the warm step, its chapters, packing)
    n = presets.RUN_PARTS if not args.part else int(args.part.split("/")[1])
    parts = [presets.budget_parts(args.preset, n)[int(args.part.split("/")[0]) - 1]] if args.part else \
        presets.budget_parts(args.preset, n)
    total, too_long = 0.0, []
    for i, part in enumerate(parts, 1):
        ps = [preds[s] for s in part if s in preds]
        warm = budgets.warm_step_s(ps)
        t = presets.CEILINGS_S + presets.PACKING_S + warm + sum(p.total_s + presets.STARTUP_ALLOWANCE_S for p in ps)
        total += t
        print(f"# part {i if not args.part else args.part}: predicted {t:.0f} s (warm step {warm:.0f} s, ceilings "
              f"{presets.CEILINGS_S} s, {presets.STARTUP_ALLOWANCE_S} s start-up per chapter, packing {presets.PACKING_S} s)")
    print(f"# predicted total {total:.0f} s of {presets.GPU_RUN_TOTAL_S} s; the dry run took {dry_cpu:.0f} s of wall "
          f"time, {dry_proc:.0f} s of CPU time (wall where a chapter's counts predate the CPU count) on this CPU")
    if total > presets.GPU_RUN_TOTAL_S:
        too_long.append(f"the run ({total:.0f} s)")
    if over or missing or too_long:
        print(f"# predicted over budget: {', '.join(over + too_long) or 'none'}; "
              f"without dry-run counts: {', '.join(missing) or 'none'}")
        return 1
    return 0


def cmd_book(args) -> int:
    from . import book
    from .context import check_output_dirs

    check_output_dirs()
    book.build_book(chapters=args.chapters or None, force=args.force, keep_going=args.keep_going,
                    device=args.device, preset=args.preset, progress=sys.stderr.isatty(), jobs=args.jobs)
    return 0


def _resolve_record(spec: str):
    """FILE[#NAME] or CHAPTER[#NAME] (the latest local run of that chapter)."""
    from . import book
    from .errors import UserError
    from .record import load_records

    target, _, name = spec.partition("#")
    path = Path(target)
    if path.suffix != ".json" and "/" not in target and not path.exists():  # a chapter's name
        path = book.paths()["results"] / f"{target}.json"
    records = load_records(path)
    if name:
        for r in records:
            if r.name == name:
                return r
        raise UserError(f"no record named {name!r} in {path}; names are {', '.join(r.name for r in records)}")
    if len(records) != 1:
        raise UserError(f"{path} holds {len(records)} records; pick one with {spec}#NAME "
                        f"({', '.join(r.name for r in records)})")
    return records[0]


def cmd_results(args) -> int:
    from . import book
    from .context import reference_dir
    from .device import hardware_label
    from .errors import printable
    from .record import compare, complete_path, is_partial_path, load_records, results_complete

    if args.compare:
        a, b = (_resolve_record(s) for s in args.compare)
        cmp = compare(a, b)
        for line in cmp.context:
            print(f"# {printable(line)}")
        table = cmp.table()
        print(printable(table.to_string(index=False), keep_newlines=True) if hasattr(table, "to_string")
              else printable(str(cmp.rows)))
        return 0
    from .errors import UserError

    root = book.paths()["root"]
    files = sorted(book.paths()["results"].glob("*.json")) + sorted(reference_dir().glob("*/*.json"))
    for f in files:
        if args.chapter and f.stem != args.chapter and f.name != args.chapter + ".partial.json":
            continue
        try:
            records = load_records(f)
        except UserError as e:  # one bad file does not hide the others
            print(f"inferbook: skipping {printable(str(e))}", file=sys.stderr)
            continue
        shown = printable(_shown_path(f, root))
        if is_partial_path(f):
            good = complete_path(f)
            partial = ("  (partial: a run that was stopped; the last complete run is " +
                       (printable(good.name) if good.is_file() else "none") + ")")
        else:
            partial = "" if results_complete(f) else "  (incomplete: the run was stopped)"
        for r in records:
            print(f"{shown:52} {printable(r.name):24} {printable(r.variant):12} "
                  f"{printable(hardware_label(r.hardware)):40} {printable(r.created)}{partial}")
    return 0


def _shown_path(path: Path, root: Path) -> str:
    """Relative to the checkout when inside it (a build dir elsewhere is shown in full)."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors are user errors too: one line (the usage stays in --help), exit 2."""

    def error(self, message):
        self.exit(2, f"inferbook: error: {message} (see '{self.prog} --help')\n")


def cmd_inspect(args) -> int:
    """Compile a chapter's gpu-preset launches ahead of time for NVIDIA and AMD targets (no GPU needed) and
    print one line per launch; the table is saved as a record (data/compiled/<slug>.json with
    --save, else _build/compiled/<slug>.json)."""
    from . import compiled, toc
    from .errors import UserError, choices

    if args.all == (args.chapter is not None):
        raise UserError("give one CHAPTER or --all")
    targets = list(compiled.TARGETS) if args.target == "all" else [args.target]
    if args.target != "all" and args.target not in compiled.TARGETS:
        raise UserError(f"unknown target {args.target!r}; choose {choices(list(compiled.TARGETS) + ['all'])}")
    if args.jobs < 1:
        raise UserError(f"--jobs must be >= 1, got {args.jobs}")
    slugs = compiled.kernel_chapters() if args.all else [toc.get_chapter(args.chapter).slug]
    if not args.all and not compiled.has_launches(slugs[0]):
        raise UserError(f"chapter {slugs[0]!r} launches no Triton kernel at its gpu preset; chapters with kernels: "
                        f"{', '.join(compiled.kernel_chapters())}")
    rows = compiled.inspect(slugs, targets, jobs=args.jobs)
    print(compiled.format_table(rows))
    bad = [f"{r['launch']} on {r['target']}: {'; '.join(compiled.problems(r))}" for r in rows if compiled.problems(r)]
    root = compiled.repo_root() if args.save else compiled.repo_root() / "_build"
    for slug in slugs:
        print(f"  record: {compiled.save_table(slug, rows, root=root)}")
    print(f"{len(rows)} compiles, {count(len(bad), 'problem')}" + "".join(f"\n  {b}" for b in bad))
    return 1 if bad else 0


def cmd_sweep(args) -> int:
    """A named launch config's alternatives, compiled and predicted beside the chosen one
    (`inferbook.compiled.sweep`; its arguments are passed on as they are)."""
    from .compiled import restart_compiling, sweep

    restart_compiling("inferbook.compiled.sweep", args.rest)     # compile for real (returns where it is off)
    return sweep.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    ap = _OneLineParser(prog="inferbook", description="Execute, measure and render the inferbook chapters.")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="chapters and whether their executed copy is cached, stale or failed").set_defaults(fn=cmd_list)
    p = sub.add_parser("run", help="execute one chapter notebook (papermill) into _build/executed/")
    _add_run_args(p)
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("measure", help="run one chapter's measurements without Jupyter (for bare GPU images)")
    _add_run_args(p)
    p.add_argument("--budget", default=None, metavar="S|none",
                   help="seconds the measurements may take (default: the preset's table; gpu only), or none")
    p.set_defaults(fn=cmd_measure)
    p = sub.add_parser("budgets", help="each chapter's time budget, its predicted wall time, and the hard timeout")
    p.add_argument("--preset", default="gpu")
    p.add_argument("--table", action="store_true", help="the machine form scripts/gpu_measure.sh reads")
    p.add_argument("--dry-run", action="store_true", help="rehearse each chapter on CPU first (minutes)")
    p.add_argument("--save", action="store_true", help="with --dry-run: keep the counts in data/budgets/")
    p.add_argument("--part", metavar="K/N", help="only the K-th of N parts of about equal time (one device call each)")
    p.set_defaults(fn=cmd_budgets)
    p = sub.add_parser("ceilings", help="measure this device's copy bandwidth and matmul rate")
    p.add_argument("--device", default="auto")
    p.add_argument("--save-reference", action="store_true")
    p.set_defaults(fn=cmd_ceilings)
    p = sub.add_parser("inspect", help="compile a chapter's gpu-preset Triton launches for sm_80/90/100 and gfx942/950 (no GPU), with predicted times")
    p.add_argument("chapter", nargs="?")
    p.add_argument("--all", action="store_true", help="every chapter with Triton launches")
    p.add_argument("--target", default="sm_90", help="sm_80, sm_90 (default), sm_100, gfx942, gfx950 or all")
    p.add_argument("--save", action="store_true", help="write data/compiled/<slug>.json (commit it)")
    p.add_argument("--jobs", type=int, default=2, help="compiling processes (default 2)")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("sweep", help="compile and predict a kernel's launches at other tiles/warps/stages of a named "
                                     "config (no GPU); `inferbook sweep -h` for its arguments", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_sweep)
    p = sub.add_parser("book", help="execute changed chapters and build _build/html")
    p.add_argument("--force", action="store_true", help="re-execute every chapter")
    p.add_argument("--keep-going", action="store_true", help="build the other chapters when one fails")
    p.add_argument("--chapters", nargs="+", metavar="SLUG", help="only (re)execute these chapters")
    p.add_argument("--device", default="auto")
    p.add_argument("--preset", default="auto")
    p.add_argument("--jobs", default="auto", metavar="N|auto",
                   help="chapters executed at once: auto (default) is 2 on a CPU-only run with 2+ cores, "
                        "else 1; a GPU run is always sequential")
    p.set_defaults(fn=cmd_book)
    p = sub.add_parser("results", help="list run records, or compare two")
    p.add_argument("--chapter")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="FILE.json[#NAME] or CHAPTER[#NAME]")
    p.set_defaults(fn=cmd_results)
    from .workflow.cli import add_parser as add_workflow_parser

    add_workflow_parser(sub)
    return ap


def _encodable_output() -> None:
    """Any locale (LANG=C: ASCII) can print any name: what the encoding lacks is written as an escape."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass


import errno as _errno

# Errors of the place a file is written (a read-only folder, a file where a folder belongs, a full
# disk): one line naming the path, never a traceback.
_PLACE_ERRNOS = {_errno.EACCES, _errno.EPERM, _errno.EROFS, _errno.ENOTDIR, _errno.EISDIR, _errno.ENOSPC,
                 _errno.EEXIST, _errno.EDQUOT}


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a `timeout`, a scheduler): unwound like Ctrl-C, so partial records are saved once more."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    import signal
    import threading

    from .errors import UserError, printable

    _encodable_output()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        if argv[:1] == ["sweep"]:          # its own parser, options and -h included (`compiled.sweep`)
            args = argparse.Namespace(fn=cmd_sweep, rest=argv[1:])
        else:
            args = build_parser().parse_args(argv)
        try:
            from .book import ChapterFailed
        except ImportError:  # a bare GPU image without the book extras can still `measure`
            ChapterFailed = ()  # type: ignore[assignment]
        try:
            return args.fn(args)
        except UserError as e:
            print(f"inferbook: error: {printable(str(e))}", file=sys.stderr)
            return 2
        except ChapterFailed as e:  # type: ignore[misc]
            print(f"inferbook: {printable(str(e))}", file=sys.stderr)
            return 1
        except OSError as e:
            if e.errno not in _PLACE_ERRNOS:
                raise
            where = f" {printable(repr(str(e.filename)))}" if e.filename else ""
            print(f"inferbook: error: cannot write{where}: {e.strerror or e}", file=sys.stderr)
            return 2
    except _Terminated:
        print("inferbook: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("inferbook: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
