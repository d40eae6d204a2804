"""Ray Serve request router of the engine deployment: affinity first, least-loaded fallback.

Ray Serve runs one router per deployment handle, in the process that holds the handle (the
gateway replicas, or a driver). For each request it asks :meth:`AffinityRouter.choose_replicas`
for ranks of candidate replicas and sends the request to the least-loaded replica of the first
rank that has room (fewer than ``max_ongoing_requests``). The ranking itself is in
:mod:`quickdraft.server.affinity`; this module only adapts it to Serve's API
(``RequestRouterConfig(request_router_class=...)``, alpha in Ray 2.60).

Each router registers itself with :func:`quickdraft.server.ray_stats.register_router`, so the
gateway's stats poll knows which replicas are live. Serve pickles this module *by value* into
every process that routes (a copy of its globals, not the imported module's), so no state may
live here: the registry is in ray_stats, which is pickled by reference.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from quickdraft.server.affinity import rank
from quickdraft.server.ray_stats import register_router

ROUTER_PATH = "quickdraft.server.ray_router.AffinityRouter"
AFFINITY_KWARG = "affinity_key"  # the keyword argument of EngineReplica.generate it reads


class AffinityRouter(RequestRouter):
    """Routes requests with the same ``affinity_key`` to the same engine replica (rendezvous
    hashing over the live replicas) until that replica runs ``soft_limit`` requests; then to
    the least-loaded replica. Requests without a key go to the least-loaded replica."""

    soft_limit: int = 32
    affinity: bool = True

    def initialize_state(self, soft_limit: int = 32, affinity: bool = True,
                         **kwargs: Any) -> None:
        """``request_router_kwargs`` of the deployment: ``soft_limit`` is the requests in
        flight beyond which a replica counts as saturated (the engine's ``max_num_seqs``);
        ``affinity=False`` ignores affinity keys (least-loaded only: benchmarks' baseline)."""
        self.soft_limit = max(1, int(soft_limit))
        self.affinity = bool(affinity)
        register_router(self)

    @property
    def deployment(self) -> tuple[str, str]:
        """(app, deployment) of the replicas this router routes to."""
        deployment_id = getattr(self, "_deployment_id", None)  # RequestRouter's own
        return self.app_name, getattr(deployment_id, "name", "")

    def _load(self, replica: RunningReplica) -> int | None:
        """Requests in flight on ``replica`` as last probed or counted (None: unknown)."""
        return self._replica_queue_len_cache.get(replica.replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        key = None
        if pending_request is not None:
            key = pending_request.kwargs.get(AFFINITY_KWARG) if self.affinity else None
            # Every rank has been offered: back off before the next round (else Serve retries
            # at once, in a busy loop, while all replicas are full).
            pending_request.routing_context.should_backoff = True
        return rank(candidate_replicas, key if isinstance(key, str) else None,
                    name=lambda r: r.replica_id.unique_id, load=self._load,
                    soft_limit=self.soft_limit)
