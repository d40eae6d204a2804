"""One batch line run through the engine: :func:`execute` parses a request body the way its
HTTP endpoint would, runs it (never streamed, at background priority, in the tenant's cache
namespace) and returns the HTTP-shaped :class:`Answer`; an engine that cannot take requests
now raises :class:`Unavailable`, so the line stays pending. The worker reaches the engine
through an :class:`EngineLink`: the gateway's, or :class:`LocalLink` over an AsyncLLM of its
own (``quickdraft batch`` without a server).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol, cast

from quickdraft.engine.async_engine import AsyncLLM, EngineDeadError
from quickdraft.engine.outputs import RequestOutput, Usage
from quickdraft.engine.sampling_params import InvalidParameterError
from quickdraft.server.batch_cli import CHAT_ENDPOINT
from quickdraft.server.batch_store import new_id
from quickdraft.server.errors import ProtocolError, engine_failed, invalid, unsupported
from quickdraft.server.openai_api import parse_messages, parse_options, parse_prompt
from quickdraft.server.openai_format import CompletionFormat
from quickdraft.server.params import (
    JSON,
    PRIORITY_CLASSES,
    Fields,
    build_sampling,
    cache_namespace,
    fit_max_tokens,
)
from quickdraft.server.prompt_tokenizer import PromptTokenizer

BACKGROUND = PRIORITY_CLASSES["background"]


class Unavailable(Exception):
    """The engine cannot run requests now; the line stays pending and runs later."""


class EngineLink(Protocol):
    """What the worker needs from its host: :class:`server.gateway.Gateway` or
    :class:`LocalLink`."""

    model_name: str

    async def wait_loaded(self) -> bool: ...

    def engine(self) -> AsyncLLM: ...

    async def chat_prompt(self, llm: AsyncLLM, messages: list[dict[str, str]],
                          param: str) -> list[int]: ...

    async def text_prompt(self, llm: AsyncLLM, prompt: str) -> list[int]: ...


class LocalLink:
    """An :class:`EngineLink` over an AsyncLLM owned by the caller (no gateway)."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self._tokenizer = PromptTokenizer("quickdraft-batch-tokenize")

    async def wait_loaded(self) -> bool:
        return True

    def engine(self) -> AsyncLLM:
        if not self.llm.is_running:
            raise engine_failed("the engine has stopped")
        return self.llm

    async def chat_prompt(self, llm: AsyncLLM, messages: list[dict[str, str]],
                          param: str) -> list[int]:
        return await self._tokenizer.chat(llm, messages, param)

    async def text_prompt(self, llm: AsyncLLM, prompt: str) -> list[int]:
        return await self._tokenizer.text(llm, prompt)

    def close(self) -> None:
        self._tokenizer.close()


@dataclass(frozen=True)
class Answer:
    """One line's HTTP-shaped answer; ``finish_reason`` (and ``usage``, ``latency``: seconds
    from submitting to the engine to its last output) are set when the engine ran it."""

    status_code: int
    request_id: str
    body: JSON
    usage: Usage | None = None
    finish_reason: str | None = None
    latency: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status_code == 200

    @property
    def prompt_tokens(self) -> int:
        """For the batch's ``usage``: answered (200) lines only."""
        return self.usage.prompt_tokens if self.usage and self.ok else 0

    @property
    def completion_tokens(self) -> int:
        """For the batch's ``usage``: answered (200) lines only."""
        return self.usage.completion_tokens if self.usage and self.ok else 0


async def execute(link: EngineLink, endpoint: str, body: JSON,
                  priority: int = BACKGROUND, tenant: str | None = None) -> Answer:
    """Run one request body the way POST ``endpoint`` would (same parsing, same response
    shape), never streamed, at ``priority``, in ``tenant``'s cache namespace (refined by the
    body's ``cache_salt``, as over HTTP). An HTTP error becomes an Answer with its status
    and ``{"error": ...}`` body; raises Unavailable if the engine cannot take requests now."""
    try:
        llm = link.engine()
    except ProtocolError as err:  # loading, draining, stopped
        raise Unavailable(err.message) from err
    chat = endpoint == CHAT_ENDPOINT
    fmt: CompletionFormat | None = None
    try:
        f = Fields(body)  # error params name fields as the HTTP API does
        opts = parse_options(f, link.model_name, chat=chat)
        if opts.stream:
            raise unsupported("stream", "batch requests cannot be streamed")
        if chat:
            ids = await link.chat_prompt(llm, parse_messages(f), "messages")
        else:
            prompt = parse_prompt(f)
            ids = prompt if isinstance(prompt, list) else await link.text_prompt(llm, prompt)
        prompt_param = "messages" if chat else "prompt"
        max_tokens = fit_max_tokens(len(ids), opts.max_tokens, llm.engine.max_model_len,
                                    param=opts.max_tokens_param, prompt_param=prompt_param)
        params = build_sampling({**opts.sampling, "max_tokens": max_tokens,
                                 "logprobs": opts.logprobs}, "", opts.max_tokens_param)
        fmt = CompletionFormat(chat=chat, model=link.model_name,
                               tokenizer=llm.engine.tokenizer, logprobs=opts.logprobs)
        start = time.monotonic()
        outputs = await _generate(llm, ids, params, fmt.id, priority, opts.speculation,
                                  prompt_param, cache_namespace(tenant, opts.cache_salt))
    except ProtocolError as err:
        return Answer(err.status, fmt.id if fmt else new_id("req_"), {"error": err.to_dict()})
    final, latency = outputs[-1], time.monotonic() - start
    if final.finish_reason == "abort":
        raise Unavailable("the request was aborted")
    if final.finish_reason == "error":
        if not llm.is_running:
            raise Unavailable(final.error or "the engine stopped")
        failed = engine_failed(final.error or "the engine failed this request")
        return Answer(failed.status, fmt.id, {"error": failed.to_dict()}, final.usage,
                      "error", latency)
    return Answer(200, fmt.id, fmt.body(outputs), final.usage, final.finish_reason, latency)


async def _generate(llm: AsyncLLM, ids: list[int], params: Any, request_id: str,
                    priority: int, speculation: Any, prompt_param: str,
                    cache_salt: str | None) -> list[RequestOutput]:
    stream = cast(AsyncGenerator[RequestOutput, None], llm.generate(
        prompt_token_ids=ids, sampling_params=params, request_id=request_id,
        priority=priority, speculation=speculation, cache_salt=cache_salt))
    outputs: list[RequestOutput] = []
    try:
        async with contextlib.aclosing(stream):  # cancelled: aclose() aborts the request
            async for out in stream:
                outputs.append(out)
    except InvalidParameterError as err:  # refused by the engine itself
        param = prompt_param if err.param in ("prompt", "prompt_token_ids") else err.param
        raise invalid(param, err.message) from err
    except EngineDeadError as err:
        raise Unavailable(str(err)) from err
    if not outputs:
        raise Unavailable("the engine returned no output")
    return outputs
