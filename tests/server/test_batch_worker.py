"""The batch worker in-process on the tiny engine: lines wait (unanswered) while the engine
cannot take requests; a worker stopped mid-job leaves its lines pending and another one resumes
them; only one worker at a time runs a database's batches."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from quickdraft.engine.async_engine import AsyncLLM
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.server.batch_cli import CHAT_ENDPOINT
from quickdraft.server.batch_requests import LocalLink
from quickdraft.server.batch_store import BatchStore
from quickdraft.server.batch_worker import BatchWorker
from quickdraft.server.errors import model_loading
from tests.server.conftest import ENGINE_KW

MODEL = "tiny"


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(LLMEngine(EngineConfig(model=str(tiny_model_dir), **ENGINE_KW),
                                progress=False))
    yield engine
    engine.shutdown()


class FlakyLink(LocalLink):
    """Refuses requests ("the model is loading") until ``ready`` is set."""

    def __init__(self, llm: AsyncLLM) -> None:
        super().__init__(llm, MODEL)
        self.ready = False

    def engine(self) -> AsyncLLM:
        if not self.ready:
            raise model_loading()
        return super().engine()


def lines(n: int, max_tokens: int) -> bytes:
    return b"".join(orjson.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": CHAT_ENDPOINT,
        "body": {"messages": [{"role": "user", "content": f"line {i}"}],
                 "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}) + b"\n"
        for i in range(n))


async def create(worker: BatchWorker, data: bytes) -> tuple[BatchStore, str]:
    store = await worker.store()
    assert store is not None
    file_id = (await asyncio.to_thread(store.create_file, data, "in.jsonl", "batch"))["id"]
    batch = await asyncio.to_thread(store.create_batch, file_id, CHAT_ENDPOINT, "24h", None)
    worker.wake()
    return store, batch["id"]


async def until(store: BatchStore, batch_id: str, check: Any, timeout: float = 30) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check(batch := await asyncio.to_thread(store.get_batch, batch_id)):
        assert loop.time() < deadline, batch
        await asyncio.sleep(0.01)
    return batch


def test_lines_wait_while_the_engine_cannot_take_them(llm, tmp_path):
    async def scenario() -> None:
        link = FlakyLink(llm)
        worker = BatchWorker(tmp_path / "b.sqlite3", link, idle_poll=0.1)
        store, batch_id = await create(worker, lines(3, 4))
        worker.start()
        try:
            await until(store, batch_id, lambda b: b["status"] == "in_progress")
            await asyncio.sleep(0.3)
            batch = await asyncio.to_thread(store.get_batch, batch_id)
            assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
            link.ready = True
            done = await until(store, batch_id, lambda b: b["status"] == "completed")
            assert done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        finally:
            await worker.stop()
            link.close()

    asyncio.run(scenario())


class CountingLink(LocalLink):
    """Counts the lines it was asked to run. With ``hold_after`` set, every line after that
    many waits (before reaching the engine) until the worker stops it: the worker cannot
    finish the batch, however fast the engine answers."""

    def __init__(self, llm: AsyncLLM, hold_after: int | None = None) -> None:
        super().__init__(llm, MODEL)
        self.prompts = 0
        self.hold_after = hold_after

    async def chat_prompt(self, llm: AsyncLLM, messages: list[dict[str, str]],
                          param: str) -> list[int]:
        self.prompts += 1
        if self.hold_after is not None and self.prompts > self.hold_after:
            await asyncio.Event().wait()  # until cancelled
        return await super().chat_prompt(llm, messages, param)


def test_stopped_worker_leaves_lines_pending_and_another_takes_over(llm, tmp_path):
    db = tmp_path / "b.sqlite3"
    baseline = llm.engine.kv.num_free_blocks

    async def scenario() -> None:
        # The first worker answers at most 4 lines; the tiny engine answers a line in tens
        # of milliseconds, so without the hold it could finish all 8 before the test sees
        # it mid-job (seen once in CI).
        first_link, second_link = CountingLink(llm, hold_after=4), CountingLink(llm)
        first = BatchWorker(db, first_link, max_in_flight=2, idle_poll=0.05)
        second = BatchWorker(db, second_link, max_in_flight=4, idle_poll=0.05)
        store, batch_id = await create(first, lines(8, 40))
        first.start()
        second.start()  # waits: the first holds the database's lock
        try:
            partial = await until(store, batch_id, lambda b: first.in_flight > 0
                                  and b["request_counts"]["completed"] >= 2)
            assert second.in_flight == 0 and second_link.prompts == 0
            await first.stop()  # mid-job: its lines in flight are aborted and stay pending
            assert first.in_flight == 0
            store = await second.store()
            assert store is not None
            done = await until(store, batch_id, lambda b: b["status"] == "completed")
            assert done["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
            out = await asyncio.to_thread(store.file_content, done["output_file_id"])
            assert [orjson.loads(x)["custom_id"] for x in out.splitlines()] == \
                [f"r{i}" for i in range(8)]
            # The second ran exactly the lines the first had not answered (those it aborted
            # included), not the ones already answered.
            answered_by_first = 8 - second_link.prompts
            assert partial["request_counts"]["completed"] <= answered_by_first < 8
            # it had lines in flight when stopped (partial's condition); a line taken may be
            # aborted before its task reached the link, so the link may not have counted it
            assert first_link.prompts >= answered_by_first
        finally:
            await first.stop()
            await second.stop()
            first_link.close()
            second_link.close()

    asyncio.run(scenario())
    assert llm.engine.kv.num_free_blocks == baseline


def test_stop_ends_the_loop_even_when_a_cancel_is_lost(llm, tmp_path):
    """Python 3.11's asyncio.wait_for can swallow a cancellation that races its inner wait;
    stop() then waited forever for the worker's loop (seen once in CI). The loop also checks
    a stop flag."""
    async def scenario() -> None:
        link = LocalLink(llm, MODEL)
        worker = BatchWorker(tmp_path / "b.sqlite3", link, idle_poll=0.01)
        real_step = worker.step

        async def step_losing_cancels() -> None:
            with contextlib.suppress(asyncio.CancelledError):  # what the race does
                await asyncio.sleep(0.05)
            await real_step()

        worker.step = step_losing_cancels  # type: ignore[method-assign]
        worker.start()
        await asyncio.sleep(0.1)
        try:
            await asyncio.wait_for(worker.stop(), 10)
        finally:
            link.close()

    asyncio.run(scenario())
