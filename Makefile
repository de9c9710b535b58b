# Two commands on a fresh machine (Python 3.10+, pip, make):
#   make book   set-up, execute every chapter on the best device present, render _build/html
#   make test   set-up with dev tools, then the whole test suite (.ci/run calls this)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch: on a machine without an NVIDIA driver we ask for the small CPU build;
# with one, pip's default (CUDA) build; with AMD's (`rocm-smi` on PATH, no nvidia-smi) the ROCm
# build from PyTorch's ROCm index (ROCM_INDEX). Override: `make book TORCH=torch==2.11.0`,
# and TORCH_INDEX=<url> to take it from another package index.
HAS_NVIDIA  := $(shell command -v nvidia-smi 2>/dev/null)
HAS_ROCM    := $(if $(HAS_NVIDIA),,$(shell command -v rocm-smi 2>/dev/null))
ROCM_INDEX  ?= https://download.pytorch.org/whl/rocm7.0
TORCH       ?= $(if $(HAS_NVIDIA)$(HAS_ROCM),torch,torch==2.13.0)
TORCH_INDEX ?= $(if $(HAS_ROCM),$(ROCM_INDEX),)
PIP_FLAGS   ?= -q
# No byte-compiling at install: pip would compile every .py of torch and the book's tools (about 80 CPU-s
# of a cold set-up's 130 on 2 cores, measured). `scripts/compile_imports.py` then writes the .pyc of what
# the book and the tests import (about 18 CPU-s): where PYTHONDONTWRITEBYTECODE is set, Python would
# otherwise compile those modules again in every chapter's kernel (about 10 CPU-s a chapter, measured).
PIP_INSTALL := $(BIN)/python -m pip install --no-compile $(PIP_FLAGS)

# The optional peers' wheels for a GPU run with no network (scripts/gpu_measure.sh installs them offline
# from .wheelhouse/, which the device run carries: 64 MiB at most with the rest of the tree). gemlite
# ships only an sdist on the index, so it is built here into a pure-Python wheel.
WHEELHOUSE     ?= .wheelhouse
PEER_WHEELS    ?= fla-core einops torchao liger-kernel
PEER_SDISTS    ?= gemlite
WHEELHOUSE_MIB ?= 48

.PHONY: book test setup setup-dev wheelhouse clean clean-all

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(if $(HAS_ROCM),@echo "rocm-smi found (no nvidia-smi): installing PyTorch's ROCm build from $(TORCH_INDEX)")
	$(BIN)/python -c "import torch" 2>/dev/null || \
	  $(PIP_INSTALL) "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	touch $@

$(VENV)/.book: pyproject.toml $(VENV)/.torch
	$(PIP_INSTALL) -e ".[book]"
	$(BIN)/python scripts/compile_imports.py
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.book
	$(PIP_INSTALL) -e ".[book,dev]"
	$(BIN)/python scripts/compile_imports.py
	touch $@

setup: $(VENV)/.book
setup-dev: $(VENV)/.dev

book: $(VENV)/.book
	$(BIN)/inferbook book $(BOOK_ARGS)

test: $(VENV)/.dev
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(TEST_ARGS)

wheelhouse: | $(BIN)/python
	mkdir -p $(WHEELHOUSE)
	$(BIN)/python -m pip download $(PIP_FLAGS) --no-deps --only-binary=:all: -d $(WHEELHOUSE) $(PEER_WHEELS)
	$(BIN)/python -m pip wheel $(PIP_FLAGS) --no-deps -w $(WHEELHOUSE) $(PEER_SDISTS)
	@size=$$(du -sm $(WHEELHOUSE) | cut -f1); ls -1 $(WHEELHOUSE); \
	  if [ $$size -gt $(WHEELHOUSE_MIB) ]; then echo "wheelhouse is $$size MiB, over $(WHEELHOUSE_MIB) MiB: the device run carries 64 MiB in all"; exit 1; fi; \
	  echo "wheelhouse: $$size MiB in $(WHEELHOUSE)"

clean:
	rm -rf _build

clean-all: clean
	rm -rf $(VENV)
