"""Executing chapters and building the book.

    chapters/<slug>.md  --jupytext-->  notebook  --papermill-->  _build/executed/<slug>.ipynb
                                                                 _build/results/<slug>.json
    _config.yml, _toc.yml, intro.md, executed notebooks, status page  -->  _build/stage/
    _build/stage  --sphinx (jupyter-book config, execution off)-->  _build/html/

A chapter is re-executed only when its inputs change: the chapter source, its parameters
(device, preset, seed and knobs), any file under `src/inferbook/` or `data/`. The hash of
those inputs is kept next to the executed notebook, with status, device, duration and date.
We use papermill (parameters, per-cell timeout, failing cell named) and jupytext (MyST
markdown sources, no outputs in git) rather than code of our own; the cache is ours
because jupyter-book's own cache keys on notebook text only and would miss `src/` edits.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import reader, toc
from .context import build_dir, repo_root, results_dir
from .errors import MissingRequirement, UserError
from .record import load_records, write_json_atomic
from .words import count

DEFAULT_CELL_TIMEOUT_S = 1800
# papermill waits 60 s by default for a new kernel to answer; two chapters starting side by side on a busy
# two-core machine (CI running tests beside them) have taken longer, and the chapter then failed before
# its first cell. A kernel that never starts still fails, after this.
KERNEL_START_TIMEOUT_S = 300


def paths() -> dict[str, Path]:
    root = repo_root()
    build = build_dir()
    return {"root": root, "chapters": root / "chapters", "build": build, "executed": build / "executed",
            "results": results_dir(), "stage": build / "stage", "html": build / "html",
            "doctrees": build / "doctrees"}


def toc_files() -> list[str]:
    """Every `file:` entry of _toc.yml, in order (e.g. 'chapters/upgrade-record')."""
    import re

    toc_yml = paths()["root"] / "_toc.yml"
    if not toc_yml.is_file():
        return []
    return re.findall(r"^\s*-?\s*file:\s*['\"]?([^'\"\s#]+)", toc_yml.read_text(), re.M)


def built_chapters() -> list[toc.ChapterInfo]:
    """Chapters of the book: listed in _toc.yml and with a source, in book order.

    A source not yet in the table of contents is work in progress: it can be run with
    `inferbook run`, but the book neither executes nor links it (a test keeps the two in step).
    """
    src = paths()["chapters"]
    listed = set(toc_files())
    return [c for c in toc.CHAPTERS.values()
            if (src / f"{c.slug}.md").is_file() and f"chapters/{c.slug}" in listed]


def _hash_tree(h, folder: Path, skip: tuple[str, ...] = ("__pycache__", ".ipynb_checkpoints")) -> None:
    if not folder.is_dir():
        return
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not any(s in p.parts for s in skip) and not p.name.endswith(".pyc"):
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())


def input_hash(slug: str, run_params: dict) -> str:
    """What a cached execution depends on: chapter source, parameters, src/inferbook, data/."""
    p = paths()
    h = hashlib.sha256()
    h.update((p["chapters"] / f"{slug}.md").read_bytes())
    h.update(json.dumps(run_params, sort_keys=True, default=str).encode())
    _hash_tree(h, p["root"] / "src" / "inferbook")
    _hash_tree(h, p["root"] / "data")
    return h.hexdigest()


def meta_path(slug: str, executed: Path | None = None) -> Path:
    return (executed or paths()["executed"]) / f"{slug}.meta.json"


def failed_paths(slug: str, executed: Path | None = None) -> tuple[Path, Path]:
    """(notebook, meta) of the latest failed execution, kept beside the last good one, which a
    failure never replaces: `<slug>.failed.ipynb`, `<slug>.failed.meta.json`."""
    folder = executed or paths()["executed"]
    return folder / f"{slug}.failed.ipynb", folder / f"{slug}.failed.meta.json"


def read_meta(slug: str, executed: Path | None = None) -> dict | None:
    try:
        meta = json.loads(meta_path(slug, executed).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def read_failed_meta(slug: str, executed: Path | None = None) -> dict | None:
    """The meta of the latest failed execution kept beside a good one (None when there is none)."""
    nb, meta_file = failed_paths(slug, executed)
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and nb.is_file() else None


def _has_good_execution(slug: str, executed_dir: Path) -> bool:
    meta = read_meta(slug, executed_dir)
    return meta is not None and meta.get("status") == "ok" and executed_ok(slug, meta, executed_dir)


def notebook_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def executed_ok(slug: str, meta: dict | None, executed: Path | None = None) -> bool:
    """The executed notebook is the one its meta describes: the bytes hash to the meta's
    `notebook_sha256` (metas older than that field: the notebook at least parses as JSON).
    A notebook torn by a crash, or replaced without its meta, is not reused."""
    nb = (executed or paths()["executed"]) / f"{slug}.ipynb"
    if meta is None or not nb.is_file():
        return False
    want = meta.get("notebook_sha256")
    if want is not None:
        return notebook_sha256(nb) == want
    try:
        return isinstance(json.loads(nb.read_bytes()).get("cells"), list)
    except (OSError, ValueError, AttributeError):
        return False


def chapter_status(slug: str, run_params: dict) -> str:
    """'cached', 'stale', 'failed' or 'not executed' (a notebook its meta does not vouch for: 'stale')."""
    meta = read_meta(slug)
    if meta is None or not (paths()["executed"] / f"{slug}.ipynb").is_file():
        return "not executed"
    if not executed_ok(slug, meta):
        return "stale"
    if meta.get("status") == "failed":
        return "failed" if meta.get("hash") == input_hash(slug, run_params) else "stale"
    return "cached" if meta.get("hash") == input_hash(slug, run_params) else "stale"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


ORPHAN_AGE_S = 600   # a `write_json_atomic` temporary lives milliseconds; one this old was orphaned


def clean_orphans(executed: Path | None = None) -> list[Path]:
    """Remove temporaries an interrupted or killed run left in the executed folder: ours carry the
    writer's pid (`.<slug>.<pid>.*.tmp.ipynb`) and go when that process is gone; anonymous ones (from
    `write_json_atomic`) when older than ORPHAN_AGE_S. Returns what was removed."""
    folder = executed or paths()["executed"]
    removed = []
    if not folder.is_dir():
        return removed
    now = time.time()
    for f in [*folder.glob(".*.tmp"), *folder.glob(".*.tmp.ipynb")]:
        parts = f.name.split(".")
        pid = next((int(x) for x in parts[2:3] if x.isdigit()), None)
        try:
            orphan = (not _pid_alive(pid)) if pid is not None else now - f.stat().st_mtime > ORPHAN_AGE_S
            if orphan:
                f.unlink()
                removed.append(f)
        except OSError:
            pass
    return removed


@dataclass
class ChapterFailed(Exception):
    slug: str
    cell: int | None
    ename: str
    evalue: str

    def __str__(self):
        where = f"code cell {self.cell}" if self.cell is not None else "setup"
        return f"chapter {self.slug!r} failed in {where}: {self.ename}: {self.evalue}"


def run_parameters(device: str = "auto", preset: str = "auto", seed: int = 0, params: dict | None = None) -> dict:
    return {"device": device, "preset": preset, "seed": seed, **(params or {})}


def validate(slug: str, run_params: dict) -> None:
    """Every check `setup()` makes, in this process, before a kernel is started."""
    from .context import setup

    rp = dict(run_params)
    setup(slug, device=rp.pop("device"), preset=rp.pop("preset"), seed=rp.pop("seed"), **rp)


def _typed_for_notebook(slug: str, run_params: dict) -> dict:
    """CLI values arrive as strings; give papermill the declared types."""
    info = toc.get_chapter(slug)
    module = toc.load_module(info)
    from .presets import coerce_param

    out = {}
    for k, v in run_params.items():
        if k in module.PARAMETERS and v is not None:
            v = coerce_param(module.PARAMETERS, module.PRESETS, k, v)
        out[k] = v
    return out


def execute(slug: str, *, device: str = "auto", preset: str = "auto", seed: int = 0, params: dict | None = None,
            executed_dir: Path | None = None, results_dir: Path | None = None, save_reference: bool = False,
            cell_timeout: int = DEFAULT_CELL_TIMEOUT_S, progress: bool = True) -> dict:
    """Execute one chapter with papermill. Returns its meta (status, device, seconds, date).

    Raises `UserError` for bad input before any kernel starts, `ChapterFailed` naming the
    cell and error when a cell fails (the executed notebook is kept, error included).
    """
    import jupytext
    import papermill

    info = toc.get_chapter(slug)
    src = paths()["chapters"] / f"{slug}.md"
    if not src.is_file():
        raise UserError(f"chapter {slug!r} is planned but has no source yet ({src.relative_to(repo_root())})")
    run_params = run_parameters(device, preset, seed, params)
    run_params = _typed_for_notebook(slug, run_params)
    validate(slug, run_params)

    executed_dir = Path(executed_dir or paths()["executed"])
    executed_dir.mkdir(parents=True, exist_ok=True)
    clean_orphans(executed_dir)
    results_dir = Path(results_dir or paths()["results"])
    clean_orphans(results_dir)
    out_nb = executed_dir / f"{slug}.ipynb"
    # papermill saves its output notebook cell by cell, so it writes into a temporary beside the good
    # notebook; that is replaced only once the run has ended (ok, or a cell failed: then notebook and
    # meta agree). Ctrl-C or SIGKILL leaves the last good notebook and its meta as they were.
    tag = f".{slug}.{os.getpid()}"
    in_nb = executed_dir / f"{tag}.input.tmp.ipynb"
    tmp_nb = executed_dir / f"{tag}.output.tmp.ipynb"
    nb = jupytext.read(src)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    jupytext.write(nb, in_nb, fmt="ipynb")

    env_backup = {k: os.environ.get(k) for k in ("INFERBOOK_RESULTS", "INFERBOOK_SAVE_REFERENCE", "PYTHONUNBUFFERED")}
    os.environ["INFERBOOK_RESULTS"] = str(results_dir)
    os.environ["INFERBOOK_SAVE_REFERENCE"] = "1" if save_reference else "0"
    started = time.perf_counter()
    cpu_started = _children_cpu_s()
    meta = {"chapter": slug, "title": info.title, "parameters": run_params, "hash": input_hash(slug, run_params),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    guard = _GoodResults(results_dir / f"{slug}.json")
    succeeded = False
    try:
        try:
            papermill.execute_notebook(str(in_nb), str(tmp_nb), parameters=run_params, kernel_name="python3",
                                       execution_timeout=cell_timeout, start_timeout=KERNEL_START_TIMEOUT_S,
                                       progress_bar=progress, cwd=str(repo_root()),
                                       log_output=False, report_mode=False,
                                       kernel_manager_class=_kernel_manager_logging_to(executed_dir / f"{slug}.kernel.log"))
        except papermill.PapermillExecutionError as e:
            cell = _source_code_cell(tmp_nb, e.cell_index)
            meta.update(status="failed", seconds=round(time.perf_counter() - started, 2), cell=cell,
                        error=f"{e.ename}: {_first_line(e.evalue)}", device=_device_of_run(results_dir, slug))
            _commit_failure(tmp_nb, out_nb, meta, slug, executed_dir)
            raise ChapterFailed(slug, cell, e.ename, _first_line(e.evalue)) from None
        except Exception as e:  # kernel died, timeout, bad notebook
            meta.update(status="failed", seconds=round(time.perf_counter() - started, 2), cell=None,
                        error=f"{type(e).__name__}: {_first_line(str(e))}", device=None)
            _commit_failure(tmp_nb, out_nb, meta, slug, executed_dir)
            raise ChapterFailed(slug, None, type(e).__name__, _first_line(str(e))) from None
        meta.update(status="ok", seconds=round(time.perf_counter() - started, 2),
                    device=_device_of_run(results_dir, slug))
        cpu = _children_cpu_s() - cpu_started
        if cpu > 0:  # the kernel's CPU time once it is reaped: what a chapter costs, whatever else ran
            meta["cpu_seconds"] = round(cpu, 2)
        _commit_execution(tmp_nb, out_nb, meta, slug, executed_dir)
        for stale in failed_paths(slug, executed_dir):  # the latest execution is this good one
            stale.unlink(missing_ok=True)
        succeeded = True
    finally:
        guard.release(succeeded)
        for k, v in env_backup.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        in_nb.unlink(missing_ok=True)
        tmp_nb.unlink(missing_ok=True)
    return meta


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's reaped children (the Jupyter kernels, and what they
    waited for): on a shared machine a chapter's cost, where its wall time is inflated by others' work."""
    try:
        import resource

        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime
    except (ImportError, OSError):
        return 0.0


class _GoodResults:
    """Keeps `<slug>.json` (the last complete results) through a notebook execution: the notebook's
    `ctx.measure()` may complete and save its records before a later cell fails, and a failed or
    interrupted execution must not replace the last good results. A hard link holds the good file
    (`.<slug>.<pid>.good.tmp`, cleaned by `clean_orphans` if this process is killed); on failure the
    new records move to `<slug>.partial.json` and the good file is put back."""

    def __init__(self, path: Path):
        self.path = path
        self.backup = path.with_name(f".{path.stem}.{os.getpid()}.good.tmp")
        self.started = time.time()
        self.held = False
        try:
            if path.is_file():
                self.backup.unlink(missing_ok=True)
                os.link(path, self.backup)
                self.held = True
        except OSError:  # a filesystem without hard links: copy instead
            try:
                shutil.copy2(path, self.backup)
                self.held = True
            except OSError:
                self.held = False

    def release(self, succeeded: bool) -> None:
        from .record import partial_path

        try:
            if succeeded:
                return
            written = self.path.is_file() and (not self.held or not os.path.samefile(self.path, self.backup)) \
                and self.path.stat().st_mtime >= self.started - 1
            if written:  # this failed run's records: beside the good file, never in its place
                os.replace(self.path, partial_path(self.path))
            if self.held:
                os.replace(self.backup, self.path)
        except OSError:
            pass
        finally:
            self.backup.unlink(missing_ok=True)


def _kernel_manager_logging_to(log: Path):
    """A Jupyter kernel manager whose kernel writes its stderr (its start-up warnings, and the
    tracebacks of a kernel torn down by Ctrl-C) to `log`, so that our one line is what the person
    running the book sees; a cell's own error still comes back as the cell's output."""
    from jupyter_client.manager import AsyncKernelManager

    class KernelManagerWithLog(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd, **kw):
            with open(log, "ab") as f:
                kw["stderr"] = f
                return await super()._async_launch_kernel(kernel_cmd, **kw)

    return KernelManagerWithLog


def _parses(nb: Path) -> bool:
    try:
        return isinstance(json.loads(nb.read_bytes()).get("cells"), list)
    except (OSError, ValueError, AttributeError):
        return False


def _commit_execution(tmp_nb: Path, out_nb: Path, meta: dict, slug: str, executed_dir: Path,
                      meta_file: Path | None = None) -> None:
    """Replace the executed notebook and its meta as one step: the meta carries the notebook's
    sha256 and is written last, so a crash between the two replaces leaves a meta that does not
    vouch for the notebook beside it (`executed_ok` is False: re-executed, never reused)."""
    with open(tmp_nb, "rb") as f:
        os.fsync(f.fileno())
    meta["notebook_sha256"] = notebook_sha256(tmp_nb)
    os.replace(tmp_nb, out_nb)
    write_json_atomic(meta_file or meta_path(slug, executed_dir), meta)


def _commit_failure(tmp_nb: Path, out_nb: Path, meta: dict, slug: str, executed_dir: Path) -> None:
    """A failed execution never replaces a good one: beside a good notebook it is kept as
    `<slug>.failed.ipynb` + `.failed.meta.json` (the page shows the good run and says the latest
    failed); with no good one it takes the chapter's place, so its page shows the failing cell."""
    has_nb = tmp_nb.is_file() and _parses(tmp_nb)
    if _has_good_execution(slug, executed_dir):
        failed_nb, failed_meta = failed_paths(slug, executed_dir)
        if has_nb:
            _commit_execution(tmp_nb, failed_nb, meta, slug, executed_dir, meta_file=failed_meta)
        return
    if has_nb:  # what ran, with its meta
        _commit_execution(tmp_nb, out_nb, meta, slug, executed_dir)
    elif not out_nb.is_file():  # nothing to keep: the meta says why
        write_json_atomic(meta_path(slug, executed_dir), meta)


def _source_code_cell(executed_nb: Path, cell_index: int) -> int | None:
    """Number of the failing code cell as counted in the chapter source (1-based), skipping
    the parameters cell papermill injects, so a reader finds it in `chapters/<slug>.md`."""
    import nbformat

    try:
        cells = nbformat.read(executed_nb, as_version=4).cells
    except Exception:
        return None
    # papermill adds an error banner at the top of the saved notebook; the index predates it
    cells = [c for c in cells if "papermill-error-cell-tag" not in c.metadata.get("tags", [])]
    n = 0
    for i, c in enumerate(cells[:cell_index + 1]):
        if c.cell_type == "code" and "injected-parameters" not in c.metadata.get("tags", []):
            n += 1
    return n


def _first_line(text: str) -> str:
    text = (text or "").strip()
    return text.splitlines()[0] if text else ""


def _device_of_run(results_dir: Path, slug: str) -> str | None:
    from .device import hardware_label
    from .record import load_records

    try:
        records = load_records(results_dir / f"{slug}.json")
    except Exception:
        return None
    return hardware_label(records[0].hardware) if records else None


# ---------------------------------------------------------------------------
# Staging and building.

def _copy_if_changed(src: Path, dst: Path) -> None:
    """Copy keeping mtimes, and only when bytes differ: Sphinx then rebuilds only what changed."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.is_file() and dst.read_bytes() == src.read_bytes():
        return
    shutil.copy2(src, dst)


def _write_if_changed(dst: Path, text: str) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.is_file() and dst.read_text() == text:
        return
    dst.write_text(text)


def status_page(metas: dict[str, dict | None]) -> str:
    """The status page: every chapter, where and when it was executed, and how long it took."""
    lines = ["# Execution status", "",
             "Every chapter of this build, the device it was executed on, how long execution took and when. "
             "Chapters marked *planned* are not written yet; *failed* chapters show the failing cell on their page.", "",
             "| Part | Chapter | Status | Device | Preset | Time (s) | Executed (UTC) |",
             "|---|---|---|---|---|---|---|"]
    for info in toc.CHAPTERS.values():
        meta = metas.get(info.slug)
        part = toc.PARTS[info.part]
        if info.slug not in metas:
            lines.append(f"| {part} | {info.title} (`{info.slug}`) | planned | | | | |")
            continue
        if meta is None:
            lines.append(f"| {part} | [{info.title}](chapters/{info.slug}) | not executed | | | | |")
            continue
        status = meta.get("status", "?")
        if status == "failed":
            status = f"failed (code cell {meta.get('cell')}: {meta.get('error', '')[:80]})"
        failure = meta.get("latest_failure")
        if status == "ok" and failure:
            status = (f"ok; a later run failed (code cell {failure.get('cell')}: {str(failure.get('error', ''))[:80]}, "
                      f"{str(failure.get('date', '')).replace('T', ' ')}); this page shows the last good run")
        if _partial_results(info.slug):
            status += "; a later measurement was stopped (its records are partial and not shown)"
        lines.append(f"| {part} | [{info.title}](chapters/{info.slug}) | {status} | {meta.get('device') or ''} | "
                     f"{_resolved_preset(info.slug, meta)} | {meta.get('seconds', '')} | "
                     f"{meta.get('date', '').replace('T', ' ')} |")
    lines += ["", f"Built with Python {sys.version.split()[0]}. Chapter records are under `_build/results/`; "
              "committed reference runs are under `data/results/`.", ""]
    return "\n".join(lines)


def _partial_results(slug: str) -> Path | None:
    """`<results>/<slug>.partial.json` when a run stopped after the last complete one was saved."""
    from .record import partial_path

    good = paths()["results"] / f"{slug}.json"
    partial = partial_path(good)
    try:
        if partial.is_file() and (not good.is_file() or partial.stat().st_mtime >= good.stat().st_mtime):
            return partial
    except OSError:
        pass
    return None


def _resolved_preset(slug: str, meta: dict) -> str:
    """The preset the chapter really ran at: "auto" resolves per device, so read it from its records."""
    from .record import load_records

    asked = meta.get("parameters", {}).get("preset", "")
    try:
        records = load_records(paths()["results"] / f"{slug}.json")
    except Exception:
        records = []
    ran = next((r.preset for r in records if r.preset), None)
    return ran or asked


def _placeholder_notebook(slug: str, message: str) -> dict:
    import nbformat

    info = toc.CHAPTERS[slug]
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {info.title}\n\n:::{{warning}}\n{message}\n:::\n")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def stage(metas: dict[str, dict | None]) -> Path:
    """Copy config, pages and executed notebooks into `_build/stage` (sources never sit beside
    their executed copies in the tree Sphinx reads)."""
    import nbformat

    p = paths()
    st = p["stage"]
    st.mkdir(parents=True, exist_ok=True)
    for name in ("_config.yml", "_toc.yml", "intro.md", "glossary.md", "bibliography.md", "references.bib"):
        if (p["root"] / name).is_file():
            _copy_if_changed(p["root"] / name, st / name)
    for folder in ("parts", "_static"):
        for f in sorted((p["root"] / folder).rglob("*")) if (p["root"] / folder).is_dir() else []:
            if f.is_file():
                _copy_if_changed(f, st / folder / f.relative_to(p["root"] / folder))
    _write_if_changed(st / "status.md", status_page(metas))
    _write_if_changed(st / "results.md", reader.results_page(p["results"]))
    for slug, meta in metas.items():
        dst = st / "chapters" / f"{slug}.ipynb"
        executed = p["executed"] / f"{slug}.ipynb"
        # the chapter to take home: its source and the whole executed notebook (plumbing included)
        _copy_if_changed(p["chapters"] / f"{slug}.md", st / reader.DOWNLOADS / f"{slug}.md")
        if executed.is_file():
            _copy_if_changed(executed, st / reader.DOWNLOADS / f"{slug}.ipynb")
        if meta is None or not executed.is_file():
            nb = _placeholder_notebook(slug, f"This chapter was not executed in this build. Run "
                                             f"`inferbook run {slug}` (or `make book`) to execute it.")
            _write_if_changed(dst, nbformat.writes(nb))
        elif meta.get("status") == "failed":
            nb = nbformat.read(executed, as_version=4)
            banner = nbformat.v4.new_markdown_cell(
                f":::{{error}} This chapter failed to execute\nCode cell {meta.get('cell')}: `{meta.get('error', '')}`. "
                "The output below stops at the failing cell.\n:::\n")
            nb.cells.insert(1 if nb.cells and nb.cells[0].cell_type == "markdown" else 0, banner)
            _write_if_changed(dst, nbformat.writes(nb))
        else:
            try:
                records = load_records(p["results"] / f"{slug}.json")
            except Exception:  # a page without its records still builds; it shows no headline then
                records = []
            page = reader.reader_notebook(nbformat.read(executed, as_version=4), slug, records)
            failure = meta.get("latest_failure")
            if failure:
                banner = nbformat.v4.new_markdown_cell(
                    f":::{{warning}} The latest execution of this chapter failed\n"
                    f"Run of {str(failure.get('date', '')).replace('T', ' ')} UTC, code cell {failure.get('cell')}: "
                    f"`{str(failure.get('error', '')).replace('`', chr(39))}`. This page shows the last good run "
                    f"({str(meta.get('date', '')).replace('T', ' ')} UTC).\n:::\n")
                page.cells.insert(1 if page.cells and page.cells[0].cell_type == "markdown" else 0, banner)
            _write_if_changed(dst, nbformat.writes(page))
    # stale pages of chapters no longer in the book
    for f in (st / "chapters").glob("*.ipynb"):
        if f.stem not in metas:
            f.unlink()
    return st


def sphinx_build(stage_dir: Path, html_dir: Path, doctrees: Path) -> None:
    """jupyter-book turns _config.yml into conf.py; Sphinx builds with warnings as errors,
    nitpicky, keep-going, incremental (doctrees kept), execution off."""
    jb = Path(sys.executable).parent / "jupyter-book"
    conf = subprocess.run([str(jb) if jb.exists() else "jupyter-book", "config", "sphinx", str(stage_dir)],
                          capture_output=True, text=True)
    if conf.returncode != 0:
        raise RuntimeError(f"jupyter-book config sphinx failed:\n{conf.stdout}\n{conf.stderr}")
    # sphinx_thebe writes a CDN script URL into every page even when thebe is off, and
    # sphinx_comments can load remote widgets: the book must not name an external host.
    conf_py = stage_dir / "conf.py"
    conf_py.write_text(conf_py.read_text() + "\n# inferbook: an offline book\n"
                       "extensions = [e for e in extensions if e not in ('sphinx_thebe', 'sphinx_comments')]\n")
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "-n", "--keep-going", "-q",
           "-d", str(doctrees), str(stage_dir), str(html_dir)]
    res = subprocess.run(cmd, text=True, capture_output=True)
    if res.returncode != 0:
        raise RuntimeError(f"sphinx build failed (exit {res.returncode}):\n{res.stdout[-4000:]}\n{res.stderr[-8000:]}")


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, as a container's CPU limit sets it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


JOBS_ENV = "INFERBOOK_BOOK_JOBS"   # read by device.hardware_info: the record says it ran beside others


def book_jobs(jobs: int | str, device: str) -> int:
    """How many chapters execute at once. `auto`: 2 on a CPU-only run on 2 or more cores, else 1.

    Why 2 and not one per core: a CPU chapter spends much of its time on one core (kernel start-up and
    imports, Triton's interpreter, Python loops of small ops), so two chapters side by side fill a
    2-core machine that one leaves half idle; more than two would split the cores further and make
    each chapter's timings noisier for little gain. A GPU run stays sequential whatever is asked:
    one GPU, and chapters timed side by side on it would contend."""
    from .device import resolve_device

    if jobs == "auto":
        wanted = 2 if cpu_cores() >= 2 else 1
    else:
        try:
            wanted = int(jobs)
        except (TypeError, ValueError):
            raise UserError(f"--jobs must be a positive integer or 'auto', got {jobs!r}") from None
        if isinstance(jobs, bool) or wanted < 1:
            raise UserError(f"--jobs must be a positive integer or 'auto', got {jobs!r}")
    if wanted > 1 and resolve_device(device).type != "cpu":
        return 1
    return wanted


def _worker_env(jobs: int) -> dict[str, str]:
    """What a chapter executing beside others inherits: the cores split between the jobs (torch reads
    OMP_NUM_THREADS for its intra-op threads; a value the user set is kept), and the job count, which
    its records carry."""
    env = {JOBS_ENV: str(jobs)}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, cpu_cores() // jobs))
    return env


def _execute_in_worker(conn, slug: str, kwargs: dict, env: dict) -> None:
    """Body of a forked worker: one `execute`, its outcome sent back. In its own process group, so a
    Ctrl-C at the terminal reaches it once, forwarded by the parent (a second SIGINT could cut its
    clean-up short). Interrupted or terminated, `execute` has already cleaned up: exit quietly."""
    import signal

    os.setpgid(0, 0)
    os.environ.update(env)
    # the parent stops a worker with SIGINT: it must raise here even where the build was started with SIGINT
    # ignored (a non-interactive shell starts a background command, `make book &`, nohup, some CI steps, so)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # blocked by the parent
        meta = execute(slug, **kwargs)
        conn.send(("ok", meta))
    except ChapterFailed as e:
        conn.send(("failed", (e.slug, e.cell, e.ename, e.evalue)))
    except Exception as e:  # noqa: BLE001 -- re-raised in the parent, as the sequential run raises it
        try:
            conn.send(("raise", e))
        except Exception:  # an exception that does not pickle: its type and message
            conn.send(("raise", RuntimeError(f"{type(e).__name__}: {e}")))
    except BaseException:  # KeyboardInterrupt, SIGTERM's exception: nothing to report
        os._exit(130)
    finally:
        conn.close()


class _Executions:
    """Executes the chapters of a build, `jobs` at a time, in book order; `result(slug)` waits for one.

    jobs == 1: each chapter in this process when asked for, as before. jobs > 1: forked workers (the
    Jupyter kernel each one starts does the work), up to `jobs` running, started in book order as
    others end. Each worker commits its own notebook, meta and results with `execute`'s guarantees, so
    a killed or interrupted build never replaces a good executed notebook or a complete results file."""

    def __init__(self, slugs: list[str], jobs: int, kwargs: dict, log, labels: dict[str, str]):
        self.queue = list(slugs)
        self.jobs = jobs
        self.kwargs = kwargs
        self.log = log
        self.labels = labels
        self.running: dict[str, tuple] = {}
        self.done: dict[str, tuple] = {}
        self.env = _worker_env(jobs) if jobs > 1 else {}

    def _start(self) -> None:
        import multiprocessing as mp
        import signal

        ctx = mp.get_context("fork")  # the worker sees this process's state (a test's stand-in book too)
        while self.queue and len(self.running) < self.jobs:
            slug = self.queue.pop(0)
            threads = self.env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", ""))
            threads = count(int(threads), "torch thread") if threads.isdigit() else "torch threads unknown"
            self.log(f"{self.labels[slug]} executing ({self.kwargs['status'][slug]}, beside up to "
                     f"{count(self.jobs - 1, 'other chapter')}, {threads} each) ...")
            here, there = ctx.Pipe(duplex=False)
            kw = {k: v for k, v in self.kwargs.items() if k != "status"}
            proc = ctx.Process(target=_execute_in_worker, args=(there, slug, kw, self.env), daemon=False)
            # a signal that comes while the worker starts waits until it is inside its `try` (else it
            # would print a traceback of multiprocessing's start-up); here it waits for the line below
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            there.close()
            self.running[slug] = (proc, here)

    def _collect(self, timeout: float | None = None) -> None:
        from multiprocessing.connection import wait

        ready = wait([conn for _, conn in self.running.values()], timeout)
        for slug, (proc, conn) in list(self.running.items()):
            if conn not in ready:
                continue
            try:
                outcome = conn.recv()
            except EOFError:  # the worker died without a word (killed, out of memory)
                proc.join()
                outcome = ("failed", (slug, None, "WorkerDied", f"the process executing it ended with code {proc.exitcode}"))
            proc.join()
            conn.close()
            del self.running[slug]
            self.done[slug] = outcome

    def result(self, slug: str):
        """The chapter's meta; raises what its execution raised (ChapterFailed, UserError, ...)."""
        if self.jobs == 1:
            self.log(f"{self.labels[slug]} executing ({self.kwargs['status'][slug]}) ...")
            kw = {k: v for k, v in self.kwargs.items() if k != "status"}
            return execute(slug, **kw)
        try:
            while slug not in self.done:
                self._start()
                self._collect()
        except BaseException as e:  # Ctrl-C or SIGTERM: the workers are told once, then waited for
            self.stop(signal_name="SIGINT" if isinstance(e, KeyboardInterrupt) else "SIGTERM")
            raise
        kind, value = self.done.pop(slug)  # the next chapter starts once this outcome is handled:
        # a failure without --keep-going starts nothing more
        if kind == "ok":
            return value
        if kind == "failed":
            raise ChapterFailed(*value)
        raise value

    def stop(self, signal_name: str = "SIGINT", grace_s: float = 60.0) -> None:
        """Start nothing more; interrupt the running workers (their `execute` cleans up) and wait."""
        import signal

        self.queue.clear()
        for proc, _ in self.running.values():
            try:
                os.kill(proc.pid, getattr(signal, signal_name))
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        for slug, (proc, conn) in list(self.running.items()):
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():  # SIGKILL loses nothing good either: the temporaries are cleaned later
                proc.kill()
                proc.join()
            conn.close()
        self.running.clear()


def build_book(*, chapters: list[str] | None = None, force: bool = False, keep_going: bool = False,
               device: str = "auto", preset: str = "auto", progress: bool = True, jobs: int | str = 1,
               log=print) -> dict:
    """Execute what changed, stage, and build HTML. Returns {slug: meta}.

    `chapters` limits which chapters may be (re)executed; the others keep their cached
    pages. Raises ChapterFailed on the first failure (in book order) unless `keep_going`.
    `jobs` chapters execute at once on CPU (`book_jobs`); the log stays in book order.
    """
    jobs = book_jobs(jobs, device)
    built = [c.slug for c in built_chapters()]
    if chapters:
        for s in chapters:
            toc.get_chapter(s)
            if s not in built:
                raise UserError(f"chapter {s!r} has no source yet; built chapters are {', '.join(built)}")
    run_params = run_parameters(device, preset)
    missing: dict[str, str] = {}
    for slug in (chapters or built):  # validate all before executing any
        try:
            validate(slug, run_params)
        except MissingRequirement as e:  # an environment without an optional package: with
            if not keep_going:             # --keep-going, the other chapters still build
                raise
            missing[slug] = str(e)
    clean_orphans()
    clean_orphans(paths()["results"])  # temporaries of records written by a killed run
    metas: dict[str, dict | None] = {}
    failures: list[ChapterFailed] = []
    plan = []
    for i, slug in enumerate(built, 1):
        st = chapter_status(slug, run_params)
        selected = chapters is None or slug in chapters
        if slug in missing and (force or st != "cached"):
            plan.append((i, slug, st, "missing"))
        elif selected and (force or st != "cached"):
            plan.append((i, slug, st, "execute"))
        else:
            plan.append((i, slug, st, "reuse"))
    labels = {slug: f"[{i}/{len(built)}] {slug}:" for i, slug, _, _ in plan}
    to_run = [slug for _, slug, _, action in plan if action == "execute"]
    runs = _Executions(to_run, min(jobs, max(1, len(to_run))), log=log, labels=labels,
                       kwargs={"device": device, "preset": preset, "progress": progress and jobs == 1,
                               "status": {slug: st for _, slug, st, _ in plan}})
    try:
        for i, slug, st, action in plan:
            if action == "missing":
                log(f"[{i}/{len(built)}] {slug}: not executed: {missing[slug]}")
                failures.append(ChapterFailed(slug, None, "MissingRequirement", missing[slug]))
                meta = read_meta(slug)
                metas[slug] = meta if executed_ok(slug, meta) else None
                continue
            if action == "execute":
                try:
                    meta = runs.result(slug)
                    cpu = f" (CPU {meta['cpu_seconds']:.1f} s)" if meta.get("cpu_seconds") else ""
                    log(f"[{i}/{len(built)}] {slug}: ok in {meta['seconds']:.1f} s{cpu} on {meta.get('device')}")
                except ChapterFailed as e:
                    log(f"[{i}/{len(built)}] {e}")
                    failures.append(e)
                    if not keep_going:
                        raise
                    meta = read_meta(slug)
                    failed = read_failed_meta(slug)
                    if meta is not None and meta.get("status") == "ok" and failed is not None:
                        meta = {**meta, "latest_failure": failed}  # the good page stays, marked
            else:
                meta = read_meta(slug)
                if executed_ok(slug, meta):
                    log(f"[{i}/{len(built)}] {slug}: {st}, reused")
                else:  # not selected, and its notebook is missing or torn: a placeholder, never a broken page
                    meta = None
                    log(f"[{i}/{len(built)}] {slug}: {st}, no usable executed notebook")
            metas[slug] = meta
    finally:
        if runs.running:  # a failure without --keep-going (or an error) ends the build: stop the others
            runs.stop()
    p = paths()
    stage_dir = stage(metas)
    t0 = time.perf_counter()
    sphinx_build(stage_dir, p["html"], p["doctrees"])
    log(f"book built in {time.perf_counter() - t0:.1f} s: open {p['html'] / 'index.html'}")
    if failures:
        raise ChapterFailed(failures[0].slug, failures[0].cell, failures[0].ename,
                            failures[0].evalue + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""))
    return metas
