"""Allowed values of every enumerated setting, defined once.

The torch-free config schema (:mod:`saopd.config`) checks values against these tuples at
start-up, and the modules that implement each setting check their arguments against the same
tuples, so the two can never disagree. Plain Python: nothing here imports torch.
"""

from __future__ import annotations

__all__ = [
    "AGGREGATIONS",
    "DATA_SOURCES",
    "EXTREMES",
    "LOGGERS",
    "LONG_PROMPT_MODES",
    "PADDING_SIDES",
    "RANK_OVER",
    "RESIDUAL_MODES",
    "ROLLOUT_SAMPLERS",
    "SCHEDULES",
    "SYNC_TRANSPORTS",
    "TEACHER_CONTEXTS",
    "TRUNCATION_MODES",
    "VISION_RESIDUAL_MODES",
    "VLLM_DTYPES",
]

#: How the HF engine's lean decode loop draws a token (``rollout.sampler``;
#: :mod:`saopd.rollout.sampling`).
ROLLOUT_SAMPLERS = ("multinomial", "inverse_cdf")
#: Loss reduction over kept tokens (``step.aggregation``; Eq. 19 is ``token-mean``).
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "token-sum")
#: SA-OPD's extreme set on the full-context divergence (``filter.extreme``).
EXTREMES = ("abs", "two_sided")
#: Which tokens SA-OPD's ranks are taken over: "valid" (the paper) or "divergent" (saopd's
#: extension: |A_full| above the filter's divergence_floor).
RANK_OVER = ("valid", "divergent")
#: The residual context's task-free prefix (``step.residual``).
RESIDUAL_MODES = ("empty_user", "response_only", "neutral_prompt")
#: What a VLM residual removes from the prompt (``data.residual_remove``).
VISION_RESIDUAL_MODES = ("all", "image", "text")
#: Padding side of a context batch.
PADDING_SIDES = ("right", "left")
#: Learning-rate schedule after warm-up (``optim.schedule``).
SCHEDULES = ("constant", "linear", "cosine")
#: Where the training prompts come from (``data.source``; :mod:`saopd.prompts.sources`).
DATA_SOURCES = ("gsm8k", "prepared", "vision")
#: Experiment tracking (``logger.kind``).
LOGGERS = ("mlflow", "none")
#: vLLM weight dtype (``rollout.dtype``).
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
#: How weights reach a vLLM engine (``rollout.sync_transport``).
SYNC_TRANSPORTS = ("auto", "iterator", "files")
#: Which contexts the teacher scores (``teacher_contexts``; :mod:`saopd.models.vocab`): ``auto``
#: (from the graded pair: the student's for ``same``, the teacher's own template otherwise),
#: ``student`` (exactly the student's ids, as verl does) or ``own`` (always the teacher's own).
TEACHER_CONTEXTS = ("auto", "student", "own")

# ---- the one "prompt too long" vocabulary ------------------------------------------------
#: What happens to a prompt longer than its limit, everywhere a limit applies:
#: ``skip`` (leave it out, counted), ``error`` (stop, naming it), ``truncate`` (cut the start of
#: the prompt, keeping its end and the response; counted). ``data.long_prompts`` takes all
#: three; each stage accepts the subset it can do (below).
LONG_PROMPT_MODES = ("skip", "error", "truncate")
#: Context building (``step.truncation``): a sampled response cannot be skipped any more.
#: (Rollout engines and the prompt loader take all of :data:`LONG_PROMPT_MODES`; the loader
#: keeps ``truncate`` prompts, which the engine and the contexts cut.)
TRUNCATION_MODES = ("truncate", "error")
