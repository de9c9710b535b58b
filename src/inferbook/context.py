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
from .errors import UserError
from .record import RunRecord, load_records, save_records


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
    """Commit and dirty flag of the checkout (INFERBOOK_GIT_COMMIT where there is no .git)."""
    root = repo_root()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        if commit:
            status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout
            return {"commit": commit, "dirty": bool(status.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": os.environ.get("INFERBOOK_GIT_COMMIT", "unknown"), "dirty": None}


@functools.lru_cache(maxsize=1)
def package_versions() -> dict:
    import numpy

    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
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
        return RunRecord(chapter=self.chapter.slug, name=name, variant=variant, git=git_state(),
                         packages=package_versions(), hardware=hardware, device=str(self.device),
                         preset=self.preset, parameters={"seed": self.seed, **self.params},
                         workload=dict(workload or {}), topology=dict(topology or {}), runtime=runtime, **fields)

    def measure(self) -> list[RunRecord]:
        """Run the chapter's `measure(ctx, **params)`, save its records, return them."""
        records = self.module.measure(self, **self.params)
        self.save(records)
        return records

    def results_path(self) -> Path:
        return results_dir() / f"{self.chapter.slug}.json"

    def save(self, records: list[RunRecord]) -> list[Path]:
        """Write records atomically to `_build/results/`, and with INFERBOOK_SAVE_REFERENCE=1
        also to `data/results/<hardware-slug>/<chapter>.json` (committed reference runs)."""
        self.records = list(records)
        paths = [save_records(self.results_path(), self.records)]
        if os.environ.get("INFERBOOK_SAVE_REFERENCE", "0") not in ("", "0"):
            paths.append(save_records(reference_dir() / self.hardware_slug / f"{self.chapter.slug}.json", self.records))
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


def setup(chapter: str, device: str = "auto", preset: str = "auto", seed: int = 0, **params) -> Context:
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
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    return Context(chapter=info, module=module, device=dev, preset=preset, seed=seed, params=resolved,
                   hardware=_device.hardware_info(dev))
