"""A public corpus for suffix decoding: the target's own answers, which every request may
draft from.

SuffixDecoding's global tree holds earlier responses, and for privacy quickdraft partitions
it by tenant (spec/suffix.py): a new tenant's first request has nothing to draft from but
its own prompt. Much of what a small model says is its own stock phrasing ("I hope this
message finds you well", a list's markup, a code block's frame), the same whoever asks. So
the target's answers to prompts it wrote itself, generated while training its draft head
(``quickdraft draft-head train``: no user's text in them, nothing a timing side channel
could leak), are shipped beside the head and drafted from by every request, as one more
trie. The drafts are verified like any other, so output never changes; the policy tracks
their acceptance apart from the request's own suffix drafts ("corpus/…").

A trie of bounded depth over millions of tokens would need gigabytes, so the corpus is
indexed by a suffix array over reversed contexts (``suffix_corpus.c``: 4 bytes a token,
built in about a second at start-up, beside its own copy of the tokens and a table of where
each token's run starts, all on 2 MiB pages where the machine allows); a
lookup is that table for the context's last token, a few binary searches within its run
for the tokens before it, and a small trie of the matched positions' continuations.

Files: ``suffix_corpus.u16.xz`` (xz of little-endian uint16 token ids, 0xFFFF between
answers; ``.u32.xz`` and 0xFFFFFFFF for a vocabulary of 65,535 ids or more) and
``suffix_corpus.json`` (the target's fingerprint, counts, provenance) in a head's directory;
optionally ``suffix_corpus.txt.xz``, the same answers as UTF-8 text, NUL between them.

**Other targets.** Only the default model has a corpus of its own answers. Much of its stock
phrasing is any chat model's, so a target without one drafts from the shipped text
re-tokenized by its own tokenizer (:func:`derive_corpus`, once, then cached under the
engine's cache directory by target and text): on Qwen2.5-Coder-1.5B, C=1, the decode
speed-up of suffix decoding over spec_bench's categories went from 1.615x to 1.679x with it
(geometric mean, `benchmarks/suffix_corpus_ab.py`, 2026-11-30, the 2-core AMX Xeon). Its
drafts are verified like any other and tracked apart ("corpus/…"), so where another model's
phrasing does not fit, the policy stops asking for them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import lzma
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from quickdraft.kernels import cbuild, huge_pages
from quickdraft.spec.suffix_tree import Draft, TreeDraft

_SOURCE = Path(__file__).with_name("suffix_corpus.c")
_CFLAGS = ("-O2", "-fPIC", "-shared")
CORPUS_CONFIG = "suffix_corpus.json"
TEXT_FILE = "suffix_corpus.txt.xz"  # the answers as UTF-8 text, NUL between them
# token files by width: name, numpy dtype, the separator in the file (-1 in the index)
_FORMATS = (("suffix_corpus.u16.xz", "<u2", 0xFFFF), ("suffix_corpus.u32.xz", "<u4", 0xFFFFFFFF))
_MAX_NODES = 256
MAX_SOURCES = 256  # matched positions whose continuations one lookup counts
_SCRATCH_NODES = 16  # a look-up's budget per source that _Scratch's trie room covers (the engine's)


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    lib = cbuild.load("suffix_corpus", _SOURCE, _CFLAGS, frozenset())
    if lib is None:
        return None
    ptr = ctypes.c_void_p
    lib.qd_sc_index_bytes.argtypes = [ptr, ctypes.c_int64]
    lib.qd_sc_index_bytes.restype = ctypes.c_int64
    lib.qd_sc_new.argtypes = [ptr, ctypes.c_int64, ctypes.c_int, ptr, ctypes.c_int64]
    lib.qd_sc_new.restype = ctypes.c_void_p
    lib.qd_sc_free.argtypes = [ptr]
    lib.qd_sc_free.restype = None
    lib.qd_sc_num_starts.argtypes = [ptr]
    lib.qd_sc_num_starts.restype = ctypes.c_int64
    lib.qd_sc_speculate_tree.argtypes = [ptr, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                         ctypes.c_float, ctypes.c_int, ctypes.c_int, ptr, ptr,
                                         ptr, ptr, ptr, ctypes.c_int64]
    lib.qd_sc_speculate_tree.restype = ctypes.c_int
    lib.qd_sc_scratch_bytes.argtypes = [ctypes.c_int64]
    lib.qd_sc_scratch_bytes.restype = ctypes.c_int64
    return lib


def available() -> bool:
    """True when the index is built and loaded. Never raises."""
    try:
        return _lib() is not None
    except Exception:
        return False


class _Scratch(threading.local):
    """One thread's look-up buffers and their addresses (``ndarray.ctypes.data`` costs more
    than the call's arithmetic), with room for the trie of a look-up drafting up to 16 nodes
    from up to MAX_SOURCES sources (a bigger one allocates its own)."""

    def __init__(self, lib: ctypes.CDLL, max_depth: int, max_sources: int) -> None:
        self.ctx = np.zeros(max(max_depth, 1), dtype=np.int32)
        self.tokens = np.zeros(_MAX_NODES, dtype=np.int32)
        self.parents = np.zeros(_MAX_NODES, dtype=np.int32)
        self.probs = np.zeros(_MAX_NODES, dtype=np.float32)
        self.match = np.zeros(1, dtype=np.int32)
        nodes = min(max_sources, MAX_SOURCES) * _SCRATCH_NODES + 1  # (at most 128 KB)
        self.trie = np.zeros(lib.qd_sc_scratch_bytes(nodes), dtype=np.uint8)
        self.ctx_at = self.ctx.ctypes.data
        # the call's last six arguments: the outputs, then the trie scratch and its size
        self.call_tail = (self.tokens.ctypes.data, self.parents.ctypes.data,
                          self.probs.ctypes.data, self.match.ctypes.data,
                          self.trie.ctypes.data, self.trie.size)


class SuffixCorpus:
    """An immutable corpus that drafts like a :class:`~spec.suffix_tree.SuffixTree`
    (``speculate`` / ``speculate_tree``, the same arguments and result types; drafts are
    marked ``public``)."""

    def __init__(self, sequences: Sequence[Sequence[int]] | np.ndarray,
                 max_depth: int = 16, max_sources: int = MAX_SOURCES) -> None:
        """``sequences``: the corpus's sequences, or one int array with -1 between them."""
        lib = _lib()
        if lib is None:
            raise RuntimeError("the corpus index (spec/suffix_corpus.c) could not be built")
        if isinstance(sequences, np.ndarray):
            flat = np.ascontiguousarray(sequences, dtype=np.int32)
        else:
            parts = [np.asarray([*list(s), -1], dtype=np.int64) for s in sequences]
            flat = np.concatenate(parts).astype(np.int32) if parts else np.empty(0, np.int32)
        if flat.size and int(flat.min()) < -1:
            raise ValueError("token ids must be >= 0 (-1 separates sequences)")
        if max_sources < 1:
            raise ValueError(f"max_sources must be >= 1, got {max_sources}")
        self._lib = lib
        self.num_tokens = int(np.count_nonzero(flat >= 0))
        self.max_depth = max_depth
        self.max_sources = max_sources
        # the index's arrays (a copy of the tokens among them), on 2 MiB pages where the
        # machine allows: a look-up after a model step finds them evicted, and on small
        # pages each of its probes would also walk the page tables
        size = lib.qd_sc_index_bytes(flat.ctypes.data, flat.size)
        self._memory = huge_pages.zeros((max(size, 1),), torch.uint8)
        self._handle = lib.qd_sc_new(flat.ctypes.data, flat.size, max_depth,
                                     self._memory.data_ptr(), size)
        if not self._handle:
            raise ValueError(f"max_depth must be in [1, 1024], got {max_depth} (or no memory)")
        self._scratch = _Scratch(lib, max_depth, max_sources)

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.qd_sc_free(handle)

    @property
    def num_starts(self) -> int:
        return int(self._lib.qd_sc_num_starts(self._handle))

    def speculate_tree(self, context: Sequence[int] | np.ndarray, max_nodes: int,
                       max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                       min_match_len: int = 1) -> TreeDraft:
        if not 0 <= max_nodes <= _MAX_NODES:
            raise ValueError(f"max_nodes must be in [0, {_MAX_NODES}], got {max_nodes}")
        # this thread's buffers (engines in one process share a corpus, load_corpus, and
        # each may step in its own thread); the look-up runs right after a model step has
        # evicted everything, where each numpy array made or addressed costs microseconds
        s = self._scratch
        n = min(len(context), self.max_depth)
        if n:
            s.ctx[:n] = context[-n:]
        count = self._lib.qd_sc_speculate_tree(
            self._handle, s.ctx_at, n, max_nodes, max_spec_factor, min_token_prob,
            min_match_len, self.max_sources, *s.call_tail)
        if count < 0:
            raise RuntimeError("qd_sc_speculate_tree failed")
        return TreeDraft(s.tokens[:count].tolist(), s.parents[:count].tolist(),
                         s.probs[:count].tolist(), int(s.match[0]), public=True)

    def speculate(self, context: Sequence[int] | np.ndarray, max_tokens: int,
                  max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                  min_match_len: int = 1) -> Draft:
        """The tree's likeliest path (each node's likeliest child), at most ``max_tokens``."""
        tree = self.speculate_tree(context, max_tokens, max_spec_factor, min_token_prob,
                                   min_match_len)
        tokens: list[int] = []
        score, parent = 0.0, -1
        for i, (node_parent, p) in enumerate(zip(tree.parents, tree.probs, strict=True)):
            if node_parent == parent and len(tokens) < max_tokens:  # best-first: the first
                tokens.append(tree.tokens[i])  # child met is the likeliest
                score += p
                parent = i
        return Draft(tokens, score, tree.match_len)


def tokens_file(directory: Path) -> Path:
    """The corpus token file in ``directory`` (either width)."""
    for name, _dtype, _sep in _FORMATS:
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"no {_FORMATS[0][0]} or {_FORMATS[1][0]} in {directory}")


def read_tokens(path: Path) -> np.ndarray:
    """A corpus file's token ids, int32 with -1 between sequences."""
    _name, dtype, separator = next(f for f in _FORMATS if path.name == f[0])
    raw = np.frombuffer(lzma.decompress(path.read_bytes()), dtype=dtype)
    out = raw.astype(np.int64)
    out[raw == separator] = -1
    return out.astype(np.int32)


def write_corpus(directory: Path, sequences: Sequence[Sequence[int]], fingerprint: str,
                 source: str) -> dict[str, object]:
    """Writes ``sequences`` as a corpus for the target of ``fingerprint`` (16-bit ids when
    every id is below 65,535, else 32-bit; ids must be below 2^31); returns its config."""
    top = max((max(seq) for seq in sequences if len(seq)), default=0)
    if top >= 1 << 31 or any(min(seq) < 0 for seq in sequences if len(seq)):
        raise ValueError("corpus token ids must be in [0, 2^31)")
    name, dtype, separator = _FORMATS[0] if top < _FORMATS[0][2] else _FORMATS[1]
    flat: list[int] = []
    for seq in sequences:
        flat.extend(seq)
        flat.append(separator)
    for stale, _dtype, _sep in _FORMATS:
        (directory / stale).unlink(missing_ok=True)
    data = np.asarray(flat, dtype=dtype).tobytes()
    (directory / name).write_bytes(lzma.compress(data, preset=6))
    config = {"target_fingerprint": fingerprint, "sequences": len(sequences),
              "tokens": len(flat) - len(sequences), "file": name, "source": source}
    (directory / CORPUS_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return config


def write_texts(directory: Path, texts: Sequence[str]) -> None:
    """Writes ``texts`` (the corpus's answers, decoded) as ``directory``'s text file."""
    if any("\0" in t for t in texts):
        raise ValueError("corpus texts must not contain NUL")
    (directory / TEXT_FILE).write_bytes(lzma.compress("\0".join(texts).encode(), preset=9))


def read_texts(directory: Path) -> list[str]:
    """``directory``'s corpus answers as text (FileNotFoundError when it has none)."""
    return lzma.decompress((directory / TEXT_FILE).read_bytes()).decode().split("\0")


Tokenize = Callable[[list[str]], list[list[int]]]  # texts -> token ids, no special tokens


def derive_corpus(source: Path, tokenize: Tokenize, fingerprint: str, cache: Path,
                  vocab_size: int | None = None) -> Path:
    """A corpus for the target of ``fingerprint`` from ``source``'s text (another target's
    corpus directory), tokenized by ``tokenize`` and cut where it gives an id of
    ``vocab_size`` or more (one the model has no embedding for; the pieces kept apart):
    written once under ``cache`` (named by the target and the text's digest; a half-written
    one is never seen, as the directory appears whole) and its directory returned."""
    digest = hashlib.sha256((source / TEXT_FILE).read_bytes()).hexdigest()[:16]
    out = cache / "suffix_corpus" / f"{fingerprint}-{digest}"
    if (out / CORPUS_CONFIG).is_file():
        return out
    sequences = [piece for ids in tokenize(read_texts(source))
                 for piece in _embeddable_pieces(ids, vocab_size) if piece]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".derive-", dir=out.parent))
    staging.chmod(0o755)  # (mkdtemp's is 0o700: a cache directory like the others)
    try:
        write_corpus(staging, sequences, fingerprint,
                     f"{source.name}'s corpus text ({digest}), tokenized for this target")
        try:
            os.rename(staging, out)
        except OSError:  # another process wrote it first: theirs stands
            if not (out / CORPUS_CONFIG).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _embeddable_pieces(ids: list[int], vocab_size: int | None) -> list[list[int]]:
    """``ids`` split at (and without) every id of ``vocab_size`` or more (None: whole)."""
    if vocab_size is None or all(i < vocab_size for i in ids):
        return [ids]
    pieces: list[list[int]] = [[]]
    for i in ids:
        if i < vocab_size:
            pieces[-1].append(i)
        elif pieces[-1]:
            pieces.append([])
    return pieces


def find_corpus(setting: str | None, fingerprint: str, shipped: Path,
                tokenize: Tokenize | None = None, cache: Path | None = None,
                vocab_size: int | None = None) -> SuffixCorpus | None:
    """The corpus an engine drafts from: None / "none" = none; "auto" = the one shipped
    (under ``shipped``) for this target's ``fingerprint``, else one derived from a shipped
    corpus's text (given ``tokenize`` and ``cache``: :func:`derive_corpus`), else none; else
    a directory holding one for this target, or another target's with its text (derived
    the same way; ValueError otherwise)."""
    if setting is None or setting == "none" or not available():
        return None
    if setting == "auto":
        own = own_corpus_dir(fingerprint, shipped)
        if own is not None:
            return load_corpus(own)
        dirs = [path.parent.resolve() for path in sorted(shipped.glob(f"*/{CORPUS_CONFIG}"))]
        texts = [d for d in dirs if (d / TEXT_FILE).is_file()]
        if texts and tokenize is not None and cache is not None:
            return load_corpus(derive_corpus(texts[0], tokenize, fingerprint, cache,
                                              vocab_size))
        return None
    directory = Path(setting).expanduser().resolve()
    if tokenize is not None and cache is not None and (directory / TEXT_FILE).is_file() \
            and _target_of(directory) != fingerprint:
        return load_corpus(derive_corpus(directory, tokenize, fingerprint, cache, vocab_size))
    check_corpus_target(directory, fingerprint)
    return load_corpus(directory)


def own_corpus_dir(fingerprint: str, shipped: Path) -> Path | None:
    """The directory under ``shipped`` holding a corpus of this target's own answers (the
    target of ``fingerprint``), or None."""
    for config in sorted(shipped.glob(f"*/{CORPUS_CONFIG}")):
        if _target_of(config.parent) == fingerprint:
            return config.parent.resolve()
    return None


def _target_of(directory: Path) -> str | None:
    """The fingerprint of the target ``directory``'s corpus is for (None: no corpus)."""
    config = directory / CORPUS_CONFIG
    return json.loads(config.read_text()).get("target_fingerprint") if config.is_file() \
        else None


def check_corpus_target(directory: Path, fingerprint: str) -> None:
    """ValueError unless ``directory`` holds a corpus for the target of ``fingerprint``."""
    if not (directory / CORPUS_CONFIG).is_file():
        raise ValueError(f"suffix corpus {directory}: no {CORPUS_CONFIG} (write one with "
                         "`quickdraft draft-head corpus`)")
    target = _target_of(directory)
    if target != fingerprint:
        raise ValueError(f"suffix corpus {directory}: target_fingerprint {target!r} is not "
                         f"this model's {fingerprint!r}")


@functools.lru_cache(maxsize=2)
def load_corpus(directory: Path) -> SuffixCorpus:
    """The corpus in ``directory``, indexed once per process (it is immutable: engines in
    one process share it; indexing 5 M tokens takes ~1.5 s)."""
    return SuffixCorpus(read_tokens(tokens_file(directory)))
