"""Engine configuration: one frozen dataclass, validated once, built in one place, passed down."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SPECULATION_METHODS = ("auto", "off", "ngram", "suffix", "recycling", "draft", "head",
                       "combined")
KERNEL_BACKENDS = ("auto", "torch", "triton")
WEIGHT_FORMATS = ("auto", "int4-q8", "int4", "dense")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
# Names of torch dtypes (this module stays torch-free: the CLI imports it for --help).
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An engine setting is invalid; the message names the setting."""


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance.

    ``kv_cache_memory`` (bytes) sizes the block pool unless ``num_kv_blocks`` is given.
    ``max_model_len`` defaults to the model's ``max_position_embeddings`` (capped at 8192).
    """

    model: str | None = None  # None = the embedded default (SmolLM2-135M-Instruct)
    draft_model: str | None = None  # a smaller LM sharing the vocabulary (draft/combined)
    dtype: str = "bfloat16"
    block_size: int = 16
    kv_cache_memory: int = 1 << 30
    num_kv_blocks: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    seed: int = 0
    # CPU threads per step; None: torch's default, fewer while other processes load our
    # cores (engine/cpu_threads.py)
    num_threads: int | None = None
    # Where the model runs: auto (cuda when a GPU is visible, else cpu) | cpu | cuda | cuda:N.
    device: str = "auto"
    # auto (triton on CUDA when triton is installed, else torch) | torch | triton. The torch
    # path is the reference (plus the C kernels on CPU); see engine/backend.py.
    kernel_backend: str = "auto"
    # Capture decode/verification steps as CUDA graphs (only on CUDA with the triton backend).
    cuda_graphs: bool = True
    cuda_graph_max_tokens: int = 256  # largest captured step, in tokens (bucketed below it)
    # triton backend: give every row the same bits whatever its batch (fixed-tile GEMM and
    # attention, no split-KV, chain drafts only), so that speculation's output is exactly
    # plain decoding's in bf16 too (kernels/triton_invariant.py). False: cuBLAS, tuned
    # attention tiles and tree drafts, faster but only equal up to rounding.
    batch_invariant: bool = True
    # off | ngram | suffix | recycling | draft | head | combined | auto (draft needs
    # draft_model, head a draft head; combined takes per request and step the suffix tree or
    # the draft head's / draft model's chain, whichever expects more accepted tokens). auto
    # (the default): combined with a draft head or draft model, else suffix (n-gram where
    # its trie cannot be built). The adaptive
    # policy turns drafts down wherever they would not pay for themselves.
    speculation: str = "auto"
    # An EAGLE-3-style draft head (spec/draft_head.py): "auto" = the head shipped for this
    # target, when its fingerprint matches one (else none); a directory; None = none.
    draft_head: str | None = "auto"
    # Suffix decoding's public corpus (spec/suffix_corpus.py: the target's own answers, which
    # every request may draft from): "auto" = the one shipped for this target, else the
    # shipped one's text re-tokenized for it (cached); a directory; None = none.
    suffix_corpus: str | None = "auto"
    # Most drafts verified per request per step (a chain's length; a tree's depth). 8, not
    # 4: suffix drafts copy runs that are often longer than 4 tokens, and the policy prices
    # each row, so it grants fewer where rows are dear (C=1 suffix on the 2-core AMX Xeon,
    # arms alternating in one process, 2026-11-30: 4 -> 8 1.190x -> 1.213x and 1.179x ->
    # 1.197x, 6 1.203x, 16 1.203x; C=8 1.007x -> 1.009x).
    num_speculative_tokens: int = 8
    ngram_min: int = 2
    ngram_max: int = 4
    # A waiting request gains one priority level per this many seconds (None: no aging).
    priority_aging_s: float | None = 30.0
    # While interactive requests run, background requests get at most this many tokens a step
    # (0: they pause, keeping their blocks, and run in the gaps; aging prevents starvation).
    max_background_tokens_with_interactive: int = 0
    # Background requests' tokens per step otherwise (short steps: an arriving interactive
    # request waits at most one short step).
    max_background_tokens_per_step: int = 64
    enable_prefix_caching: bool = True  # share full KV blocks between equal prefixes
    measure_step_cost: bool = True  # time forward passes at start-up for the spec policy
    # Check each speculation method's realised tokens per second against the plain path in
    # alternating epochs and hold it off where it loses (spec/speed_guard.py).
    speed_guard: bool = True
    # Linear layers on the GGUF's own 4-bit blocks (engine/weight_format.py): auto (when a
    # timed decode step says it is faster on this CPU) | int4 (always; error if impossible)
    # | dense
    weights: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not 1 <= self.block_size <= 256:
            raise ConfigError(f"block_size must be in [1, 256], got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory < 1:
            raise ConfigError("kv_cache_memory must be positive")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")
        if self.weights not in WEIGHT_FORMATS:
            raise ConfigError(f"weights must be one of {list(WEIGHT_FORMATS)}, got "
                              f"{self.weights!r}")
        if self.num_threads is not None and not 1 <= self.num_threads <= 1024:
            raise ConfigError(f"num_threads must be in [1, 1024], got {self.num_threads}")
        if self.max_background_tokens_per_step < 1:
            raise ConfigError("max_background_tokens_per_step must be >= 1")
        if self.max_background_tokens_with_interactive < 0:
            raise ConfigError("max_background_tokens_with_interactive must be >= 0")
        if self.priority_aging_s is not None and self.priority_aging_s <= 0:
            raise ConfigError("priority_aging_s must be positive or None")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ConfigError(f"kernel_backend must be one of {list(KERNEL_BACKENDS)}, got "
                              f"{self.kernel_backend!r}")
        if not _DEVICE.fullmatch(self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 1 <= self.cuda_graph_max_tokens <= 4096:
            raise ConfigError("cuda_graph_max_tokens must be in [1, 4096]")
        if self.speculation not in SPECULATION_METHODS:
            raise ConfigError(f"speculation must be one of {list(SPECULATION_METHODS)}, "
                              f"got {self.speculation!r}")
        if self.speculation == "draft" and self.draft_model is None:
            raise ConfigError(f"speculation {self.speculation!r} needs a draft_model")
        if self.speculation == "head" and self.draft_head is None:
            raise ConfigError(f"speculation {self.speculation!r} needs a draft_head")
        if self.draft_head is not None and self.draft_model is not None \
                and self.draft_head != "auto":
            raise ConfigError("draft_head and draft_model: choose one")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ConfigError("need 1 <= ngram_min <= ngram_max <= 16")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype
