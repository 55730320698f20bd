"""Running SQL that a model wrote, without letting it touch anything or run away.

Every query runs on a fresh read-only connection (a `file:...?mode=ro` URI) with:

- an authorizer that allows reading and nothing else (no ATTACH, no PRAGMA, no writes,
  no schema changes, no transactions) and refuses the functions that reach outside the
  database or the process (`fts3_tokenizer`, which returns a pointer, `load_extension`,
  `readfile`, `writefile`, ...),
- `PRAGMA query_only` and a limit of zero attached databases as second lines of defence,
- SQLite's own size limits: no string or blob longer than `max_value_bytes` (so `zeroblob`,
  `printf` or `replace` cannot build a huge value), at most `MAX_COLUMNS` result columns,
  short LIKE/GLOB patterns and short statements,
- a time limit, enforced inside SQLite by a progress handler that interrupts the query every
  `_PROGRESS_OPCODES` instructions of its virtual machine,
- a cap on the rows fetched and on their total size (`max_result_bytes`), counted row by row.

One instruction of SQLite's virtual machine can still run for long (`printf('%.*c', 2147483647,
'x')` loops for about 20 s inside one call, `instr` on two long strings is quadratic), and no
progress handler or `interrupt()` reaches inside it. So on POSIX systems the query runs in a
worker process (this file, run as a script) with its address space capped at `WORKER_MEMORY_MB`;
the caller waits at most the time limit plus `_KILL_GRACE_S` for the answer and otherwise kills
the worker (a new one starts with the next query). The evaluating process never holds more than
one query's result, whatever the query.

A query that breaks any of these fails with a `SQLResult.error`; it never raises, never
changes the database file and never stops the evaluation.
"""

from __future__ import annotations

import atexit
import marshal
import os
import select
import signal
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
# Functions that reach outside the database or the process: fts3_tokenizer('simple') returns the address
# of a C structure (and with two arguments installs one); the others read or write files or load code.
_DENIED_FUNCTIONS = frozenset({
    "fts3_tokenizer", "fts5", "load_extension", "readfile", "writefile", "edit", "zipfile",
    "sqlar_compress", "sqlar_uncompress", "fts5_source_id", "sqlite_dbpage",
})
_PROGRESS_OPCODES = 100  # the progress handler runs every this many virtual-machine instructions
MAX_VALUE_BYTES = 1_000_000  # longest string or blob a query may build or read (SQLITE_LIMIT_LENGTH)
MAX_RESULT_BYTES = 16_000_000  # total size of the rows returned
MAX_COLUMNS = 128  # result columns (and table columns in a schema): one row holds at most MAX_COLUMNS * MAX_VALUE_BYTES
MAX_PATTERN_BYTES = 1_000  # LIKE / GLOB pattern length (matching costs up to pattern x value length)
MAX_SQL_BYTES = 100_000  # length of the statement itself
WORKER_MEMORY_MB = 1024  # address space of the worker process that runs the queries
_KILL_GRACE_S = 0.5  # how long after the time limit the worker is killed if it has not answered


@dataclass
class SQLResult:
    rows: list[tuple] | None  # None when the query failed
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _authorize(action, arg1, arg2, db_name, trigger) -> int:
    if action == sqlite3.SQLITE_FUNCTION:
        return sqlite3.SQLITE_DENY if str(arg2).lower() in _DENIED_FUNCTIONS else sqlite3.SQLITE_OK
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def _read_only_uri(path: Path) -> str:
    return f"file:{urllib.parse.quote(str(Path(path).resolve()))}?mode=ro"


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes)) else 8


def run_query(db_path: str | Path, sql: str, timeout_s: float = 5.0, max_rows: int = 10_000,
              max_value_bytes: int = MAX_VALUE_BYTES, max_result_bytes: int = MAX_RESULT_BYTES) -> SQLResult:
    """Rows of `sql` on the database at `db_path`, or the reason it could not run."""
    if not Path(db_path).is_file():
        return SQLResult(None, f"database not found: {db_path}")
    sql = sql.strip()
    if not sql:
        return SQLResult(None, "empty query")
    if len(sql.encode("utf-8", "replace")) > MAX_SQL_BYTES:
        return SQLResult(None, f"query longer than {MAX_SQL_BYTES:,} bytes")
    request = {"db": str(Path(db_path).resolve()), "sql": sql, "timeout_s": float(timeout_s), "max_rows": int(max_rows),
               "max_value_bytes": int(max_value_bytes), "max_result_bytes": int(max_result_bytes)}
    if os.name != "posix":  # no worker (select on pipes, rlimits): the in-process limits only
        return _execute(**request)
    return _WORKER.run(request)


def _execute(db: str, sql: str, timeout_s: float, max_rows: int, max_value_bytes: int, max_result_bytes: int) -> SQLResult:
    """Run one query in this process, under every limit that SQLite itself can enforce."""
    deadline = time.monotonic() + timeout_s
    try:
        conn = sqlite3.connect(_read_only_uri(Path(db)), uri=True, timeout=1.0, check_same_thread=False)
    except sqlite3.Error as e:
        return SQLResult(None, f"cannot open database read-only: {e}")
    try:
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
        conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, MAX_COLUMNS)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, MAX_PATTERN_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, MAX_SQL_BYTES)
        conn.execute("PRAGMA query_only = ON")
        conn.set_authorizer(_authorize)
        conn.text_factory = lambda b: b.decode("utf-8", errors="replace")
        conn.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, _PROGRESS_OPCODES)
        rows, total = [], 0
        try:
            for row in conn.execute(sql):
                total += sum(_size(v) for v in row)
                if total > max_result_bytes:
                    return SQLResult(None, f"result larger than {max_result_bytes:,} bytes")
                rows.append(tuple(row))
                if len(rows) > max_rows:
                    return SQLResult(None, f"more than {max_rows} rows returned")
        except sqlite3.OperationalError as e:
            if "interrupted" in str(e):
                return SQLResult(None, f"time limit of {timeout_s:g} s exceeded")
            return SQLResult(None, f"{type(e).__name__}: {e}")
        except sqlite3.DataError as e:
            if "too big" in str(e):
                return SQLResult(None, f"a string or blob longer than the limit of {max_value_bytes:,} bytes")
            return SQLResult(None, f"{type(e).__name__}: {e}")
        except MemoryError:
            return SQLResult(None, f"the query needed more than {WORKER_MEMORY_MB} MB of memory")
        except (sqlite3.Error, ValueError, OverflowError) as e:
            return SQLResult(None, f"{type(e).__name__}: {e}")
        if time.monotonic() > deadline:
            return SQLResult(None, f"time limit of {timeout_s:g} s exceeded")
        return SQLResult(rows)
    finally:
        conn.close()


# --- the worker process ----------------------------------------------------------------------------
# Messages on its stdin / stdout: a 4-byte big-endian length, then a marshal'd value (requests are dicts
# of plain values, answers (rows, error) with rows of str, bytes, int, float and None: marshal's types).


def _send(stream, value) -> None:
    data = marshal.dumps(value)
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    data = stream.read(n)
    return marshal.loads(data) if len(data) == n else None


def _serve() -> None:
    """The worker's loop: one request in, one answer out, until stdin closes."""
    import resource

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the evaluating process's to handle
    limit = WORKER_MEMORY_MB * 2**20
    try:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ValueError, OSError):
        pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    _send(stdout, "ready")
    while (request := _receive(stdin)) is not None:
        try:
            result = _execute(**request)
            _send(stdout, (result.rows, result.error))
        except MemoryError:
            _send(stdout, (None, f"the query needed more than {WORKER_MEMORY_MB} MB of memory"))


class _Worker:
    """The evaluating process's side: starts the worker on demand, kills it when a query overruns."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.pid = 0  # the process that started `proc` (a forked child starts its own)
        self.lock = threading.Lock()
        self.warned = False

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(Path(__file__).resolve())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=os.path.abspath(os.sep), close_fds=True)
        self.pid = os.getpid()
        if self._wait_answer(60.0) != "ready":
            self.stop()
            raise OSError("the SQL worker process did not start")

    def _wait_answer(self, timeout_s: float):
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout_s, 0.0))
        return _receive(self.proc.stdout) if ready else None

    def stop(self) -> None:
        if self.proc is not None and self.pid == os.getpid():
            try:
                self.proc.kill()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        self.proc = None

    def run(self, request: dict) -> SQLResult:
        with self.lock:
            if self.proc is None or self.pid != os.getpid() or self.proc.poll() is not None:
                self.proc = None
                try:
                    self._start()
                except OSError as e:  # no worker here (no interpreter to start, a zipped install): SQLite's limits only
                    if not self.warned:
                        warnings.warn(f"cannot start the SQL worker process ({e}): queries run in this process, "
                                      "bounded by SQLite's limits but not killed at the time limit", stacklevel=3)
                        self.warned = True
                    return _execute(**request)
            try:
                _send(self.proc.stdin, request)
                answer = self._wait_answer(request["timeout_s"] + _KILL_GRACE_S)
            except (OSError, ValueError, EOFError):
                answer = None
            if isinstance(answer, tuple) and len(answer) == 2:
                rows, error = answer
                return SQLResult(None if error is not None else [tuple(r) for r in rows], error)
            died = self.proc.poll() is not None
            self.stop()
            if died:
                return SQLResult(None, f"the query ended the SQL worker process (more than {WORKER_MEMORY_MB} MB of memory?)")
            return SQLResult(None, f"time limit of {request['timeout_s']:g} s exceeded (the query was stopped)")


_WORKER = _Worker()
atexit.register(_WORKER.stop)


def results_match(gold: list[tuple], predicted: list[tuple], ordered: bool) -> bool:
    """Same rows; in the same order only when `ordered` (the gold query has ORDER BY), else as multisets."""
    if ordered:
        return gold == predicted
    return Counter(gold) == Counter(predicted)


if __name__ == "__main__":
    _serve()
