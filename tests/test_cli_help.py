"""The command lines' ``--help`` fits one screen and says what a user needs: ``saopd-train``'s
names every config group with its options, every launcher, the main knobs at this command's
values and where runs go (``SAOPD_ROOT``), with the raw config behind ``--cfg job`` as Hydra
has it; ``saopd-eval``'s the same for evaluations. No help names a session or an issue."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from saopd.paths import repo_root

CONF = repo_root() / "conf"
HISTORY = re.compile(r"session [0-9]|issue [0-9]", re.IGNORECASE)
#: Launchers Hydra's installed plugins bring (the others are conf/hydra/launcher/*.yaml).
PLUGIN_LAUNCHERS = ("basic", "joblib")


def _run(command: str, *args: str) -> str:
    """``command`` (a console script beside this Python, or ``-m <module>``) with ``args``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = ([sys.executable, command, *args] if command == "-m"
            else [str(Path(sys.executable).with_name(command)), *args])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _groups() -> dict[str, list[str]]:
    """Every config group of conf/ (but Hydra's own) with its options, from the files."""
    return {d.name: sorted(f.stem for f in d.glob("*.yaml"))
            for d in sorted(CONF.iterdir()) if d.is_dir() and d.name != "hydra"}


@pytest.fixture(scope="module")
def train_help() -> str:
    return _run("saopd-train", "--help", "steps=7", "trainer.progress_bar=false")


@pytest.fixture(scope="module")
def eval_help() -> str:
    return _run("saopd-eval", "--help", "limit=9")


def _shown_groups(help_text: str) -> dict[str, list[str]]:
    """``group: [choices]`` from the "Configuration groups" section of a ``--help``."""
    section = help_text.split("== Configuration groups ==", 1)[1].split("\n== ", 1)[0]
    groups = {}
    for line in section.splitlines():
        name, sep, choices = line.partition(": ")
        if sep and name and " " not in name:
            groups[name] = choices.split(", ")
    return groups


@pytest.mark.parametrize("which", ["train_help", "eval_help"])
def test_help_lists_the_engines_and_no_schema(which: str, request: pytest.FixtureRequest
                                               ) -> None:
    """Only what can be chosen: every engine of the rollout registry, none of the typed schemas
    (they are stored outside the groups)."""
    from saopd.rollout import ENGINES

    groups = _shown_groups(request.getfixturevalue(which))
    assert groups["rollout"] == ENGINES.names()
    for name, choices in groups.items():
        assert not [c for c in choices if c.endswith("_schema")], (name, choices)


def test_train_help_fits_one_screen_and_names_groups_launchers_and_root(train_help: str
                                                                         ) -> None:
    lines = train_help.rstrip("\n").splitlines()
    assert len(lines) <= 60, len(lines)
    shown = {name: options.split(", ") for name, _, options in
             (line.partition(": ") for line in lines) if name in _groups()}
    assert shown == _groups()  # every group, each with all its options
    launchers = sorted(f.stem for f in (CONF / "hydra" / "launcher").glob("*.yaml"))
    assert launchers  # slurm, slurm_local, ray_cluster
    for launcher in (*PLUGIN_LAUNCHERS, *launchers):
        assert f"hydra/launcher={launcher} " in train_help, launcher
    assert "SAOPD_ROOT" in train_help
    assert f"Root:   {repo_root()};" in train_help
    assert f"{repo_root()}/outputs/testbed/" in train_help  # the default experiment's runs
    assert "--cfg job" in train_help
    assert not HISTORY.search(train_help)


def test_train_help_shows_this_commands_values_not_the_raw_config(train_help: str) -> None:
    assert "steps=7 " in train_help
    assert "trainer.progress_bar=False " in train_help
    assert "name_or_path:" not in train_help  # the raw config is --cfg job's


def test_cfg_job_still_prints_the_whole_config() -> None:
    out = _run("saopd-train", "--cfg", "job", "experiment=tiny")
    for key in ("student:", "name_or_path:", "trainer:", "progress_bar: true",
                "progress_bar_every_s: 10.0", "steps: 3"):
        assert key in out, key


def test_the_jobs_log_files_keep_their_names() -> None:
    """Hydra names a job's log after the file of its app unless the config names the job:
    ``train.log`` and ``evaluate.log``, whatever module holds the apps."""
    assert "    name: train\n" in _run("saopd-train", "--cfg", "hydra")
    assert "    name: evaluate\n" in _run("saopd-eval", "--cfg", "hydra")


def test_eval_help_fits_one_screen(eval_help: str) -> None:
    out = eval_help
    lines = out.rstrip("\n").splitlines()
    assert len(lines) <= 60, len(lines)
    assert "model: " in out and "rollout: " in out
    assert "limit=9 " in out
    assert "SAOPD_ROOT" in out and "--cfg job" in out
    assert "name_or_path:" not in out
    assert not HISTORY.search(out)


def test_argparse_help_names_no_history(capsys: pytest.CaptureFixture) -> None:
    from saopd.report import main as report_main

    with pytest.raises(SystemExit) as done:  # in this process: the same parser
        report_main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: saopd-report")
    assert not HISTORY.search(out)
    out = _run("-m", "saopd.serve", "--help")  # the thin `python -m saopd.serve` entry point
    assert out.startswith("usage: saopd-serve")
    assert not HISTORY.search(out)


def test_history_pattern_finds_history() -> None:
    assert HISTORY.search("fixed in Session 9") and HISTORY.search("see issue 25")
    assert not HISTORY.search("a session of training")


def test_groups_are_read_from_conf() -> None:
    groups = _groups()
    assert "testbed" in groups["experiment"] and "hf" in groups["rollout"]
    assert "hydra" not in groups


def test_make_help_lists_every_target_by_purpose_run_first() -> None:
    """``make`` alone is ``make help``: every target of the Makefile under one of the purposes,
    in the order set-up, run, study, docs, test, with ``run`` before all of them."""
    import shutil

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    root = repo_root()
    plain = subprocess.run(["make", "-s"], cwd=root, capture_output=True, text=True, timeout=60)
    helped = subprocess.run(["make", "-s", "help"], cwd=root, capture_output=True, text=True,
                            timeout=60)
    assert plain.returncode == 0 and helped.returncode == 0, plain.stderr + helped.stderr
    assert plain.stdout == helped.stdout
    lines = helped.stdout.splitlines()
    listed = [line.split()[0] for line in lines if line.startswith("  ") and line.strip()
              and not line.startswith("   ")]
    assert listed[0] == "run"
    targets = set(re.findall(r"^([a-z][\w-]*):", (root / "Makefile").read_text(), flags=re.M))
    assert targets - {"help"} == set(listed), targets ^ set(listed)
    headings = [line for line in lines if line and not line.startswith(" ")][1:]
    assert headings == ["Set-up", "Run", "Study", "Docs", "Test"]


#: What a training job imports (seconds on a 2-core CPU); the command line must not need them.
HEAVY = ("torch", "lightning", "transformers", "mlflow")
IMPORTS_OF = """
import json, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
from saopd import cli
main = cli.train_main if sys.argv[0] == "saopd-train" else cli.eval_main
code = None
try:
    main()
except SystemExit as done:
    code = done.code
print(json.dumps({"code": code, "heavy": [m for m in HEAVY if m in sys.modules]}))
"""


def _imports_of(tmp_path: Path, *argv: str) -> tuple[dict, str]:
    """Exit status and heavy modules imported of ``saopd.cli``'s command ``argv``."""
    code = f"HEAVY = {HEAVY!r}\n" + IMPORTS_OF
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stdout + out.stderr


def test_help_and_config_errors_answer_before_the_heavy_imports(tmp_path: Path) -> None:
    """``--help``, a YAML syntax error and a mistyped override end without importing torch,
    Lightning, transformers or MLflow (~13 s on a 2-core CPU): the job imports them."""
    got, text = _imports_of(tmp_path, "saopd-train", "--help")
    assert got == {"code": 0, "heavy": []} and "Configuration groups" in text
    got, text = _imports_of(tmp_path, "saopd-eval", "--help")
    assert got == {"code": 0, "heavy": []} and "Configuration groups" in text
    bad = tmp_path / "conf"
    bad.mkdir()
    (bad / "train.yaml").write_text("defaults: [\n")
    got, text = _imports_of(tmp_path, "saopd-train", "--config-dir", str(bad))
    assert got == {"code": 2, "heavy": []} and "train.yaml" in text
    got, text = _imports_of(tmp_path, "saopd-train", "no_such_key=1")
    assert got["code"] == 1 and got["heavy"] == [] and "no_such_key" in text
