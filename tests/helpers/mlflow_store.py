"""Fresh MLflow SQLite stores for tests without MLflow's schema migrations each time.

A new SQLite file makes MLflow run every Alembic migration of its schema (about 4 s on the
2-core machine, against 0.01 s to open a store already migrated). :func:`sqlite_store` copies
one migrated, empty store made once per test process instead, so that each test still gets a
store of its own. The copy holds no experiment: MLflow creates its ``Default`` experiment when
it first opens the copy, with the copy's own artifact root, as it does in a new file. Tests of
the store's creation itself (``saopd.runs.tracking``'s tests, the default URI) keep new
files.
"""

from __future__ import annotations

import atexit
import shutil
import sqlite3
import tempfile
from pathlib import Path

_template: Path | None = None


def _migrated_empty_store() -> Path:
    """The template: MLflow's current schema, no experiment, no run (made once per process)."""
    global _template
    if _template is None:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        folder = Path(tempfile.mkdtemp(prefix="saopd-mlflow-template-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        db = folder / "mlflow.db"
        store = SqlAlchemyStore(f"sqlite:///{db}", str(folder / "artifacts"))
        store.engine.dispose()
        with sqlite3.connect(db) as con:  # the Default experiment carries the template's root
            con.execute("DELETE FROM experiment_tags")
            con.execute("DELETE FROM experiments")
        con.close()
        _template = db
    return _template


def sqlite_store(db: Path) -> str:
    """``sqlite:///<db>``, with ``db`` a copy of a migrated, empty MLflow store if it does not
    exist yet (its folder is made). An existing file is left as it is."""
    if not db.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_migrated_empty_store(), db)
    return f"sqlite:///{db}"
