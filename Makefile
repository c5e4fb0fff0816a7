# Two commands do all the set-up on a fresh machine:
#   make test      create/reuse .venv, install mok[dev], run the pytest suite
#   make figures   create/reuse .venv, install mok[notebooks], run every notebook headless into build/
# Both are quick when .venv is already up to date (stamp files track pyproject.toml).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
NOTEBOOKS := $(wildcard notebooks/*.ipynb)
FIGDIR := build/figures
# the figures the README shows: regenerated here, committed under docs/figures/
README_FIGURES := 01_route_placement 02_sqnr 03_timeline 04_tflops

.PHONY: test figures lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build; 2.13.0 is a CPU build on disk here.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[dev]"
	touch $@

$(VENV)/.notebooks: pyproject.toml $(VENV)/.torch
	$(PIP) install -e ".[notebooks]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

test: $(VENV)/.dev $(VENV)/.notebooks
	$(PY) -m ruff check mok tests tools notebooks
	$(PY) -m pytest -q

figures: $(VENV)/.notebooks
	mkdir -p build/notebooks $(FIGDIR)
	@for nb in $(NOTEBOOKS); do \
	  echo "== $$nb"; \
	  $(PY) -m papermill -k python3 --cwd notebooks "$$nb" "build/notebooks/$$(basename $$nb)" \
	    -p out_dir "../$(FIGDIR)" || exit 1; \
	done
	for f in $(README_FIGURES); do cp $(FIGDIR)/$$f.png docs/figures/; done
	@echo "figures in $(FIGDIR)/ (README's copies in docs/figures/)"

lint: $(VENV)/.dev
	$(PY) -m ruff check mok tests tools notebooks

clean:
	rm -rf build .cache
