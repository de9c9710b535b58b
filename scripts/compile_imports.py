"""Byte-compile the modules the book imports, once, at set-up: `python scripts/compile_imports.py`.

Why: set-up installs with `pip install --no-compile` (byte-compiling every file of torch and the book's
tools cost about 80 CPU-s of a cold set-up on 2 cores), and Python then writes a module's .pyc on its first
import -- unless PYTHONDONTWRITEBYTECODE is set, as it is on this project's build machines: there every
chapter's kernel compiled torch, Inductor, the Jupyter stack and the book from source again (about 4 CPU-s
for one chapter's first cell alone, measured; more once Inductor's code generators load). This imports what
the chapters, their kernels, the Sphinx build and the tests import, and writes the .pyc of each module it loaded that
has no .pyc yet, as pip would have for those files (import writes them itself once this interpreter may
write bytecode). Prints one line.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import warnings
from pathlib import Path

# Third-party modules the chapters, their Jupyter kernels, the book's build and the tests load; several
# only lazily (Inductor's code generators on a first torch.compile, torch.distributed in the multi-rank
# chapters). One that is absent (a GPU-only module, the dev tools before `setup-dev`) is skipped.
MODULES = [
    "torch", "torch.nn.functional", "torch.distributed", "torch.distributed.distributed_c10d",
    "torch.multiprocessing", "torch.profiler", "torch.utils.benchmark", "torch._dynamo",
    "torch._inductor.compile_fx", "torch._inductor.graph", "torch._inductor.scheduler",
    "torch._inductor.lowering", "torch._inductor.decomposition", "torch._inductor.codecache",
    "torch._inductor.async_compile", "torch._inductor.codegen.cpp", "torch._inductor.codegen.cpp_wrapper_cpu",
    "torch._inductor.codegen.simd", "torch._inductor.codegen.triton", "torch._inductor.fx_passes.post_grad",
    "torch._inductor.fx_passes.joint_graph", "torch._inductor.kernel.mm", "torch._inductor.select_algorithm",
    "torch._functorch.aot_autograd", "torch._subclasses.fake_tensor", "torch.export",
    "triton", "triton.language", "triton.compiler", "triton.runtime.interpreter", "triton.tools.compile",
    "numpy", "pandas", "altair", "vl_convert", "av", "safetensors.torch", "nbformat", "jupytext", "papermill",
    "nbclient", "jupyter_client", "ipykernel.kernelapp", "ipykernel.ipkernel", "IPython", "IPython.display",
    "sphinx.application", "sphinx.cmd.build", "myst_nb", "myst_parser", "jupyter_book", "sphinx_book_theme",
    "pydata_sphinx_theme", "sphinxcontrib.bibtex", "sphinx_mathjax_offline", "docutils.core", "yaml",
    "pytest", "xdist", "pytest_timeout", "playwright.sync_api", "fontTools.ttLib",  # `make test` (dev)
]


def import_all() -> None:
    warnings.simplefilter("ignore")
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- an optional or GPU-only module: nothing to compile for it
            pass
    import inferbook
    for info in pkgutil.walk_packages(inferbook.__path__, "inferbook."):
        if info.name.endswith(".__main__"):  # runs a command line when imported
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001
            pass


def main() -> int:
    started = time.process_time()
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "src"))
    # import writes each module's .pyc as it compiles it (one compile a module), whatever
    # PYTHONDONTWRITEBYTECODE said when this interpreter started
    sys.dont_write_bytecode = False
    before = len(sys.modules)
    import_all()
    print(f"compile_imports: {len(sys.modules) - before} modules imported, their .pyc written where missing, in "
          f"{time.process_time() - started:.1f} CPU-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
