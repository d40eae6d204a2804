"""Paged KV cache bookkeeping: a pool of blocks, per-request block tables, a prefix cache.

Only :class:`KVCacheManager` edits block tables; the scheduler asks it for slots and the model
runner reads the tables it is handed. The K/V tensors themselves live in the model runner.

Prefix cache. A *full* block is identified by a chained hash: ``H(parent hash, the block's
token ids, salt)`` (the salt separates tenants or anything else that changes the K/V), so a
hash names the whole prefix up to the block's end. Once a request's tokens in a full block are
computed *and verified*, the block is registered under its hash. A later request whose prompt
starts with the same blocks shares them (reference counts) instead of recomputing them. A block
whose last user finishes keeps its hash and its K/V: it goes to the free list, which is LRU
ordered, and loses its hash only when it is reused for something else.

Invariants (asserted):
- a block is free iff its ref count is 0; a free block may still be cached (it is evictable);
- a request's table covers exactly ``ceil(num_allocated_tokens / block_size)`` blocks;
- blocks are returned in reverse order (tail first), so the LRU list evicts a sequence's
  last blocks before its first ones (the shared prefix survives longest);
- a cache hit is capped at ``num_tokens - 1``: the last prompt token is always computed, so
  there are logits to sample from;
- only verified tokens are cached: callers pass ``num_computed_tokens`` after rejected drafts
  were rolled back, and only blocks fully below it are hashed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_bytes_per_block(
    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    return 2 * block_size * num_layers * num_kv_heads * head_dim * dtype_bytes


BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], salt: str | None) -> BlockHash:
    """Chained block hash (BLAKE2b, 128 bits): equal hashes mean equal prefixes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    if parent is None and salt:
        h.update(b"salt:" + salt.encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """Free list (LRU order), reference counts and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_cnt = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the LRU end; a cached one loses its hash (evicted)."""
        assert n <= len(self._free), "allocate() called without checking num_free"
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            assert self._ref_cnt[b] == 0
            self._evict(b)
            self._ref_cnt[b] = 1
            blocks.append(b)
        return blocks

    def _evict(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            self._hash_of[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]

    def lookup(self, h: BlockHash) -> int | None:
        return self._cached.get(h)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit); free ones leave the list."""
        for b in blocks:
            if self._ref_cnt[b] == 0:
                del self._free[b]
            self._ref_cnt[b] += 1

    def register(self, block: int, h: BlockHash) -> None:
        """Name a full, verified block by its hash (first writer wins for a given hash)."""
        assert self._ref_cnt[block] > 0, "only blocks in use are registered"
        if self._hash_of[block] is not None:
            return
        if h not in self._cached:
            self._cached[h] = block
            self._hash_of[block] = h

    def free(self, blocks: list[int]) -> None:
        """Drop one reference of each block; ``blocks`` must already be in eviction order."""
        for b in blocks:
            assert self._ref_cnt[b] > 0, f"double free of block {b}"
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref_cnt[block]

    def check_invariants(self, references: Sequence[int]) -> None:
        """``references[b]``: how many block tables hold block ``b``."""
        for b in range(self.num_blocks):
            assert self._ref_cnt[b] == references[b], (b, self._ref_cnt[b], references[b])
            assert (b in self._free) == (self._ref_cnt[b] == 0), b
        for h, b in self._cached.items():
            assert self._hash_of[b] == h, b


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # of which found in the cache

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


@dataclass
class _Hashes:
    salt: str | None
    hashes: list[BlockHash] = field(default_factory=list)


class KVCacheManager:
    """Maps each request to the blocks holding its K/V; shares full blocks by prefix hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, _Hashes] = {}
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.pool.num_blocks, self.pool.num_free, self.pool.num_cached,
                            self.num_queries, self.num_hits)

    def block_table(self, request_id: str) -> list[int]:
        """The request's table. Callers read it; only this class changes it."""
        return self._tables.get(request_id, [])

    # ------------------------------------------------------------------ prefix cache

    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int],
                           salt: str | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of ``token_ids`` (a request about to be
        admitted, holding no blocks), capped so at least the last token is computed."""
        assert request_id not in self._tables, "look up only before allocating"
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs  # cap: hit <= len - 1
        hits: list[int] = []
        hashes: list[BlockHash] = []
        for i in range(max_blocks):
            h = hash_block(hashes[-1] if hashes else None, token_ids[i * bs:(i + 1) * bs], salt)
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
        self._hashes[request_id] = _Hashes(salt, hashes)  # reused by cache_verified
        return hits

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (for the metrics endpoint)."""
        self.num_queries += num_tokens
        self.num_hits += num_hit_tokens

    def cache_verified(self, request_id: str, num_verified: int,
                       token_slice: Callable[[int, int], Sequence[int]],
                       salt: str | None = None) -> None:
        """Register the request's full blocks below ``num_verified``; ``token_slice(a, b)``
        returns its token ids ``[a, b)`` (only new full blocks are read and hashed)."""
        table = self._tables.get(request_id)
        if not self.enable_prefix_caching or not table:
            return
        bs = self.block_size
        state = self._hashes.setdefault(request_id, _Hashes(salt))
        full = min(num_verified // bs, len(table))
        for i in range(len(state.hashes), full):
            parent = state.hashes[-1] if state.hashes else None
            h = hash_block(parent, token_slice(i * bs, (i + 1) * bs), state.salt)
            state.hashes.append(h)
            self.pool.register(table[i], h)

    # ------------------------------------------------------------------ slots

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return max(cdiv(num_tokens, self.block_size) - len(self.block_table(request_id)), 0)

    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached_blocks: Sequence[int] = ()) -> bool:
        """Grow the table so it covers ``num_tokens`` tokens, starting from ``cached_blocks``
        (a prefix hit for a request without a table); False (and no change) if short."""
        assert not cached_blocks or request_id not in self._tables
        # Hit blocks on the free list are reused, not allocated, but leave the free list.
        reclaimed = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        need = max(cdiv(num_tokens, self.block_size) - len(self.block_table(request_id))
                   - len(cached_blocks), 0)
        if need + reclaimed > self.pool.num_free:
            return False
        if cached_blocks:
            self.pool.touch(cached_blocks)
            self._tables[request_id] = list(cached_blocks)
        if need:
            self._tables.setdefault(request_id, []).extend(self.pool.allocate(need))
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep only the blocks that hold positions ``[0, num_tokens)`` (speculation rollback)."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(table):
            tail = table[keep:]
            del table[keep:]
            self.pool.free(tail[::-1])
            state = self._hashes.get(request_id)
            if state is not None:  # (only full verified blocks were hashed: none of these)
                del state.hashes[keep:]

    def num_hashed_tokens(self, request_id: str) -> int:
        """Tokens of the request registered in the prefix cache (whole blocks)."""
        state = self._hashes.get(request_id)
        return len(state.hashes) * self.block_size if state is not None else 0

    def check_invariants(self) -> None:
        """Reference counts equal the tables' references; a table's hashes name a prefix of
        its blocks (tests run it after every step, with the scheduler's)."""
        references = [0] * self.pool.num_blocks
        for rid, table in self._tables.items():
            for b in table:
                references[b] += 1
            state = self._hashes.get(rid)
            assert state is None or len(state.hashes) <= len(table), rid
        self.pool.check_invariants(references)

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks, last block first; cached ones stay cached."""
        self._hashes.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table[::-1])
