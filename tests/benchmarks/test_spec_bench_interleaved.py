"""benchmarks/spec_bench.py's C = 1 runs, the methods interleaved prompt by prompt
(``run_interleaved``): the same requests, tenants and figures as one ``run_category`` per
method, submitted prompt-major; checked against a scripted engine, without loading a model."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import spec_bench  # noqa: E402

from quickdraft.engine.sampling_params import SamplingParams  # noqa: E402


@dataclass
class _Usage:
    completion_tokens: int
    decode_time: float


@dataclass
class _Out:
    request_id: str
    token_ids: list[int]
    finished: bool
    usage: _Usage | None = None
    error: str | None = None


@dataclass
class _Stats:
    proposer_seconds: float = 0.0


@dataclass
class _Speculator:
    stats: _Stats = field(default_factory=_Stats)
    num_guard_off_steps: int = 0


@dataclass
class _ScriptedEngine:
    """One request at a time: it emits ``len(prompt)`` tokens (its method's index + 1 each)
    in one step; a method's request adds its index to the proposer's seconds and the guard's
    off steps, so each method's totals say which requests were counted for it."""

    methods: list[str]
    speculator: _Speculator = field(default_factory=_Speculator)
    submitted: list[tuple[str, str, str]] = field(default_factory=list)  # rid, method, salt
    pending: list[tuple[str, int, int]] = field(default_factory=list)

    def add_request(self, rid: str, *, sampling_params: SamplingParams,
                    prompt_token_ids: list[int], speculation: object,
                    cache_salt: str) -> None:
        method = speculation.method  # type: ignore[attr-defined]
        self.submitted.append((rid, method, cache_salt))
        index = self.methods.index(method)
        self.pending.append((rid, len(prompt_token_ids), index))

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[_Out]:
        assert len(self.pending) == 1  # C = 1
        rid, n, index = self.pending.pop()
        self.speculator.stats.proposer_seconds += index
        self.speculator.num_guard_off_steps += index
        return [_Out(rid, [index + 1] * n, True, usage=_Usage(n, 0.5 * n))]


def test_interleaved_runs_prompt_major_and_returns_each_methods_run() -> None:
    methods = ["off", "suffix", "head"]
    engine = _ScriptedEngine(methods)
    prompts = [[0] * n for n in (3, 1, 2)]
    runs = spec_bench.run_interleaved(engine, prompts, SamplingParams(max_tokens=8),  # type: ignore[arg-type]
                                      "r0-chat-c1", methods)
    # prompt by prompt, every method in the given order for each
    assert [(rid, m) for rid, m, _ in engine.submitted] == [
        (f"r0-chat-c1-{m}-p{i}-0", m) for i in range(3) for m in methods]
    # every request its own tenant without a shared one
    assert len({salt for _, _, salt in engine.submitted}) == 9
    assert list(runs) == methods
    for index, method in enumerate(methods):
        run = runs[method]
        assert run["tokens"] == [[index + 1] * 3, [index + 1], [index + 1] * 2]
        assert run["generated"] == 6 and run["decode_tokens"] == 3
        assert run["decode_s"] == 3.0 and run["decode_tok_s"] == 1.0
        assert run["proposer_s"] == 3 * index and run["guard_off_steps"] == 3 * index
        assert run["tok_s"] == 6 / run["wall_s"] and len(run["latency_s"]) == 3


def test_interleaved_shared_tenant_is_one_per_method() -> None:
    methods = ["off", "suffix"]
    engine = _ScriptedEngine(methods)
    spec_bench.run_interleaved(engine, [[0], [0, 0]], SamplingParams(max_tokens=8),  # type: ignore[arg-type]
                               "r1-agentic-c1", methods, shared_tenant=True)
    salts = {m: {salt for _, mm, salt in engine.submitted if mm == m} for m in methods}
    assert salts == {"off": {"r1-agentic-c1-off"}, "suffix": {"r1-agentic-c1-suffix"}}


def test_interleaved_run_matches_run_category_at_c1() -> None:
    """The figures of one method's interleaved run are those run_category gives it alone."""
    prompts = [[0] * n for n in (2, 5)]
    params = SamplingParams(max_tokens=8)
    alone = spec_bench.run_category(_ScriptedEngine(["off", "suffix"]), prompts, 1,  # type: ignore[arg-type]
                                    params, "t", "suffix")
    mixed = spec_bench.run_interleaved(_ScriptedEngine(["off", "suffix"]), prompts,  # type: ignore[arg-type]
                                       params, "t", ["off", "suffix"])["suffix"]
    for key in ("tokens", "generated", "decode_tokens", "decode_s", "proposer_s",
                "guard_off_steps"):
        assert mixed[key] == alone[key], key
