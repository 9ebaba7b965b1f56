#!/usr/bin/env bash
# Issue 17's benchmark: the default experiment (smollm2_gsm8k), 4 steps, one run each, with the
# teacher scored in the trainer (hf), by an in-process vLLM engine (vllm) and by a saopd-serve
# server on 127.0.0.1 (vllm_server), for SA-OPD and vanilla OPD. Figures: docs/teacher_scoring.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1
PY=.venv-vllm/bin/python
STEP=experiments/benchmarks/teacher_scoring_step.py
COMMON="experiment=smollm2_gsm8k steps=4 trainer.checkpoint_every_n_steps=4 trainer.view_every_n_steps=0"
VLLM="teacher_scoring=vllm teacher_scoring.kv_cache_gb=0.5 teacher_scoring.max_model_len=1024"
for f in sa_opd none; do
  $PY $STEP "hf_$f" $COMMON filter=$f 2>/dev/null | grep BENCH
  $PY $STEP "vllm_$f" $COMMON filter=$f $VLLM 2>/dev/null | grep BENCH
done
# the teacher (SmolLM2-135M-Instruct, float32) served on loopback from a folder without the
# converter's extra safetensors file (vLLM would read every *.safetensors in the folder)
VIEW=$($PY -c "from saopd.models.factory import vllm_model_folder; \
from saopd.models.smollm2 import smollm2_135m_instruct; \
print(vllm_model_folder(str(smollm2_135m_instruct()))[0])")
LOG=$(mktemp)
$PY -m saopd.serve --model "$VIEW" --port 8123 --dtype float32 --max-model-len 1024 \
  --kv-cache-memory-bytes $((512 << 20)) >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 200); do curl -sf http://127.0.0.1:8123/health >/dev/null && break; sleep 3; done
for f in sa_opd none; do
  $PY $STEP "server_$f" $COMMON filter=$f teacher_scoring=vllm_server \
    "teacher_scoring.urls=[http://127.0.0.1:8123]" 2>/dev/null | grep BENCH
done
