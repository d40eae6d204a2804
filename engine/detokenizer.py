"""Incremental detokenization for streaming, one :class:`IncrementalDetokenizer` per request.

Two layers, each holding text back for its own reason:

* **UTF-8 safety** (:class:`_TokenWindow`). Byte-level BPE tokens can split a multi-byte
  character, so decoding the tokens seen so far may end in U+FFFD that a later token turns
  into a real character. Following vLLM, only a small window of tokens is decoded per step:
  ``ids[prefix_offset:]`` is decoded and diffed against the text of the window that was
  already accounted for, so the cost per step is O(window), not O(sequence), and the
  tokenizer's leading-space handling at a decode boundary cancels out. Trailing U+FFFD is
  held back until the character completes (or :meth:`IncrementalDetokenizer.finish`).
* **Stop strings** (:class:`IncrementalDetokenizer`). The longest suffix of the pending text
  that is a prefix of some stop string is held back, so half a stop string is never sent.
  When several stop strings occur, the one completed first in the text wins (ties: the one
  starting earliest), so the result does not depend on how the tokens were chunked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from quickdraft.engine.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded before the first output token, so its leading space comes out right.
_PROMPT_CONTEXT_TOKENS = 5
# A window that still ends in U+FFFD after this many tokens is not valid UTF-8 being
# completed (a character is at most 4 bytes); it is released as is to keep steps O(window).
_MAX_WINDOW_TOKENS = 64


@dataclass(frozen=True, slots=True)
class DetokenizerUpdate:
    """What one :meth:`IncrementalDetokenizer.add_tokens` call produced."""

    text: str  # new text safe to emit now ('' if nothing)
    stop_str: str | None = None  # the stop string that matched: finish with reason "stop"


def _decoder(tokenizer: Any, skip_special: bool) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=skip_special,
    clean_up_tokenization_spaces=False)``. For transformers' fast tokenizers whose class
    decodes as the base class does (SmolLM2's, Qwen2's) that is their Rust tokenizer's
    ``decode``, called directly: transformers' wrapper costs ~3 us a call warm and ~14 us
    after a model step has evicted it (two calls a step; AVX2-only Zen 4, 2026-11-29)."""
    from transformers import PreTrainedTokenizerFast

    kind, base = type(tokenizer), PreTrainedTokenizerFast
    if isinstance(tokenizer, base) and kind.decode is base.decode \
            and kind._decode is base._decode:
        return partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=skip_special)
    return partial(tokenizer.decode, skip_special_tokens=skip_special,
                   clean_up_tokenization_spaces=False)


class _TokenWindow:
    """Token ids -> text, emitting only complete characters, decoding a bounded window."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special: bool) -> None:
        self._decode_ids = _decoder(tokenizer, skip_special)
        self._ids: list[int] = list(prompt_token_ids)
        self._prefix_offset = max(len(self._ids) - _PROMPT_CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        # Characters of decode(ids[prefix_offset:]) already emitted (or, for the prompt
        # context, never to be emitted).
        self._done_chars = len(self._decode(self._prefix_offset, self._read_offset))

    def _decode(self, start: int, end: int | None = None) -> str:
        if start == end:
            return ""
        return self._decode_ids(self._ids[start:end])

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text ('' while a character is split)."""
        self._ids.extend(token_ids)
        text = self._decode(self._prefix_offset)
        window = len(self._ids) - self._prefix_offset
        if text.endswith(_REPLACEMENT) and window <= _MAX_WINDOW_TOKENS:
            # Emit what precedes the split character; keep the window where it is.
            return self._take(text.rstrip(_REPLACEMENT))
        piece = self._take(text)
        self._advance()
        return piece

    def flush(self) -> str:
        """Everything not yet emitted, incomplete trailing characters included."""
        piece = self._take(self._decode(self._prefix_offset))
        self._advance()
        return piece

    def _take(self, text: str) -> str:
        if len(text) <= self._done_chars:
            return ""
        piece = text[self._done_chars :]
        self._done_chars = len(text)
        return piece

    def _advance(self) -> None:
        """The window's text is fully emitted: restart it at the last read boundary."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._done_chars = len(self._decode(self._prefix_offset, self._read_offset))


class IncrementalDetokenizer:
    """Turns a request's generated token ids into streamable text, honouring stop strings.

    ``add_tokens`` takes one or several new ids (speculative decoding accepts several per
    step) and returns the text that is safe to send now. When it reports ``stop_str`` the
    request must finish with reason "stop"; later calls return empty updates. When the
    request ends for any other reason, ``finish()`` returns the text still held back.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._window = _TokenWindow(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stops: tuple[str, ...] = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._max_hold = max(params.max_stop_str_len - 1, 0)
        self._pending = ""  # decoded, not yet emitted: a possible start of a stop string
        self._output: list[str] = []
        self._done = False

    @property
    def output_text(self) -> str:
        """Text emitted so far (after stop-string truncation)."""
        return "".join(self._output)

    @property
    def finished(self) -> bool:
        """A stop string matched or :meth:`finish` was called."""
        return self._done

    def add_tokens(self, token_ids: list[int]) -> DetokenizerUpdate:
        """Append newly generated tokens; return the text safe to emit and any stop match."""
        if self._done:
            return DetokenizerUpdate("")
        self._pending += self._window.add(list(token_ids))
        if not self._stops:
            return DetokenizerUpdate(self._emit(len(self._pending)))
        match = self._find_stop()
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include_stop else start
            self._done = True
            return DetokenizerUpdate(self._emit(end, drop_rest=True), stop)
        return DetokenizerUpdate(self._emit(len(self._pending) - self._held_len()))

    def finish(self) -> str:
        """End without a stop string: return all held-back text, split characters included."""
        if self._done:
            return ""
        self._pending += self._window.flush()
        self._done = True
        return self._emit(len(self._pending), drop_rest=True)

    def _emit(self, end: int, drop_rest: bool = False) -> str:
        piece = self._pending[:end]
        self._pending = "" if drop_rest else self._pending[end:]
        if piece:
            self._output.append(piece)
        return piece

    def _find_stop(self) -> tuple[int, str] | None:
        """The stop string completed first in the pending text, as ``(start, stop)``."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = self._pending.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _held_len(self) -> int:
        """Length of the longest suffix of the pending text that begins some stop string."""
        text = self._pending
        for k in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0
