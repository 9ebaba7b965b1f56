"""The benchmark records (saopd.eval.benchmarks): every record complete and gradable, unknown
names refused with the list, files read where the record says, and saopd-eval's overrides of k
and max new tokens winning over the record (checked on what the runner is given)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from saopd.eval.benchmarks import BENCHMARKS, MODALITIES, Benchmark
from saopd.eval.graders import GRADERS
from saopd.eval.runner import BenchmarkResult, grade_samples, load_benchmark
from saopd.evaluate import CONF_DIR, benchmark_sampling, run_eval
from saopd.registry import Registry

REPO = Path(CONF_DIR).parent
PAPER = {"gsm8k", "math500", "aime24", "aime25", "amc23", "minerva_math", "synth_vqa",
         "evochart", "mmifeval", "countqa", "mathvision", "geo3k", "mathvista"}


def compose_eval(tmp: Path, *overrides: str, data_dir: Path | None = None):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("eval", overrides=[
            f"data_dir={data_dir or REPO / 'data' / 'prepared' / 'eval'}",
            f"output_dir={tmp / 'eval'}", "log_to_mlflow=false", *overrides])


def test_every_record_is_complete_and_its_grader_exists() -> None:
    # the paper's and the arithmetic testbed's, and any benchmark added since: each is checked
    assert PAPER | {"arith"} <= set(BENCHMARKS.names())
    assert set(GRADERS) == {"math", "vision", "mmifeval", "exact"}
    for name in BENCHMARKS:
        record = BENCHMARKS.get(name)
        assert isinstance(record, Benchmark) and record.name == name
        for f in dataclasses.fields(record):
            if f.name not in ("file", "stage", "label", "column"):
                assert getattr(record, f.name) not in (None, ""), (name, f.name)
        assert callable(GRADERS.get(record.grader)), name
        assert record.modality in MODALITIES
        assert (record.file is None) == (record.stage is None) == (name == "gsm8k")
        # vision benchmarks live beside data_dir, written by the VLM stages
        assert (record.modality == "vision") == (record.stage in ("prepare_vlm",
                                                                   "prepare_vlm_eval")), name


def test_a_grader_outside_the_registry_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"grader must be one of \['exact', 'math', 'mmifeval', "
                                         r"'vision'\], got 'fuzzy'"):
        Benchmark("toy", file="toy.jsonl", stage="s", grader="fuzzy", k=1, max_new_tokens=8,
                  modality="text", description="a toy")
    with pytest.raises(ValueError, match="unknown grader 'fuzzy'"):
        GRADERS.get("fuzzy")


def test_the_papers_table_benchmarks_carry_their_header_and_column() -> None:
    """Headers and the paper's column order live on the records (saopd-report reads them)."""
    ordered = sorted((r for r in map(BENCHMARKS.get, BENCHMARKS) if r.column is not None),
                     key=lambda r: r.column)
    assert [r.label for r in ordered] == [
        "Math500", "AMC23", "AIME25", "AIME24", "Minerva", "GSM8K", "EvoChart", "MMIFEval",
        "CountQA", "MathVision", "Geo3K", "MathVista"]
    assert len({r.column for r in ordered}) == len(ordered)
    assert {r.name for r in ordered} == PAPER - {"synth_vqa"}
    with pytest.raises(ValueError, match="label must be one non-empty line"):
        Benchmark("toy", file="toy.jsonl", stage="s", grader="exact", k=1, max_new_tokens=8,
                  modality="text", description="a toy", label=" ")


def test_records_hold_the_papers_settings() -> None:
    """Avg@8 everywhere but MATH500 (accuracy); 18,000 new tokens for competition math, 1,024
    for visual understanding, 4,096 for visual reasoning (Appendix B)."""
    k = {name: BENCHMARKS.get(name).k for name in PAPER}
    assert k.pop("math500") == 1 and set(k.values()) == {8}
    tokens = {name: BENCHMARKS.get(name).max_new_tokens for name in PAPER}
    assert {n for n, t in tokens.items() if t == 18000} == {
        "math500", "aime24", "aime25", "amc23", "minerva_math"}
    assert {n for n, t in tokens.items() if t == 4096} == {"mathvision", "geo3k", "mathvista"}
    assert {n for n, t in tokens.items() if t == 1024} == {
        "gsm8k", "synth_vqa", "evochart", "mmifeval", "countqa"}
    assert BENCHMARKS.get("mmifeval").grader == "mmifeval"
    assert BENCHMARKS.get("geo3k").grader == "math"  # expressions: math-verify


@pytest.mark.parametrize(("change", "match"), [
    ({"grader": "vibes"}, r"grader must be one of \['exact', 'math', 'mmifeval', 'vision'\]"),
    ({"modality": "audio"}, r"modality must be one of"),
    ({"k": 0}, r"benchmark 'x'\.k must be an int >= 1"),
    ({"max_new_tokens": 1.5}, r"max_new_tokens must be an int"),
    ({"stage": None}, r"file and stage are both set or both None"),
    ({"file": "/abs/x.jsonl"}, r"relative to data_dir"),
    ({"description": "two\nlines"}, r"one non-empty line"),
    ({"name": "Bad-Name"}, r"benchmark name must match"),
])
def test_an_incomplete_record_is_refused(change: dict, match: str) -> None:
    fields = dict(name="x", file="x.jsonl", stage="prepare_eval", grader="math", k=8,
                  max_new_tokens=64, modality="text", description="a test benchmark")
    Benchmark(**fields)
    with pytest.raises(ValueError, match=match):
        Benchmark(**{**fields, **change})


def test_registry_add_registers_records() -> None:
    registry: Registry[Benchmark] = Registry("benchmark")
    record = Benchmark("x", file="x.jsonl", stage="prepare_eval", grader="math", k=1,
                       max_new_tokens=8, modality="text", description="x")
    registry.add("x", record)
    assert registry.get("x") is record and "x" in registry and registry.names() == ["x"]
    with pytest.raises(ValueError, match=r"benchmark 'x' is registered twice"):
        registry.add("x", record)


UNKNOWN = (r"unknown benchmark 'gsm9k'; allowed: aime24, aime25, amc23, arith, arith_tic, countqa, "
           r"evochart, geo3k")


def test_an_unknown_name_lists_the_registered_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=UNKNOWN):
        load_benchmark("gsm9k", tmp_path)
    with pytest.raises(ValueError, match=UNKNOWN):
        grade_samples("gsm9k", [], {})
    from saopd.lightning.callbacks import EvalCallback
    from saopd.rollout.base import SamplingParams

    with pytest.raises(ValueError, match=UNKNOWN):  # evaluation during training, at start-up
        EvalCallback(1, {"gsm9k": []}, SamplingParams(), tmp_path)
    # saopd-eval refuses it (in benchmarks or in an override) before building the model
    for override in ("benchmarks=[gsm8k,gsm9k]", "+max_new_tokens.gsm9k=8",
                     "+k_per_benchmark.gsm9k=2"):
        with pytest.raises(ValueError, match=UNKNOWN):
            run_eval(compose_eval(tmp_path, "model.name_or_path=/nonexistent", override))


def test_files_are_read_where_the_record_says(tmp_path: Path) -> None:
    """``<data_dir>/<file>``, with ``..`` taken lexically: the VLM benchmarks sit beside a
    data_dir that need not exist; gsm8k reads the vendored split whatever data_dir is."""
    row = {"id": "q1", "messages": [{"role": "user", "content": "1+1?"}], "answer": "2",
           "metadata": {"format": "count"}}
    (tmp_path / "vlm_eval").mkdir()
    (tmp_path / "vlm_eval" / "countqa.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "amc23.jsonl").write_text(json.dumps({**row, "id": "a1"}) + "\n")
    data_dir = tmp_path / "eval"
    assert not data_dir.exists()
    (problem,) = load_benchmark("countqa", data_dir)
    assert (problem.id, problem.answer, problem.metadata["format"]) == ("q1", "2", "count")
    assert [p.id for p in load_benchmark("amc23", tmp_path)] == ["a1"]
    gsm8k = load_benchmark("gsm8k", tmp_path / "nowhere", limit=2)
    first = json.loads((REPO / "data" / "gsm8k" / "test.jsonl").read_text().splitlines()[0])
    assert len(gsm8k) == 2 and gsm8k[0].answer in first["answer"]


def test_overrides_win_over_the_record_and_the_record_fills_the_rest(tmp_path: Path) -> None:
    record = BENCHMARKS.get("math500")
    plain = OmegaConf.to_object(compose_eval(tmp_path))
    s = benchmark_sampling(plain, "math500")
    assert (s.n, s.max_new_tokens) == (record.k, record.max_new_tokens) == (1, 18000)
    assert (s.temperature, s.top_p, s.seed) == (1.0, 0.95, 0)
    every = OmegaConf.to_object(compose_eval(tmp_path, "k=4", "+max_new_tokens.aime24=32"))
    assert benchmark_sampling(every, "math500").n == 4  # k overrides every record
    assert benchmark_sampling(every, "math500").max_new_tokens == 18000
    assert benchmark_sampling(every, "aime24").max_new_tokens == 32
    single = OmegaConf.to_object(compose_eval(tmp_path, "k=4", "+k_per_benchmark.math500=2"))
    assert benchmark_sampling(single, "math500").n == 2  # k_per_benchmark over k
    assert benchmark_sampling(single, "amc23").n == 4


def test_saopd_eval_gives_the_runner_the_resolved_sampling(tmp_path: Path,
                                                          monkeypatch) -> None:
    """What ``evaluate_benchmark`` receives per benchmark: the record's k and max new tokens,
    except where the config overrides them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import saopd.evaluate as evaluate

    data_dir = tmp_path / "prepared"
    data_dir.mkdir()
    row = {"id": "m1", "messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}
    (data_dir / "math500.jsonl").write_text(json.dumps(row) + "\n")
    given: dict[str, tuple[int, int]] = {}

    def recording(name, problems, engine, tokenizer, sampling, **kwargs):
        given[name] = (sampling.n, sampling.max_new_tokens)
        return BenchmarkResult(name=name, k=sampling.n, score=0.0, problems=len(problems))

    monkeypatch.setattr(evaluate, "evaluate_benchmark", recording)
    base = ("model=tiny_qwen3", "benchmarks=[gsm8k,math500]", "limit=1")
    run_eval(compose_eval(tmp_path, *base, "+k_per_benchmark.gsm8k=2",
                          "+max_new_tokens.math500=7", data_dir=data_dir))
    assert given == {"gsm8k": (2, BENCHMARKS.get("gsm8k").max_new_tokens),
                     "math500": (BENCHMARKS.get("math500").k, 7)}
    out = run_eval(compose_eval(tmp_path, *base, data_dir=data_dir))
    assert given == {name: (BENCHMARKS.get(name).k, BENCHMARKS.get(name).max_new_tokens)
                     for name in ("gsm8k", "math500")}
    assert out["benchmarks"]["math500"]["max_new_tokens"] == 18000
    assert out["benchmarks"]["gsm8k"]["k"] == 8
