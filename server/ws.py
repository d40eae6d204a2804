"""The WebSocket endpoint ``/v1/ws``: I/O only; the protocol lives in server.protocol.

Per connection three kinds of task run: the receive loop (parse nothing itself: hand each
message to the :class:`Session` core, execute the commands it returns), one sender (pulls queued
events from the core whenever the socket can take one; deltas merge while it waits, so a slow
client never blocks the engine) and one task per response (tokenize off the loop, stream the
engine's outputs into the core). Disconnect cancels every response task, which aborts its engine
request (its KV blocks are free within one step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import cast

import orjson
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from quickdraft.engine.async_engine import AsyncLLM, EngineDeadError
from quickdraft.engine.outputs import RequestOutput
from quickdraft.engine.sampling_params import InvalidParameterError
from quickdraft.server.errors import ProtocolError, engine_failed, invalid
from quickdraft.server.gateway import Gateway
from quickdraft.server.guard import select_subprotocol, tenant
from quickdraft.server.params import cache_namespace, fit_max_tokens
from quickdraft.server.protocol import Command, Session, StartResponse, new_id

log = logging.getLogger(__name__)
HIGH_WATER = 256  # queued events beyond which the client's next message waits
CLOSE_FLUSH_TIMEOUT = 5.0  # seconds to flush queued events before a server-side close
TRY_AGAIN_LATER = 1013
INTERNAL_ERROR = 1011
_GONE = (WebSocketDisconnect, WebSocketDisconnected, OSError)


async def websocket_endpoint(ws: WebSocket) -> None:
    gw: Gateway = ws.app.state.gateway
    subprotocol = select_subprotocol(ws.scope.get("subprotocols", []))
    try:
        llm = gw.engine()
    except ProtocolError as err:
        code = {"server_shutting_down": 1012, "model_loading": TRY_AGAIN_LATER}
        await ws.accept(subprotocol)
        await ws.close(code.get(err.code, INTERNAL_ERROR), err.message[:120])
        return
    if not gw.ws_limit.try_open():
        await ws.accept(subprotocol)
        await ws.close(TRY_AGAIN_LATER, "too many connections; try again later")
        return
    conn = Connection(ws, gw, llm)
    gw.metrics.ws_connections.inc()
    try:
        await ws.accept(subprotocol)
        gw.sessions.add(conn)  # from here on, a drain closes it
        await conn.run()
    except _GONE:
        pass
    finally:
        gw.sessions.discard(conn)
        gw.ws_limit.close()
        gw.metrics.ws_connections.dec()


@dataclass
class _Running:
    task: asyncio.Task[None] | None = None
    submitted: bool = False  # the engine has (or will have) the request: cancel = abort
    cancelled: bool = False  # cancelled before submission


class Connection:
    def __init__(self, ws: WebSocket, gw: Gateway, llm: AsyncLLM) -> None:
        self.ws, self.gw, self.llm = ws, gw, llm
        self.max_model_len = llm.engine.max_model_len
        s = gw.settings
        self.session = Session(new_id("sess"), model=gw.model_name,
                               max_model_len=self.max_model_len, admission=gw.admission,
                               max_responses=s.max_responses_per_connection,
                               max_items=s.max_conversation_items,
                               max_message_size=s.max_message_size)
        self._running: dict[str, _Running] = {}
        self._wake = asyncio.Event()  # events are queued
        self._flushed = asyncio.Event()  # the sender emptied the queue (or stopped)
        self._close_request: tuple[int, str] | None = None
        self._sender_done = asyncio.Event()

    async def run(self) -> None:
        self.session.open()
        self._wake.set()
        sender = asyncio.create_task(self._send_loop())
        try:
            await self._receive_loop()
        finally:
            self.session.connection_lost()
            tasks = [r.task for r in self._running.values() if r.task is not None]
            for task in (*tasks, sender):
                task.cancel()  # a response task's cancellation aborts its engine request
            await asyncio.gather(*tasks, sender, return_exceptions=True)

    # ------------------------------------------------------------------ receive

    async def _receive_loop(self) -> None:
        while True:
            while self.session.pending_events > HIGH_WATER and not self._sender_done.is_set():
                self._flushed.clear()
                await self._flushed.wait()  # backpressure: the client is not reading
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") is not None:
                commands = self.session.receive_text(message["text"])
            else:
                self.session.receive_bytes()
                commands = []
            for command in commands:
                self._execute(command)
            self._wake.set()

    def _execute(self, command: Command) -> None:
        rid = command.response_id
        if isinstance(command, StartResponse):
            started = _Running()
            self._running[rid] = started
            started.task = asyncio.create_task(self._respond(command, started))
            return
        running = self._running.get(rid)
        if running is None:
            return
        if running.submitted:
            self.llm.abort(rid)  # the final output (abort, with usage) ends the response
        else:
            running.cancelled = True

    # ------------------------------------------------------------------ responses

    async def _respond(self, cmd: StartResponse, running: _Running) -> None:
        rid, start = cmd.response_id, time.monotonic()
        try:
            ids = await self.gw.chat_prompt(self.llm, cmd.messages, "conversation")
            max_tokens = fit_max_tokens(len(ids), cmd.max_tokens, self.max_model_len,
                                        param="response.max_output_tokens",
                                        prompt_param="conversation")
            if running.cancelled:
                self.session.on_cancelled(rid)
                return
            running.submitted = True
            stream = cast(AsyncGenerator[RequestOutput, None], self.llm.generate(
                prompt_token_ids=ids, sampling_params=replace(cmd.params, max_tokens=max_tokens),
                request_id=rid, priority=cmd.priority, speculation=cmd.speculation,
                cache_salt=cache_namespace(tenant(self.ws.scope), cmd.cache_salt)))
            async with contextlib.aclosing(stream):
                async for out in stream:
                    self.session.on_output(rid, out)
                    if out.finished:
                        self.gw.metrics.observe(out.usage, out.finish_reason,
                                                time.monotonic() - start, cmd.priority)
                    self._wake.set()
        except ProtocolError as err:
            self.session.on_failure(rid, err)
        except InvalidParameterError as err:
            param = {"prompt": "conversation", "prompt_token_ids": "conversation"}.get(
                err.param, f"response.{err.param}")
            self.session.on_failure(rid, invalid(param, err.message))
        except EngineDeadError as err:
            self.session.on_failure(rid, engine_failed(str(err)))
        except Exception:  # a bug must not leave the response (and its slot) hanging
            log.exception("response %s failed", rid)
            self.session.on_failure(rid, engine_failed("internal error"))
        finally:
            self._running.pop(rid, None)
            self._wake.set()

    # ------------------------------------------------------------------ send

    async def _send_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while (event := self.session.next_event()) is not None:
                    await self.ws.send({"type": "websocket.send",
                                        "text": orjson.dumps(event).decode()})
                self._flushed.set()
                if self._close_request is not None:
                    await self.ws.close(*self._close_request)
                    return
        except _GONE:
            return  # the client is gone; the receive loop sees the disconnect
        finally:
            self._sender_done.set()
            self._flushed.set()

    # ------------------------------------------------------------------ drain (Gateway)

    def cancel_all(self, reason: str) -> None:
        for command in self.session.cancel_all(reason):
            self._execute(command)

    async def close(self, code: int, reason: str) -> None:
        """Send what is queued, then close; the receive loop then ends the connection."""
        self._close_request = (code, reason)
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._sender_done.wait(), CLOSE_FLUSH_TIMEOUT)
