"""Evaluation: answer extraction and grading for math benchmarks."""

from saopd.eval.math import (
    GoldAnswerError,
    GradeResult,
    extract_answer,
    grade,
    grade_detailed,
    grade_many,
    grade_many_detailed,
    normalize_answer,
)

__all__ = [
    "GoldAnswerError",
    "GradeResult",
    "extract_answer",
    "grade",
    "grade_detailed",
    "grade_many",
    "grade_many_detailed",
    "normalize_answer",
]
