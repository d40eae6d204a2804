"""engine.cpu_threads: the thread count follows the load other processes put on our cores."""

from __future__ import annotations

import itertools

import pytest
import torch

from quickdraft.engine import cpu_threads
from quickdraft.engine.cpu_threads import ThreadGovernor, choose_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("max_threads", "current", "load", "quiet", "want"), [
    (2, 2, 0.0, 0, 2),    # idle: keep every core
    (2, 2, 0.4, 1, 2),    # under half a core of noise: no change
    (2, 2, 0.6, 1, 1),    # a busy neighbour: drop at once
    (2, 2, 3.0, 1, 1),    # never below one
    (2, 1, 1.0, 0, 1),    # still busy: stay down
    (2, 1, 0.0, 4, 1),    # quiet, but not for long enough yet
    (2, 1, 0.0, 5, 2),    # quiet for up_windows windows: back up
    (8, 8, 2.6, 1, 5),    # three cores' worth of others on an 8-core box
    (8, 5, 1.2, 5, 7),    # rises to what the load leaves
    (1, 1, 5.0, 9, 1),
])
def test_choose_threads(max_threads, current, load, quiet, want):
    assert choose_threads(max_threads, current, load, quiet, up_windows=5) == want


def test_proc_readers_work_here():
    cpus = frozenset(cpu_threads.os.sched_getaffinity(0))
    busy, own = cpu_threads._read_cpu_busy(cpus), cpu_threads._read_own_ticks()
    assert isinstance(busy, int) and busy > 0
    assert isinstance(own, int) and own >= 0
    assert cpu_threads._read_cpu_busy(frozenset({10**6})) == 0  # a CPU we do not have


def _fake_clock(monkeypatch, other_cores: list[float], interval: float = 0.1) -> None:
    """Each before_step() sees one more window in which others used other_cores[i] cores."""
    ticks = cpu_threads._CLK_TCK * interval
    times = itertools.count(start=1000.0, step=interval)
    state = {"busy": 0.0, "own": 0.0, "i": -1}

    def monotonic() -> float:
        state["i"] += 1
        i = min(state["i"], len(other_cores) - 1)
        state["busy"] += (other_cores[i] + 1.0) * ticks  # others + our one busy core
        state["own"] += 1.0 * ticks
        return next(times)

    monkeypatch.setattr(cpu_threads.time, "monotonic", monotonic)
    monkeypatch.setattr(cpu_threads, "_read_cpu_busy", lambda cpus: int(state["busy"]))
    monkeypatch.setattr(cpu_threads, "_read_own_ticks", lambda: int(state["own"]))


def test_governor_drops_under_load_and_recovers(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_DEFAULT_THREADS", 2)
    load = [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    _fake_clock(monkeypatch, load)
    gov = ThreadGovernor(None, adaptive=True)
    assert gov.state.mode == "adaptive" and torch.get_num_threads() == 2
    seen = []
    for _ in load:
        gov.before_step()
        seen.append(torch.get_num_threads())
    assert seen[:2] == [2, 2]
    assert seen[2] == 1  # the first busy window
    assert 1 in seen[5:8] and seen[-1] == 2  # back up only after five quiet windows
    assert gov.state.changes == 2
    assert gov.describe()["threads"] == 2


def test_fixed_count_is_applied_and_kept(monkeypatch):
    _fake_clock(monkeypatch, [3.0])
    gov = ThreadGovernor(1)
    assert torch.get_num_threads() == 1 and gov.state.mode == "fixed"
    for _ in range(5):
        gov.before_step()
    assert torch.get_num_threads() == 1 and gov.state.changes == 0


def test_not_adaptive_off_cpu_or_without_proc(monkeypatch):
    assert ThreadGovernor(None, adaptive=False).state.mode == "fixed"
    monkeypatch.setattr(cpu_threads, "_read_own_ticks", lambda: None)
    monkeypatch.setattr(cpu_threads, "_DEFAULT_THREADS", 2)
    assert ThreadGovernor(None).state.mode == "fixed"


def test_engine_applies_num_threads(tiny_model_dir):
    """--num-threads reaches the kernels (it used to be parsed and then ignored)."""
    from quickdraft.engine.config import EngineConfig
    from quickdraft.engine.llm_engine import LLMEngine
    from quickdraft.engine.sampling_params import SamplingParams

    llm = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_threads=1,
                                 speculation="off", num_kv_blocks=16), progress=False)
    llm.add_request("r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(
        temperature=0, max_tokens=3))
    while llm.has_unfinished_requests():
        llm.step()
        assert torch.get_num_threads() == 1
    assert llm.threads.describe()["mode"] == "fixed"
