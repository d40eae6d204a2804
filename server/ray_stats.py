"""The engine replicas' stats on a gateway replica, polled from every replica when /metrics is
scraped.

One poll broadcasts ``stats`` to the engine deployment (a broadcast bypasses the replicas'
request limits, so a full replica still answers) and waits at most ``timeout`` seconds for each
replica: a replica that has not answered by then is left out of the snapshot and reported as
down (``quickdraft:replica_up`` 0) beside those that answered. Which replicas are live comes
from the gateway's own request routers (:func:`live_replicas`), so a replica that was scaled
down or replaced drops out, and only a live one that stays silent counts as down. Concurrent
scrapes share one poll.

A snapshot is ``{"replicas": {replica id: its AsyncLLM.stats()}, "replicas_up": {replica id:
1 or 0}}``; server/metrics.py turns it into one series per replica (label ``replica``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT = 2.0  # seconds an engine replica has to answer a /metrics scrape's poll
LiveReplicas = Callable[[], set[str] | None]
_ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's affinity routers
_ROUTERS_LOCK = threading.Lock()


def register_router(router: Any) -> None:
    """Called by each :class:`~quickdraft.server.ray_router.AffinityRouter` as Serve starts it
    (in Serve's router thread): :func:`live_replicas` reads its replica set."""
    with _ROUTERS_LOCK:
        _ROUTERS.add(router)


def live_replicas(deployment: str, app: str) -> set[str] | None:
    """The ids of the replicas of ``deployment`` (of ``app``) that this process's affinity
    routers route to now: Serve's live set, without replicas that are starting or stopping;
    None while no such router has started (Serve starts one with a handle's first call)."""
    with _ROUTERS_LOCK:
        routers = [r for r in _ROUTERS if r.deployment == (app, deployment)]
    if not routers:
        return None
    # list() of a dict copies its keys at once (the router thread may change it meanwhile)
    return {replica.unique_id for r in routers for replica in list(r.curr_replicas)}


def empty_snapshot() -> dict[str, Any]:
    return {"replicas": {}, "replicas_up": {}}


async def broadcast_each(handle: Any, method: str, timeout: float) -> list[Any]:
    """``method()`` on every replica of ``handle``'s deployment: the results of the replicas
    that answered within ``timeout`` seconds (failed and late ones are left out)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    response = handle.broadcast(method)
    # Serve's public results_async() has one deadline for all replicas (one late replica
    # loses every answer); the replicas' own results have one each.
    fetch = getattr(response, "_fetch_replica_results_async", None)
    try:
        if fetch is None:  # another Ray version: all or nothing
            results = await response.results_async(timeout_s=timeout, return_exceptions=True)
            return [r for r in results if not isinstance(r, BaseException)]
        pending = await asyncio.wait_for(fetch(), timeout)
    except (RayError, RayServeException, TimeoutError, RuntimeError) as exc:
        log.warning("engine %s broadcast failed: %s: %s", method, type(exc).__name__, exc)
        return []
    tasks = [asyncio.ensure_future(result.get_async()) for result in pending]
    if not tasks:
        return []
    done, late = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
    for task in late:
        task.cancel()
    answers = []
    for task in done:
        if (error := task.exception()) is None:
            answers.append(task.result())
        else:
            log.warning("an engine replica's %s failed: %s: %s", method, type(error).__name__,
                        error)
    if late:
        log.warning("%d engine replica(s) did not answer %s within %.1f s", len(late), method,
                    timeout)
    return answers


class ReplicaStatsPoller:
    """Polls the engine deployment behind ``handle`` for each replica's stats on request; lives
    on the gateway replica's event loop."""

    def __init__(self, handle: Any, *, timeout: float = SCRAPE_TIMEOUT,
                 live: LiveReplicas | None = None) -> None:
        self._handle = handle
        self.timeout = timeout
        self._live = live or (lambda: live_replicas(handle.deployment_name, handle.app_name))
        self.snapshot: dict[str, Any] = empty_snapshot()
        self._poll: asyncio.Task[None] | None = None

    async def refresh(self) -> dict[str, Any]:
        """Poll every replica now (a caller that comes while a poll runs waits for that one);
        the new snapshot."""
        if self._poll is None or self._poll.done():
            self._poll = asyncio.get_running_loop().create_task(self._refresh())
        await asyncio.shield(self._poll)
        return self.snapshot

    async def _refresh(self) -> None:
        answers = await broadcast_each(self._handle, "stats", self.timeout)
        replicas = {str(s["replica"]): s for s in answers if isinstance(s, dict)
                    and "replica" in s}
        live = self._live() or set()
        self.snapshot = {
            "replicas": dict(sorted(replicas.items())),
            "replicas_up": {r: int(r in replicas) for r in sorted(live | set(replicas))},
        }

    def cancel(self) -> None:
        """Stop a poll in flight (the gateway shuts down)."""
        if self._poll is not None:
            self._poll.cancel()
