# Two commands do all the set-up on a fresh machine:
#   make test      create/reuse .venv, install mok[dev,integrations], run the pytest suite
#   make figures   create/reuse .venv, install mok[notebooks], run every notebook headless into build/ (~40 s on
#                  2 CPU cores); it writes only under build/, never a tracked file
# Both are quick when .venv is already up to date (stamp files track pyproject.toml). Two explicit ones change the tree:
#   make readme-figures  make figures, then copy the README's figures into docs/figures/ (tracked: commit them)
#   make notebook-data   rerun the notebooks' heavy experiments into data/notebooks/*.csv (notebooks/precompute.py,
#                        ~25 min on 2 CPU cores), the rows the notebooks read with source="precomputed"
#
# On a machine with a Hopper GPU (sm_90a) and nvcc, four more; they use that machine's $(GPU_PY) (python3) with the
# packages it has (torch, pytest, ...), mok from this tree, no .venv, no network, and build the extension first:
#   make gpu-test   every test that needs a GPU (marks gpu, sm90, multigpu, bigmem; the others are `make test`'s)
#   make bench      the layer benchmark, L1 and L2 beside the peers it can import (Liger, ...): rows merge into
#                   data/bench/moe.csv (more options of `python -m bench moe` in BENCH_ARGS, e.g. --shapes qwen3-235b)
#   make sanitize   compute-sanitizer memcheck and racecheck on tools/sanitize.py's small workload, synccheck on
#                   its rounding kernels; fails on any error
#   make profile    Nsight Compute on every L2 GEMM (tools/profile_gemms.py), clocks left free: $(GPU_OUT)/ncu_gemms.csv
# Variables: GPU_PY (python3), GPU_OUT (build/gpu), BENCH_ARGS, CUDA_BIN (where compute-sanitizer and ncu are when
# not on PATH), MOK_COMMIT (the commit a benchmark row records; default: git's HEAD).
# On the lent device machine, which stops a command after 10 minutes and returns only $OUT:
#   MOK_COMMIT=<your HEAD> bash tools/gpu_run.sh gpu-test bench ...   (its header says more)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
NOTEBOOKS := $(wildcard notebooks/*.ipynb)
FIGDIR := build/figures
# the figures the README shows: regenerated here, committed under docs/figures/
README_FIGURES := 01_route_placement 02_sqnr 03_timeline 04_mok_figure

.PHONY: test figures readme-figures notebook-data lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build; 2.13.0 is a CPU build on disk here.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	touch $@

# The integrations extra (transformers, torchtitan, triton: ~30 s on a fresh machine) lets tests/test_integrations.py run.
$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[dev,integrations]"
	touch $@

$(VENV)/.notebooks: pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[notebooks]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

test: $(VENV)/.dev $(VENV)/.notebooks
	$(PY) -m ruff check mok bench tests tools notebooks examples
	$(PY) -m pytest -q

figures: $(VENV)/.notebooks
	mkdir -p build/notebooks $(FIGDIR)
	@for nb in $(NOTEBOOKS); do \
	  echo "== $$nb"; \
	  $(PY) -m papermill -k python3 --cwd notebooks "$$nb" "build/notebooks/$$(basename $$nb)" \
	    -p out_dir "../$(FIGDIR)" || exit 1; \
	done
	@echo "figures in $(FIGDIR)/"

readme-figures: figures
	for f in $(README_FIGURES); do cp $(FIGDIR)/$$f.png docs/figures/; done
	@echo "README's figures copied into docs/figures/ (tracked: review and commit them)"

notebook-data: $(VENV)/.notebooks
	PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PY) notebooks/precompute.py

lint: $(VENV)/.dev
	$(PY) -m ruff check mok bench tests tools notebooks examples

clean:
	rm -rf build .cache

# --- GPU targets (see the top) -------------------------------------------------------------------------------------
GPU_PY     ?= python3
GPU_OUT    ?= build/gpu
BENCH_ARGS ?=
CUDA_BIN   ?= /usr/local/cuda/bin
SANITIZER  ?= $(or $(shell command -v compute-sanitizer),$(CUDA_BIN)/compute-sanitizer)
NCU        ?= $(or $(shell command -v ncu),$(CUDA_BIN)/ncu)
# JIT builds stay in .cache/ (ignored); Liger's autotuner would spend minutes per shape, so it runs one config.
GPU_ENV = PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)) PYTHONUNBUFFERED=1 \
  TORCH_EXTENSIONS_DIR=$(CURDIR)/.cache/torch_extensions LIGER_FUSED_MOE_AUTOTUNE=0

.PHONY: gpu-build gpu-test bench sanitize profile

# Built here, outside any tool: built under compute-sanitizer the build crashed (rc 139) and left torch's lock behind.
gpu-build:
	$(GPU_ENV) $(GPU_PY) -c "from mok.ops.core import load_extension; load_extension(); print('mok: extension built')"

gpu-test: gpu-build
	$(GPU_ENV) $(GPU_PY) -m pytest -q -m "gpu or sm90 or multigpu or bigmem"

bench: gpu-build
	$(GPU_ENV) $(GPU_PY) -m bench moe --levels torch fused $(BENCH_ARGS)

sanitize: gpu-build
	$(GPU_ENV) $(SANITIZER) --tool memcheck --error-exitcode 1 $(GPU_PY) tools/sanitize.py
	$(GPU_ENV) $(SANITIZER) --tool racecheck --error-exitcode 1 $(GPU_PY) tools/sanitize.py
	$(GPU_ENV) $(SANITIZER) --tool synccheck --error-exitcode 1 $(GPU_PY) tools/sanitize.py rounding

profile: gpu-build
	mkdir -p $(GPU_OUT)
	$(GPU_ENV) $(NCU) --clock-control none --profile-from-start off -k regex:grouped_gemm --section SpeedOfLight \
	  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --csv --page details \
	  --log-file $(GPU_OUT)/ncu_gemms.csv $(GPU_PY) tools/profile_gemms.py
