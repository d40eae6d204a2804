"""benchmarks/spec_bench.py's ``--closed-loop N``: N requests with at most C in flight, each
finished one replaced in the same step (vLLM's ``--max-concurrency``), results in submission
order; checked against a scripted engine, without loading a model."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import spec_bench  # noqa: E402

from quickdraft.engine.sampling_params import SamplingParams  # noqa: E402


@dataclass
class _Out:
    request_id: str
    token_ids: list[int]
    finished: bool
    usage: object = None
    error: str | None = None


@dataclass
class _ScriptedEngine:
    """Each request emits one token per step, ``len(prompt)`` tokens in all."""

    left: dict[str, int] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)
    most_in_flight: int = 0

    def add_request(self, rid: str, *, sampling_params: SamplingParams,
                    prompt_token_ids: list[int], speculation: object,
                    cache_salt: str) -> None:
        assert rid not in self.left
        self.left[rid] = len(prompt_token_ids)
        self.submitted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[_Out]:
        self.most_in_flight = max(self.most_in_flight, len(self.left))
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            finished = self.left[rid] == 0
            if finished:
                del self.left[rid]
            outs.append(_Out(rid, [len(self.submitted)], finished, usage=rid))
        return outs


def test_closed_loop_keeps_c_in_flight_and_returns_in_submission_order() -> None:
    engine = _ScriptedEngine()
    prompts = [[0] * n for n in (3, 1, 2, 5, 1, 4, 2)]  # request i emits len(prompts[i])
    run = spec_bench.run_closed_loop(engine, prompts, 3, SamplingParams(max_tokens=8),  # type: ignore[arg-type]
                                     "t", "off")
    assert engine.submitted == [f"t-{i}" for i in range(7)]
    assert engine.most_in_flight == 3
    assert [len(t) for t in run["tokens"]] == [3, 1, 2, 5, 1, 4, 2]
    assert run["usage"] == [f"t-{i}" for i in range(7)]
    assert len(run["latency_s"]) == 7 and all(x > 0 for x in run["latency_s"])
    assert run["wall_s"] >= max(run["latency_s"])


def test_closed_loop_flag_is_validated() -> None:
    assert spec_bench.parse_args(["--closed-loop", "16"]).closed_loop == 16
    assert spec_bench.parse_args([]).closed_loop == 0
    with pytest.raises(SystemExit):
        spec_bench.parse_args(["--closed-loop", "-1"])


def test_one_batch_is_the_closed_loop_with_every_request_in_flight() -> None:
    engine = _ScriptedEngine()
    run = spec_bench.run_batch(engine, [[0] * n for n in (2, 4, 1)],  # type: ignore[arg-type]
                               SamplingParams(max_tokens=8), "b", "off")
    assert engine.most_in_flight == 3
    assert [len(t) for t in run["tokens"]] == [2, 4, 1]
