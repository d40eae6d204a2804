"""The Batch API on a real server (uvicorn, tiny model): upload, create, poll, download in input
order with one line per custom_id, an error file for bad lines, list pagination, cancel (aborts
the lines in flight, keeps what finished), OpenAI-shaped 4xx errors, background priority, and
the official ``openai`` client."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.server.conftest import TIMEOUT, Served, make_settings, serve, tiny_factory

CHAT = "/v1/chat/completions"
MAX_IN_FLIGHT = 4


@pytest.fixture(scope="module")
def bserved(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    db = tmp_path_factory.mktemp("batch") / "batches.sqlite3"
    settings = make_settings(batch_db_path=str(db), batch_max_in_flight=MAX_IN_FLIGHT,
                             max_upload_size=64 << 10)
    with serve(settings, tiny_factory(tiny_model_dir, num_kv_blocks=1024)) as s:
        yield s


@pytest.fixture(scope="module")
def http(bserved: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=bserved.http, timeout=TIMEOUT) as client:
        yield client


def jsonl(*objs: object) -> bytes:
    return b"".join(orjson.dumps(o) + b"\n" for o in objs)


def chat_line(cid: str, text: str, max_tokens: int = 8, **body: Any) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, **body}}


def upload(http: httpx.Client, data: bytes, purpose: str = "batch") -> httpx.Response:
    return http.post("/v1/files", data={"purpose": purpose},
                     files={"file": ("input.jsonl", data, "application/jsonl")})


def submit(http: httpx.Client, data: bytes, endpoint: str = CHAT,
           **extra: Any) -> dict[str, Any]:
    r = upload(http, data)
    assert r.status_code == 200, r.text
    r = http.post("/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": endpoint,
                                       "completion_window": "24h", **extra})
    assert r.status_code == 200, r.text
    batch: dict[str, Any] = r.json()
    return batch


def wait_for(http: httpx.Client, batch_id: str, statuses: tuple[str, ...] = ("completed",),
             timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        batch: dict[str, Any] = http.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in statuses:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)


def content(http: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    r = http.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200
    return [orjson.loads(line) for line in r.content.splitlines()]


def assert_error(r: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"type", "code", "message", "param"} and error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


def test_batch_runs_to_completion_in_input_order(bserved, http):
    good = [chat_line(f"q{i}", f"Question number {i}?", max_tokens=4 + i) for i in range(6)]
    bad_lines = [
        b"{oops",
        orjson.dumps(chat_line("q1", "duplicate")),
        orjson.dumps(chat_line("model", "hi", model="gpt-4o")),
        orjson.dumps(chat_line("temp", "hi", temperature=5000)),
        orjson.dumps({**chat_line("url", "hi"), "url": "/v1/completions"}),
        orjson.dumps({"method": "POST", "url": CHAT, "body": {}}),
    ]
    data = (jsonl(*good[:3]) + b"\n".join(bad_lines) + b"\n" + jsonl(*good[3:]))
    batch = submit(http, data, metadata={"job": "test"})
    assert batch["object"] == "batch" and batch["status"] == "validating"
    assert batch["endpoint"] == CHAT and batch["metadata"] == {"job": "test"}
    assert batch["completion_window"] == "24h"
    assert batch["expires_at"] == batch["created_at"] + 24 * 3600
    batch = wait_for(http, batch["id"])
    assert batch["request_counts"] == {"total": 12, "completed": 6, "failed": 6}
    assert batch["in_progress_at"] and batch["finalizing_at"] and batch["completed_at"]
    assert batch["usage"]["output_tokens"] == sum(4 + i for i in range(6))

    out = content(http, batch["output_file_id"])
    assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(6)]  # input order
    for i, o in enumerate(out):
        assert o["error"] is None and o["id"].startswith("batch_req_")
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["response"]["request_id"] == body["id"]
        assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] \
            == "length"
        assert body["usage"]["completion_tokens"] == 4 + i
    # Greedy: the batch answers exactly what the interactive endpoint answers.
    direct = http.post(CHAT, json=good[4]["body"]).json()
    assert out[4]["response"]["body"]["choices"][0]["message"]["content"] \
        == direct["choices"][0]["message"]["content"]

    errors = content(http, batch["error_file_id"])
    refused = [(e["custom_id"], e["error"]["code"]) for e in errors if e["response"] is None]
    assert refused == [(None, "invalid_json"), ("q1", "duplicate_custom_id"),
                       ("url", "invalid_url"), (None, "missing_required_parameter")]
    answered = {e["custom_id"]: e["response"] for e in errors if e["response"] is not None}
    assert answered["model"]["status_code"] == 404
    assert answered["model"]["body"]["error"]["code"] == "model_not_found"
    assert answered["temp"]["status_code"] == 400
    assert answered["temp"]["body"]["error"]["param"] == "temperature"
    assert [e["custom_id"] for e in errors] == [None, "q1", "model", "temp", "url", None]

    f = http.get(f"/v1/files/{batch['output_file_id']}").json()
    assert f["object"] == "file" and f["purpose"] == "batch_output"
    assert f["bytes"] == len(http.get(f"/v1/files/{f['id']}/content").content)


def test_completions_endpoint(http):
    lines = [{"custom_id": "text", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}},
             {"custom_id": "ids", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0,
                       "ignore_eos": True}}]
    batch = wait_for(http, submit(http, jsonl(*lines), "/v1/completions")["id"])
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    out = content(http, batch["output_file_id"])
    assert [o["response"]["body"]["object"] for o in out] == ["text_completion"] * 2
    assert out[1]["response"]["body"]["usage"]["prompt_tokens"] == 3
    assert batch["error_file_id"] is None


def test_cancel_aborts_in_flight_and_keeps_finished(bserved, http):
    baseline = bserved.free_blocks()
    lines = [chat_line("short-0", "Hi", 4), chat_line("short-1", "Hello", 4)]
    lines += [chat_line(f"long-{i}", f"Tell story {i}", 900) for i in range(10)]
    batch = submit(http, jsonl(*lines))
    deadline = time.monotonic() + TIMEOUT
    while bserved.gateway.llm.stats()["num_running"] < 2:  # long lines are in the engine
        assert time.monotonic() < deadline
        time.sleep(0.01)
    running = list(bserved.engine().scheduler.running)
    assert running and {r.priority for r in running} == {10}  # background priority
    # Interactive work gets through meanwhile.
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200
    partial = wait_for(http, batch["id"], ("in_progress",))
    assert partial["request_counts"]["total"] == 12

    r = http.post(f"/v1/batches/{batch['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled")
    assert r.json()["cancelling_at"] is not None
    done = wait_for(http, batch["id"], ("cancelled",), timeout=TIMEOUT)
    assert done["cancelled_at"] is not None
    counts = done["request_counts"]
    assert counts["total"] == 12 and counts["completed"] < 12 and counts["failed"] == 0
    out = content(http, done["output_file_id"])
    assert len(out) == counts["completed"]
    assert [o["custom_id"] for o in out] == [ln["custom_id"] for ln in lines
                                             if ln["custom_id"] in {o["custom_id"] for o in out}]
    bserved.wait_idle(baseline)  # aborted lines freed their KV blocks
    assert bserved.gateway.llm.stats()["num_running"] == 0
    again = http.post(f"/v1/batches/{batch['id']}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    time.sleep(0.3)
    assert http.get(f"/v1/batches/{batch['id']}").json()["request_counts"] == counts

    finished = wait_for(http, submit(http, jsonl(chat_line("x", "x", 2)))["id"])
    assert_error(http.post(f"/v1/batches/{finished['id']}/cancel"), 409,
                 "batch_not_cancellable")


def test_list_and_pagination(http):
    ids = [submit(http, jsonl(chat_line("only", f"p{i}", 1)))["id"] for i in range(3)]
    page = http.get("/v1/batches", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"]
    assert [b["id"] for b in page["data"]] == [ids[2], ids[1]]
    assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
    page = http.get("/v1/batches", params={"limit": 2, "after": ids[1]}).json()
    assert page["data"][0]["id"] == ids[0]
    listed = http.get("/v1/batches", params={"limit": 100}).json()
    assert not listed["has_more"] and ids[0] in [b["id"] for b in listed["data"]]
    for batch_id in ids:
        wait_for(http, batch_id)


def test_errors_are_openai_shaped(http):
    assert_error(http.get("/v1/batches/batch_nope"), 404, "batch_not_found")
    assert_error(http.post("/v1/batches/batch_nope/cancel"), 404, "batch_not_found")
    assert_error(http.get("/v1/files/file-nope"), 404, "file_not_found")
    assert_error(http.get("/v1/files/file-nope/content"), 404, "file_not_found")
    assert_error(http.get("/v1/batches", params={"limit": 0}), 400, "invalid_value", "limit")
    assert_error(http.get("/v1/batches", params={"after": "batch_nope"}), 404,
                 "batch_not_found", "after")

    file_id = upload(http, jsonl(chat_line("a", "a"))).json()["id"]
    ok = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}

    def create(**changes: Any) -> httpx.Response:
        body = {k: v for k, v in {**ok, **changes}.items() if v is not None}
        return http.post("/v1/batches", json=body)

    assert_error(create(input_file_id=None), 400, "missing_required_parameter", "input_file_id")
    assert_error(create(input_file_id="file-nope"), 404, "file_not_found", "input_file_id")
    assert_error(create(endpoint="/v1/embeddings"), 400, "unsupported_value", "endpoint")
    assert_error(create(completion_window="1h"), 400, "unsupported_value", "completion_window")
    assert_error(create(metadata={"k": 1}), 400, "invalid_value", "metadata.k")
    assert_error(create(colour="blue"), 400, "unknown_parameter", "colour")
    assert_error(http.post("/v1/batches", content=b"{nope"), 400, "invalid_json")

    assert_error(upload(http, b"x\n", purpose="fine-tune"), 400, "invalid_value", "purpose")
    assert_error(http.post("/v1/files", data={"purpose": "batch"}), 400,
                 "missing_required_parameter", "file")
    assert_error(upload(http, b""), 400, "invalid_value", "file")
    assert_error(upload(http, b"x" * (70 << 10)), 413, "file_too_large")  # parsed, then refused
    assert_error(upload(http, b"x" * (200 << 10)), 413, "file_too_large")  # refused up front

    # An uploaded output file cannot be used as an input.
    done = wait_for(http, create().json()["id"])
    assert_error(create(input_file_id=done["output_file_id"]), 400, "invalid_value",
                 "input_file_id")


def test_empty_input_fails_the_batch(http):
    batch = wait_for(http, submit(http, b"\n\n\n \n")["id"], ("failed",))
    assert batch["failed_at"] and batch["errors"]["data"][0]["code"] == "empty_file"
    assert batch["request_counts"]["total"] == 0 and batch["output_file_id"] is None


def test_official_openai_client(bserved, tmp_path):
    client = openai.OpenAI(base_url=f"{bserved.http}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(*(chat_line(f"c{i}", f"Say {i}", 3) for i in range(3))))
    with path.open("rb") as fh:
        f = client.files.create(file=fh, purpose="batch")
    assert f.purpose == "batch" and f.bytes == path.stat().st_size and f.filename == "in.jsonl"
    assert client.files.retrieve(f.id).id == f.id
    batch = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h",
                                  metadata={"who": "sdk"})
    deadline = time.monotonic() + 60
    while batch.status != "completed":
        assert time.monotonic() < deadline and batch.status in ("validating", "in_progress",
                                                                "finalizing")
        time.sleep(0.05)
        batch = client.batches.retrieve(batch.id)
    assert batch.request_counts.completed == 3 and batch.metadata == {"who": "sdk"}
    lines = client.files.content(batch.output_file_id).content.splitlines()
    assert [orjson.loads(x)["custom_id"] for x in lines] == ["c0", "c1", "c2"]
    page = client.batches.list(limit=1)
    assert page.data[0].id == batch.id and page.has_more
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    cancelled_or_done = client.batches.create(input_file_id=f.id, endpoint=CHAT,
                                              completion_window="24h")
    with contextlib.suppress(openai.ConflictError):  # it may have finished first
        assert client.batches.cancel(cancelled_or_done.id).status in ("cancelling", "cancelled")
