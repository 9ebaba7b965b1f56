"""The suite's order (tests/conftest.py): long modules first, whole, so that `pytest -n 2
--dist worksteal` ends on short tests the workers share out."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.conftest import pytest_collection_modifyitems


@dataclass
class Item:
    nodeid: str
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


def test_long_modules_come_first_whole_and_each_group_keeps_its_order() -> None:
    items = [Item("tests/analysis/test_a.py::t1"),
             Item("tests/models/test_m.py::fast"),
             Item("tests/models/test_m.py::big", {"slow"}),
             Item("tests/models/test_m.py::fast2"),
             Item("tests/config/test_c.py::t1"),
             Item("tests/integration/test_i.py::t1"),
             Item("tests/hostile/test_h.py::t1"),
             Item("tests/runs/test_sweeps.py::t1"),
             Item("tests/runs/test_folder.py::t1")]
    pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        "tests/models/test_m.py::fast", "tests/models/test_m.py::big",
        "tests/models/test_m.py::fast2", "tests/integration/test_i.py::t1",
        "tests/hostile/test_h.py::t1", "tests/runs/test_sweeps.py::t1",
        "tests/analysis/test_a.py::t1", "tests/config/test_c.py::t1",
        "tests/runs/test_folder.py::t1"]
