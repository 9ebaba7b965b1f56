"""Evaluation: the benchmark records, answer extraction and grading, and the Avg@k runner.

``benchmarks``: :data:`BENCHMARKS`, one :class:`Benchmark` record per benchmark; ``math``:
answer extraction and equality for math answers; ``grading``: math grading under a deadline, in
worker processes; ``vision`` / ``mmifeval``: the vision-language answer formats and MM-IFEval's
constraints; ``runner``: loading a benchmark, sampling and Avg@k.
"""

from saopd.eval.benchmarks import BENCHMARKS, Benchmark, register_benchmark
from saopd.eval.grading import GradeResult, grade, grade_detailed, grade_many, grade_many_detailed
from saopd.eval.math import GoldAnswerError, extract_answer, normalize_answer

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "GoldAnswerError",
    "GradeResult",
    "extract_answer",
    "grade",
    "grade_detailed",
    "grade_many",
    "grade_many_detailed",
    "normalize_answer",
    "register_benchmark",
]
