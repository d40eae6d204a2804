"""Where ``quickdraft chat``'s answers come from: :class:`LocalChat` (the model loaded in this
process, the conversation kept here) or :class:`RemoteChat` (a server over the WebSocket
protocol, the conversation kept by the server in a :class:`ChatSession`). Either one takes a
stopped or failed turn back out of the conversation. Neither torch nor the client is imported
until one is made.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from quickdraft.client import AsyncClient, ChatSession, ResponseStream
    from quickdraft.engine.async_engine import AsyncLLM
    from quickdraft.engine.sampling_params import SamplingParams

T = TypeVar("T")
Write = Callable[[str], None]
FORGET_TIMEOUT = 10.0  # seconds to take a stopped turn back out of the server's conversation


class ChatError(Exception):
    """The chat cannot go on (no server, the connection is gone for good): exit status 1."""


class TurnError(Exception):
    """One answer failed; the conversation is as it was before the message."""



class Chat(Protocol):
    """Where the answers come from; every coroutine runs on the :class:`LoopThread`."""

    model: str
    system: str | None

    def messages(self) -> list[dict[str, str]]:
        """The conversation, the system prompt first."""

    async def answer(self, text: str, write: Write) -> Meter:
        """Stream the answer to ``text``; both join the conversation once it completes."""

    async def set_system(self, text: str | None) -> None:
        """Set (None: remove) the system prompt and clear the conversation."""

    async def reset(self) -> None:
        """Clear the conversation."""

    async def close(self) -> None:
        """Stop the engine or close the socket."""


@dataclass
class Meter:
    """One answer's statistics as the user saw them: time to the first token, the rate after."""

    start: float = field(default_factory=time.perf_counter)
    first: float | None = None
    tokens: int = 0
    spec: str = ""

    def add(self, n_tokens: int) -> None:
        if n_tokens and self.first is None:
            self.first = time.perf_counter()
        self.tokens += n_tokens

    def speculation(self, accepted: int, drafted: int, per_step: float) -> None:
        self.spec = (f", speculation accepted {accepted}/{drafted} drafts, "
                     f"{per_step:.2f} tokens/step")

    def line(self, colour: bool) -> str:
        elapsed = time.perf_counter() - (self.first or self.start)
        ttft = self.first - self.start if self.first else 0.0
        rate = (self.tokens - 1) / elapsed if self.tokens > 1 and elapsed > 0 else 0.0
        dim, plain = ("\x1b[2m", "\x1b[0m") if colour else ("", "")
        return (f"{dim}[{self.tokens} tokens, TTFT {ttft * 1000:.0f} ms, {rate:.1f} tok/s"
                f"{self.spec}]{plain}")


class LocalChat:
    """The model in this process (an :class:`AsyncLLM`); the conversation is kept here."""

    def __init__(self, llm: AsyncLLM, params: SamplingParams, model: str,
                 system: str | None) -> None:
        self.llm = llm
        self.params = params
        self.model = model
        self.system = system
        self.history: list[dict[str, str]] = []

    @classmethod
    def load(cls, args: argparse.Namespace, params: SamplingParams) -> LocalChat:
        from quickdraft.engine.async_engine import AsyncLLM
        from quickdraft.engine.model_names import served_name
        from quickdraft.server.cli import engine_config

        llm = AsyncLLM.from_config(engine_config(args))
        return cls(llm, params, served_name(args.model), args.system)

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history

    async def answer(self, text: str, write: Write) -> Meter:
        turn = [*self.messages(), {"role": "user", "content": text}]
        meter, pieces = Meter(), []
        try:
            prompt_ids = self.llm.engine.apply_chat_template(turn)
            async for delta in self.llm.generate(prompt_token_ids=prompt_ids,
                                                 sampling_params=self.params):
                meter.add(len(delta.token_ids))
                pieces.append(delta.text)
                write(delta.text)
                if delta.error:
                    raise TurnError(delta.error)
                if (u := delta.usage) is not None and u.num_spec_steps:
                    meter.speculation(u.num_accepted_tokens, u.num_drafted_tokens,
                                      u.mean_acceptance_length)
        except (ValueError, RuntimeError) as exc:  # refused by the engine (too long...)
            raise TurnError(str(exc)) from exc
        self.history += [turn[-1], {"role": "assistant", "content": "".join(pieces)}]
        return meter

    async def set_system(self, text: str | None) -> None:
        self.system = text
        self.history = []

    async def reset(self) -> None:
        self.history = []

    async def close(self) -> None:
        self.llm.shutdown()


class RemoteChat:
    """A running server's model over the WebSocket protocol: a :class:`ChatSession` (the
    sampling flags are its defaults, the system prompt its ``instructions``)."""

    def __init__(self, client: AsyncClient, session: ChatSession, system: str | None) -> None:
        self.client = client
        self.session = session
        self.system = system
        self.model = session.info.model if session.info is not None else "the server's model"

    @classmethod
    async def open(cls, url: str, api_key: str | None, system: str | None,
                   params: SamplingParams) -> RemoteChat:
        """Connect; a server that is down or refuses the key raises :class:`ChatError`."""
        from quickdraft.client import AsyncClient, AuthenticationError, QuickdraftError

        client = AsyncClient(url, api_key=api_key)
        session = client.session(system, **response_fields(params))
        try:
            await session.start()
        except QuickdraftError as exc:
            with contextlib.suppress(QuickdraftError):
                await client.close()
            hint = (" (pass --api-key or set $QUICKDRAFT_API_KEY)"
                    if isinstance(exc, AuthenticationError) else "")
            raise ChatError(f"{exc}{hint}") from exc
        return cls(client, session, system)

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + [m.as_dict() for m in self.session.history]

    async def answer(self, text: str, write: Write) -> Meter:
        from quickdraft.client import APIError, ConnectionLostError, TextDelta

        known = len(self.session.history)
        stream = self.session.chat(text)
        meter = Meter()
        try:
            while (event := await self._checked(stream.next_event())) is not None:
                if isinstance(event, TextDelta):
                    meter.add(event.num_tokens or 1)
                    write(event.text)
        except (asyncio.CancelledError, APIError, ConnectionLostError) as exc:
            await self._forget(stream, known)
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise TurnError(str(exc)) from exc
        done = stream.done
        if done is not None and done.usage is not None:
            meter.tokens = done.usage.output_tokens
        if done is not None and (s := done.speculation) is not None and s.num_steps:
            meter.speculation(s.accepted_tokens, s.drafted_tokens, s.mean_acceptance_length)
        return meter

    async def set_system(self, text: str | None) -> None:
        await self._checked(self.session.update(instructions=text), refusal=True)
        self.system = text
        await self.reset()

    async def reset(self) -> None:
        items = [m.id for m in self.session.history]
        await self._checked(asyncio.gather(*(self.session.delete(i) for i in items)),
                            refusal=True)

    async def close(self) -> None:
        await self.client.close()

    async def _checked(self, step: Awaitable[T], *, refusal: bool = False) -> T:
        """``step``, with a socket closed for good turned into :class:`ChatError` and, with
        ``refusal``, the server's refusal (an error event) into :class:`TurnError`."""
        from quickdraft.client import APIError, ConnectionClosedError, ConnectionLostError

        try:
            return await step
        except ConnectionLostError as exc:
            if refusal:  # reconnecting: this command is lost, the chat goes on
                raise TurnError(str(exc)) from exc
            raise
        except ConnectionClosedError as exc:
            raise ChatError(f"lost the server: {exc}") from exc
        except APIError as exc:
            if refusal:
                raise TurnError(str(exc)) from exc
            raise

    async def _forget(self, stream: ResponseStream, known: int) -> None:
        """Take a turn that did not complete back out: stop the answer, delete the message."""
        from quickdraft.client import QuickdraftError

        with contextlib.suppress(QuickdraftError, TimeoutError):
            async with asyncio.timeout(FORGET_TIMEOUT):
                await stream.aclose()
                if stream.done is None:  # stopped while being sent: the server may have it
                    await self.session.cancel_all()
                for message in self.session.history[known:]:
                    if message.role == "user":
                        await self.session.delete(message.id)


def response_fields(p: SamplingParams) -> dict[str, Any]:
    """The sampling flags as the protocol's fields (docs/protocol.md)."""
    return {"max_output_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p,
            "top_k": p.top_k, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "seed": p.seed, "stop": list(p.stop) or None}
