"""The real-vLLM suite runs its modules in ``conftest.MODULE_ORDER`` (those that mostly wait
first, those that keep both cores busy last), which lists every module of the folder; tests
elsewhere keep their places. Needs no vLLM: it runs in both suites."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.integration.vllm.conftest import HERE, MODULE_ORDER, pytest_collection_modifyitems


def test_every_module_of_the_folder_has_its_place() -> None:
    modules = sorted(p.stem for p in HERE.glob("test_*.py"))
    assert sorted(MODULE_ORDER) == modules
    assert len(set(MODULE_ORDER)) == len(MODULE_ORDER)


def test_the_folder_runs_in_that_order_and_other_tests_keep_their_places() -> None:
    def item(path: Path, name: str) -> SimpleNamespace:
        return SimpleNamespace(path=path, name=name)

    last, first = HERE / f"{MODULE_ORDER[-1]}.py", HERE / f"{MODULE_ORDER[1]}.py"
    other = Path(__file__).parents[1] / "test_train.py"
    items = [item(other, "a"), item(last, "l1"), item(HERE / "test_new.py", "n"),
             item(last, "l2"), item(other, "b"), item(first, "f")]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.name for i in items] == ["a", "n", "f", "l1", "b", "l2"]
