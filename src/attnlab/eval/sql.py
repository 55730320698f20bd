"""Running SQL that a model wrote, without letting it touch anything.

Every query runs on a fresh read-only connection (a `file:...?mode=ro` URI) with:

- an authorizer that allows reading and nothing else (no ATTACH, no PRAGMA, no writes,
  no schema changes, no transactions),
- `PRAGMA query_only` and a limit of zero attached databases as second lines of defence,
- a per-query time limit, enforced by a progress handler that interrupts the query,
- a cap on the rows fetched.

A query that breaks any of these fails with a `SQLResult.error`; it never raises, never
changes the database file and never stops the evaluation.
"""

from __future__ import annotations

import sqlite3
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_PROGRESS_OPCODES = 1000  # the progress handler runs every this many virtual-machine instructions


@dataclass
class SQLResult:
    rows: list[tuple] | None  # None when the query failed
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _authorize(action, arg1, arg2, db_name, trigger) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def _read_only_uri(path: Path) -> str:
    return f"file:{urllib.parse.quote(str(Path(path).resolve()))}?mode=ro"


def run_query(db_path: str | Path, sql: str, timeout_s: float = 5.0, max_rows: int = 10_000) -> SQLResult:
    """Rows of `sql` on the database at `db_path`, or the reason it could not run."""
    if not Path(db_path).is_file():
        return SQLResult(None, f"database not found: {db_path}")
    sql = sql.strip()
    if not sql:
        return SQLResult(None, "empty query")
    try:
        conn = sqlite3.connect(_read_only_uri(db_path), uri=True, timeout=1.0, check_same_thread=False)
    except sqlite3.Error as e:
        return SQLResult(None, f"cannot open database read-only: {e}")
    try:
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.execute("PRAGMA query_only = ON")
        conn.set_authorizer(_authorize)
        conn.text_factory = lambda b: b.decode("utf-8", errors="replace")
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, _PROGRESS_OPCODES)
        try:
            cursor = conn.execute(sql)
            rows = cursor.fetchmany(max_rows + 1)
        except sqlite3.OperationalError as e:
            if "interrupted" in str(e):
                return SQLResult(None, f"time limit of {timeout_s:g} s exceeded")
            return SQLResult(None, f"{type(e).__name__}: {e}")
        except (sqlite3.Error, ValueError, OverflowError, MemoryError) as e:
            return SQLResult(None, f"{type(e).__name__}: {e}")
        if len(rows) > max_rows:
            return SQLResult(None, f"more than {max_rows} rows returned")
        return SQLResult([tuple(r) for r in rows])
    finally:
        conn.close()


def results_match(gold: list[tuple], predicted: list[tuple], ordered: bool) -> bool:
    """Same rows; in the same order only when `ordered` (the gold query has ORDER BY), else as multisets."""
    if ordered:
        return gold == predicted
    return Counter(gold) == Counter(predicted)
