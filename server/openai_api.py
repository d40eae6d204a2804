"""OpenAI-compatible HTTP API: ``/v1/chat/completions`` and ``/v1/completions`` (whole or as
server-sent events), ``/v1/models``.

A request is validated, tokenized off the loop, fitted to the context, admitted, and then its
first engine output is awaited before the HTTP status is chosen, so requests the engine refuses
still get a proper 4xx. A client that goes away aborts its engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from quickdraft.engine.async_engine import AsyncLLM, EngineDeadError
from quickdraft.engine.outputs import RequestOutput
from quickdraft.engine.sampling_params import InvalidParameterError
from quickdraft.server.errors import (
    ProtocolError,
    empty_conversation,
    engine_failed,
    invalid,
    model_not_found,
    unsupported,
    wrong_type,
)
from quickdraft.server.gateway import Gateway
from quickdraft.server.guard import tenant
from quickdraft.server.limits import Slot
from quickdraft.server.openai_format import DONE, CompletionFormat, sse
from quickdraft.server.params import (
    CHAT_ROLES,
    JSON,
    UNSUPPORTED_FIELDS,
    Fields,
    build_sampling,
    cache_namespace,
    check_model,
    fit_max_tokens,
    read_cache_salt,
    read_max_tokens,
    read_message,
    read_priority,
    read_sampling,
    read_speculation,
)
from quickdraft.spec.params import SpeculationParams

T = TypeVar("T")
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


@dataclass(frozen=True)
class Options:
    sampling: JSON
    max_tokens: int | None
    max_tokens_param: str
    stream: bool
    include_usage: bool
    priority: int
    speculation: SpeculationParams | None
    logprobs: bool
    cache_salt: str | None = None  # the client's namespace within its tenant


def gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


# ---------------------------------------------------------------------- endpoints


async def chat_completions(request: Request) -> Response:
    gw = gateway(request)
    llm = gw.engine()
    f = Fields(await read_json(request, gw.settings.max_message_size))
    opts = parse_options(f, gw.model_name, chat=True)
    ids = await gw.chat_prompt(llm, parse_messages(f), "messages")
    fmt = CompletionFormat(chat=True, model=gw.model_name, tokenizer=llm.engine.tokenizer,
                           logprobs=opts.logprobs, include_usage=opts.include_usage)
    return await run(request, gw, llm, ids, opts, fmt, "messages")


async def completions(request: Request) -> Response:
    gw = gateway(request)
    llm = gw.engine()
    f = Fields(await read_json(request, gw.settings.max_message_size))
    opts = parse_options(f, gw.model_name, chat=False)
    prompt = parse_prompt(f)
    ids = prompt if isinstance(prompt, list) else await gw.text_prompt(llm, prompt)
    fmt = CompletionFormat(chat=False, model=gw.model_name, tokenizer=llm.engine.tokenizer,
                           logprobs=opts.logprobs, include_usage=opts.include_usage)
    return await run(request, gw, llm, ids, opts, fmt, "prompt")


async def list_models(request: Request) -> Response:
    gw = gateway(request)
    return JSONResponse({"object": "list", "data": [_model_card(gw, gw.engine())]})


async def get_model(request: Request) -> Response:
    gw = gateway(request)
    llm = gw.engine()
    if request.path_params["model"] != gw.model_name:
        raise model_not_found(request.path_params["model"])
    return JSONResponse(_model_card(gw, llm))


def _model_card(gw: Gateway, llm: AsyncLLM) -> JSON:
    return {"id": gw.model_name, "object": "model", "created": gw.created,
            "owned_by": "quickdraft", "max_model_len": llm.engine.max_model_len}


# ---------------------------------------------------------------------- parsing


async def read_json(request: Request, limit: int) -> JSON:
    too_large = ProtocolError("request_too_large", f"the request body exceeds {limit} bytes",
                              status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError("invalid_json", f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProtocolError("invalid_json", "the request body must be a JSON object")
    return data


def parse_options(f: Fields, model_name: str, *, chat: bool) -> Options:
    check_model(f, model_name)
    for key in ("n", "best_of"):
        if f.get(key, "int") not in (None, 1):
            raise unsupported(key, "only 1 is supported")
    for key in UNSUPPORTED_FIELDS:
        if f.has(key):
            raise unsupported(key, "not supported by this server")
    if f.has("logit_bias") and f.obj["logit_bias"]:
        raise unsupported("logit_bias", "not supported by this server")
    if f.get("echo", "bool"):
        raise unsupported("echo", "not supported by this server")
    fmt = f.child("response_format")
    if fmt is not None and fmt.string("type") not in (None, "text"):
        raise unsupported("response_format.type", "only text output is supported")
    if chat:
        key = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
        max_tokens = read_max_tokens(f, key)
    else:
        key, max_tokens = "max_tokens", read_max_tokens(f, "max_tokens")
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    sampling = read_sampling(f)
    logprobs = _read_logprobs(f, chat)
    build_sampling({**sampling, "max_tokens": max_tokens or 1}, "", key)  # fail early
    stream = bool(f.get("stream", "bool"))
    stream_options = f.child("stream_options")
    include_usage = bool(stream_options and stream_options.get("include_usage", "bool"))
    return Options(sampling, max_tokens, key, stream, stream and include_usage,
                   read_priority(f), read_speculation(f), logprobs, read_cache_salt(f))


def _read_logprobs(f: Fields, chat: bool) -> bool:
    if chat:
        if f.get("top_logprobs", "int"):
            raise unsupported("top_logprobs", "only the sampled token's logprob is available")
        return bool(f.get("logprobs", "bool"))
    n = f.get("logprobs", "int")
    if n:
        raise unsupported("logprobs", "only logprobs=0 (the sampled token's) is supported")
    return n == 0


def parse_messages(f: Fields) -> list[dict[str, str]]:
    raw = f.obj.get("messages")
    if raw is None:
        raise ProtocolError("missing_required_parameter", "messages is required", "messages")
    if not isinstance(raw, list):
        raise wrong_type("messages", "a non-empty list of messages")
    if not raw:
        raise empty_conversation("messages", "messages is empty; send at least one message")
    messages = []
    for i, value in enumerate(raw):
        role, text = read_message(Fields(value, f"messages[{i}]"))
        messages.append({"role": CHAT_ROLES[role], "content": text})
    return messages


def parse_prompt(f: Fields) -> str | list[int]:
    prompt = f.obj.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if prompt is None:
        raise ProtocolError("missing_required_parameter", "prompt is required", "prompt")
    if prompt == []:
        raise invalid("prompt", "the prompt is empty")  # as the engine says of ""
    if isinstance(prompt, list) and all(isinstance(p, str | list) for p in prompt):
        raise unsupported("prompt", "batched prompts are not supported; send one per request")
    raise wrong_type("prompt", "a string or a non-empty list of token ids")


# ---------------------------------------------------------------------- running


async def run(request: Request, gw: Gateway, llm: AsyncLLM, ids: list[int], opts: Options,
              fmt: CompletionFormat, prompt_param: str) -> Response:
    max_tokens = fit_max_tokens(len(ids), opts.max_tokens, llm.engine.max_model_len,
                                param=opts.max_tokens_param, prompt_param=prompt_param)
    params = build_sampling({**opts.sampling, "max_tokens": max_tokens,
                             "logprobs": opts.logprobs}, "", opts.max_tokens_param)
    refused = gw.admission.try_acquire()
    if refused is not None:
        raise refused
    slot, rid, start = Slot(gw.admission), fmt.id, time.monotonic()
    gw.http_requests.add(rid)
    stream = cast(AsyncGenerator[RequestOutput, None], llm.generate(
        prompt_token_ids=ids, sampling_params=params, request_id=rid, priority=opts.priority,
        speculation=opts.speculation,
        cache_salt=cache_namespace(tenant(request.scope), opts.cache_salt)))  # aclose() aborts

    def observe(out: RequestOutput) -> None:
        gw.metrics.observe(out.usage, out.finish_reason, time.monotonic() - start,
                           opts.priority)

    async def cleanup() -> None:
        await stream.aclose()  # aborts the engine request unless it finished
        gw.http_requests.discard(rid)
        slot.release()

    streaming = False
    try:
        first = await until_disconnect(request, _first(stream, prompt_param))
        if opts.stream and first.finish_reason != "error":
            streaming = True  # the response's own cleanup takes over
            return EventStream(_events(fmt, first, stream, observe), cleanup)
        outputs = await until_disconnect(request, _collect(first, stream))
        observe(outputs[-1])
        if outputs[-1].finish_reason == "error":
            raise engine_failed(outputs[-1].error or "the engine failed this request")
        return JSONResponse(fmt.body(outputs))
    except ClientGone:
        return Response(status_code=499)
    finally:
        if not streaming:
            await cleanup()


async def _first(stream: AsyncIterator[RequestOutput], prompt_param: str) -> RequestOutput:
    try:
        return await anext(stream)
    except InvalidParameterError as err:  # refused by the engine itself
        param = prompt_param if err.param in ("prompt", "prompt_token_ids") else err.param
        raise invalid(param, err.message) from err
    except EngineDeadError as err:
        raise engine_failed(str(err)) from err


async def _collect(first: RequestOutput,
                   stream: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    outputs = [first]
    if not first.finished:
        outputs += [out async for out in stream]
    return outputs


async def _events(fmt: CompletionFormat, first: RequestOutput,
                  stream: AsyncIterator[RequestOutput],
                  observe: Callable[[RequestOutput], None]) -> AsyncGenerator[bytes, None]:
    if (chunk := fmt.role_chunk()) is not None:
        yield chunk
    out = first
    try:
        while True:
            if out.finished and out.finish_reason == "error":
                observe(out)
                yield sse({"error": engine_failed(out.error or "engine error").to_dict()})
                break
            if (chunk := fmt.delta_chunk(out)) is not None:
                yield chunk
            if out.finished:
                observe(out)
                if fmt.include_usage:
                    yield fmt.usage_chunk(out.usage)
                break
            out = await anext(stream)
    except EngineDeadError as err:
        yield sse({"error": engine_failed(str(err)).to_dict()})
    yield DONE


class EventStream(StreamingResponse):
    """Server-sent events whose cleanup (abort if unfinished, release the slot) always runs."""

    def __init__(self, body: AsyncGenerator[bytes, None],
                 cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await self._cleanup()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def error_response(err: ProtocolError) -> JSONResponse:
    return JSONResponse({"error": err.to_dict()}, err.status, err.headers())


async def protocol_error_handler(request: Any, exc: Exception) -> Response:
    assert isinstance(exc, ProtocolError)
    return error_response(exc)
