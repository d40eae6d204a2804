"""The blocking ``Client``: text deltas as an iterator, the whole answer, a multi-turn session,
leaving the loop early (cancels the response), typed errors, and a clean shutdown of its
background event loop."""

from __future__ import annotations

import threading

import pytest

from quickdraft.client import APIError, Client
from tests.client.conftest import FAST, LONG, SHORT, wait_no_inflight


def test_sync_chat_iterates_text_and_returns_the_answer(server):
    with Client(server.ws_url, backoff=FAST, timeout=30) as client:
        assert client.info is not None
        stream = client.chat("Hello", **SHORT)
        pieces = list(stream)
        assert all(isinstance(p, str) for p in pieces) and pieces
        assert stream.done is not None and stream.done.text == "".join(pieces)
        assert stream.done.usage.output_tokens == 8
        answer = client.chat([{"role": "system", "content": "Be kind."},
                              {"role": "user", "content": "Hi"}], **SHORT).text()
        assert isinstance(answer, str) and answer
        with pytest.raises(APIError) as info:
            client.chat("x", top_p=0).text()
        assert info.value.param == "response.top_p"
    assert not any(t.name == "quickdraft-client" and t.is_alive()
                   for t in threading.enumerate())


def test_sync_session_and_early_exit(server):
    with Client(server.ws_url, backoff=FAST, timeout=30) as client, \
            client.session("You are terse.", temperature=0) as session:
        first = session.chat("Hi", **SHORT).text()
        session.chat("More", **SHORT).text()
        assert [m.role for m in session.history] == ["user", "assistant"] * 2
        assert session.history[1].text == first
        for _ in session.chat("Go on forever", **LONG):
            break  # the generator's close cancels the response
        assert len(session.history) == 5  # the message, not the cancelled answer
        wait_no_inflight(server)
