"""How many threads a CPU step uses, chosen for the load the machine carries right now.

A decode step is ~150 short OpenMP regions (one per matmul and fused op). With as many
threads as cores, each region ends in a barrier that waits for every thread; when another
busy process shares the cores, one of our threads is descheduled for a whole scheduler slice
and every region waits for it. Measured on a 2-core EPYC with AVX512-BF16 (SmolLM2, bf16,
batch 1, one
``python -c "while True: pass"`` beside it): 2 threads fall from ~83 to ~25 tok/s with stalls
of ~200 ms between tokens, while 1 thread keeps ~55-73 tok/s, about what losing one core
costs. Idle, 2 threads are faster (83 against 70). So the thread count follows the load.

:class:`ThreadGovernor` samples, every ``interval_s``, the busy time of the CPUs this process
may run on (``/proc/stat``, only the cores in its affinity mask) and this process's own CPU
time (``/proc/self/stat``); the difference over the wall time is the load *other* processes
put on our cores, in cores. :func:`choose_threads` turns it into a thread count: fewer at
once when others are busy, more again only after ``up_windows`` quiet windows in a row (a
short-lived neighbour does not make the count flap). ``--num-threads`` fixes the count and
turns the governor off; so does a machine without ``/proc`` (the count stays torch's).

One writer: the engine thread calls :meth:`ThreadGovernor.before_step` before each step;
``torch.set_num_threads`` is process-wide and every C kernel reads ``torch.get_num_threads()``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# torch's own count (one per physical core) before any governor changed it: the most an
# adaptive engine uses, also for engines built later in the same process.
_DEFAULT_THREADS = torch.get_num_threads()


def target_threads(max_threads: int, other_load: float) -> int:
    """What the load leaves us: each core another process keeps busy (``other_load``, in
    cores; 0.5 counts as one) takes one thread away, never below 1."""
    return min(max_threads, max(1, max_threads - int(other_load + 0.5)))


def choose_threads(max_threads: int, current: int, other_load: float, quiet_windows: int,
                   up_windows: int) -> int:
    """The thread count for the next window: :func:`target_threads` at once when that is
    fewer, only after ``up_windows`` quiet windows (``quiet_windows``: how many windows in a
    row, this one included, wanted more than ``current``) when it is more."""
    assert max_threads >= 1 and 1 <= current <= max_threads
    target = target_threads(max_threads, other_load)
    if target < current:
        return target
    if target > current and quiet_windows >= up_windows:
        return target
    return current


def _read_cpu_busy(cpus: frozenset[int]) -> int | None:
    """Busy clock ticks (all but idle and iowait) summed over ``cpus``; None without /proc."""
    try:
        with open("/proc/stat", "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    busy = 0
    for line in lines:
        if not line.startswith(b"cpu") or line[3:4] == b" ":
            continue
        name, *fields = line.split()
        if int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        busy += sum(values) - values[3] - values[4]
    return busy


def _read_own_ticks() -> int | None:
    """This process's user + system clock ticks (all its threads)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # after "pid (comm) "
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


@dataclass
class ThreadState:
    """What the governor last decided (reported by /health)."""

    mode: str  # "adaptive" | "fixed"
    threads: int
    max_threads: int
    other_load: float  # cores other processes used on our cores in the last window
    changes: int  # how many times the count changed


class ThreadGovernor:
    def __init__(self, fixed_threads: int | None, *, adaptive: bool = True,
                 interval_s: float = 0.1, up_windows: int = 5) -> None:
        """``fixed_threads``: a count to keep (``--num-threads``); None: torch's default,
        adapted to the load when ``adaptive`` (CPU engines) and /proc can be read."""
        self.interval_s = interval_s
        self.up_windows = up_windows
        max_threads = fixed_threads or _DEFAULT_THREADS
        torch.set_num_threads(max_threads)
        self.cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else frozenset()
        adaptive = (adaptive and fixed_threads is None and max_threads > 1 and bool(self.cpus)
                    and _read_cpu_busy(self.cpus) is not None and _read_own_ticks() is not None)
        self.state = ThreadState("adaptive" if adaptive else "fixed", max_threads, max_threads,
                                 0.0, 0)
        self._quiet = 0
        self._last: tuple[float, int, int] | None = None

    def before_step(self) -> None:
        """Re-decide the thread count when a window has passed (cheap otherwise)."""
        if torch.get_num_threads() != self.state.threads:  # another engine in this process
            torch.set_num_threads(self.state.threads)
        if self.state.mode != "adaptive":
            return
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return
        busy, own = _read_cpu_busy(self.cpus), _read_own_ticks()
        if busy is None or own is None:
            return
        if self._last is None:
            self._last = (now, busy, own)
            return
        t0, busy0, own0 = self._last
        self._last = (now, busy, own)
        # After an idle spell the window is long: its average still says whether a neighbour
        # kept our cores busy, so the first step of a new request gets the right count.
        wall_ticks = (now - t0) * _CLK_TCK
        other = max(0.0, (busy - busy0) - (own - own0)) / wall_ticks
        s = self.state
        s.other_load = round(other, 2)
        wants_more = target_threads(s.max_threads, other) > s.threads
        self._quiet = self._quiet + 1 if wants_more else 0
        threads = choose_threads(s.max_threads, s.threads, other, self._quiet, self.up_windows)
        if threads != s.threads:
            log.info("CPU threads %d -> %d (other processes use %.2f of our cores)",
                     s.threads, threads, other)
            torch.set_num_threads(threads)
            s.threads = threads
            s.changes += 1
            self._quiet = 0

    def describe(self) -> dict[str, object]:
        s = self.state
        return {"mode": s.mode, "threads": s.threads, "max_threads": s.max_threads,
                "other_load": s.other_load}
