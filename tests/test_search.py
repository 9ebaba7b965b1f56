"""Pieces of ``saopd.search`` (the Optuna search's storage, ties and resume plan) in process;
the searches themselves run in tests/integration/test_hparams_search.py and
tests/hostile/test_studies.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from saopd.search import prepare_sqlite_storage, tie_line


def test_a_sqlite_storage_is_stamped_so_that_optuna_opens_it_and_alembic_says_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import optuna

    url = f"sqlite:///{tmp_path / 'new' / 'search.db'}"
    alembic = logging.getLogger("alembic")
    before = alembic.level  # MLflow may have set it already in this process
    alembic.setLevel(logging.INFO)  # a level that would let its lines through
    try:
        with caplog.at_level(logging.INFO):
            db = prepare_sqlite_storage(url)
        assert alembic.level == logging.INFO  # its level is given back
    finally:
        alembic.setLevel(before)
    assert db == tmp_path / "new" / "search.db" and db.is_file()  # the folder is made
    assert [r.getMessage() for r in caplog.records if r.name.startswith("alembic")] == []
    # opens: the schema version is committed
    optuna.create_study(storage=url, study_name="s").optimize(lambda t: 1.0, n_trials=1)
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 1
    assert prepare_sqlite_storage(url) == db  # a stamped database is left as it is


def test_other_storages_are_not_touched() -> None:
    assert prepare_sqlite_storage(None) is None
    assert prepare_sqlite_storage("postgresql://host/db") is None


def test_a_tie_is_one_line_naming_the_tied_trials() -> None:
    assert tie_line({0: [0.5], 1: [0.7]}, [0.7]) is None
    line = tie_line({0: [0.7], 1: [0.5], 2: [0.7]}, [0.7])
    assert line is not None and "2 of 3 completed trials share the best value 0.7 (#0, #2)" \
        in line and "every" not in line
    assert "(every completed trial)" in tie_line({0: [0.7], 1: [0.7]}, [0.7])
