"""The suffix proposer (SuffixDecoding, arXiv 2411.04975): drafts from suffix tries over the
request's own context and over earlier responses of the same tenant.

Two kinds of trie (:class:`spec.suffix_tree.SuffixTree`):

* **per request**: its prompt (earlier chat turns included) and its output so far, extended
  incrementally before each proposal and dropped when the request finishes;
* **global, partitioned by tenant**: the outputs of finished requests, one partition per
  ``cache_salt`` (``None`` is its own partition). A request only ever drafts from its own
  partition: drafts are verified, so another tenant's text could not be *emitted*, but how
  fast a draft is accepted would leak it as a timing side channel. Each partition keeps its
  latest ``max_responses`` outputs (LRU); the least recently used partitions beyond
  ``max_partitions`` are dropped whole. A partition's trie is rebuilt from its live outputs
  when removals leave more dead nodes than live ones.

A proposal queries both tries with the context's last ``max_depth`` tokens and keeps the
draft with the higher score (the expected number of accepted tokens under the trie's
frequencies); its length is at most ``k`` and ``max_spec_factor`` times the matched suffix
length, and it stops where the path probability falls below ``min_token_prob``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from engine.request import Request
from spec.suffix_tree import Draft, SuffixTree

_EMPTY = Draft([], 0.0, 0)


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 32  # longest context suffix matched (and trie depth)
    max_spec_factor: float = 1.0  # draft at most this many tokens per matched token
    min_token_prob: float = 0.1  # stop drafting below this path probability
    min_match_len: int = 1  # shortest context suffix drafted from
    max_responses: int = 256  # earlier outputs kept per tenant partition
    max_partitions: int = 64  # tenants kept

    def __post_init__(self) -> None:
        if not 1 <= self.max_depth <= 1024:
            raise ValueError(f"max_depth must be in [1, 1024], got {self.max_depth}")
        if self.max_spec_factor <= 0 or not 0 <= self.min_token_prob <= 1 \
                or self.min_match_len < 1:
            raise ValueError("max_spec_factor must be > 0, min_token_prob in [0, 1] and "
                             "min_match_len >= 1")
        if self.max_responses < 1 or self.max_partitions < 1:
            raise ValueError("max_responses and max_partitions must be >= 1")


@dataclass
class _Partition:
    """One tenant's earlier outputs: the trie and, LRU-ordered, the outputs it holds."""

    tree: SuffixTree
    outputs: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)
    next_id: int = 0


@dataclass
class _RequestTrie:
    tree: SuffixTree
    appended: int = 0  # tokens of prompt + output already in the trie


class SuffixProposer:
    """Per-request and per-tenant suffix tries; the only writer of both."""

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self._requests: dict[str, _RequestTrie] = {}
        self._partitions: OrderedDict[str | None, _Partition] = OrderedDict()

    def propose(self, request: Request, k: int) -> Draft:
        """Up to ``k`` draft tokens for ``request``'s next positions."""
        if k <= 0:
            return _EMPTY
        c = self.config
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestTrie(SuffixTree(c.max_depth))
        n = request.num_tokens
        if state.appended < n:
            state.tree.append(0, request.token_ids_slice(state.appended, n))
            state.appended = n
        context = request.token_ids_slice(max(n - c.max_depth, 0), n)
        best = state.tree.speculate(context, k, c.max_spec_factor, c.min_token_prob,
                                    c.min_match_len)
        partition = self._partitions.get(request.cache_salt)
        if partition is not None:
            other = partition.tree.speculate(context, k, c.max_spec_factor, c.min_token_prob,
                                             c.min_match_len)
            if other.score > best.score:
                best = other
        return best

    def finish(self, request: Request) -> None:
        """Drop the request's trie; add its output to its tenant's partition."""
        self._requests.pop(request.request_id, None)
        output = list(request.output_token_ids)
        if not output:
            return
        key = request.cache_salt
        partition = self._partitions.get(key)
        if partition is None:
            partition = self._partitions[key] = _Partition(SuffixTree(self.config.max_depth))
            while len(self._partitions) > self.config.max_partitions:
                self._partitions.popitem(last=False)
        self._partitions.move_to_end(key)
        seq = partition.next_id
        partition.next_id += 1
        partition.tree.append(seq, output)
        partition.outputs[seq] = output
        while len(partition.outputs) > self.config.max_responses:
            old, _ = partition.outputs.popitem(last=False)
            partition.tree.remove(old)
        if partition.tree.num_nodes(live=False) > 2 * max(partition.tree.num_nodes(), 1024):
            self._rebuild(partition)

    def forget(self, request_id: str) -> None:
        """Drop a request's trie without learning from it (e.g. it failed)."""
        self._requests.pop(request_id, None)

    def _rebuild(self, partition: _Partition) -> None:
        tree = SuffixTree(self.config.max_depth)
        for seq, output in partition.outputs.items():
            tree.append(seq, output)
        partition.tree = tree

    def stats(self) -> dict[str, int]:
        return {"requests": len(self._requests), "partitions": len(self._partitions),
                "responses": sum(len(p.outputs) for p in self._partitions.values())}
