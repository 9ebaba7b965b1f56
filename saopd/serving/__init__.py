"""What the rollout engines and the teacher-scoring backends share to drive vLLM: JSON over HTTP
with a server (:mod:`saopd.serving.http`) and the process-level care around a vLLM engine
started in a training process (:mod:`saopd.serving.vllm_runtime`)."""
