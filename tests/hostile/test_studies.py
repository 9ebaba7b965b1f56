"""Hostile cases of studies that outgrow one machine, tried as a new user would: an evaluation
given both a run and a checkpoint, a tracking server on a taken port, a tracking server that is
absent or dies mid-run, searches that cannot finish, a prompt of tens of megabytes, a local Ray
cluster. Each case ended silently, in a raw traceback or in a hang before its fix."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from saopd.evaluate import run_eval
from saopd.runs.server import start_server, stop_server
from saopd.train import CONF_DIR, UserError, train
from tests.helpers.mlflow_store import sqlite_store
from tests.helpers.net import free_port

FAST = ("experiment=tiny", "trainer.view_every_n_steps=0")
REPO = Path(CONF_DIR).parent


def _compose_eval(tmp: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("eval", overrides=[
            f"data_dir={REPO / 'data' / 'prepared' / 'eval'}", f"output_dir={tmp / 'eval'}",
            f"tracking_uri={sqlite_store(tmp / 'mlflow.db')}", "model=tiny_qwen3",
            "benchmarks=[gsm8k]", "limit=1", "k=1", "+max_new_tokens.gsm8k=4",
            "grade_workers=1", *overrides])


# ---- saopd-eval: run_id and checkpoint together ------------------------------------------------

def test_eval_of_a_run_id_and_a_checkpoint_scores_that_checkpoint_or_refuses(
        make_cfg, tmp_path: Path) -> None:
    """run_id=A checkpoint=FILE: FILE is scored (its step logged into A) when it records A, and
    refused when it records another run; A's last.ckpt is never scored in its place."""
    first = train(make_cfg(*FAST, "steps=1"))
    folder = Path(first["output_dir"])
    kept = tmp_path / "kept"  # step 1 of run A, kept aside before A trains on
    shutil.copytree(folder / "checkpoints", kept / "checkpoints")
    (kept / ".hydra").mkdir()
    OmegaConf.save(make_cfg(*FAST), kept / ".hydra" / "config.yaml")
    again = train(make_cfg(*FAST, "steps=2", f"resume={folder}"))
    assert again["run_id"] == first["run_id"] and again["steps"] == 2
    other = train(make_cfg(*FAST, "steps=1", f"paths.output_dir={tmp_path / 'b'}"))

    step_1 = kept / "checkpoints" / "step_000001.ckpt"
    out = run_eval(_compose_eval(tmp_path, f"run_id={first['run_id']}", f"checkpoint={step_1}"))
    assert out["checkpoint"] == str(step_1) and out["step"] == 1  # not A's last.ckpt (step 2)

    theirs = Path(other["last_checkpoint"])
    with pytest.raises(ValueError, match=rf"trained by MLflow run {other['run_id']}, not "
                                         rf"{first['run_id']}"):
        run_eval(_compose_eval(tmp_path, f"run_id={first['run_id']}", f"checkpoint={theirs}"))


# ---- the tracking server: a taken port, nothing listening, a server that dies mid-run ---------

def test_a_tracking_server_on_a_taken_port_refuses_before_its_banner(tmp_path: Path) -> None:
    """Another process listens on the port: one line naming it, status 2, no banner (the banner
    named a URI whose runs went into the other process's store)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "saopd.runs.server", "--port", str(port),
             "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
             "--artifacts-destination", str(tmp_path / "artifacts")],
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr
        assert "runs log here" not in proc.stdout and "Traceback" not in proc.stderr
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            start_server(backend_store_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                         artifacts_destination=tmp_path / "artifacts", port=port,
                         timeout_s=60)


def test_a_tracking_uri_where_nothing_listens_stops_the_run_at_once(make_cfg,
                                                                    monkeypatch) -> None:
    """logger.tracking_uri=http://... with no server: one error naming the URI within seconds,
    before the models are built (MLflow's client retried for minutes)."""
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(UserError, match=rf"logger: MLflow tracking server {uri} does not "
                                        r"answer GET /health \(Connection refused\)"):
        train(make_cfg(*FAST, "steps=1", f"logger.tracking_uri={uri}"))
    assert time.monotonic() - started < 30


class KillServerAt(L.Callback):
    """Stops the tracking server once ``step`` steps are done (their checkpoint saved)."""

    def __init__(self, server: subprocess.Popen, step: int) -> None:
        self.server, self.step = server, step
        self.killed_at: float | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step and self.killed_at is None:
            stop_server(self.server, kill=True)  # its uvicorn with it
            self.killed_at = time.monotonic()


def test_a_tracking_server_that_dies_mid_run_stops_it_within_a_minute(make_cfg, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """The server is killed after step 2: within 60 s one error names the URI, the step saved
    and the resume command (MLflow's client retried for 8 minutes, then 10 tracebacks)."""
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    port = free_port()
    server = start_server(backend_store_uri=sqlite_store(tmp_path / "server.db"),
                          artifacts_destination=tmp_path / "artifacts", port=port, workers=1,
                          log_file=tmp_path / "server.log", timeout_s=600)  # a loaded machine
    uri = f"http://127.0.0.1:{port}"
    kill = KillServerAt(server, 2)
    try:
        with pytest.raises(UserError) as caught:
            train(make_cfg(*FAST, "steps=6", f"logger.tracking_uri={uri}"),
                  extra_callbacks=[kill])
    finally:
        stop_server(server, kill=True)
    assert kill.killed_at is not None and time.monotonic() - kill.killed_at < 60
    message = str(caught.value)
    folder = tmp_path / "run"
    assert message.startswith(f"logger: MLflow tracking server {uri} stopped answering")
    assert f"step 2 is saved in {folder / 'checkpoints' / 'step_000002.ckpt'}" in message
    assert f"saopd-train resume={folder}" in message and "resume=auto" in message
    assert os.path.exists(folder / "checkpoints" / "step_000002.ckpt")


# ---- searches that cannot finish: no trials, every trial failed ------------------------------

TRAIN = Path(sys.executable).with_name("saopd-train")


def _search(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``saopd-train -m hparams_search=sa_opd`` on the tiny experiment from ``tmp_path``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SAOPD_ROOT", None)
    return subprocess.run(
        [str(TRAIN), "-m", "hparams_search=sa_opd", *FAST, "steps=1", "eval.every_n_steps=0",
         "hydra.callbacks.search_objectives.metrics=[train/loss]",
         "hydra.sweeper.direction=[minimize]", f"hydra.sweep.dir={tmp_path / 'sweep'}",
         f"logger.tracking_uri={sqlite_store(tmp_path / 'mlflow.db')}", *args],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)


def test_a_search_of_no_trials_is_refused(tmp_path: Path) -> None:
    proc = _search(tmp_path, "hydra.sweeper.n_trials=0")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "saopd-train: error: hydra.sweeper.n_trials=0: a search needs at least one trial" \
        in proc.stderr
    assert "Traceback" not in proc.stderr and "No trials are completed" not in proc.stderr


def test_a_search_whose_every_trial_failed_ends_with_its_summary(tmp_path: Path) -> None:
    proc = _search(tmp_path, "hydra.sweeper.n_trials=2", f"data.path={tmp_path / 'none.jsonl'}")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "No trials are completed" not in proc.stderr
    sweep = tmp_path / "sweep"
    best = json.loads((sweep / "best.json").read_text())
    assert best["trials"] == 2 and best["failed"] == 2 and best["best"] == []
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    assert summary["jobs"] == 2 and summary["failed"] == 2
    assert "hparams search: 2 trials (2 failed)" in proc.stdout
    assert "no trial completed, so there is no best point" in proc.stdout
    assert proc.stdout.count("data.path: no such file") >= 2  # each trial's reason



def test_a_reversed_interval_names_its_key(tmp_path: Path) -> None:
    proc = _search(tmp_path, "hydra.sweeper.n_trials=1", "filter.p1=interval(0.5, 0.1)")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "saopd-train: error: filter.p1=interval(0.5, 0.1): the low end is above the high " \
        "end; write interval(0.1, 0.5)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "sweep" / "0").exists()


def test_a_search_for_a_metric_no_trial_logs_is_refused_before_the_first_trial(
        tmp_path: Path) -> None:
    """The held-out metric of hparams_search=sa_opd with eval.every_n_steps=0: refused at once
    (every trial trained, then failed for want of it)."""
    proc = _search(tmp_path, "hydra.sweeper.n_trials=2",
                   "hydra.callbacks.search_objectives.metrics=[eval/gsm8k/avg_at_1]",
                   "hydra.sweeper.direction=[maximize]")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "saopd-train: error: objective metric 'eval/gsm8k/avg_at_1' comes from the " \
        "held-out evaluation, but eval.every_n_steps=0" in proc.stderr
    assert not (tmp_path / "sweep" / "0").exists()  # no trial ran


@pytest.mark.parametrize(("metric", "says"), [
    ("train/no_such_metric", "objective metric 'train/no_such_metric': no trial logs it (the "
                             "trials log train/abs_a_filtered"),
    ("val/loss", "objective metric 'val/loss': a trial reports train/<name> and "
                 "eval/<benchmark>/<metric> metrics only"),
])
def test_a_search_for_a_training_or_unknown_metric_no_trial_logs_is_refused_at_once(
        tmp_path: Path, metric: str, says: str) -> None:
    """Not only evaluation metrics: a train/ name the experiment's filter and objective do not
    log, and a namespace no trial reports, are refused before the first trial (they used to
    run every trial and fail each one for want of the metric)."""
    proc = _search(tmp_path, "hydra.sweeper.n_trials=2",
                   f"hydra.callbacks.search_objectives.metrics=[{metric}]")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"saopd-train: error: {says}" in proc.stderr
    assert not (tmp_path / "sweep" / "0").exists()  # no trial ran


def test_a_stopped_search_continues_from_its_storage(tmp_path: Path) -> None:
    """A search of 2 trials, then a trial left RUNNING in its study (what a search killed
    during a trial leaves), then the same command with n_trials=3 in the same folder: the
    stored trials count, the stale one is marked failed, one trial runs, in a new folder."""
    import optuna

    first = _search(tmp_path, "hydra.sweeper.n_trials=2")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    sweep = tmp_path / "sweep"
    storage = f"sqlite:///{sweep / 'optuna.db'}"
    assert f"if it stops, continue it with: {TRAIN} -m" in first.stdout
    assert f"hydra.sweep.dir={sweep}" in first.stdout
    study = optuna.load_study(study_name="sa_opd", storage=storage)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    study.ask()  # trial 2 left running

    again = _search(tmp_path, "hydra.sweeper.n_trials=3")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert ("hparams search: resuming study 'sa_opd' of " f"{storage}: 2 trial(s) done, 1 "
            "interrupted (marked failed), 1 of n_trials=3 to run") in again.stdout
    states = [t.state.name for t in optuna.load_study(study_name="sa_opd",
                                                      storage=storage).trials]
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "COMPLETE"]
    assert (sweep / "3").is_dir() and not (sweep / "2").exists()  # job 3: trial 3's number
    rows = [json.loads(x) for x in (sweep / "trials.jsonl").read_text().splitlines()]
    assert [r["job"] for r in rows] == [0, 1, 3]
    best = json.loads((sweep / "best.json").read_text())
    assert best["trials"] == 3 and best["failed"] == 0
    assert "hparams search: 3 trials (0 failed)" in again.stdout


def test_an_unknown_launcher_option_is_one_line_naming_it(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SAOPD_ROOT", None)
    proc = subprocess.run(
        [str(TRAIN), "-m", *FAST, "steps=1", "hydra/launcher=slurm_local",
         "+hydra.launcher.gpus_per_task=1", f"hydra.sweep.dir={tmp_path / 'sweep'}",
         "logger=none"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "saopd-train: error: hydra.launcher.gpus_per_task: submitit's 'local' executor has " \
        "no such option" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_yaml_syntax_error_is_one_line_naming_the_file_and_line(tmp_path: Path) -> None:
    """A user's experiment file with a bracket left open: one line with the file and line,
    exit 2 (Hydra printed a 40-line traceback first)."""
    folder = tmp_path / "conf" / "experiment"
    folder.mkdir(parents=True)
    (folder / "mine.yaml").write_text("# @package _global_\nsteps: 3\ndata:\n  limit: [1, 2\n"
                                      "  shuffle: true\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("SAOPD_ROOT", None)
    for entry in ("saopd-train", "saopd-eval"):
        proc = subprocess.run([str(TRAIN.with_name(entry)), "--config-dir", str(tmp_path / "conf"),
                               "experiment=mine"], cwd=tmp_path, capture_output=True, text=True,
                              env=env, timeout=900)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [
            f"{entry}: error: {folder / 'mine.yaml'}, line 5, column 10: did not find expected "
            "',' or ']' (while parsing a flow sequence at line 4)"]
    # the same folder added through hydra.searchpath (a list, file:// or a bare path): the
    # check main() runs before Hydra, in this process (the entry points' wiring is above)
    from saopd.paths import config_dirs, yaml_problem

    for value in (f"[file://{tmp_path / 'conf'}]", f"[pkg://saopd,{tmp_path / 'conf'}]",
                  f"{tmp_path / 'conf'}"):
        dirs = config_dirs([f"hydra.searchpath={value}", "experiment=mine"])
        assert dirs[1:] == [tmp_path / "conf"]
        assert yaml_problem(dirs) == (
            f"{folder / 'mine.yaml'}, line 5, column 10: did not find expected ',' or ']' "
            "(while parsing a flow sequence at line 4)")
    assert yaml_problem(config_dirs(["experiment=tiny"])) is None

# ---- a prompt of megabytes -------------------------------------------------------------------

class RecordingTokenizer:
    """The real tokenizer, noting the longest text it was asked to tokenize."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, text: str, **kwargs: object) -> object:
        self.longest = max(self.longest, len(text))
        return self.tokenizer(text, **kwargs)  # type: ignore[operator]

    def __getattr__(self, name: str) -> object:
        return getattr(self.tokenizer, name)


def test_a_prompt_of_megabytes_is_skipped_and_counted_without_tokenizing(tmp_path: Path,
                                                                       tiny_tok) -> None:
    """One 5 MB JSON line among short prompts: counted with the prompts over
    data.max_prompt_length, never tokenized (a 50 MB line held a run for minutes)."""
    from saopd.config.data import DataConfig
    from saopd.prompts.sources import load_prompts

    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "answer": str(2 * i)} for i in range(3)]
    rows.insert(1, {"id": "huge", "messages": [{"role": "user", "content": "7 " * 2_500_000}],
                    "answer": "7"})
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = RecordingTokenizer(tiny_tok)
    records, counts = load_prompts(DataConfig(source="prepared", path=str(path),
                                              max_prompt_length=256), tok)
    assert [r.id for r in records] == ["p0", "p1", "p2"]
    assert counts == {"prompts_read": 4, "rows_skipped_bad": 0, "prompts_skipped_long": 1}
    assert tok.longest < 100_000  # the short prompts only


def test_a_prompt_of_megabytes_in_truncate_mode_is_cut_before_tokenizing(tmp_path: Path,
                                                                        tiny_tok) -> None:
    """data.long_prompts=truncate keeps the 5 MB prompt, cut in characters first: nothing
    tokenizes megabytes, and the engine's left truncation gives the same ids as on the whole
    text."""
    from saopd.config.data import DataConfig
    from saopd.prompts.render import render_prompt_ids
    from saopd.prompts.sources import load_prompts
    from saopd.prompts.text import prompt_char_limit
    from saopd.rollout.base import limit_prompts

    words = [f"w{i % 97} " for i in range(600_000)]  # varied text, ~2.4 MB
    huge = {"id": "huge", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "".join(words)}],
            "answer": "7"}
    rows = [{"id": "p0", "messages": [{"role": "user", "content": "What is 1 + 1?"}],
             "answer": "2"}, huge]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = RecordingTokenizer(tiny_tok)
    limit = 64
    records, counts = load_prompts(DataConfig(source="prepared", path=str(path),
                                              max_prompt_length=limit, long_prompts="truncate"),
                                   tok)
    assert [r.id for r in records] == ["p0", "huge"]
    assert counts == {"prompts_read": 2, "rows_skipped_bad": 0, "prompts_cut_long": 1}
    assert tok.longest < 100_000
    cut = records[1].messages
    assert cut[0]["content"] == ""  # the start (the system turn) is what the engine drops too
    assert len(cut[1]["content"]) == prompt_char_limit(tiny_tok, limit)
    assert huge["messages"][1]["content"].endswith(cut[1]["content"])
    # the engine's left truncation: the same last `limit` ids with or without the cut
    whole_tail = "".join(words[-20_000:])  # enough text for far more than `limit` tokens
    ref = render_prompt_ids(tiny_tok, [{"role": "user", "content": whole_tail}])
    got = render_prompt_ids(tiny_tok, cut)
    (_, ref_kept), = limit_prompts([ref], limit, "truncate")[0]
    (_, got_kept), = limit_prompts([got], limit, "truncate")[0]
    assert got_kept == ref_kept and len(got_kept) == limit


# ---- a local Ray cluster ---------------------------------------------------------------------

def test_a_local_ray_cluster_is_refused_when_ray_was_imported_before_the_switch() -> None:
    """Ray reads its multi-node switch when imported: a sweep in a process that imported ray
    first cannot keep its local cluster on loopback, and says so instead of listening on every
    interface; with the switch set in the environment it goes on; a cluster given by address is
    left as it is."""
    pytest.importorskip("ray", reason="the Ray launcher is the [ray] extra (make setup has it)")
    code = (
        "import os, sys\n"
        "from hydra_plugins.saopd_launchers.ray_launcher import keep_on_loopback, "
        "starts_local_cluster, MULTI_NODE_ENV\n"
        "assert starts_local_cluster({'init': {'address': None}})\n"
        "assert starts_local_cluster({'init': {'address': 'local'}})\n"
        "assert not starts_local_cluster({'init': {'address': 'auto'}})\n"
        "import ray\n"
        "try:\n"
        "    keep_on_loopback()\n"
        "except RuntimeError as err:\n"
        "    print('refused:', err)\n"
        "os.environ[MULTI_NODE_ENV] = '0'\n"
        "keep_on_loopback()\n"
        "print('switch set: ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("refused: ray was imported before the sweep started, so its "
                               "local cluster would listen on every interface")
    assert lines[1:] == ["switch set: ok"]


# A local cluster's listeners all on loopback: checked on the sweep of
# tests/integration/test_cluster_launchers.py::test_two_jobs_on_a_local_ray_cluster_listening_on_
# loopback_only (one Ray cluster for both checks).


# ---- a cluster job killed with SIGTERM -------------------------------------------------------

def _submitit_task(sweep: Path) -> int | None:
    """The pid of the submitit task that runs a job of ``sweep`` (what SLURM would signal)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" in cmd and any(str(sweep).encode() in c for c in cmd):
            return int(pid)
    return None


def test_a_slurm_local_job_killed_by_sigterm_is_in_the_summary_and_resumes(tmp_path: Path
                                                                          ) -> None:
    """SIGTERM to a hydra/launcher=slurm_local job: the sweep ends with its summary, the job
    listed as killed with the command that continues it, and that command resumes the saved
    step (the sweep ended in submitit's UncompletedJobError, with no summary)."""
    steps, sweep = 20, tmp_path / "sweep"
    job = sweep / "0"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("SAOPD_ROOT", None)
    proc = subprocess.Popen(
        [str(TRAIN), "-m", *FAST, f"steps={steps}", "hydra/launcher=slurm_local",
         f"hydra.sweep.dir={sweep}",
         f"logger.tracking_uri={sqlite_store(tmp_path / 'mlflow.db')}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 1500  # a loaded machine took 10 minutes to the first step
        while time.monotonic() < deadline and proc.poll() is None and not list(
                (job / "checkpoints").glob("step_*.ckpt")):
            time.sleep(0.2)
        assert list((job / "checkpoints").glob("step_*.ckpt")), "no step saved: not signalled"
        pid = _submitit_task(sweep)
        assert pid is not None and proc.poll() is None, "the job ended before it was signalled"
        os.kill(pid, signal.SIGTERM)  # scancel, or a kill by hand
        out, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "UncompletedJobError" not in err and "Traceback" not in err
    assert "1 of 1 were killed" in err
    summary = json.loads((sweep / "sweep_summary.json").read_text())
    (row,) = summary["job_outcomes"]
    assert (summary["killed"], summary["failed"], row["status"]) == (1, 0, "killed")
    assert row["resume"].endswith(f"resume={job}") and "continue it: saopd-train" in out
    saved = int(row["error"].split("step ", 1)[1].split()[0])
    assert 0 < saved < steps

    resumed = subprocess.run([str(TRAIN), *shlex.split(row["resume"])[1:]], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume (resume): {job / 'checkpoints' / 'last.ckpt'} at step {saved}" in \
        resumed.stdout + resumed.stderr
    assert f"saopd-train: {steps} steps" in resumed.stdout
    assert f"outputs:     {job}" in resumed.stdout  # in the job's own folder


# ---- messages that blamed the wrong thing, and a warning for what a resume is for -----------

def test_a_wrong_sidecar_beside_a_whole_checkpoint_is_blamed_not_the_checkpoint(
        tmp_path: Path) -> None:
    import torch

    from saopd.runs.checkpoints import CheckpointError, VerifiedCheckpointIO, read_checkpoint

    path, other = tmp_path / "step_000003.ckpt", tmp_path / "other.ckpt"
    io = VerifiedCheckpointIO()
    io.save_checkpoint({"state_dict": {"student.w": torch.ones(4)}, "global_step": 3}, path)
    io.save_checkpoint({"state_dict": {"student.w": torch.zeros(4)}, "global_step": 1}, other)
    shutil.copy(tmp_path / "other.ckpt.sha256", tmp_path / "step_000003.ckpt.sha256")
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert "its step_000003.ckpt.sha256 is wrong, not the checkpoint" in message
    assert "corrupt" not in message and f"sha256sum {path}" in message


def test_a_directory_as_data_path_is_called_a_directory(make_cfg, tmp_path: Path) -> None:
    with pytest.raises(UserError, match=rf"data: data.path: {tmp_path} is a directory"):
        train(make_cfg(*FAST, "steps=1", f"data.path={tmp_path}", mlflow=False))


def test_a_resume_that_only_trains_longer_does_not_warn(make_cfg, caplog) -> None:
    first = train(make_cfg(*FAST, "steps=1"))
    caplog.clear()
    with caplog.at_level("INFO"):
        again = train(make_cfg(*FAST, "steps=2", f"resume={first['output_dir']}"))
    assert again["steps"] == 2 and again["run_id"] == first["run_id"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"
              and r.name.startswith("saopd") and "max_prompt_length" not in r.getMessage()]
    assert warned == []  # the long prompts of the tiny data are warned of in every run
    assert any("resume: steps 1 -> 2" in r.getMessage() for r in caplog.records)


def test_eval_and_report_on_a_tracking_uri_where_nothing_listens_stop_at_once(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """saopd-eval and saopd-report with a server URI where nothing listens: one error naming
    it within seconds (MLflow's client retried for minutes)."""
    from saopd.report import main as report_main

    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    uri = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"MLflow tracking server {uri} does not answer"):
        run_eval(_compose_eval(tmp_path, f"tracking_uri={uri}"))
    with pytest.raises(SystemExit) as stop:
        report_main(["--tracking-uri", uri, "-e", "tiny", "--out", str(tmp_path / "r")])
    assert stop.value.code == 2
    assert f"saopd-report: error: MLflow tracking server {uri} does not answer" in \
        capsys.readouterr().err
    assert time.monotonic() - started < 30



class SigtermAt(L.Callback):
    """Sends this process SIGTERM once ``step`` steps are done (a scheduler's stop)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_save_does_not_log_lightnings_weights_only_default(make_cfg, caplog) -> None:
    """The step saved on SIGTERM: no "`weights_only` was not set, defaulting to `False`" line
    (it read like an unsafe load; checkpoints are always read weights-only)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    with caplog.at_level("INFO"), pytest.raises(SIGTERMException):
        train(make_cfg(*FAST, "steps=6", mlflow=False), extra_callbacks=[SigtermAt(2)])
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("preempted: saved step") for m in messages)
    assert not [m for m in messages if "weights_only" in m]
