#!/usr/bin/env bash
# Issue 16's step-time comparison: the default experiment (smollm2_gsm8k), 4 steps, one run each,
# with rollouts from HF generate (rollout=hf), a vLLM engine in the trainer (rollout=vllm) and a
# saopd-serve server on 127.0.0.1 (rollout=vllm_server). Each run prints one `BENCH {...}` line
# (experiments/benchmarks/teacher_scoring_step.py). Figures: docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1
PY=.venv-vllm/bin/python
STEP=experiments/benchmarks/teacher_scoring_step.py
COMMON="experiment=smollm2_gsm8k steps=4 trainer.checkpoint_every_n_steps=4 trainer.view_every_n_steps=0"
VLLM="rollout.kv_cache_gb=0.5 rollout.max_model_len=1024 rollout.dtype=float32"
$PY $STEP hf $COMMON 2>/dev/null | grep BENCH
$PY $STEP vllm $COMMON rollout=vllm $VLLM 2>/dev/null | grep BENCH
# the pruned student as the servers' starting copy (the first sync replaces its weights)
DIR=$(mktemp -d)
$PY - "$DIR" <<'PY'
import sys
from saopd.config.model import ModelConfig
from saopd.models.factory import build_model
model, tok = build_model(ModelConfig(name_or_path="saopd:smollm2-135m-instruct", prune_every=3))
model.save_pretrained(sys.argv[1]); tok.save_pretrained(sys.argv[1])
PY
$PY -m saopd.serve --model "$DIR" --port 8124 --dtype float32 --max-model-len 1024 \
  --kv-cache-memory-bytes $((512 << 20)) >"$DIR/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 200); do curl -sf http://127.0.0.1:8124/health >/dev/null && break; sleep 3; done
$PY $STEP vllm_server $COMMON rollout=vllm_server "rollout.urls=[http://127.0.0.1:8124]" \
  2>/dev/null | grep BENCH
