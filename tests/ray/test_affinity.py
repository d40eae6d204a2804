"""The Ray-free parts of scale-out: affinity keys, rendezvous ranking, delta batching."""

from __future__ import annotations

import asyncio
from collections import Counter

from quickdraft.engine.outputs import RequestOutput
from quickdraft.server.affinity import preferred, prefix_key, rank, session_key
from quickdraft.server.ray_engine import DeltaBatch, EngineReplica, RemoteError

REPLICAS = ["r-alpha", "r-beta", "r-gamma"]


def ranked(key: str | None, load: dict[str, int], soft: int = 4) -> list[list[str]]:
    return rank(REPLICAS, key, name=str, load=load.get, soft_limit=soft)


def test_prefix_key_is_the_first_blocks_within_a_tenant():
    shared = list(range(100, 164))  # 4 blocks of 16
    a, b = [*shared, 1, 2, 3], shared + [7, 8, 9, 10] * 20
    assert prefix_key(a, 16) == prefix_key(b, 16)  # they differ only after 4 blocks
    assert prefix_key(a, 16, max_blocks=5) != prefix_key(b, 16, max_blocks=5)
    assert prefix_key(a, 16, "tenant-1") != prefix_key(a, 16, "tenant-2")
    assert prefix_key([5, 6], 16) != prefix_key([5, 7], 16)  # short: the whole prompt
    assert prefix_key([5, 6], 16).startswith("prefix:")


def test_rendezvous_is_stable_and_spreads_keys():
    keys = [session_key(f"s{i}") for i in range(300)]
    wins = Counter(preferred(k, REPLICAS, str) for k in keys)
    assert set(wins) == set(REPLICAS) and min(wins.values()) > 60
    # A replica leaving moves only the keys it held.
    survivors = REPLICAS[:2]
    for k in keys:
        before = preferred(k, REPLICAS, str)
        if before in survivors:
            assert preferred(k, survivors, str) == before


def test_rank_prefers_the_winner_until_it_is_saturated():
    key = session_key("abc")
    winner = preferred(key, REPLICAS, str)
    others = [r for r in REPLICAS if r != winner]
    load = {others[0]: 3, others[1]: 1}
    assert ranked(key, load) == [[winner], [others[1], others[0]]]
    load[winner] = 4  # saturated: the others with room first, least loaded first
    assert ranked(key, load) == [[others[1], others[0]], [winner]]
    load.update({others[0]: 9, others[1]: 4})  # all full: everyone, in one last rank
    assert ranked(key, load) == [[winner, others[1], others[0]]]


def test_rank_without_key_offers_everyone():
    (everyone,) = ranked(None, {})
    assert sorted(everyone) == sorted(REPLICAS)
    assert rank([], "k", name=str, load=lambda r: 0, soft_limit=1) == []


def _out(i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", f"t{i}", [i], finished=finished,
                         finish_reason="length" if finished else None)


def _batches(items: list[RequestOutput | RemoteError], interval: float,
             every: float = 0.0) -> list[DeltaBatch]:
    """The batches of ``items`` arriving one per ``every`` seconds (0: all ready at once)."""
    replica = EngineReplica.__new__(EngineReplica)  # no engine: only the batching runs
    replica.replica, replica.stream_interval = "r0", interval

    async def run() -> list[DeltaBatch]:
        ready: asyncio.Queue[RequestOutput | RemoteError] = asyncio.Queue()

        async def produce() -> None:
            for item in items:
                ready.put_nowait(item)
                if every:
                    await asyncio.sleep(every)

        producer = asyncio.create_task(produce())
        batches = [b async for b in replica._batches(ready)]
        await producer
        return batches

    return asyncio.run(run())


def test_ready_deltas_leave_together():
    outs = [_out(i) for i in range(9)] + [_out(9, finished=True)]
    (batch,) = _batches(list(outs), interval=0.05)
    assert batch.outputs == outs and batch.ended and batch.replica == "r0"


def test_a_fast_stream_is_batched_by_the_interval():
    outs = [_out(i) for i in range(29)] + [_out(29, finished=True)]
    batches = _batches(list(outs), interval=0.05, every=0.005)  # ~150 ms of deltas
    assert [o for b in batches for o in b.outputs] == outs
    assert batches[0].outputs == outs[:1]  # the first token leaves at once
    assert 2 <= len(batches) <= 8 and batches[-1].ended  # not one object per token


def test_an_error_ends_the_stream():
    batches = _batches([_out(0), RemoteError("invalid", "too long", "prompt"), _out(1)], 0.0)
    assert batches[-1].error is not None and batches[-1].ended
    err = batches[-1].error.rebuild()
    assert type(err).__name__ == "InvalidParameterError" and "too long" in str(err)
