"""AsyncClient and ChatSession against a real server on a tiny model: a streamed chat with its
typed done event, concurrent chats on one socket, multi-turn sessions (the server keeps the
conversation), cancel (explicit and by leaving the loop), and errors as typed exceptions."""

from __future__ import annotations

import asyncio

import pytest

from quickdraft.client import (
    APIError,
    AsyncClient,
    AuthenticationError,
    ConnectionClosedError,
    ResponseCreated,
    ResponseDone,
    TextDelta,
)
from tests.client.conftest import (
    FAST,
    KEY,
    LONG,
    SHORT,
    run,
    server_conversations,
    wait_no_inflight,
)


def test_chat_streams_typed_deltas_and_done(server):
    async def body() -> None:
        async with AsyncClient(server.ws_url, backoff=FAST) as client:
            assert client.info is not None and client.info.max_model_len > 0
            stream = client.chat("Hello there", **SHORT)
            deltas = [d async for d in stream]
            done = stream.done
            assert isinstance(done, ResponseDone) and done.status == "completed"
            assert done.finish_reason == "length" and done.text == "".join(d.text for d in deltas)
            assert [d.sequence_number for d in deltas] == list(range(len(deltas)))
            assert sum(d.num_tokens for d in deltas) == 8 == done.usage.output_tokens
            assert done.timings.time_to_first_token > 0 and done.tpot is not None
            assert done.speculation is not None and done.speculation.num_steps >= 0
            assert done.response_id == stream.response_id
            # The one-shot messages do not stay in the shared socket's conversation.
            assert server_conversations(server) == [[]]
            kinds = [type(e) async for e in client.chat("Hi", **SHORT).events()]
            assert kinds[0] is ResponseCreated and kinds[-1] is ResponseDone
            assert set(kinds[1:-1]) == {TextDelta}
        with pytest.raises(ConnectionClosedError) as info:  # closed by the client
            await client.chat("Anyone?", **SHORT).result()
        assert info.value.code == 1000

    run(body())


def test_concurrent_chats_share_one_socket(server):
    async def body() -> None:
        async with AsyncClient(server.ws_url, backoff=FAST) as client:
            prompts = ["One.", "Two two two two two two.", "Three " * 20, "Four " * 40]
            solo = [(await client.chat(p, **SHORT).result()).usage.input_tokens
                    for p in prompts]
            assert len(set(solo)) == 4
            streams = [client.chat(p, **SHORT) for p in prompts]
            dones = await asyncio.gather(*(s.result() for s in streams))
            # Each answered exactly its own messages, on one socket.
            assert [d.usage.input_tokens for d in dones] == solo
            assert len({d.response_id for d in dones}) == 4
            assert len(server.gateway.sessions) == 1

    run(body())


def test_session_keeps_the_conversation(server):
    async def body() -> None:
        client = AsyncClient(server.ws_url, backoff=FAST)
        async with client.session("You are terse.", temperature=0) as session:
            first = await session.chat("Hi", max_output_tokens=6, ignore_eos=True).result()
            second = await session.chat("More", max_output_tokens=6, ignore_eos=True).result()
            assert second.usage.input_tokens > first.usage.input_tokens + 6
            history = session.history
            assert [m.role for m in history] == ["user", "assistant", "user", "assistant"]
            assert history[1].text == first.text and history[1].id == first.item_id
            assert session.info is not None and session.info.instructions == "You are terse."
            assert session.settings == {"instructions": "You are terse.", "temperature": 0}
            convs = [c for c in server_conversations(server) if c]
            assert [[i["id"] for i in c] for c in convs] == [[m.id for m in history]]
            # conversation="none" leaves the answer out; delete and update work.
            aside = await session.chat(None, conversation="none", **SHORT).result()
            assert aside.completed and len(session.history) == 4
            await session.delete(history[0].id)
            assert [m.id for m in session.history] == [m.id for m in history[1:]]
            info = await session.update(instructions=None, top_k=5)
            assert info.instructions is None and info.defaults["top_k"] == 5
            assert session.settings == {"temperature": 0, "top_k": 5}
        await client.close()

    run(body())


def test_cancel_and_leaving_the_loop(server):
    async def body() -> None:
        async with AsyncClient(server.ws_url, backoff=FAST) as client:
            stream = client.chat("Never stop.", **LONG)
            async for _ in stream:
                await stream.cancel()
            assert stream.done.status == "cancelled"
            assert stream.done.status_details["reason"] == "client_cancelled"
            assert stream.done.usage.output_tokens < 1500
            # Leaving the loop early cancels on the server too.
            async for _ in client.chat("Never stop either.", **LONG):
                break
            await asyncio.sleep(0)
            for _ in range(200):
                if not server.gateway.admission.in_flight:
                    break
                await asyncio.sleep(0.05)
            assert server.gateway.admission.in_flight == 0
            async with client.chat("And this one.", **LONG) as s3:
                await s3.start()
            assert s3.done is not None and s3.done.status == "cancelled"
            # Cancelling before anything was sent sends nothing.
            never = client.chat("x", **SHORT)
            await never.cancel()
            assert [d async for d in never] == [] and never.done is None

    run(body())
    wait_no_inflight(server)


def test_errors_are_typed_and_the_socket_survives(server):
    async def body() -> None:
        async with AsyncClient(server.ws_url, backoff=FAST) as client:
            with pytest.raises(APIError) as info:
                await client.chat("x", temperature=-1).result()
            err = info.value
            assert err.code == "invalid_value" and err.param == "response.temperature"
            assert err.event_id is not None and err.response_id is None
            with pytest.raises(APIError) as info:
                await client.chat("x", temprature=1).result()
            assert info.value.code == "unknown_parameter"
            # Fails after creation: the error carries the response id.
            with pytest.raises(APIError) as info:
                await client.chat("x", max_output_tokens=10**6).result()
            assert info.value.code == "context_length_exceeded"
            assert info.value.response_id is not None
            # A bad message item: the response is cancelled and the item error raised.
            bad = [{"role": "user", "content": [{"type": "input_image", "text": "?"}]}]
            with pytest.raises(APIError) as info:
                await client.chat(bad, **SHORT).result()
            assert info.value.code in ("unsupported_parameter", "invalid_value")
            assert info.value.param.startswith("item.content")
            with pytest.raises(ValueError):
                client.chat([{"role": "robot", "content": "beep"}])
            done = await client.chat("Still there?", **SHORT).result()
            assert done.completed and server_conversations(server) == [[]]
        session = AsyncClient(server.ws_url, backoff=FAST).session(temperature=-3)
        with pytest.raises(APIError) as info:
            await session.start()
        assert info.value.param == "session.temperature"

    run(body())
    wait_no_inflight(server)


def test_api_key_and_response_slots(strict):
    async def body() -> None:
        with pytest.raises(AuthenticationError) as info:
            await AsyncClient(strict.ws_url, api_key="wrong-key-1", backoff=FAST).connect()
        assert info.value.code == 1008
        async with AsyncClient(strict.ws_url, api_key=KEY, backoff=FAST) as client:
            assert client.info.limits.max_concurrent_responses == 2
            # Five chats on a socket allowed 2 at a time: they queue instead of failing.
            dones = await asyncio.gather(*(client.chat(f"Q{i}", **SHORT).result()
                                           for i in range(5)))
            assert all(d.completed for d in dones)

    run(body())
