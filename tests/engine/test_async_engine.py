"""AsyncLLM on a tiny random model: streamed deltas match the sync engine, concurrent requests,
abort (explicit, by leaving the loop, by cancellation) frees blocks, bad requests fail alone,
the event loop stays responsive while the engine thread steps, and shutdown stops the thread.

pytest-asyncio is not a dependency: each test drives its coroutine with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from quickdraft.engine.async_engine import AsyncLLM, EngineDeadError
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import InvalidRequestError, LLMEngine
from quickdraft.engine.outputs import RequestOutput
from quickdraft.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Far more than any test waits for: the request is still running when it gets aborted.
LONG = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)
ENGINE_KW = dict(dtype="float32", num_kv_blocks=512, block_size=4, max_num_batched_tokens=64)


def new_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **ENGINE_KW), progress=False)


@pytest.fixture(scope="module")
def sync_engine(tiny_model_dir) -> LLMEngine:
    return new_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    llm = AsyncLLM(new_engine(tiny_model_dir))
    yield llm
    llm.shutdown()


async def collect(llm: AsyncLLM, prompt: str, params: SamplingParams = GREEDY,
                  **kw) -> list[RequestOutput]:
    return [d async for d in llm.generate(prompt, params, **kw)]


def merged_ids(deltas: list[RequestOutput]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def wait_for_free_blocks(llm: AsyncLLM, baseline: int, timeout: float = 60.0) -> int:
    """Poll (without blocking the loop) until the pool is back at ``baseline`` (the limit is
    for a loaded machine; a healthy run returns within a step or two)."""
    deadline = time.monotonic() + timeout
    while llm.engine.kv.num_free_blocks != baseline and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return llm.engine.kv.num_free_blocks


def assert_idle(llm: AsyncLLM, baseline: int) -> None:
    """Nothing left running or waiting, every block free, no stale output sink."""
    assert llm.engine.kv.num_free_blocks == baseline
    assert not llm.engine.has_unfinished_requests()
    assert llm._sinks == {}
    assert llm.is_running


def test_stream_equals_sync_engine(llm, sync_engine):
    prompt = "Hello there, how are you?"
    [ref] = sync_engine.generate([prompt], GREEDY)
    deltas = asyncio.run(collect(llm, prompt))

    assert merged_ids(deltas) == ref.token_ids and len(ref.token_ids) == 12
    assert "".join(d.text for d in deltas) == ref.text
    assert len(deltas) > 1  # streamed, not one final blob
    assert all(not d.finished and d.usage is None for d in deltas[:-1])
    last = deltas[-1]
    assert last.finished and last.finish_reason == "length" and last.error is None
    assert last.usage is not None and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == ref.usage.prompt_tokens
    assert len({d.request_id for d in deltas}) == 1


def test_concurrent_requests_equal_each_alone(llm):
    prompts = ["one two three", "a much longer prompt " * 6, "x", "The capital of France"]
    params = [GREEDY, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), GREEDY]
    baseline = llm.engine.kv.num_free_blocks

    async def alone() -> list[list[RequestOutput]]:
        return [await collect(llm, p, sp) for p, sp in zip(prompts, params, strict=True)]

    async def together() -> list[list[RequestOutput]]:
        return list(await asyncio.gather(
            *(collect(llm, p, sp) for p, sp in zip(prompts, params, strict=True))))

    solo = asyncio.run(alone())
    batch = asyncio.run(together())
    assert [merged_ids(d) for d in batch] == [merged_ids(d) for d in solo]
    assert [len(merged_ids(d)) for d in batch] == [12, 20, 3, 12]
    for deltas in batch:
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert sum(not d.finished for d in deltas) == len(deltas) - 1
    assert len({d[0].request_id for d in batch}) == len(prompts)
    assert_idle(llm, baseline)


def test_abort_from_another_task(llm):
    baseline = llm.engine.kv.num_free_blocks

    async def main() -> tuple[list[RequestOutput], int, int]:
        started = asyncio.Event()
        deltas: list[RequestOutput] = []

        async def consume() -> None:
            async for d in llm.generate("Tell me a long story", LONG, request_id="long-abort"):
                deltas.append(d)
                if len(merged_ids(deltas)) >= 3:
                    started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        in_use = llm.engine.kv.num_free_blocks
        llm.abort("long-abort")  # from this task, not the consumer
        await asyncio.wait_for(task, 10)
        return deltas, in_use, await wait_for_free_blocks(llm, baseline)

    deltas, in_use, free_after = asyncio.run(main())
    assert in_use < baseline  # the request really held blocks
    last = deltas[-1]
    assert last.finished and last.finish_reason == "abort"
    assert last.usage is not None and last.usage.completion_tokens == len(merged_ids(deltas))
    assert len(merged_ids(deltas)) < LONG.max_tokens
    assert free_after == baseline
    assert_idle(llm, baseline)


def test_abort_unknown_request_is_harmless(llm):
    llm.abort("no-such-request")
    deltas = asyncio.run(collect(llm, "still fine"))
    assert deltas[-1].finish_reason == "length"


def test_break_out_of_loop_aborts(llm):
    baseline = llm.engine.kv.num_free_blocks

    async def main() -> tuple[int, int, int]:
        n = 0
        async for d in llm.generate("Tell me a long story", LONG):
            n += len(d.token_ids)
            if n >= 3:
                break
        in_flight = llm.engine.kv.num_free_blocks
        return n, in_flight, await wait_for_free_blocks(llm, baseline)

    n, _, free_after = asyncio.run(main())
    assert 3 <= n < LONG.max_tokens
    assert free_after == baseline
    assert_idle(llm, baseline)
    # The engine still serves a request afterwards.
    deltas = asyncio.run(collect(llm, "after the break"))
    assert deltas[-1].finished and len(merged_ids(deltas)) == 12
    assert_idle(llm, baseline)


def test_cancelling_the_task_aborts(llm):
    baseline = llm.engine.kv.num_free_blocks

    async def main() -> tuple[int, int]:
        got = asyncio.Event()
        n = 0

        async def consume() -> None:
            nonlocal n
            async for d in llm.generate("Tell me a long story", LONG):
                n += len(d.token_ids)
                got.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return n, await wait_for_free_blocks(llm, baseline)

    n, free_after = asyncio.run(main())
    assert 1 <= n < LONG.max_tokens
    assert free_after == baseline
    assert_idle(llm, baseline)
    deltas = asyncio.run(collect(llm, "after the cancel"))
    assert deltas[-1].finished and len(merged_ids(deltas)) == 12


def test_invalid_request_raises_and_others_carry_on(llm, sync_engine):
    baseline = llm.engine.kv.num_free_blocks
    [ref] = sync_engine.generate(["a valid prompt"], GREEDY)

    async def main():
        good = asyncio.create_task(collect(llm, "a valid prompt"))
        with pytest.raises(InvalidRequestError) as empty:
            await collect(llm, "")
        with pytest.raises(InvalidRequestError) as bad_ids:
            async for _ in llm.generate(prompt_token_ids=[10**9], sampling_params=GREEDY):
                pass
        return await good, empty.value, bad_ids.value

    deltas, empty, bad_ids = asyncio.run(main())
    assert empty.param == "prompt" and "empty" in str(empty)
    assert bad_ids.param == "prompt_token_ids"
    assert merged_ids(deltas) == ref.token_ids
    assert_idle(llm, baseline)
    assert asyncio.run(collect(llm, "and another"))[-1].finished


def test_duplicate_request_id_fails_only_the_duplicate(llm):
    async def main():
        first = asyncio.create_task(collect(llm, "first", request_id="dup"))
        await asyncio.sleep(0)  # the first add is queued before the second
        with pytest.raises(InvalidRequestError) as err:
            await collect(llm, "second", request_id="dup")
        return await first, err.value

    deltas, err = asyncio.run(main())
    assert err.param == "request_id"
    assert deltas[-1].finished and len(merged_ids(deltas)) == 12


def test_event_loop_stays_responsive(llm):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[float, float, int]:
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        start = time.perf_counter()
        deltas = await collect(llm, "keep the loop alive " * 4, params)
        elapsed = time.perf_counter() - start
        stop.set()
        await tick
        return elapsed, max(gaps), len(merged_ids(deltas))

    elapsed, max_gap, n = asyncio.run(main())
    assert n == 400
    # Were the steps run on the loop, one gap would span the whole generation (seconds).
    # Off the loop, a gap is one 10 ms sleep plus scheduling noise on a busy 2-core box.
    assert max_gap < 0.3, (max_gap, elapsed)
    assert max_gap < elapsed / 3, (max_gap, elapsed)


def test_stats_snapshot(llm):
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == llm.engine.kv.num_free_blocks
    assert 0.0 <= stats["kv_usage"] <= 1.0


def test_shutdown_stops_thread(tiny_model_dir):
    llm = AsyncLLM(new_engine(tiny_model_dir))
    assert llm.is_running
    assert asyncio.run(collect(llm, "before shutdown"))[-1].finished
    llm.shutdown()
    assert not llm._thread.is_alive() and not llm.is_running

    async def after() -> None:
        async for _ in llm.generate("after shutdown", GREEDY):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(after())


def test_shutdown_ends_in_flight_streams(tiny_model_dir):
    """A consumer streaming when the engine shuts down gets an error, not a hang."""
    llm = AsyncLLM(new_engine(tiny_model_dir))

    async def main() -> list[RequestOutput]:
        got = asyncio.Event()
        deltas: list[RequestOutput] = []

        async def consume() -> None:
            async for d in llm.generate("Tell me a long story", LONG):
                deltas.append(d)
                got.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got.wait(), 30)
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 10)
        return deltas

    deltas = asyncio.run(main())
    assert deltas and not deltas[-1].finished
    assert not llm._thread.is_alive()
