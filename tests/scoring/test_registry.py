"""The teacher-scoring backends are built from a run's config through their registry."""

from __future__ import annotations

import pytest

from saopd.config import to_train_config
from saopd.models.factory import build_models
from saopd.scoring.registry import SCORERS, build_scorer


def test_hf_scores_in_the_module_and_two_in_process_vllm_cores_are_refused(make_cfg) -> None:
    conf = to_train_config(make_cfg("experiment=tiny", mlflow=False))
    pair = build_models(conf)
    assert pair.teacher is not None and build_scorer(conf, pair) is None
    both = to_train_config(make_cfg("experiment=tiny", "teacher_scoring=vllm",
                                    "teacher_scoring.in_process=true", "rollout=vllm",
                                    "rollout.in_process=true", mlflow=False))
    with pytest.raises(ValueError, match="two vLLM engine cores cannot share"):
        build_scorer(both, pair)  # refused before vLLM is imported or a folder written
    with pytest.raises(ValueError, match="unknown teacher_scoring backend 'tgi'; allowed: hf, "
                                         "vllm, vllm_server"):
        SCORERS.get("tgi")
