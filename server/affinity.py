"""Which engine replica should serve a request: the pure part of scale-out routing (no Ray).

A request carries an *affinity key*: its session (``x-session-id`` header, ``?session=`` on the
WebSocket URL, or one key per WebSocket connection) or, for stateless calls, a digest of the
prompt's first KV blocks. Rendezvous hashing (highest random weight) maps the key onto the live
replicas: every gateway computes the same preferred replica without sharing state, and when a
replica joins or leaves only the keys it wins or held move. A preferred replica that is
saturated (``soft_limit`` requests in flight) gives way to the least-loaded ones.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections.abc import Callable, Sequence
from typing import TypeVar

R = TypeVar("R")
DEFAULT_KEY_BLOCKS = 4  # KV blocks of prompt that name a stateless request's prefix


def prefix_key(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
               max_blocks: int = DEFAULT_KEY_BLOCKS) -> str:
    """A digest of the prompt's first ``max_blocks`` full KV blocks (the whole prompt when it is
    shorter than one block), within the tenant's cache namespace ``cache_salt``: requests that
    share these blocks share a key, so they meet the prefix cache of the same replica."""
    full = min(len(token_ids) // block_size, max_blocks) * block_size
    head = token_ids[:full] if full else token_ids
    digest = hashlib.blake2b(digest_size=12)
    digest.update((cache_salt or "").encode() + b"\0")
    digest.update(array("q", head).tobytes())
    return "prefix:" + digest.hexdigest()


def session_key(session: str) -> str:
    return "session:" + session


def rendezvous_weight(key: str, replica: str) -> int:
    """A stable pseudo-random weight of (key, replica): the same in every process."""
    digest = hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred(key: str, replicas: Sequence[R], name: Callable[[R], str]) -> R:
    """The replica that wins ``key`` (highest rendezvous weight)."""
    return max(replicas, key=lambda r: rendezvous_weight(key, name(r)))


def rank(replicas: Sequence[R], key: str | None, *, name: Callable[[R], str],
         load: Callable[[R], int | None], soft_limit: int) -> list[list[R]]:
    """Ranks of replicas for one request, most preferred first (the router tries each rank in
    turn and takes its least-loaded member that has room).

    With a key: ``[[winner], others]`` while the winner runs fewer than ``soft_limit``
    requests; once it is saturated, the unsaturated others come first, least loaded first.
    Without a key: one rank of everything, shuffled so that ties do not always pick the first.
    ``load`` is a replica's known requests in flight (None: unknown, taken as idle).
    """
    if not replicas:
        return []
    if key is None:
        everyone = list(replicas)
        random.shuffle(everyone)
        return [everyone]
    winner = preferred(key, replicas, name)
    others = sorted((r for r in replicas if r is not winner), key=lambda r: load(r) or 0)
    if (load(winner) or 0) < soft_limit:
        return [[winner], others] if others else [[winner]]
    room = [r for r in others if (load(r) or 0) < soft_limit]
    full = [r for r in others if (load(r) or 0) >= soft_limit]
    return [ranked for ranked in (room, [winner, *full]) if ranked]
