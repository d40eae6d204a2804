"""A batch job's input and output files as data, no I/O: the JSONL input split into request
lines (a malformed line kept as a refused one with its error-file entry, the file as a whole
refused with :class:`BatchInputError`), and the output- and error-file lines (OpenAI's batch
format). Used by the worker (server/batch_worker.py), which reads and writes them through the
store.
"""

from __future__ import annotations

import orjson

from quickdraft.server.batch_store import LineRecord, new_id
from quickdraft.server.params import JSON

MAX_LINES = 50_000  # requests in one batch (OpenAI's limit)


class BatchInputError(Exception):
    """The input file as a whole is unusable: the batch fails."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def to_dict(self) -> JSON:
        return {"code": self.code, "message": self.message, "param": None, "line": None}



def error_line(custom_id: str | None, code: str, message: str) -> JSON:
    """An error-file line for a request that got no HTTP response (refused before running)."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def response_line(custom_id: str, status_code: int, request_id: str, body: JSON) -> JSON:
    """An output-file line (status 200) or an error-file line (an HTTP error response)."""
    return {"id": new_id("batch_req_"), "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None}


def parse_input(data: bytes, endpoint: str, max_lines: int = MAX_LINES) -> list[LineRecord]:
    """Split a JSONL input file into request lines (blank lines skipped). A malformed line is
    kept as a refused line with its error-file entry, so the rest of the job carries on; raises
    BatchInputError if the file as a whole is unusable."""
    raw_lines = [(n, raw) for n, raw in enumerate(data.splitlines(), 1) if raw.strip()]
    if not raw_lines:
        raise BatchInputError("empty_file", "the input file holds no request lines")
    if len(raw_lines) > max_lines:
        raise BatchInputError("too_many_requests", f"the input file holds {len(raw_lines)} "
                              f"requests; a batch takes at most {max_lines}")
    records: list[LineRecord] = []
    seen: dict[str, int] = {}
    for idx, (n, raw) in enumerate(raw_lines):
        custom_id, body, error = _parse_line(raw, n, endpoint, seen)
        if error is not None:
            code, message = error
            records.append(LineRecord(idx, custom_id, None,
                                      error_line(custom_id, code, f"line {n}: {message}")))
        else:
            records.append(LineRecord(idx, custom_id, body))
    return records


def _parse_line(raw: bytes, n: int, endpoint: str, seen: dict[str, int]
                ) -> tuple[str | None, JSON | None, tuple[str, str] | None]:
    """(custom_id, body, None) or (custom_id or None, None, (code, message))."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return None, None, ("invalid_json", f"not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return None, None, ("invalid_request", "a request line must be a JSON object")
    cid = obj.get("custom_id")
    if cid is None:
        return None, None, ("missing_required_parameter", "custom_id is required")
    if not isinstance(cid, str) or not cid:
        return None, None, ("invalid_custom_id", "custom_id must be a non-empty string")
    if cid in seen:
        return cid, None, ("duplicate_custom_id", f"custom_id {cid!r} is already used on line "
                           f"{seen[cid]}; each request needs its own")
    seen[cid] = n
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    missing = [k for k, v in (("method", method), ("url", url), ("body", body)) if v is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        return cid, None, ("missing_required_parameter", f"{', '.join(missing)} {verb} required")
    if not isinstance(method, str) or method.upper() != "POST":
        return cid, None, ("invalid_method", f"method must be 'POST', got {method!r}")
    if url != endpoint:
        return cid, None, ("invalid_url", f"url {url!r} does not match the batch's endpoint "
                           f"{endpoint!r}")
    if not isinstance(body, dict):
        return cid, None, ("invalid_request", "body must be a JSON object")
    return cid, body, None
