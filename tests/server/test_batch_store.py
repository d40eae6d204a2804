"""The batch store (SQLite) and input parsing, without an engine: a restart resumes the pending
lines only, a line is answered exactly once, output files keep input order, bad lines become
error-file entries while the rest of the job carries on."""

from __future__ import annotations

import orjson
import pytest

from quickdraft.server.batch_cli import CHAT_ENDPOINT, detect_endpoint
from quickdraft.server.batch_lines import (
    BatchInputError,
    error_line,
    parse_input,
    response_line,
)
from quickdraft.server.batch_store import BatchStore


def jsonl(*objs: object) -> bytes:
    return b"".join(orjson.dumps(o) + b"\n" for o in objs)


def req(cid: str, **body: object) -> dict[str, object]:
    return {"custom_id": cid, "method": "POST", "url": CHAT_ENDPOINT,
            "body": {"messages": [{"role": "user", "content": cid}], **body}}


def new_batch(store: BatchStore, n: int) -> tuple[str, bytes]:
    data = jsonl(*(req(f"r{i}") for i in range(n)))
    file_id = store.create_file(data, "in.jsonl", "batch")["id"]
    batch = store.create_batch(file_id, CHAT_ENDPOINT, "24h", {"k": "v"}, "tiny")
    assert batch["status"] == "validating" and batch["request_counts"]["total"] == 0
    assert store.start_batch(batch["id"], parse_input(data, CHAT_ENDPOINT))
    return batch["id"], data


def answer(store: BatchStore, batch_id: str, idx: int, cid: str, ok: bool = True) -> bool:
    body = {"choices": [{"message": {"content": f"answer {idx}"}}]}
    return store.record(batch_id, idx, ok, response_line(cid, 200 if ok else 400, "req", body),
                        3, 5)


def test_restart_resumes_pending_lines_only(tmp_path):
    db = tmp_path / "sub" / "b.sqlite3"  # parent directories are created
    store = BatchStore(db)
    batch_id, data = new_batch(store, 6)
    for idx in (0, 2, 3):
        assert answer(store, batch_id, idx, f"r{idx}")
    store.close()  # "crash": nothing else survives but the file

    store = BatchStore(db)
    [active] = store.active_batches()
    assert (active.id, active.status, active.endpoint) == (batch_id, "in_progress",
                                                           CHAT_ENDPOINT)
    pending = store.pending_lines(batch_id)
    assert [(p.idx, p.custom_id) for p in pending] == [(1, "r1"), (4, "r4"), (5, "r5")]
    assert pending[0].body["messages"][0]["content"] == "r1"
    batch = store.get_batch(batch_id)
    assert batch["request_counts"] == {"total": 6, "completed": 3, "failed": 0}
    assert batch["usage"]["input_tokens"] == 9 and batch["usage"]["output_tokens"] == 15
    assert batch["metadata"] == {"k": "v"} and batch["model"] == "tiny"
    assert store.find_active_batch(data, CHAT_ENDPOINT) == batch_id
    assert store.find_active_batch(data + b"\n", CHAT_ENDPOINT) is None
    store.close()


def test_each_line_is_answered_exactly_once_in_input_order(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    batch_id, _ = new_batch(store, 4)
    assert not store.mark_finalizing(batch_id)  # lines are pending
    for idx in (3, 1, 0):
        assert answer(store, batch_id, idx, f"r{idx}")
    assert not answer(store, batch_id, 1, "r1")  # executed twice: the second answer is dropped
    assert answer(store, batch_id, 2, "r2", ok=False)
    assert not answer(store, batch_id, 2, "r2")
    assert store.mark_finalizing(batch_id)
    assert store.get_batch(batch_id)["status"] == "finalizing"
    assert store.active_batches()[0].status == "finalizing"  # a crash here resumes finalizing
    assert store.finalize(batch_id)
    assert not store.finalize(batch_id)
    batch = store.get_batch(batch_id)
    assert batch["status"] == "completed" and batch["completed_at"] is not None
    assert batch["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    out = [orjson.loads(x) for x in store.file_content(batch["output_file_id"]).splitlines()]
    assert [o["custom_id"] for o in out] == ["r0", "r1", "r3"]
    assert out[1]["response"]["body"]["choices"][0]["message"]["content"] == "answer 1"
    errors = store.file_content(batch["error_file_id"]).splitlines()
    assert [orjson.loads(e)["custom_id"] for e in errors] == ["r2"]
    assert store.get_file(batch["output_file_id"])["purpose"] == "batch_output"
    assert store.active_batches() == []
    assert not answer(store, batch_id, 0, "r0")  # finalized: nothing changes any more
    store.close()


def test_cancel_keeps_what_finished(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    batch_id, _ = new_batch(store, 3)
    assert answer(store, batch_id, 1, "r1")
    assert store.request_cancel(batch_id)["status"] == "cancelling"
    assert answer(store, batch_id, 0, "r0")  # in flight when cancelled: it still counts
    assert store.finalize(batch_id)
    batch = store.get_batch(batch_id)
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 0}
    assert batch["error_file_id"] is None
    out = store.file_content(batch["output_file_id"]).splitlines()
    assert [orjson.loads(o)["custom_id"] for o in out] == ["r0", "r1"]
    assert store.request_cancel(batch_id)["status"] == "cancelled"  # no change
    assert store.request_cancel("batch_nope") is None
    store.close()


def test_list_newest_first_with_cursor(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    file_id = store.create_file(b"x\n", "in.jsonl", "batch")["id"]
    ids = [store.create_batch(file_id, CHAT_ENDPOINT, "24h", None)["id"] for _ in range(5)]
    page, more = store.list_batches(2)
    assert [b["id"] for b in page] == [ids[4], ids[3]] and more
    page, more = store.list_batches(2, after=ids[3])
    assert [b["id"] for b in page] == [ids[2], ids[1]] and more
    page, more = store.list_batches(2, after=ids[1])
    assert [b["id"] for b in page] == [ids[0]] and not more
    with pytest.raises(KeyError):
        store.list_batches(2, after="batch_unknown")
    assert store.fail_batch(ids[0], [{"code": "empty_file", "message": "m"}])
    failed = store.get_batch(ids[0])
    assert failed["status"] == "failed" and failed["errors"]["data"][0]["code"] == "empty_file"
    store.close()


def test_bad_lines_are_refused_one_by_one():
    lines = [
        orjson.dumps(req("ok-1")),
        b"{not json",
        b"",  # blank lines are skipped
        b"[1, 2]",
        orjson.dumps({"method": "POST", "url": CHAT_ENDPOINT, "body": {}}),
        orjson.dumps(req("ok-1")),
        orjson.dumps({**req("get"), "method": "GET"}),
        orjson.dumps({**req("url"), "url": "/v1/embeddings"}),
        orjson.dumps({"custom_id": "nobody", "method": "POST", "url": CHAT_ENDPOINT}),
        orjson.dumps({**req("body"), "body": [1]}),
        orjson.dumps({**req("num"), "custom_id": 7}),
        orjson.dumps(req("ok-2")),
    ]
    records = parse_input(b"\n".join(lines), CHAT_ENDPOINT)
    assert [r.idx for r in records] == list(range(11))
    good = [r for r in records if r.result is None]
    assert [(r.idx, r.custom_id) for r in good] == [(0, "ok-1"), (10, "ok-2")]
    codes = {r.idx: (r.custom_id, r.result["error"]["code"]) for r in records if r.result}
    assert codes == {1: (None, "invalid_json"), 2: (None, "invalid_request"),
                     3: (None, "missing_required_parameter"), 4: ("ok-1", "duplicate_custom_id"),
                     5: ("get", "invalid_method"), 6: ("url", "invalid_url"),
                     7: ("nobody", "missing_required_parameter"), 8: ("body", "invalid_request"),
                     9: (None, "invalid_custom_id")}
    dup = records[4].result
    assert dup["response"] is None and "line 6" in dup["error"]["message"] \
        and "line 1" in dup["error"]["message"]
    assert records[1].result["error"]["message"].startswith("line 2: not valid JSON")
    with pytest.raises(BatchInputError, match="no request lines"):
        parse_input(b"\n \n", CHAT_ENDPOINT)
    with pytest.raises(BatchInputError, match="at most 2"):
        parse_input(jsonl(req("a"), req("b"), req("c")), CHAT_ENDPOINT, max_lines=2)
    assert detect_endpoint(b"{bad\n" + jsonl({**req("a"), "url": "/v1/completions"})) \
        == "/v1/completions"
    assert detect_endpoint(b"") == CHAT_ENDPOINT
    assert error_line("x", "c", "m")["id"].startswith("batch_req_")


def test_batch_settings_and_serve_flags(tmp_path, monkeypatch):
    from quickdraft.server.cli import build_parser
    from quickdraft.server.serve import serve_settings
    from quickdraft.server.settings import ServerSettings, SettingsError

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    s = ServerSettings()
    assert s.batch_db_path == str(tmp_path / "cache" / "batches.sqlite3")
    assert (s.batch_max_in_flight, s.max_upload_size) == (8, 200 << 20)
    for kw, word in ((dict(batch_max_in_flight=0), "batch_max_in_flight"),
                     (dict(max_upload_size=10), "max_upload_size"),
                     (dict(batch_db_path=" "), "batch_db_path")):
        with pytest.raises(SettingsError, match=word):
            ServerSettings(**kw)
    args = build_parser().parse_args(["serve", "--batch-db", str(tmp_path / "x.db"),
                                      "--batch-max-in-flight", "3", "--max-upload-size", "4096"])
    s = serve_settings(args)
    assert (s.batch_db_path, s.batch_max_in_flight, s.max_upload_size) == \
        (str(tmp_path / "x.db"), 3, 4096)
    assert serve_settings(build_parser().parse_args(["serve"])).batch_db_path == \
        str(tmp_path / "cache" / "batches.sqlite3")
    assert not (tmp_path / "cache").exists()  # nothing is created until a batch is used
