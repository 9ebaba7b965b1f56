"""A key the schema does not have is refused, even when added with Hydra's ``+`` (issue 15,
point 9): it used to be kept in the config and dropped when the dataclasses were built."""

from __future__ import annotations

from pathlib import Path

import pytest

from saopd.config import to_train_config
from tests.conftest import compose_train


@pytest.mark.parametrize(("override", "message"), [
    ("+rollout.temprature=0.01", r"rollout\.temprature \(did you mean rollout\.temperature\?\)"),
    ("+optim.lrr=3", r"optim\.lrr \(did you mean optim\.lr\?\)"),
    ("+student.tiny_layer=3", r"student\.tiny_layer \(did you mean student\.tiny_layers\?\)"),
    ("+unknown_top_level=1", r"unknown_top_level \(the config has no such field\)"),
])
def test_a_plus_key_outside_the_schema_is_refused(tmp_path: Path, override: str,
                                                  message: str) -> None:
    cfg = compose_train(tmp_path, "experiment=tiny", override, mlflow=False)
    with pytest.raises(ValueError, match=message):
        to_train_config(cfg)


def test_the_rollout_node_is_checked_against_its_own_engine(tmp_path: Path) -> None:
    vllm_only = compose_train(tmp_path, "experiment=tiny", "+rollout.kv_cache_gb=1", mlflow=False)
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_gb"):  # not an hf option
        to_train_config(vllm_only)
    ok = compose_train(tmp_path, "experiment=tiny", "rollout=vllm", "rollout.kv_cache_gb=1",
                       "+data.chat_template_kwargs.enable_thinking=false", mlflow=False)
    conf = to_train_config(ok)  # free-form mappings take new keys
    assert conf.rollout.kv_cache_gb == 1 and conf.data.chat_template_kwargs == {
        "enable_thinking": False}
