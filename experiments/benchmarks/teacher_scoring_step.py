"""Benchmark: step time and trainer peak memory of one training run, for the teacher-scoring
backends (issue 17). One run per call, its overrides on the command line; prints one JSON line
``BENCH {...}``: the step times (``train/step_time``), their mean after the first step, the mean
``train/teacher_wait`` (vLLM backends: how long the step still waited for the teacher after the
student's passes) and the process's peak RSS.

    experiments/benchmarks/teacher_scoring.sh   # hf / vllm / vllm_server x SA-OPD / OPD

Needs the vLLM venv for the vLLM backends (``make setup-vllm``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    import lightning as L
    from hydra import compose, initialize_config_dir

    from saopd.config import register_schema
    from saopd.paths import conf_dir, register_resolvers
    from saopd.train import train

    register_schema()
    register_resolvers()
    label, overrides = sys.argv[1], sys.argv[2:]
    out = tempfile.mkdtemp(prefix=f"saopd-bench-{label}-")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={out}", "logger=none", *overrides])

    class Record(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.waits: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            m = trainer.callback_metrics
            self.times.append(float(m["train/step_time"]))
            if "train/teacher_wait" in m:
                self.waits.append(float(m["train/teacher_wait"]))

    rec = Record()
    started = time.perf_counter()
    train(cfg, extra_callbacks=[rec])
    steady, waits = rec.times[1:], rec.waits[1:]
    print("BENCH", json.dumps({
        "label": label, "steps": len(rec.times), "step_times": [round(t, 2) for t in rec.times],
        "mean_step_s_after_first": round(sum(steady) / len(steady), 3) if steady else None,
        "mean_teacher_wait_s": round(sum(waits) / len(waits), 3) if waits else None,
        "trainer_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "wall_s": round(time.perf_counter() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
