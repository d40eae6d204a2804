"""Durable state of batch jobs (OpenAI's Batch API) in one SQLite database.

Three tables: ``files`` (uploaded inputs and produced outputs, their bytes in the row),
``batches`` (one row per job: status, timestamps, metadata) and ``lines`` (one row per request
line of a job: its request body, ``pending`` | ``done`` | ``failed``, and once answered its
output-file line as JSON).

Guarantees the worker builds on:

- A line's result and its status are written in one transaction, and only while the line is
  still ``pending`` and its batch still runs (:meth:`BatchStore.record`): a line is answered at
  most once however often it is executed, and never after its batch was finalized.
- A batch's lines are all inserted in the same transaction that moves it from ``validating`` to
  ``in_progress``; its output files are written in the same transaction that makes it
  ``completed`` / ``cancelled``. A crash between any two transactions leaves a state the worker
  resumes from (see :meth:`BatchStore.active_batches`).

Every method is synchronous and thread-safe: one connection (WAL journal, ``synchronous=FULL``)
behind a lock. Callers on an event loop run them with ``asyncio.to_thread``. One process at a
time should run batches from a given database.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

JSON = dict[str, Any]
SCHEMA_VERSION = 2  # 2: batches.tenant
# Statuses a batch passes through; the first four are "active": the worker still owes work.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "cancelled", "expired")
COMPLETION_WINDOW_S = {"24h": 24 * 3600}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id         TEXT PRIMARY KEY,
    purpose    TEXT NOT NULL,
    filename   TEXT NOT NULL,
    bytes      INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    data       BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq               INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order, for listing
    id                TEXT NOT NULL UNIQUE,
    endpoint          TEXT NOT NULL,
    input_file_id     TEXT NOT NULL REFERENCES files(id),
    completion_window TEXT NOT NULL,
    status            TEXT NOT NULL,
    model             TEXT,
    metadata          TEXT,            -- JSON object or NULL
    tenant            TEXT,            -- the creating API key's tenant (server.guard), or NULL
    errors            TEXT,            -- JSON list of {code, message, param, line} or NULL
    output_file_id    TEXT,
    error_file_id     TEXT,
    created_at        INTEGER NOT NULL,
    expires_at        INTEGER,
    in_progress_at    INTEGER,
    finalizing_at     INTEGER,
    completed_at      INTEGER,
    failed_at         INTEGER,
    cancelling_at     INTEGER,
    cancelled_at      INTEGER
);
CREATE INDEX IF NOT EXISTS batches_status ON batches(status);
CREATE TABLE IF NOT EXISTS lines (
    batch_id          TEXT NOT NULL REFERENCES batches(id),
    idx               INTEGER NOT NULL,  -- position among the input's request lines
    custom_id         TEXT,
    request           TEXT,              -- the line's body (JSON); NULL if the line was refused
    status            TEXT NOT NULL CHECK (status IN ('pending', 'done', 'failed')),
    result            TEXT,              -- its output / error file line (JSON) once answered
    prompt_tokens     INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, idx)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS lines_status ON lines(batch_id, status);
"""


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


@dataclass(frozen=True)
class LineRecord:
    """One request line as the validation step stores it."""

    idx: int
    custom_id: str | None
    request: JSON | None  # the body; None when the line was refused
    result: JSON | None = None  # set (an error-file line) when the line was refused


@dataclass(frozen=True)
class PendingLine:
    """A line still owed an answer."""

    batch_id: str
    endpoint: str
    idx: int
    custom_id: str
    body: JSON
    tenant: str | None = None  # runs in its batch creator's cache namespace


@dataclass(frozen=True)
class ActiveBatch:
    id: str
    status: str
    endpoint: str
    input_file_id: str


class BatchStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                   timeout=30.0)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} was written by a newer quickdraft "
                                   f"(schema {version} > {SCHEMA_VERSION})")
            if version == 1:  # written before batches had a tenant: theirs run tenant-less
                self._db.execute("ALTER TABLE batches ADD COLUMN tenant TEXT")
            self._db.executescript(_SCHEMA)  # idempotent (IF NOT EXISTS)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (taken up front, so concurrent writers queue, never deadlock)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            cur = self._db.execute(sql, args)
            cur.row_factory = sqlite3.Row  # type: ignore[assignment]
            return list(cur.fetchall())

    # ------------------------------------------------------------------ files

    def create_file(self, data: bytes, filename: str, purpose: str) -> JSON:
        with self._tx() as db:
            return self._insert_file(db, data, filename, purpose)

    @staticmethod
    def _insert_file(db: sqlite3.Connection, data: bytes, filename: str, purpose: str) -> JSON:
        file_id, created = new_id("file-"), now()
        db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, data) "
                   "VALUES (?, ?, ?, ?, ?, ?)", (file_id, purpose, filename, len(data),
                                                 created, data))
        return _file_view(file_id, purpose, filename, len(data), created)

    def get_file(self, file_id: str) -> JSON | None:
        rows = self._read("SELECT id, purpose, filename, bytes, created_at FROM files "
                          "WHERE id = ?", (file_id,))
        return _file_view(*rows[0]) if rows else None

    def file_content(self, file_id: str) -> bytes | None:
        rows = self._read("SELECT data FROM files WHERE id = ?", (file_id,))
        return bytes(rows[0][0]) if rows else None

    # ------------------------------------------------------------------ batches

    def create_batch(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None, model: str | None = None,
                     tenant: str | None = None) -> JSON:
        """A new batch in ``validating``; its lines will run as ``tenant`` (the creating API
        key's: they share prefix-cache blocks and drafting history only with that key)."""
        batch_id, created = new_id("batch_"), now()
        expires = created + COMPLETION_WINDOW_S.get(completion_window, 24 * 3600)
        with self._tx() as db:
            db.execute("INSERT INTO batches (id, endpoint, input_file_id, completion_window, "
                       "status, model, metadata, tenant, created_at, expires_at) "
                       "VALUES (?, ?, ?, ?, 'validating', ?, ?, ?, ?, ?)",
                       (batch_id, endpoint, input_file_id, completion_window, model,
                        None if metadata is None else orjson.dumps(metadata).decode(),
                        tenant, created, expires))
        batch = self.get_batch(batch_id)
        assert batch is not None
        return batch

    def get_batch(self, batch_id: str) -> JSON | None:
        rows = self._read("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return self._batch_view(rows[0]) if rows else None

    def list_batches(self, limit: int, after: str | None = None) -> tuple[list[JSON], bool]:
        """Newest first; ``after`` is the id of the last batch of the previous page. Returns
        (page, has_more); raises KeyError for an unknown ``after``."""
        if after is None:
            rows = self._read("SELECT * FROM batches ORDER BY seq DESC LIMIT ?", (limit + 1,))
        else:
            cursor = self._read("SELECT seq FROM batches WHERE id = ?", (after,))
            if not cursor:
                raise KeyError(after)
            rows = self._read("SELECT * FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                              (cursor[0][0], limit + 1))
        return [self._batch_view(r) for r in rows[:limit]], len(rows) > limit

    def find_active_batch(self, data: bytes, endpoint: str) -> str | None:
        """The newest unfinished batch whose input file holds exactly ``data`` (to resume a
        local run)."""
        rows = self._read(
            "SELECT b.id FROM batches b JOIN files f ON f.id = b.input_file_id "
            f"WHERE b.endpoint = ? AND f.data = ? AND b.status IN {ACTIVE} "
            "ORDER BY b.seq DESC LIMIT 1", (endpoint, data))
        return str(rows[0][0]) if rows else None

    def request_cancel(self, batch_id: str) -> JSON | None:
        """``validating`` / ``in_progress`` become ``cancelling`` (the worker finishes the
        job); other statuses are left as they are. The batch as it now is, None if unknown."""
        with self._tx() as db:
            db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? "
                       "WHERE id = ? AND status IN ('validating', 'in_progress')",
                       (now(), batch_id))
        return self.get_batch(batch_id)

    def _batch_view(self, row: sqlite3.Row) -> JSON:
        counts = {"pending": 0, "done": 0, "failed": 0}
        prompt = completion = 0
        for status, n, p, c in self._read(
                "SELECT status, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens) "
                "FROM lines WHERE batch_id = ? GROUP BY status", (row["id"],)):
            counts[status] = n
            prompt += p or 0
            completion += c or 0
        errors = orjson.loads(row["errors"]) if row["errors"] else None
        return {
            "id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": None if errors is None else {"object": "list", "data": errors},
            "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"], "status": row["status"],
            "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            "created_at": row["created_at"], "in_progress_at": row["in_progress_at"],
            "expires_at": row["expires_at"], "finalizing_at": row["finalizing_at"],
            "completed_at": row["completed_at"], "failed_at": row["failed_at"],
            "expired_at": None, "cancelling_at": row["cancelling_at"],
            "cancelled_at": row["cancelled_at"],
            "request_counts": {"total": sum(counts.values()), "completed": counts["done"],
                               "failed": counts["failed"]},
            "model": row["model"],
            "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": completion,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt + completion},
            "metadata": orjson.loads(row["metadata"]) if row["metadata"] else None,
        }

    # ------------------------------------------------------------------ the worker's side

    def active_batches(self) -> list[ActiveBatch]:
        """Batches the worker still owes work, oldest first: after a restart, exactly the jobs
        to resume."""
        rows = self._read("SELECT id, status, endpoint, input_file_id FROM batches "
                          f"WHERE status IN {ACTIVE} ORDER BY seq")
        return [ActiveBatch(*r) for r in rows]

    def start_batch(self, batch_id: str, lines: Sequence[LineRecord]) -> bool:
        """Store the validated lines and move ``validating`` to ``in_progress``, atomically.
        False if the batch was no longer validating (cancelled meanwhile)."""
        with self._tx() as db:
            cur = db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ? "
                             "WHERE id = ? AND status = 'validating'", (now(), batch_id))
            if cur.rowcount != 1:
                return False
            db.executemany(
                "INSERT INTO lines (batch_id, idx, custom_id, request, status, result) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(batch_id, ln.idx, ln.custom_id,
                  None if ln.request is None else orjson.dumps(ln.request).decode(),
                  "pending" if ln.result is None else "failed",
                  None if ln.result is None else orjson.dumps(ln.result).decode())
                 for ln in lines])
            return True

    def fail_batch(self, batch_id: str, errors: list[JSON]) -> bool:
        """The input file as a whole is unusable: ``validating`` -> ``failed``."""
        with self._tx() as db:
            cur = db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? "
                             "WHERE id = ? AND status = 'validating'",
                             (now(), orjson.dumps(errors).decode(), batch_id))
            return cur.rowcount == 1

    def pending_lines(self, batch_id: str) -> list[PendingLine]:
        rows = self._read(
            "SELECT l.idx, l.custom_id, l.request, b.endpoint, b.tenant FROM lines l "
            "JOIN batches b ON b.id = l.batch_id "
            "WHERE l.batch_id = ? AND l.status = 'pending' ORDER BY l.idx", (batch_id,))
        return [PendingLine(batch_id, endpoint, idx, custom_id, orjson.loads(request), tenant)
                for idx, custom_id, request, endpoint, tenant in rows]

    def record(self, batch_id: str, idx: int, ok: bool, result: JSON, prompt_tokens: int = 0,
               completion_tokens: int = 0) -> bool:
        """Answer one line: its status and result in one transaction, only if it is still
        pending and its batch still runs. False if it was not written (answered already, or
        the batch was finalized meanwhile)."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE lines SET status = ?, result = ?, prompt_tokens = ?, "
                "completion_tokens = ? WHERE batch_id = ? AND idx = ? AND status = 'pending' "
                "AND EXISTS (SELECT 1 FROM batches WHERE id = ? "
                "            AND status IN ('in_progress', 'cancelling'))",
                ("done" if ok else "failed", orjson.dumps(result).decode(), prompt_tokens,
                 completion_tokens, batch_id, idx, batch_id))
            return cur.rowcount == 1

    def mark_finalizing(self, batch_id: str) -> bool:
        """``in_progress`` -> ``finalizing`` once no line is pending; False otherwise."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE batches SET status = 'finalizing', finalizing_at = ? "
                "WHERE id = ? AND status = 'in_progress' AND NOT EXISTS "
                "(SELECT 1 FROM lines WHERE batch_id = ? AND status = 'pending')",
                (now(), batch_id, batch_id))
            return cur.rowcount == 1

    def finalize(self, batch_id: str) -> bool:
        """Write the output and error files (each in input order) and end the job in the same
        transaction: ``finalizing`` -> ``completed``, ``cancelling`` -> ``cancelled``."""
        with self._tx() as db:
            row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or row[0] not in ("finalizing", "cancelling"):
                return False
            files: dict[str, str | None] = {}
            for status, kind in (("done", "output"), ("failed", "error")):
                results = [r[0] for r in db.execute(
                    "SELECT result FROM lines WHERE batch_id = ? AND status = ? ORDER BY idx",
                    (batch_id, status))]
                files[kind] = None
                if results:
                    data = ("\n".join(results) + "\n").encode()
                    files[kind] = self._insert_file(db, data, f"{batch_id}_{kind}.jsonl",
                                                    "batch_output")["id"]
            final, stamp = (("completed", "completed_at") if row[0] == "finalizing"
                            else ("cancelled", "cancelled_at"))
            db.execute(f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, "
                       "error_file_id = ? WHERE id = ?",
                       (final, now(), files["output"], files["error"], batch_id))
            return True


def _file_view(file_id: str, purpose: str, filename: str, size: int, created: int) -> JSON:
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created,
            "filename": filename, "purpose": purpose, "status": "processed",
            "expires_at": None, "status_details": None}
