"""Paged KV cache bookkeeping: a fixed pool of blocks and per-request block tables.

Only :class:`KVCacheManager` edits block tables; the scheduler asks it for slots and the model
runner reads the tables it is handed. The K/V tensors themselves live in the model runner.

Invariants (asserted):
- a block is either free or owned by exactly the requests counted in its ref count;
- a request's table covers exactly ``ceil(num_allocated_tokens / block_size)`` blocks;
- blocks are returned in reverse order (tail first), so a later prefix cache evicts a
  sequence's last blocks before its first ones.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_bytes_per_block(
    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    return 2 * block_size * num_layers * num_kv_heads * head_dim * dtype_bytes


class BlockPool:
    """Free list and reference counts of ``num_blocks`` physical blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_cnt = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "allocate() called without checking num_free"
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            assert self._ref_cnt[b] == 0
            self._ref_cnt[b] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference of each block; ``blocks`` must already be in eviction order."""
        for b in blocks:
            assert self._ref_cnt[b] > 0, f"double free of block {b}"
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free.append(b)


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks: int
    num_free_blocks: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


class KVCacheManager:
    """Maps each request to the blocks holding its K/V."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.pool.num_blocks, self.pool.num_free)

    def block_table(self, request_id: str) -> list[int]:
        """The request's table. Callers read it; only this class changes it."""
        return self._tables.get(request_id, [])

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return max(cdiv(num_tokens, self.block_size) - len(self.block_table(request_id)), 0)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the table so it covers ``num_tokens`` tokens; False (and no change) if short."""
        need = self.blocks_needed(request_id, num_tokens)
        if need > self.pool.num_free:
            return False
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

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks, last block first."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table[::-1])
