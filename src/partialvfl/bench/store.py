"""The results store: one SQLite file (``results.sqlite`` in the store directory), one row per (fit, test mechanism).

Each row says what it is (the table ``results`` below): the config hash that is its unique key, the fit it belongs
to, the code version that produced it, method / preset / overrides / resolved parameters / variant, dataset and its
protocol (parties, labels, aligned), training and test mechanisms, seed, the metric (accuracy for classification,
RMSE for regression) overall and by number of observed parties (JSON), fit and predict seconds, bytes
communicated between parties during the fit, hostname, start and finish timestamps, and a status ``done`` or
``failed`` with the error text.

Safety: the database runs in WAL mode with a busy timeout, and every write is one transaction; the unique key makes a
rewrite of a row replace it.  Two runs writing to one store therefore neither corrupt it nor duplicate a row (if both
compute the same cell, the later write wins).
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["COLUMNS", "ResultStore", "SourceChanged", "code_version", "now_utc", "source_fingerprint"]

STORE_FILE = "results.sqlite"
SCHEMA_VERSION = 3  # 2: source, role, data_stats; 3: tuning (added to older stores on open)

#: Column name -> SQL type and meaning.
COLUMNS: dict[str, tuple[str, str]] = {
    "config_hash": ("TEXT PRIMARY KEY", "hash of everything that defines the row (fit config + test mechanism)"),
    "cell_hash": ("TEXT NOT NULL", "hash of the fit config: rows of one fit share it"),
    "grid": ("TEXT", "name of the grid that produced the row"),
    "code_version": ("TEXT", "git describe of the code, else the package version"),
    "method": ("TEXT NOT NULL", "registry name of the method"),
    "label": ("TEXT NOT NULL", "display label (entries sharing a label are variants of one method)"),
    "preset": ("TEXT", "method preset"),
    "overrides": ("TEXT", "JSON: parameter overrides given in the grid"),
    "params": ("TEXT", "JSON: the resolved parameters of the fitted model"),
    "variant": ("TEXT", "'labelled-only' when the fitted model did not pretrain on unlabelled data, else NULL"),
    "tuning": ("TEXT", "JSON: a tuned grid's candidate: the entry's index and its tuned values (lr, min_steps)"),
    "dataset": ("TEXT NOT NULL", "the dataset entry's display label (its source name unless the grid names it)"),
    "source": ("TEXT", "data source name"),
    "dataset_config": ("TEXT", "JSON: the dataset's protocol settings"),
    "parties": ("INTEGER", "number of parties"),
    "labels": ("INTEGER", "labelled training samples"),
    "aligned": ("INTEGER", "fully observed labelled training samples"),
    "train_mechanism": ("TEXT NOT NULL", "missingness mechanism of the training set"),
    "test_mechanism": ("TEXT NOT NULL", "missingness mechanism of the test set ('validation' for a selection fit)"),
    "role": ("TEXT", "'test' (a fit on all labels, scored on a test set) or 'validation' (a selection fit on part "
                     "of the labels, scored on the held-out labelled training rows)"),
    "seed": ("INTEGER NOT NULL", "seed of data protocol and method"),
    "metric": ("TEXT", "'accuracy' or 'rmse'"),
    "accuracy": ("REAL", "test accuracy in [0, 1] (classification)"),
    "rmse": ("REAL", "test RMSE (regression)"),
    "by_observed": ("TEXT", "JSON: metric by number of observed parties"),
    "data_stats": ("TEXT", "JSON: the training data as the method saw it (observed patterns, pattern-batch sizes, "
                           "the split's importance shares)"),
    "n_test": ("INTEGER", "labelled test samples"),
    "fit_seconds": ("REAL", "training time of the fit"),
    "predict_seconds": ("REAL", "prediction time on this test set"),
    "bytes_communicated": ("INTEGER", "bytes that crossed between parties during the fit"),
    "hostname": ("TEXT", "machine that ran the fit"),
    "device": ("TEXT", "how the fit ran: its device (a GPU with its name), and 'bf16' / 'compiled' when so"),
    "started_at": ("TEXT", "UTC time the fit started"),
    "finished_at": ("TEXT", "UTC time the row was written"),
    "status": ("TEXT NOT NULL", "'done' or 'failed'"),
    "error": ("TEXT", "error text of a failed fit"),
}


def now_utc() -> str:
    """The current UTC time in ISO 8601, to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def code_version() -> str:
    """``git describe --always --dirty`` of the package's checkout if it is one, else the package version."""
    from partialvfl import __version__

    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"], cwd=here, capture_output=True, text=True,
            timeout=10, check=True,
        )
        described = out.stdout.strip()
        if described:
            return f"{__version__}+{described}"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


def source_fingerprint() -> dict[str, tuple[int, int]]:
    """Size and modification time of every ``.py`` file of the installed ``partialvfl`` package, by relative path."""
    root = Path(__file__).resolve().parent.parent
    out: dict[str, tuple[int, int]] = {}
    for path in root.rglob("*.py"):
        try:
            st = path.stat()
        except OSError:  # removed while we walk: a change, seen as a missing entry
            continue
        out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


class SourceChanged(RuntimeError):
    """The package's source files changed after this process started using them."""

    def __init__(self, before: dict[str, tuple[int, int]], now: dict[str, tuple[int, int]]) -> None:
        changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        super().__init__(
            f"the partialvfl source changed while this grid ran ({shown}): this process already runs the old code "
            "and would import the new code lazily, so a fit could mix both under one recorded code version.  Rerun "
            "the grid from an unchanged checkout (e.g. a git clone); finished fits are kept.")
        self.changed = changed


class ResultStore:
    """The SQLite results store in ``directory`` (created if needed)."""

    def __init__(self, directory: str | Path, *, create: bool = True) -> None:
        self.directory = Path(directory)
        self.path = self.directory / STORE_FILE
        if not create and not self.path.exists():
            raise FileNotFoundError(f"no results store in {self.directory} (expected {self.path})")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA busy_timeout=60000")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        with self.transaction():
            cols = ",\n  ".join(f"{name} {sql}" for name, (sql, _) in COLUMNS.items())
            self._conn.execute(f"CREATE TABLE IF NOT EXISTS results (\n  {cols}\n)")
            have = {r[1] for r in self._conn.execute("PRAGMA table_info(results)")}
            for name, (sql, _) in COLUMNS.items():  # a store written by an older version gains the new columns
                if name not in have:
                    self._conn.execute(f"ALTER TABLE results ADD COLUMN {name} {sql}")
            self._conn.execute("CREATE INDEX IF NOT EXISTS results_cell ON results(cell_hash)")
            self._conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            self._conn.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )

    def close(self) -> None:
        """Close the store's database connection."""
        self._conn.close()

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``: takes the write lock up front, waits for other writers)."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    # ------------------------------------------------------------------ writing
    def write(self, rows: Iterable[dict[str, Any]]) -> int:
        """Insert or replace rows (all in one transaction); JSON-able dict/list values are stored as JSON text."""
        rows = [self._encode(r) for r in rows]
        if not rows:
            return 0
        names = list(COLUMNS)
        placeholders = ", ".join(f":{n}" for n in names)
        updates = ", ".join(f"{n}=excluded.{n}" for n in names if n != "config_hash")
        sql = (f"INSERT INTO results ({', '.join(names)}) VALUES ({placeholders}) "
               f"ON CONFLICT(config_hash) DO UPDATE SET {updates}")
        with self.transaction() as conn:
            conn.executemany(sql, rows)
        return len(rows)

    @staticmethod
    def _encode(row: dict[str, Any]) -> dict[str, Any]:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ValueError(f"unknown result column(s): {', '.join(sorted(unknown))}")
        for key in ("config_hash", "cell_hash", "method", "dataset", "train_mechanism", "test_mechanism",
                    "seed", "status"):
            if row.get(key) is None:
                raise ValueError(f"a result row needs {key!r}: {row}")
        if row["status"] not in ("done", "failed"):
            raise ValueError(f"status must be 'done' or 'failed', got {row['status']!r}")
        out = {name: row.get(name) for name in COLUMNS}
        if out["label"] is None:
            out["label"] = out["method"]
        for k, v in out.items():
            if isinstance(v, (dict, list, tuple)):
                out[k] = json.dumps(v, sort_keys=True, default=str)
        if out["hostname"] is None:
            out["hostname"] = socket.gethostname()
        if out["finished_at"] is None:
            out["finished_at"] = now_utc()
        return out

    # ------------------------------------------------------------------ reading
    def done_keys(self) -> set[str]:
        """Config hashes of the rows finished successfully."""
        return {r[0] for r in self._conn.execute("SELECT config_hash FROM results WHERE status = 'done'")}

    def rows(self, *, status: str | None = "done") -> list[dict[str, Any]]:
        """All rows (of one status, or all with ``None``) as dicts, JSON columns decoded."""
        sql = "SELECT * FROM results" + (" WHERE status = ?" if status else "") + " ORDER BY rowid"
        cur = self._conn.execute(sql, (status,) if status else ())
        out = []
        for r in cur:
            d = dict(r)
            for k in ("overrides", "params", "by_observed", "dataset_config", "data_stats", "tuning"):
                if d.get(k):
                    d[k] = json.loads(d[k])
            out.append(d)
        return out

    def count(self, status: str | None = None) -> int:
        """How many rows the store holds (with ``status``: those rows only)."""
        sql = "SELECT COUNT(*) FROM results" + (" WHERE status = ?" if status else "")
        return int(self._conn.execute(sql, (status,) if status else ()).fetchone()[0])

    def dataframe(self, *, status: str | None = "done"):  # pandas.DataFrame
        """The rows (of ``status``; ``None``: all) as a pandas DataFrame."""
        import pandas as pd

        rows = self.rows(status=status)
        return pd.DataFrame(rows, columns=list(COLUMNS) if not rows else None)
