"""The stages' command line (``python -m saopd.stages``, saopd/stages/__main__.py) and the stage
registry: the registered stages are exactly those dvc.yaml runs, each listing its own code as a
dep; an unknown stage is refused naming the registered ones; errors are one line; running
``prepare_eval`` does not import torch."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from saopd.stages import STAGES
from saopd.stages.__main__ import main
from saopd.stages.common import load_params

REPO = Path(__file__).resolve().parents[2]
DVC_STAGES: dict[str, Any] = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
#: Imported by no stage that a plain `dvc repro` runs with the repository's params.
HEAVY = ("torch", "PIL", "pyarrow", "datasets", "transformers")


def _eval_params_file(tmp_path: Path, **changes: Any) -> Path:
    """The repository's ``prepare_eval`` params writing to ``tmp_path/out`` (absolute inputs)."""
    params = copy.deepcopy(load_params(REPO / "params.yaml"))
    cfg = params["prepare_eval"]
    cfg["out_dir"] = str(tmp_path / "out")
    for bench in cfg["benchmarks"].values():
        bench["path"] = str(REPO / bench["path"])
    cfg.update(changes)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"prepare_eval": cfg}))
    return path


def test_registry_holds_exactly_the_stages_dvc_runs() -> None:
    assert STAGES.names() == sorted(DVC_STAGES)  # every registered stage, checked below
    assert {"prepare_eval", "prepare_train", "prepare_vlm", "prepare_vlm_eval",
            "prepare_vlm_reasoning", "prepare_vlm_understanding", "testbed_data",
            "testbed_student", "testbed_teacher", "testbed_teacher_prior"} <= set(STAGES.names())
    for name, stage in DVC_STAGES.items():
        assert stage["cmd"] == f"python -m saopd.stages {name} --params params.yaml"
        assert stage["params"] == [name]
        code = [d for d in stage["deps"] if d.endswith(".py")]
        assert all((REPO / d).is_file() for d in code), (name, code)
        module = sys.modules[STAGES.get(name).__module__]
        own = Path(module.__file__).relative_to(REPO).as_posix()
        assert {own, "saopd/stages/common.py", "saopd/stages/__main__.py"} <= set(code), name


def test_unknown_stage_is_refused_naming_the_registered_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as e:
        main(["prepare_evals", "--params", str(_eval_params_file(tmp_path))])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'prepare_evals'" in err
    assert all(f"'{name}'" in err for name in DVC_STAGES)
    assert not (tmp_path / "out").exists()
    allowed = ", ".join(STAGES.names())
    with pytest.raises(ValueError,
                       match=re.escape(f"unknown DVC stage 'prepare_evals'; allowed: {allowed}")):
        STAGES.get("prepare_evals")


def test_stage_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _eval_params_file(tmp_path)
    params = yaml.safe_load(path.read_text())
    params["prepare_eval"]["benchmarks"]["amc23"]["sha256"] = "f" * 64
    path.write_text(yaml.safe_dump(params))
    assert main(["prepare_eval", "--params", str(path)]) == 1
    err = capsys.readouterr().err
    assert re.search(r"^error: .*amc23/test.jsonl: sha256 mismatch: expected f{64}, got 4370",
                     err, re.M)
    assert not (tmp_path / "out").exists()
    path.write_text("prepare_vlm:\n  out_dir: x\n  splits: {valid: 3}\n")  # a SynthError
    assert main(["prepare_vlm", "--params", str(path)]) == 1
    assert "error: prepare_vlm.splits must map some of" in capsys.readouterr().err


def _run_module(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    """``python -X importtime -m saopd.stages <args>`` (each import is one stderr line)."""
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "saopd.stages", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _imported(stderr: str) -> set[str]:
    """Top-level packages imported, from ``-X importtime`` lines (``... | cumulative | name``)."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and "[us]" not in line}


def test_prepare_eval_from_the_command_line_does_not_import_torch(tmp_path: Path) -> None:
    res = _run_module("prepare_eval", "--params", str(_eval_params_file(tmp_path)))
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "out" / "report.json").is_file()
    imported = _imported(res.stderr)
    assert {"saopd", "yaml"} <= imported  # the import log was read
    assert imported.isdisjoint(HEAVY), sorted(imported & set(HEAVY))


def test_module_command_reports_stage_errors_without_a_traceback(tmp_path: Path) -> None:
    params = {"prepare_vlm_reasoning": {"source": "local",
                                        "local": {"path": str(tmp_path / "missing.parquet")},
                                        "out_dir": str(tmp_path / "out")}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    res = _run_module("prepare_vlm_reasoning", "--params", str(tmp_path / "params.yaml"))
    assert res.returncode == 1, res.stderr[-2000:]
    assert "local input not found" in res.stderr and "Traceback" not in res.stderr
