"""One rank of a 2-rank gloo job whose ranks share a tensor-parallel vLLM engine, launched by
test_vllm_tensor_parallel_startup.py (not a test).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... \
        python dist_tp_startup_worker.py OUT MODE STARTUP_TIMEOUT

MODE ``ok``: both ranks start the shard and sample. ``absent``: rank 1 never starts its shard
(it sleeps, then exits). ``fails``: rank 1's vLLM start raises after the ranks met (an invalid
vLLM argument), so rank 0 waits inside vLLM's own collectives. Every rank writes
OUT/rank<R>.json with what happened (``error``: the message of an exception it raised).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch.distributed as dist

import saopd.vllm.engine as vllm_engine
import saopd.vllm.tp as vllm_tp
from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.rollout import SamplingParams


def main() -> None:
    out, mode, timeout = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    rank = int(os.environ["RANK"])
    vllm_tp.HARD_DEADLINE_GRACE = 5.0
    dist.init_process_group("gloo")
    tok = tiny_tokenizer()
    model = tiny_qwen3(tok, seed=1)
    # rank 1: a max_model_len over the model's, refused by vLLM before any collective
    extra = ({"llm_kwargs": {"max_model_len": 10**9}} if mode == "fails" and rank == 1 else {})
    engine = vllm_engine.VLLMEngine.from_model(
        model, tok, colocated_tensor_parallel=True, tensor_parallel_size=2, dtype="float32",
        kv_cache_gb=0.25, enforce_eager=True, max_model_len=256, startup_timeout=timeout,
        greedy=True, **extra)
    record: dict = {"rank": rank}
    started = time.perf_counter()
    try:
        if mode == "absent" and rank == 1:
            time.sleep(timeout + 10)  # absent until well after rank 0's deadline
            record["slept"] = True
        else:
            engine.load_weights(model.named_parameters())
            chats = [[{"role": "user", "content": f"rank {rank} says hi"}]]
            batch = engine.generate(chats, SamplingParams(max_new_tokens=4, seed=rank))
            record["responses"] = [r.response_ids for r in batch.rollouts]
    except Exception as err:  # the message is what the test checks
        record["error"] = f"{type(err).__name__}: {err}"
    record["seconds"] = time.perf_counter() - started
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    engine.close()
    sys.exit(1 if "error" in record else 0)


if __name__ == "__main__":
    main()
