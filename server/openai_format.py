"""OpenAI response shapes: chat and text completions, whole or as SSE chunks.

Usage carries OpenAI's three counts plus two extension objects, ``timings`` (queue, time to first
token, decode) and ``speculation`` (drafted / accepted tokens, mean acceptance length).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from quickdraft.engine.outputs import RequestOutput, Usage
from quickdraft.server.params import JSON, speculation_view, timings_view

DONE = b"data: [DONE]\n\n"


def sse(payload: JSON) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage_view(u: Usage | None) -> JSON | None:
    if u is None:
        return None
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            # OpenAI's name for prompt tokens served from the prefix cache
            "prompt_tokens_details": {"cached_tokens": u.num_cached_tokens},
            "timings": timings_view(u),
            "speculation": speculation_view(u)}


class CompletionFormat:
    """Renders one request's outputs as ``chat.completion`` or ``text_completion`` objects."""

    def __init__(self, *, chat: bool, model: str, tokenizer: Any, logprobs: bool,
                 include_usage: bool = False) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self._tokenizer = tokenizer
        self._logprobs = logprobs
        self._text_offset = 0

    # ------------------------------------------------------------------ whole

    def body(self, outputs: list[RequestOutput]) -> JSON:
        final = outputs[-1]
        text = "".join(o.text for o in outputs)
        choice: JSON = {"index": 0, "finish_reason": final.finish_reason,
                        "logprobs": self._logprob_view(outputs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": usage_view(final.usage)}

    # ------------------------------------------------------------------ streamed

    def role_chunk(self) -> bytes | None:
        """Chat streams open with the assistant role; text completions have no such chunk."""
        if not self.chat:
            return None
        return self._chunk({"role": "assistant", "content": ""}, "", None, None)

    def delta_chunk(self, out: RequestOutput) -> bytes | None:
        """The output's text (and finish reason if it is the last); None if nothing to say."""
        if not (out.text or out.token_ids or out.finished):
            return None
        delta = {"content": out.text} if self.chat and (out.text or not out.finished) else {}
        return self._chunk(delta if self.chat else None, out.text,
                           out.finish_reason if out.finished else None,
                           self._logprob_view([out]))

    def usage_chunk(self, usage: Usage | None) -> bytes:
        return sse({"id": self.id, "object": self._chunk_object, "created": self.created,
                    "model": self.model, "choices": [], "usage": usage_view(usage)})

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, delta: JSON | None, text: str, finish_reason: str | None,
               logprobs: JSON | None) -> bytes:
        choice: JSON = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = delta or {}
        else:
            choice["text"] = text
        payload: JSON = {"id": self.id, "object": self._chunk_object, "created": self.created,
                         "model": self.model, "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        return sse(payload)

    # ------------------------------------------------------------------ logprobs

    def _logprob_view(self, outputs: list[RequestOutput]) -> JSON | None:
        if not self._logprobs:
            return None
        ids = [t for o in outputs for t in o.token_ids]
        values = [lp for o in outputs for lp in (o.logprobs or [])]
        tokens = [self._tokenizer.decode([t]) for t in ids]
        if self.chat:
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                 "top_logprobs": []} for tok, lp in zip(tokens, values,
                                                                        strict=False)]}
        offsets = []
        for tok in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(tok)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None,
                "text_offset": offsets}
