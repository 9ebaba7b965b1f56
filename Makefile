# saopd: the README's commands, spelled out. Everything installs into .venv at the repo root.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: setup test lint bench-filter bench-scoring

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	# torch first, pinned: an unpinned torch would pull the CUDA build (GBs) on a CPU machine
	$(VPY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(VPY) -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

test: setup
	$(VPY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check saopd tests experiments

bench-filter: setup
	$(VPY) experiments/benchmarks/filter_speed.py

bench-scoring: setup
	$(VPY) experiments/benchmarks/chunked_scoring.py
