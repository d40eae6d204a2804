"""The suffix proposer (SuffixDecoding, arXiv 2411.04975): drafts from suffix tries over the
request's own context and over earlier responses of the same tenant, and from a public corpus.

Two kinds of trie (:class:`spec.suffix_tree.SuffixTree`), then the corpus:

* **per request**: its prompt (earlier chat turns included) and its output so far, extended
  incrementally before each proposal and dropped when the request finishes;
* **global, partitioned by tenant**: the outputs of finished requests, one partition per
  ``cache_salt`` (``None`` is its own partition). A request only ever drafts from its own
  partition: drafts are verified, so another tenant's text could not be *emitted*, but how
  fast a draft is accepted would leak it as a timing side channel. A partition keeps its
  latest outputs up to ``max_partition_tokens`` (oldest dropped first); beyond
  ``max_partitions`` tenants or ``max_total_tokens`` in all, the least recently used
  partitions are dropped whole. A partition's trie is rebuilt from its live outputs when
  removals leave more dead nodes than live ones;
* **public** (when the engine has one, and the caller allows it this step): a fixed corpus
  of the target's own answers to prompts written for it or by it
  (:class:`spec.suffix_corpus.SuffixCorpus`), no user's text, so every request may draft
  from it; asked only when both tries find nothing, with its own thresholds
  (``corpus_min_match_len``, ``corpus_min_token_prob``).

A seeded sampled request drafts from its own trie (and the fixed corpus) only: how many
random draws verification consumes depends on the drafts, and its output must depend on its
seed and prompt alone, not on what other requests answered before.

A proposal queries both tries with the context's last ``max_depth`` tokens and keeps the
draft with the higher score (the expected number of accepted tokens under the trie's
frequencies); its length is at most ``k`` and ``max_spec_factor`` times the matched suffix
length, and it stops where the path probability falls below ``min_token_prob``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from quickdraft.engine.request import Request
from quickdraft.spec.suffix_corpus import SuffixCorpus
from quickdraft.spec.suffix_tree import Draft, SuffixTree, TreeDraft

_EMPTY = Draft([], 0.0, 0)


@dataclass(frozen=True)
class SuffixConfig:
    # Defaults from a sweep on SmolLM2 (benchmarks/spec_bench.py, C=1; docs/benchmarks.md):
    # on this CPU a verification row is not free, so weak 1-token matches are not drafted.
    max_depth: int = 24  # longest context suffix matched (and trie depth)
    max_spec_factor: float = 4.0  # draft at most this many tokens per matched token
    min_token_prob: float = 0.2  # stop drafting below this path probability
    min_match_len: int = 2  # shortest context suffix drafted from
    max_context: int = 4096  # a request's trie starts at most this many tokens back
    # Memory: a trie holds up to max_depth nodes a token (~40 bytes each), so outputs are
    # bounded in tokens: per tenant partition and over all partitions (LRU tenants go first).
    max_partition_tokens: int = 16384
    max_total_tokens: int = 65536
    max_partitions: int = 64  # tenants kept
    # The public corpus is asked only when the request's own and its tenant's tries find
    # nothing, and drafts only along likelier paths: it is the model's stock phrasing, only
    # sometimes what it says next (on spec_bench's greedy outputs a corpus draft's first
    # token was right ~40 % of the time after a 3-token match, 86 % after 8+). Two
    # same-process A/Bs at C=1 (2026-11-27, docs/benchmarks.md): matches of 2+ and paths of
    # 0.5+ gained 1.336x -> 1.415-1.438x over off; 3+ matches 1.399-1.414x, 0.3 / 0.7 alike.
    corpus_min_match_len: int = 2
    corpus_min_token_prob: float = 0.5

    def __post_init__(self) -> None:
        if not 1 <= self.max_depth <= 1024:
            raise ValueError(f"max_depth must be in [1, 1024], got {self.max_depth}")
        if self.max_spec_factor <= 0 or not 0 <= self.min_token_prob <= 1 \
                or not 0 <= self.corpus_min_token_prob <= 1 \
                or min(self.min_match_len, self.corpus_min_match_len) < 1:
            raise ValueError("max_spec_factor must be > 0, the min token probabilities in "
                             "[0, 1] and the min match lengths >= 1")
        if min(self.max_context, self.max_partition_tokens, self.max_total_tokens,
               self.max_partitions) < 1:
            raise ValueError("max_context, the token budgets and max_partitions must be >= 1")


@dataclass
class _Partition:
    """One tenant's earlier outputs: the trie and, LRU-ordered, the outputs it holds."""

    tree: SuffixTree
    outputs: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)
    next_id: int = 0
    tokens: int = 0  # sum of the outputs' lengths


@dataclass
class _RequestTrie:
    tree: SuffixTree
    appended: int = 0  # tokens of prompt + output already in the trie
    # what the last proposal found (SuffixTree.extend_propose): the longest continued match
    # (-1: no proposal yet), at how many tokens, and the tenant's trie then with how many
    # outputs added so far (None: no tenant's trie was asked): see match_bound
    longest: int = -1
    longest_at: int = 0
    tenant: _Partition | None = None
    tenant_outputs: int = 0


class SuffixProposer:
    """Per-request and per-tenant suffix tries; the only writer of both."""

    def __init__(self, config: SuffixConfig | None = None,
                 corpus: SuffixCorpus | None = None) -> None:
        self.config = config or SuffixConfig()
        self.corpus = corpus  # public: read by every request, written by none
        self._requests: dict[str, _RequestTrie] = {}
        self._partitions: OrderedDict[str | None, _Partition] = OrderedDict()
        self._total_tokens = 0  # over every partition

    def propose(self, request: Request, k: int, public: bool = True) -> Draft:
        """Up to ``k`` draft tokens for ``request``'s next positions: the tries' best, else
        the corpus's (unless ``public`` is False)."""
        if k <= 0:
            return _EMPTY
        c = self.config
        tries, context = self._tries(request)
        best = _EMPTY
        for tree in tries:
            draft = tree.speculate(context, k, c.max_spec_factor, c.min_token_prob,
                                   c.min_match_len)
            if draft.score > best.score:
                best = draft
        if not best.tokens and public and self.corpus is not None:
            best = self.corpus.speculate(context, k, c.max_spec_factor,
                                         c.corpus_min_token_prob, c.corpus_min_match_len)
        return best

    def propose_tree(self, request: Request, max_nodes: int, public: bool = True
                     ) -> TreeDraft:
        """Up to ``max_nodes`` drafts as a tree (frequency-scored branches where the context
        continued in several ways) from whichever trie expects more accepted tokens; when
        neither finds anything, from the corpus (unless ``public`` is False)."""
        c = self.config
        state, new_tokens, partition = self._pending(request)
        # one native call: append the new tokens to the request's trie (its context is its
        # sequence 0, whose matches are read from where the append ends), draft from it and
        # from the tenant's trie, keep the better
        state.appended = request.num_tokens  # (first: a failed call must not append twice)
        state.longest = -1
        best, _, longest = state.tree.extend_propose(
            0, new_tokens, None if partition is None else partition.tree, max_nodes,
            c.max_spec_factor, c.min_token_prob, c.min_match_len)
        # (0: nothing of min_match_len or more continued; a shorter one may have)
        state.longest, state.longest_at = max(longest, c.min_match_len - 1), request.num_tokens
        state.tenant = partition
        state.tenant_outputs = partition.next_id if partition is not None else 0
        if not best.tokens and public and self.corpus is not None:
            # fixed text, no other request's: seeded sampled requests may use it too
            context = request.token_ids_slice(max(request.num_tokens - c.max_depth, 0),
                                              request.num_tokens)
            best = self.corpus.speculate_tree(context, max_nodes, c.max_spec_factor,
                                              c.corpus_min_token_prob, c.corpus_min_match_len)
        return best

    def match_bound(self, request: Request) -> int | None:
        """At most how long a match :meth:`propose_tree` can find in ``request``'s tries now
        (None: unknown): the longest continued match of its last proposal plus the tokens
        it gained since (``SuffixTree.extend_propose``), while its tenant's trie is the one
        asked then and has gained no output since (outputs are only added; a dropped one
        takes matches away, never adds one). Not the public corpus's."""
        state = self._requests.get(request.request_id)
        if state is None or state.longest < 0:
            return None
        partition = self._tenant(request)
        if partition is not state.tenant or (
                partition is not None and partition.next_id != state.tenant_outputs):
            return None
        return state.longest + request.num_tokens - state.longest_at

    def _tenant(self, request: Request) -> _Partition | None:
        """The tenant's partition ``request`` may draft from: none for a seeded sampled
        request (the random draws it consumes depend on its drafts, and its output must
        depend only on its seed), or where the tenant has no outputs yet."""
        if request.sampling_params.seeded_sampling:
            return None
        return self._partitions.get(request.cache_salt)

    def _pending(self, request: Request) -> tuple[_RequestTrie, list[int], _Partition | None]:
        """The request's trie, the tokens it does not hold yet (its prompt's last
        ``max_context`` the first time), and its tenant's partition when it may draft from
        it."""
        c = self.config
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestTrie(SuffixTree(c.max_depth))
        n = request.num_tokens
        if state.appended == 0:
            state.appended = max(n - c.max_context, 0)
        new_tokens = request.token_ids_slice(state.appended, n) if state.appended < n else []
        return state, new_tokens, self._tenant(request)

    def _tries(self, request: Request) -> tuple[list[SuffixTree], list[int]]:
        """The tries ``request`` may draft from (its own, then its tenant's partition) and
        its context, after appending its new tokens to its own trie."""
        state, new_tokens, tenant = self._pending(request)
        if new_tokens:
            state.tree.append(0, new_tokens)
        n = state.appended = request.num_tokens
        state.longest = -1  # (match_bound: its last proposal did not measure one)
        context = request.token_ids_slice(max(n - self.config.max_depth, 0), n)
        return [state.tree] + ([tenant.tree] if tenant is not None else []), context

    def finish(self, request: Request) -> None:
        """Drop the request's trie; add its output to its tenant's partition."""
        self._requests.pop(request.request_id, None)
        output = list(request.output_token_ids)
        if not output:
            return
        key = request.cache_salt
        c = self.config
        output = output[-c.max_partition_tokens:]
        partition = self._partitions.get(key)
        if partition is None:
            partition = self._partitions[key] = _Partition(SuffixTree(c.max_depth))
        self._partitions.move_to_end(key)
        seq = partition.next_id
        partition.next_id += 1
        partition.tree.append(seq, output)
        partition.outputs[seq] = output
        partition.tokens += len(output)
        self._total_tokens += len(output)
        while partition.tokens > c.max_partition_tokens:
            self._drop_oldest(partition)
        while len(self._partitions) > c.max_partitions or self._total_tokens > c.max_total_tokens:
            oldest = next(iter(self._partitions.values()))
            if oldest is partition and len(self._partitions) == 1:
                self._drop_oldest(partition)
            else:
                self._total_tokens -= self._partitions.popitem(last=False)[1].tokens
        if partition.tree.num_nodes(live=False) > 2 * max(partition.tree.num_nodes(), 1024):
            self._rebuild(partition)

    def _drop_oldest(self, partition: _Partition) -> None:
        old, tokens = partition.outputs.popitem(last=False)
        partition.tree.remove(old)
        partition.tokens -= len(tokens)
        self._total_tokens -= len(tokens)

    def forget(self, request_id: str) -> None:
        """Drop a request's trie without learning from it (e.g. it failed)."""
        self._requests.pop(request_id, None)

    def _rebuild(self, partition: _Partition) -> None:
        tree = SuffixTree(self.config.max_depth)
        for seq, output in partition.outputs.items():
            tree.append(seq, output)
        partition.tree = tree

    def tenants(self) -> list[str | None]:
        """The partitions' tenants, least recently used first."""
        return list(self._partitions)

    def stats(self) -> dict[str, int]:
        return {"requests": len(self._requests), "partitions": len(self._partitions),
                "responses": sum(len(p.outputs) for p in self._partitions.values()),
                "tokens": self._total_tokens}
