"""The benchmarks ``saopd-eval`` and evaluation during training know, one record each.

A :class:`Benchmark` holds every fact about one benchmark: where its file is, how its answers are
graded, the paper's number of samples per problem (Avg@k) and its response length limit.
:func:`saopd.eval.runner.load_benchmark` reads the file the record names,
:func:`saopd.eval.runner.grade_samples` grades with the record's grader, and ``saopd-eval`` takes
k and max new tokens from the record unless its config overrides them (``k``,
``k_per_benchmark``, ``max_new_tokens``). An unknown name fails with the list of registered ones.

Adding a benchmark: one :func:`register_benchmark` call below (and the stage that writes its
file); ``tests/eval/test_benchmarks.py`` checks every record. Plain Python: nothing here (nor in
:mod:`saopd.eval.graders`, whose registry lists the grader kinds) imports torch, so the records
can be listed anywhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from saopd.eval.graders import GRADERS
from saopd.registry import Registry
from saopd.validation import check_choice, check_int

__all__ = ["BENCHMARKS", "MODALITIES", "Benchmark", "register_benchmark"]

#: What a benchmark's prompts hold: ``text`` only, or ``vision`` (image parts: the model needs
#: its processor).
MODALITIES = ("text", "vision")

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_]*")  # names become file names and MLflow metric keys


@dataclass(frozen=True)
class Benchmark:
    """One benchmark's facts.

    Attributes:
        name: the registry name (``benchmarks=[<name>]``); lower case, digits, ``_``.
        file: the JSONL of problems, relative to ``saopd-eval``'s ``data_dir``
            (``data/prepared/eval``; ``../vlm_eval/<name>.jsonl`` for the paper's VLM
            benchmarks); None: the vendored GSM8K test split (``data/gsm8k/test.jsonl``).
        stage: the ``dvc repro`` stage that writes ``file`` (named when it is missing); None
            exactly when ``file`` is None.
        grader: a registered grader kind (:data:`saopd.eval.graders.GRADERS`: ``math``,
            ``vision``, ``mmifeval``, ``exact``).
        k: samples per problem in the paper (Avg@k; k = 1 is accuracy).
        max_new_tokens: the paper's response length limit.
        modality: one of :data:`MODALITIES`.
        description: one line: what the benchmark is.
        label: its column header in ``saopd-report``'s tables (None: the name).
        column: its place among the paper's columns (lower first; None: after them, by name).
    """

    name: str
    file: str | None
    stage: str | None
    grader: str
    k: int
    max_new_tokens: int
    modality: str
    description: str
    label: str | None = None
    column: int | None = None

    def __post_init__(self) -> None:
        owner = f"benchmark {self.name!r}"
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"benchmark name must match {_NAME_RE.pattern}, got {self.name!r}")
        if (self.file is None) != (self.stage is None):
            raise ValueError(f"{owner}: file and stage are both set or both None (the vendored "
                             f"GSM8K split), got file={self.file!r}, stage={self.stage!r}")
        if self.file is not None and (PurePosixPath(self.file).is_absolute()
                                      or not self.file.endswith(".jsonl")):
            raise ValueError(f"{owner}: file must be a .jsonl path relative to data_dir, "
                             f"got {self.file!r}")
        check_choice("grader", self.grader, tuple(GRADERS.names()), owner=owner)
        check_choice("modality", self.modality, MODALITIES, owner=owner)
        check_int("k", self.k, owner=owner)
        check_int("max_new_tokens", self.max_new_tokens, owner=owner)
        if self.column is not None:
            check_int("column", self.column, owner=owner)
        if self.label is not None and (not self.label.strip() or "\n" in self.label):
            raise ValueError(f"{owner}: label must be one non-empty line or None")
        if not self.description.strip() or "\n" in self.description:
            raise ValueError(f"{owner}: description must be one non-empty line")


#: Every known benchmark, by name (:meth:`saopd.registry.Registry.get` returns the record).
BENCHMARKS: Registry[Benchmark] = Registry("benchmark")


def register_benchmark(benchmark: Benchmark) -> Benchmark:
    """Add ``benchmark`` to :data:`BENCHMARKS` under its name (``ValueError`` if taken)."""
    BENCHMARKS.add(benchmark.name, benchmark)
    return benchmark


# Math (text). The paper: Avg@8 at 18,000 new tokens, plain accuracy (k = 1) for MATH500.
register_benchmark(Benchmark(
    "gsm8k", file=None, stage=None, grader="math", k=8, max_new_tokens=1024, modality="text",
    description="GSM8K test split: 1,319 grade-school word problems (vendored, data/gsm8k)",
    label="GSM8K", column=6))
register_benchmark(Benchmark(
    "math500", file="math500.jsonl", stage="prepare_eval", grader="math", k=1,
    max_new_tokens=18000, modality="text",
    description="MATH500: 500 competition problems of the MATH test set",
    label="Math500", column=1))
register_benchmark(Benchmark(
    "aime24", file="aime24.jsonl", stage="prepare_eval", grader="math", k=8,
    max_new_tokens=18000, modality="text",
    description="AIME 2024: 30 olympiad problems with integer answers",
    label="AIME24", column=4))
register_benchmark(Benchmark(
    "aime25", file="aime25.jsonl", stage="prepare_eval", grader="math", k=8,
    max_new_tokens=18000, modality="text",
    description="AIME 2025: 30 olympiad problems with integer answers",
    label="AIME25", column=3))
register_benchmark(Benchmark(
    "amc23", file="amc23.jsonl", stage="prepare_eval", grader="math", k=8,
    max_new_tokens=18000, modality="text", description="AMC 2023: 40 competition problems",
    label="AMC23", column=2))
register_benchmark(Benchmark(
    "minerva_math", file="minerva_math.jsonl", stage="prepare_eval", grader="math", k=8,
    max_new_tokens=18000, modality="text",
    description="Minerva Math (OCWCourses): 272 university STEM problems",
    label="Minerva", column=5))

# Vision-language (paper, Appendix B): Avg@8; 1,024 new tokens for visual understanding, 4,096
# for visual reasoning. Files beside data_dir: data/prepared/vlm (prepare_vlm) and
# data/prepared/vlm_eval (prepare_vlm_eval).
register_benchmark(Benchmark(
    "synth_vqa", file="../vlm/test.jsonl", stage="prepare_vlm", grader="vision", k=8,
    max_new_tokens=1024, modality="vision",
    description="Synthetic rendered VQA (counting, colour choice, bar values): prepare_vlm's test"))
register_benchmark(Benchmark(
    "evochart", file="../vlm_eval/evochart.jsonl", stage="prepare_vlm_eval", grader="vision",
    k=8, max_new_tokens=1024, modality="vision",
    description="EvoChart: chart question answering (numbers within 5%, short text)",
    label="EvoChart", column=7))
register_benchmark(Benchmark(
    "mmifeval", file="../vlm_eval/mmifeval.jsonl", stage="prepare_vlm_eval", grader="mmifeval",
    k=8, max_new_tokens=1024, modality="vision",
    description="MM-IFEval: multimodal instruction following, scored per constraint",
    label="MMIFEval", column=8))
register_benchmark(Benchmark(
    "countqa", file="../vlm_eval/countqa.jsonl", stage="prepare_vlm_eval", grader="vision",
    k=8, max_new_tokens=1024, modality="vision",
    description="CountQA: counting objects in real photographs (exact integer)",
    label="CountQA", column=9))
register_benchmark(Benchmark(
    "mathvision", file="../vlm_eval/mathvision.jsonl", stage="prepare_vlm_eval",
    grader="vision", k=8, max_new_tokens=4096, modality="vision",
    description="MATH-Vision: competition math with figures (option letters or math-verify)",
    label="MathVision", column=10))
register_benchmark(Benchmark(
    "geo3k", file="../vlm_eval/geo3k.jsonl", stage="prepare_vlm_eval", grader="math", k=8,
    max_new_tokens=4096, modality="vision",
    description="Geometry3K: geometry problems with diagrams (math-verify)",
    label="Geo3K", column=11))
register_benchmark(Benchmark(
    "mathvista", file="../vlm_eval/mathvista.jsonl", stage="prepare_vlm_eval",
    grader="vision", k=8, max_new_tokens=4096, modality="vision",
    description="MathVista testmini: visual math (option letters, numbers, short text)",
    label="MathVista", column=12))

# The arithmetic testbed (saopd/stages/testbed.py; experiments/testbed): held-out addition
# problems with exact answers; the teacher's planted habit phrases are counted per sample.
register_benchmark(Benchmark(
    "arith", file="../testbed/test.jsonl", stage="testbed_data", grader="exact", k=1,
    max_new_tokens=96, modality="text",
    description="Arithmetic testbed: held-out multi-digit additions, exact answer, habit rates"))
# The tic testbed (experiments/testbed, "The tic study"): the same held-out problems; the rate of
# the teacher's tic (a wrong re-answer after the answer line) is counted per sample (phrase_tic).
register_benchmark(Benchmark(
    "arith_tic", file="../testbed_tic/test.jsonl", stage="testbed_tic_data", grader="exact",
    k=1, max_new_tokens=96, modality="text",
    description="Tic testbed: the arithmetic problems, exact answer, tic and habit rates"))
