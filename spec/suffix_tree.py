"""Suffix decoding's data structure: a bounded-depth suffix trie with occurrence counts.

``suffix_tree.c`` holds the trie (its header comment states the semantics; the plain-Python
oracle is ``tests/spec/suffix_tree_reference.py``). It is built with gcc on first use like
the kernels (:mod:`kernels.cbuild`) and driven through ctypes: appending a token costs
``O(max_depth)`` hash lookups (each sequence keeps the nodes its last token reached),
drafting ``O(m^2 + max_tokens * children)`` for a longest match ``m``, or without the
``m^2`` walks for a sequence's own context (:meth:`SuffixTree.speculate_tree_of`). While
a model step streams its weights the trie falls out of the cache, so each lookup is a
memory access: these counts are what a proposal costs.
Without gcc :func:`available` is False and the ``suffix`` method falls back to n-gram
drafts (the engine says so at start-up).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quickdraft.kernels import cbuild

_SOURCE = Path(__file__).with_name("suffix_tree.c")
_CFLAGS = ("-O2", "-fPIC", "-shared")
_MAX_TREE_NODES = 256  # most nodes one speculate_tree call returns
_NEW_TOKENS = 64  # tokens an extend_propose call appends from its buffer (more: a copy)


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = cbuild.load("suffix_tree", _SOURCE, _CFLAGS, frozenset())
    if lib is None:
        return None
    lib.qd_st_new.argtypes = [ctypes.c_int]
    lib.qd_st_new.restype = ctypes.c_void_p
    lib.qd_st_free.argtypes = [ctypes.c_void_p]
    lib.qd_st_free.restype = None
    # pointers pass as plain addresses (``ndarray.ctypes.data``): ``data_as`` costs more than
    # the trie's own work on a one-token append
    ptr = ctypes.c_void_p
    lib.qd_st_append.argtypes = [ctypes.c_void_p, ctypes.c_int, ptr, ctypes.c_int]
    lib.qd_st_remove.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.qd_st_num_nodes.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.qd_st_speculate.argtypes = [ctypes.c_void_p, ptr, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_float, ctypes.c_float, ctypes.c_int, ptr, ptr, ptr]
    lib.qd_st_speculate_tree.argtypes = [ctypes.c_void_p, ptr, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_float, ctypes.c_float, ctypes.c_int, ptr,
                                         ptr, ptr, ptr]
    lib.qd_st_speculate_tree_seq.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                             ctypes.c_float, ctypes.c_float, ctypes.c_int,
                                             ptr, ptr, ptr, ptr]
    lib.qd_st_extend_propose.argtypes = [ctypes.c_void_p, ctypes.c_int, ptr, ctypes.c_int,
                                         ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                         ctypes.c_float, ctypes.c_int, ptr, ptr, ptr, ptr]
    for fn in (lib.qd_st_append, lib.qd_st_remove, lib.qd_st_num_nodes, lib.qd_st_speculate,
               lib.qd_st_speculate_tree, lib.qd_st_speculate_tree_seq,
               lib.qd_st_extend_propose):
        fn.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True when the trie is built and loaded. Never raises."""
    try:
        return _lib() is not None
    except Exception:
        return False


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    score: float  # sum of the drafted tokens' path probabilities: expected accepted length
    match_len: int  # length of the context suffix the draft continues


@dataclass(frozen=True)
class TreeDraft:
    """Drafts as a tree below the context: node ``i`` has ``tokens[i]``, parent
    ``parents[i]`` (-1: the context's last token) and ``probs[i]``, the trie's probability of
    its whole path; best-first (parents before children)."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match_len: int
    public: bool = False  # from the public corpus (spec/suffix_corpus.py), not a trie


def _i32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(tokens, dtype=np.int32)


class SuffixTree:
    """One trie; sequences are added by id, extended, and removed (counts taken back)."""

    def __init__(self, max_depth: int = 32) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("the suffix tree (spec/suffix_tree.c) could not be built")
        self._lib = lib
        self.max_depth = max_depth
        self._handle = lib.qd_st_new(max_depth)
        if not self._handle:
            raise ValueError(f"max_depth must be in [1, 1024], got {max_depth}")
        # output buffers, reused by every call (one writer: this trie's caller, one thread)
        self._tokens = np.empty(_MAX_TREE_NODES, dtype=np.int32)
        self._parents = np.empty(_MAX_TREE_NODES, dtype=np.int32)
        self._probs = np.empty(_MAX_TREE_NODES, dtype=np.float32)
        self._score = np.empty(1, dtype=np.float32)
        # match length, then (extend_propose) which trie and the longest live match
        self._match = np.empty(3, dtype=np.int32)
        self._new = np.empty(_NEW_TOKENS, dtype=np.int32)  # extend_propose's appended tokens
        self._out = (self._tokens.ctypes.data, self._parents.ctypes.data,
                     self._probs.ctypes.data, self._match.ctypes.data)
        self._new_at = self._new.ctypes.data  # (an ndarray's .ctypes.data costs ~1.5 us)

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.qd_st_free(handle)

    def append(self, seq_id: int, tokens: Sequence[int] | np.ndarray) -> None:
        arr = _i32(tokens)
        if self._lib.qd_st_append(self._handle, seq_id, arr.ctypes.data, arr.size) != 0:
            raise ValueError(f"append to sequence {seq_id} failed (negative token id or "
                             "out of memory)")

    def remove(self, seq_id: int) -> None:
        if self._lib.qd_st_remove(self._handle, seq_id) != 0:
            raise KeyError(seq_id)

    def num_nodes(self, live: bool = True) -> int:
        return int(self._lib.qd_st_num_nodes(self._handle, int(live)))

    def speculate(self, context: Sequence[int] | np.ndarray, max_tokens: int,
                  max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                  min_match_len: int = 1) -> Draft:
        if not 0 <= max_tokens <= _MAX_TREE_NODES:
            raise ValueError(f"max_tokens must be in [0, {_MAX_TREE_NODES}], got {max_tokens}")
        ctx = _i32(context[-self.max_depth:])
        tokens, _, _, match = self._out
        n = self._lib.qd_st_speculate(self._handle, ctx.ctypes.data, ctx.size, max_tokens,
                                      max_spec_factor, min_token_prob, min_match_len,
                                      tokens, self._score.ctypes.data, match)
        if n < 0:
            raise RuntimeError("qd_st_speculate failed")
        return Draft(self._tokens[:n].tolist(), float(self._score[0]), int(self._match[0]))

    def speculate_tree(self, context: Sequence[int] | np.ndarray, max_nodes: int,
                       max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                       min_match_len: int = 1) -> TreeDraft:
        """:meth:`speculate`'s match, drafted as a tree: the ``max_nodes`` most probable
        continuations best-first (depth at most its chain budget), each above
        ``min_token_prob``."""
        if not 0 <= max_nodes <= _MAX_TREE_NODES:
            raise ValueError(f"max_nodes must be in [0, {_MAX_TREE_NODES}], got {max_nodes}")
        ctx = _i32(context[-self.max_depth:])
        n = self._lib.qd_st_speculate_tree(
            self._handle, ctx.ctypes.data, ctx.size, max_nodes, max_spec_factor,
            min_token_prob, min_match_len, *self._out)
        if n < 0:
            raise RuntimeError("qd_st_speculate_tree failed")
        return self._tree_draft(n)

    def speculate_tree_of(self, seq_id: int, max_nodes: int, max_spec_factor: float = 1.0,
                          min_token_prob: float = 0.1, min_match_len: int = 1) -> TreeDraft:
        """:meth:`speculate_tree` with sequence ``seq_id``'s own last ``max_depth`` tokens as
        the context: the same draft, its matches read from the nodes its last append
        reached instead of walked from the root (a request drafting from its own trie)."""
        if not 0 <= max_nodes <= _MAX_TREE_NODES:
            raise ValueError(f"max_nodes must be in [0, {_MAX_TREE_NODES}], got {max_nodes}")
        n = self._lib.qd_st_speculate_tree_seq(
            self._handle, seq_id, max_nodes, max_spec_factor, min_token_prob, min_match_len,
            *self._out)
        if n < 0:
            raise KeyError(seq_id)
        return self._tree_draft(n)

    def extend_propose(self, seq_id: int, tokens: Sequence[int], other: SuffixTree | None,
                       max_nodes: int, max_spec_factor: float = 1.0,
                       min_token_prob: float = 0.1, min_match_len: int = 1
                       ) -> tuple[TreeDraft, bool, int]:
        """:meth:`append` ``tokens`` to ``seq_id``, then :meth:`speculate_tree_of` it and,
        with ``other``, ``other.speculate_tree`` of the same context (the sequence's last
        ``max_depth`` tokens), in one native call: the draft whose probabilities sum higher
        (ties: this trie's), whether it is ``other``'s, and the longest match in either trie
        that continued (the longest suffix of the context, of at least ``min_match_len``,
        that occurred followed by something, whatever its probability; 0 if none). That
        bounds later matches: ``j`` tokens on, as long as neither trie gained a sequence, no
        match is longer than it + ``j`` (the earlier occurrence's ``j`` tokens fewer would
        have matched now). A request's proposal each step:
        one call instead of three, each of which costs far more than its work once a model
        step has pushed the interpreter's and the tries' memory out of the cache."""
        if not 0 <= max_nodes <= _MAX_TREE_NODES:
            raise ValueError(f"max_nodes must be in [0, {_MAX_TREE_NODES}], got {max_nodes}")
        n = len(tokens)
        if n <= _NEW_TOKENS:
            self._new[:n] = tokens
            at = self._new_at
        else:
            arr = _i32(tokens)
            at = arr.ctypes.data
        count = self._lib.qd_st_extend_propose(
            self._handle, seq_id, at, n, other._handle if other is not None else None,
            max_nodes, max_spec_factor, min_token_prob, min_match_len, *self._out)
        if count == -1:
            raise ValueError(f"append to sequence {seq_id} failed (negative token id or "
                             "out of memory)")
        if count < 0:
            raise RuntimeError("qd_st_extend_propose failed")
        return self._tree_draft(count), bool(self._match[1]), int(self._match[2])

    def _tree_draft(self, n: int) -> TreeDraft:
        return TreeDraft(self._tokens[:n].tolist(), self._parents[:n].tolist(),
                         self._probs[:n].tolist(), int(self._match[0]))
