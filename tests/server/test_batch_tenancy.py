"""Batch lines run in their creator's cache namespace: the API key's tenant, refined by a line's
``cache_salt`` exactly as over HTTP, so a batch shares prefix-cache blocks and the suffix
proposer's earlier answers only with its own key. A database written before batches had a
tenant opens (schema 1 -> 2) and its lines run tenant-less, as they did."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from quickdraft.server.batch_store import SCHEMA_VERSION, BatchStore
from quickdraft.server.guard import tenant_of
from tests.server.conftest import TIMEOUT, make_settings, serve, tiny_factory
from tests.server.test_batch_api import chat_line, jsonl, submit, wait_for

KEY = "tenant-key-0001"


@pytest.fixture(scope="module")
def served_with_key(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[tuple[Any, list[str | None]]]:
    db = tmp_path_factory.mktemp("tenancy") / "b.sqlite3"
    with serve(make_settings(batch_db_path=str(db), api_keys=(KEY,)),
               tiny_factory(tiny_model_dir)) as s:
        llm = s.gateway.llm
        assert llm is not None
        salts: list[str | None] = []
        real = llm.generate

        def spy(*args: Any, **kwargs: Any) -> Any:
            salts.append(kwargs.get("cache_salt"))
            return real(*args, **kwargs)

        llm.generate = spy  # type: ignore[method-assign]
        try:
            yield s, salts
        finally:
            llm.generate = real  # type: ignore[method-assign]


def test_batch_lines_run_as_their_api_key_tenant(served_with_key):
    served, salts = served_with_key
    with httpx.Client(base_url=served.http, timeout=TIMEOUT,
                      headers={"Authorization": f"Bearer {KEY}"}) as http:
        baseline = served.free_blocks()
        batch = submit(http, jsonl(chat_line("a", "one"), chat_line("b", "two"),
                                   chat_line("c", "three", cache_salt="proj-1")))
        assert wait_for(http, batch["id"])["request_counts"]["completed"] == 3
    mine = tenant_of(KEY)
    assert sorted(salts, key=str) == sorted([mine, mine, f"{mine}/proj-1"], key=str)
    assert "tenant" not in batch  # the tenant is never shown
    served.wait_idle(baseline)


def test_a_schema_1_database_opens_and_its_lines_run_tenant_less(tmp_path):
    path = tmp_path / "old.sqlite3"
    store = BatchStore(path)
    file_id = store.create_file(jsonl(chat_line("a", "hi")), "in.jsonl", "batch")["id"]
    batch_id = store.create_batch(file_id, "/v1/chat/completions", "24h", None)["id"]
    store.close()
    db = sqlite3.connect(path)  # what a schema-1 quickdraft wrote: no tenant column
    db.execute("ALTER TABLE batches DROP COLUMN tenant")
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()

    store = BatchStore(path)
    try:
        assert store.get_batch(batch_id) is not None
        version = store._db.execute("PRAGMA user_version").fetchone()[0]
        assert version == SCHEMA_VERSION == 2
        columns = {row[1] for row in store._db.execute("PRAGMA table_info(batches)")}
        assert "tenant" in columns
    finally:
        store.close()
