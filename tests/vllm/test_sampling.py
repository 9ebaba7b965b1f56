"""checked_rollout (saopd.vllm.sampling): how the colocated engine and the rollout-server
client turn one sample into a Rollout (the real engines: tests/integration/vllm)."""

from __future__ import annotations

import math

import pytest

from saopd.vllm.sampling import checked_rollout


def test_a_sample_is_cut_after_its_first_stop_token() -> None:
    r = checked_rollout(2, [5, 6], [7, 9, 8, 9], [-0.1, -0.2, -0.3, -0.4], {9}, source="vLLM",
                        sample=0, dtype="float32")
    assert (r.prompt_index, r.prompt_ids) == (2, [5, 6])
    assert r.response_ids == [7, 9] and r.sampler_logprobs == [-0.1, -0.2] and r.finished
    whole = checked_rollout(0, [1], [7, 8], [-0.5, -0.6], {9}, source="vLLM", sample=1,
                            dtype="float32")
    assert whole.response_ids == [7, 8] and whole.sampler_logprobs == [-0.5, -0.6]
    assert not whole.finished


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_log_prob_is_refused_naming_the_source(bad: float) -> None:
    with pytest.raises(RuntimeError, match=r"^rollout server http://h:1 returned non-finite "
                       r"sampled-token log-probs for prompt 3 \(sample 1\): the served model "
                       r"computes NaN/inf in bfloat16; its samples cannot be trusted "
                       r"\(try fp32\)$"):
        checked_rollout(3, [1], [7, 9, 8], [-0.1, -0.2, bad], {9},
                        source="rollout server http://h:1", sample=1, dtype="bfloat16",
                        advice=" (try fp32)")
