"""`inferbook.setup(...)`: resolve device, preset and parameters, then start the records.

Every chapter calls it right after its parameters cell; `inferbook measure` calls it too.
All validation happens here, before any work: a bad device, preset, chapter or parameter
raises `UserError` with one line naming the value and what is allowed.
"""
from __future__ import annotations

import functools
import os
import platform
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from . import toc, device as _device, presets as _presets
from .errors import MissingRequirement, UserError
from .record import RunRecord, load_records, save_complete, save_partial, partial_path


@functools.lru_cache(maxsize=1)
def repo_root() -> Path:
    """The checkout holding `pyproject.toml` (editable install), else the working directory."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "pyproject.toml").is_file() and (parent / "src" / "inferbook").is_dir():
            return parent
    return Path.cwd()


def build_dir() -> Path:
    """Root of everything generated: $INFERBOOK_BUILD_DIR or `_build` in the checkout."""
    env = os.environ.get("INFERBOOK_BUILD_DIR")
    return Path(env) if env else repo_root() / "_build"


def check_output_dir(path: Path, what: str) -> Path:
    """`path` is a folder this process can write (or can make), else one UserError line: a file in
    its place (INFERBOOK_BUILD_DIR pointing at a file), a read-only or unwritable place. Checked by
    writing a probe file, since permission bits say nothing on a read-only mount or to root."""
    import tempfile

    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not existing.is_dir():  # the folder itself, or the first ancestor that exists, is a file
        raise UserError(f"{what} {str(path)!r} cannot be a folder: {str(existing)!r} is a file")
    try:  # nothing is made: the probe goes into the deepest folder that exists, and is removed
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{what} {str(path)!r} is not writable: {e.strerror or e}") from None
    return path


def check_output_dirs(*, reference: bool = False) -> None:
    """Before any work: the build folder and the results folder (and with `reference` the committed
    reference folder) can be written."""
    check_output_dir(build_dir(), "build folder (INFERBOOK_BUILD_DIR or _build)")
    check_output_dir(results_dir(), "results folder")
    if reference:
        check_output_dir(reference_dir(), "reference folder")


def results_dir() -> Path:
    """Where local runs write records: $INFERBOOK_RESULTS or `<build>/results`."""
    env = os.environ.get("INFERBOOK_RESULTS")
    return Path(env) if env else build_dir() / "results"


def reference_dir() -> Path:
    """Committed reference runs: `data/results` ($INFERBOOK_REFERENCE_DIR overrides, for tests)."""
    env = os.environ.get("INFERBOOK_REFERENCE_DIR")
    return Path(env) if env else repo_root() / "data" / "results"


@functools.lru_cache(maxsize=1)
def git_state() -> dict:
    """Commit and dirty flag of the checkout, and a hash of the code that ran.

    Where there is no .git (a copy of the working tree on a lent GPU machine), the commit comes
    from $INFERBOOK_GIT_COMMIT (and $INFERBOOK_GIT_DIRTY), which `scripts/gpu_measure.sh` documents,
    or from a `.git-commit` file; `tree_sha256` (src/inferbook, chapters, scripts) identifies the
    code either way, dirty or not."""
    root = repo_root()
    tree = tree_sha256()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        if commit:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout
            return {"commit": commit, "dirty": bool(status.strip()), "from": "git", "tree_sha256": tree}
    except (OSError, subprocess.SubprocessError):
        pass
    env = os.environ.get("INFERBOOK_GIT_COMMIT", "").strip()
    dirty = {"1": True, "true": True, "0": False, "false": False}.get(
        os.environ.get("INFERBOOK_GIT_DIRTY", "").strip().lower())
    if env and env != "unknown":
        return {"commit": env, "dirty": dirty, "from": "INFERBOOK_GIT_COMMIT", "tree_sha256": tree}
    try:
        text = (root / ".git-commit").read_text().split()
        if text:
            return {"commit": text[0], "dirty": dirty, "from": ".git-commit", "tree_sha256": tree}
    except OSError:
        pass
    return {"commit": "unknown", "dirty": None, "from": "none", "tree_sha256": tree}


def tree_sha256() -> str:
    """sha256 over the paths and bytes of src/inferbook, chapters and scripts (bytecode skipped)."""
    import hashlib

    h = hashlib.sha256()
    root = repo_root()
    for folder in ("src/inferbook", "chapters", "scripts"):
        base = root / folder
        if not base.is_dir():
            continue
        for f in sorted(base.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
                h.update(str(f.relative_to(root)).encode() + b"\0")
                h.update(f.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def package_versions() -> dict:
    import numpy

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "torch_hip": getattr(torch.version, "hip", None),
           "triton": _device.triton_version(), "numpy": numpy.__version__}
    for name in ("safetensors", "av"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    from . import __version__
    out["inferbook"] = __version__
    return out


@dataclass
class Context:
    """What a chapter run knows about itself. Shapes and dtypes live in `params`."""

    chapter: toc.ChapterInfo
    module: ModuleType
    device: torch.device
    preset: str
    seed: int
    params: dict[str, Any]
    hardware: dict
    records: list[RunRecord] = field(default_factory=list)
    budget_s: float | None = None          # wall seconds this run's measurements may take (None: no budget)
    compile_budget_s: float = 0.0          # the part of budget_s set aside for compilation
    _live: list[RunRecord] = field(default_factory=list, repr=False)
    _last_autosave: float = field(default=0.0, repr=False)
    _autosave_failed: bool = field(default=False, repr=False)
    _measuring: bool = field(default=False, repr=False)

    @property
    def interpreted(self) -> bool:
        """True when Triton kernels run in the interpreter (correctness only, never timed)."""
        return self.device.type != "cuda" and _device.triton_interpreted()

    @property
    def hardware_label(self) -> str:
        return _device.hardware_label(self.hardware)

    @property
    def hardware_slug(self) -> str:
        return _device.hardware_slug(self.hardware)

    def generator(self, offset: int = 0) -> torch.Generator:
        """A generator on this device seeded from the run's seed (+offset for independent streams)."""
        g = torch.Generator(device=self.device)
        g.manual_seed(self.seed + offset)
        return g

    def new_record(self, name: str, *, variant: str = "", workload: dict | None = None,
                   topology: dict | None = None, **fields) -> RunRecord:
        """A record pre-filled with git, packages, hardware, chapter and parameters."""
        # The machine's load when the record was made: on a shared CPU, times swing with it.
        hardware = {**self.hardware, "load_average_1m": _load_average()}
        runtime = {**runtime_settings(self.device), **dict(fields.pop("runtime", None) or {})}
        rec = RunRecord(chapter=self.chapter.slug, name=name, variant=variant, git=git_state(),
                        packages=package_versions(), hardware=hardware, device=str(self.device),
                        preset=self.preset, parameters={"seed": self.seed, **self.params},
                        workload=dict(workload or {}), topology=dict(topology or {}), runtime=runtime, **fields)
        rec._on_change = self._record_changed
        self._live.append(rec)
        self._autosave(force=True)
        return rec

    def measure(self) -> list[RunRecord]:
        """Run the chapter's `measure(ctx, **params)` within `budget_s`, save its records, return them.

        Records made with `new_record` are saved to `<chapter>.partial.json` (atomically, marked
        incomplete) as they fill in, at most every AUTOSAVE_INTERVAL_S, so a run killed by a timeout
        keeps what it had measured; `<chapter>.json`, the last complete run, is replaced only when
        `measure` returns."""
        from .measure import time_budget

        self._live, self._measuring = [], True
        try:
            with time_budget(self.budget_s):
                records = self.module.measure(self, **self.params)
        except BaseException:
            self._autosave(force=True)
            raise
        finally:
            self._measuring = False
        self.save(records)
        return records

    def budget_left(self) -> float | None:
        """Seconds left of this run's budget while `measure` runs (None without one)."""
        from .measure import budget_left

        return budget_left()

    def _record_changed(self, rec: RunRecord) -> None:
        self._autosave()

    def _autosave(self, force: bool = False) -> None:
        import time

        now = time.monotonic()
        # only while `measure` runs: a record made afterwards (a page's own) must not replace the saved run
        if not self._measuring or not self._live or (not force and now - self._last_autosave < AUTOSAVE_INTERVAL_S):
            return
        self._last_autosave = now
        try:
            self._write(self._live, complete=False)
        except Exception as e:  # never let saving a partial result break the measurement itself
            if not self._autosave_failed:
                import sys

                print(f"inferbook: warning: could not save partial records: {type(e).__name__}: {e}", file=sys.stderr)
            self._autosave_failed = True

    def results_path(self) -> Path:
        """`<results>/<chapter>.json`: the last complete run (replaced only when a run completes)."""
        return results_dir() / f"{self.chapter.slug}.json"

    def partial_results_path(self) -> Path:
        """`<results>/<chapter>.partial.json`: the records of the run in progress, or of one stopped."""
        return partial_path(self.results_path())

    def save(self, records: list[RunRecord]) -> list[Path]:
        """The run completed: replace `_build/results/<chapter>.json` atomically (and remove the partial
        file), and with INFERBOOK_SAVE_REFERENCE=1 also `data/results/<hardware-slug>/<chapter>.json`."""
        self.records = list(records)
        return self._write(self.records, complete=True)

    def _write(self, records: list[RunRecord], *, complete: bool) -> list[Path]:
        """complete: `record.save_complete` (replaces the good file); else `record.save_partial`
        (`<chapter>.partial.json` beside it; the good file is never touched)."""
        save = save_complete if complete else save_partial
        paths = [save(self.results_path(), records)]
        if os.environ.get("INFERBOOK_SAVE_REFERENCE", "0") not in ("", "0"):
            paths.append(save(reference_dir() / self.hardware_slug / f"{self.chapter.slug}.json", records))
        return paths

    def references(self) -> dict[str, list[RunRecord]]:
        """Committed reference runs of this chapter, by hardware slug."""
        return reference_records(self.chapter.slug)


def runtime_settings(device: torch.device) -> dict:
    """Process-wide settings that change results, as they are when a record is made: PyTorch's
    determinism switches and, on CUDA, cuDNN autotuning and TF32. A chapter adds its own
    (`cuda_graphs`, `prefix_caching`, `attention_backend`) with `new_record(..., runtime={...})`;
    `compare` refuses a pair that differs in any of them."""
    out = {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    if device.type == "cuda":
        out.update(cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
                   cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
                   tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32))
    return out


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def reference_records(chapter: str) -> dict[str, list[RunRecord]]:
    out = {}
    for path in sorted(reference_dir().glob(f"*/{chapter}.json")):
        out[path.parent.name] = load_records(path)
    return out


SEED_MAX = 2**32 - 1
AUTOSAVE_INTERVAL_S = 1.0


def check_requirements(slug: str, module: ModuleType) -> None:
    """A chapter's optional packages (`REQUIRES = {"av": "why"}` in its measure module) are
    importable, else one UserError line naming them, before any work."""
    import importlib.util

    for name, why in dict(getattr(module, "REQUIRES", {}) or {}).items():
        if importlib.util.find_spec(name) is None:
            pip = {"av": "av"}.get(name, name)
            raise MissingRequirement(f"chapter {slug!r} needs the Python package {name!r} ({why}), which is not installed "
                            f"here; install it (pip install {pip}) or run another chapter")


def resolve_budget(slug: str, preset: str, budget_s=None) -> tuple[float | None, float]:
    """(budget_s, compile_budget_s): `budget_s` given (seconds or 'none'), else $INFERBOOK_BUDGET_S,
    else the preset's table (`presets.BUDGETS_S`: the gpu preset), else no budget."""
    given = budget_s if budget_s is not None else os.environ.get("INFERBOOK_BUDGET_S")
    table = _presets.budget_for(slug, preset)
    if given is not None:
        value = _presets.parse_budget(given)
        return value, (min(table[1], value) if table and value else 0.0)
    if table is None:
        return None, 0.0
    return float(sum(table)), float(table[1])


def check_chapter_params(slug: str, module: ModuleType, params: dict) -> None:
    """The chapter's own relations between parameters (`check_params(params)` in its measure module),
    before any work. A ValueError there is a bad user value too: it becomes a one-line UserError."""
    check = getattr(module, "check_params", None)
    if check is None:
        return
    try:
        check(dict(params))
    except UserError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"chapter {slug!r}: {e}") from None


# What a reader means by "off": Triton reads every value outside `device.TRITON_TRUE_VALUES` as off, so ' 1', '2'
# or 'enable' are off too; those are refused rather than read against what they look like.
TRITON_FALSE_LOOKING = ("", "0", "false", "off", "no", "n")


def check_environment(slug: str, module: ModuleType, dev: torch.device) -> None:
    """TRITON_INTERPRET, as Triton reads it, before any work: a value that reads as off but does not look it is one
    UserError line; so is the interpreter turned off on a machine without a GPU for a chapter with Triton
    kernels (they run only in the interpreter there, and would be left out of the run without a word)."""
    value = os.environ.get("TRITON_INTERPRET")
    if value is None or _device.env_flag_as_triton_reads_it(value):
        return
    if value.strip().lower() not in TRITON_FALSE_LOOKING:
        raise UserError(f"TRITON_INTERPRET={value!r} is read by Triton as off: it takes "
                        f"{', '.join(_device.TRITON_TRUE_VALUES)} as on (lower-cased, not stripped) and anything "
                        "else as off; set it to 1 (interpreter on) or 0 (off)")
    if dev.type == "cpu" and hasattr(module, "gpu_launches") and not torch.cuda.is_available():
        raise UserError(f"TRITON_INTERPRET={value!r} turns Triton's interpreter off, but on this machine (no GPU) the "
                        f"Triton kernels of chapter {slug!r} run only in the interpreter and would be left out; "
                        "unset TRITON_INTERPRET or set it to 1")


def setup(chapter: str, device: str = "auto", preset: str = "auto", seed: int = 0, *, budget_s=None,
          **params) -> Context:
    """Resolve device, preset and parameters for `chapter` and seed the RNGs.

    Raises `UserError` (one line: the bad value and what is allowed) before any work.
    """
    info = toc.get_chapter(chapter)
    dev = _device.resolve_device(device)
    preset = _presets.resolve_preset(preset, dev.type)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UserError(f"seed must be an int, got {seed!r}")
    if not 0 <= seed <= SEED_MAX:  # torch, numpy and every per-stream offset must accept it
        raise UserError(f"seed must be in [0, {SEED_MAX}], got {seed}")
    module = toc.load_module(info)
    resolved = _presets.resolve_params(info.slug, module.PARAMETERS, module.PRESETS, preset, params)
    check_chapter_params(info.slug, module, resolved)
    check_environment(info.slug, module, dev)
    check_requirements(info.slug, module)
    budget, compile_budget = resolve_budget(info.slug, preset, budget_s)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    return Context(chapter=info, module=module, device=dev, preset=preset, seed=seed, params=resolved,
                   hardware=_device.hardware_info(dev), budget_s=budget, compile_budget_s=compile_budget)
