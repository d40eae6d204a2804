"""The WebSocket gateway over a real socket (uvicorn + a real ``websockets`` client) on a tiny
random model: a turn and its usage, several responses at once on one socket, cancel and
disconnect mid-stream (KV blocks back to baseline), every bad input answered with an ``error``
while the socket keeps working, 1007 / 1009 closes, and a lagging client's coalesced deltas."""

from __future__ import annotations

import socket
import time

import pytest
from websockets.exceptions import ConnectionClosed

from tests.server.conftest import (
    LONG,
    SHORT,
    collect,
    of_type,
    recv,
    recv_until,
    respond,
    say,
    send,
    session,
    ws_open,
)


def test_turn_streams_and_reports(served):
    baseline = served.free_blocks()
    with ws_open(served.ws_url) as ws:
        created = session(ws)["session"]
        assert created["model"] == "tiny-llama" or created["model"]
        item = say(ws, "Hello there", event_id="i1")
        assert item["client_event_id"] == "i1"
        rid = respond(ws, event_id="r1", **SHORT)
        text, done, deltas = collect(ws, rid)
        response = done["response"]
        assert done["client_event_id"] == "r1"
        assert response["status"] == "completed" and response["finish_reason"] == "length"
        assert [d["sequence_number"] for d in deltas] == list(range(len(deltas)))
        assert sum(d["num_tokens"] for d in deltas) == 8 == response["usage"]["output_tokens"]
        assert response["usage"]["input_tokens"] > 3
        assert response["output"][0]["content"][0]["text"] == text and text
        timings = response["timings"]
        assert timings["time_to_first_token"] > 0 and timings["queue_time"] >= 0
        assert set(response["speculation"]) == {"num_steps", "drafted_tokens",
                                                "accepted_tokens", "mean_acceptance_length"}
        # The answer joined the conversation: the next prompt is longer by at least it.
        say(ws, "And again?")
        rid2 = respond(ws, **SHORT)
        _, done2, _ = collect(ws, rid2)
        assert done2["response"]["usage"]["input_tokens"] > response["usage"]["input_tokens"] + 8
    served.wait_idle(baseline)


def test_speculation_override_reports_drafts(served):
    before = served.gateway.llm.stats()
    with ws_open(served.ws_url) as ws:
        session(ws)
        say(ws, "Count: 1 2 3 1 2 3 1 2 3")
        rid = respond(ws, speculation={"method": "ngram", "k": 3}, max_output_tokens=40,
                      temperature=0, ignore_eos=True)
        _, done, _ = collect(ws, rid)
    after = served.gateway.llm.stats()
    spec = done["response"]["speculation"]
    # How much to draft is the engine policy's call; the report must match what it did.
    assert spec["drafted_tokens"] == after["spec_num_drafted"] - before["spec_num_drafted"]
    assert spec["accepted_tokens"] == after["spec_num_accepted"] - before["spec_num_accepted"]
    assert spec["num_steps"] == after["spec_num_steps"] - before["spec_num_steps"]


def test_concurrent_responses_on_one_socket(served):
    baseline = served.free_blocks()
    with ws_open(served.ws_url) as ws:
        session(ws)
        say(ws, "Tell me things.")
        for i, n in enumerate((6, 10, 14)):
            send(ws, {"type": "response.create", "event_id": f"c{i}",
                      "response": {**SHORT, "max_output_tokens": n}})
        created: dict[str, str] = {}
        done: dict[str, dict] = {}
        tokens: dict[str, int] = {}
        while len(done) < 3:
            event = recv(ws)
            if event["type"] == "response.created":
                created[event["client_event_id"]] = event["response"]["id"]
            elif event["type"] == "response.output_text.delta":
                assert event["response_id"] in created.values()  # created comes first
                tokens[event["response_id"]] = (tokens.get(event["response_id"], 0)
                                                + event["num_tokens"])
            elif event["type"] == "response.done":
                done[event["client_event_id"]] = event["response"]
    for i, n in enumerate((6, 10, 14)):
        response = done[f"c{i}"]
        assert response["id"] == created[f"c{i}"] and response["status"] == "completed"
        assert response["usage"]["output_tokens"] == n == tokens[response["id"]]
    served.wait_idle(baseline)


def test_cancel_mid_stream(served):
    baseline = served.free_blocks()
    with ws_open(served.ws_url) as ws:
        session(ws)
        say(ws, "A long story, please.")
        rid = respond(ws, **LONG)
        recv_until(ws, of_type("response.output_text.delta", response_id=rid))
        assert served.free_blocks() < baseline
        send(ws, {"type": "response.cancel", "event_id": "x", "response_id": rid})
        _, done, _ = collect(ws, rid)
        response = done["response"]
        assert response["status"] == "cancelled" and response["finish_reason"] == "cancelled"
        assert response["status_details"]["reason"] == "client_cancelled"
        assert 0 < response["usage"]["output_tokens"] < 1500
        served.wait_idle(baseline)
        # The socket goes on; the cancelled answer is not in the conversation.
        rid = respond(ws, **SHORT)
        _, done, _ = collect(ws, rid)
        assert done["response"]["status"] == "completed"


@pytest.mark.parametrize("how", ["close", "drop"])
def test_disconnect_mid_stream_frees_blocks(served, how):
    baseline = served.free_blocks()
    with ws_open(served.ws_url) as ws:
        session(ws)
        say(ws, "Go on and on.")
        rids = [respond(ws, **LONG), respond(ws, **LONG)]
        recv_until(ws, of_type("response.output_text.delta", response_id=rids[1]))
        assert served.gateway.admission.in_flight == 2
        if how == "drop":  # vanish without a closing handshake
            ws.socket.shutdown(socket.SHUT_RDWR)
    served.wait_idle(baseline, timeout=10)


def test_bad_inputs_keep_the_socket_usable(served):
    baseline = served.free_blocks()
    cases = [
        ("{not json", "invalid_json", None),
        ('{"type": "response.create", "event_id": "e1", "response": {"temperature": -1}}',
         "invalid_value", "response.temperature"),
        ('{"type": "response.create", "event_id": "e2", "response": {"top_k": "many"}}',
         "invalid_type", "response.top_k"),
        ('{"type": "nope", "event_id": "e3"}', "unknown_event_type", "type"),
        ('{"type": "conversation.item.create", "event_id": "e4"}', "missing_required_parameter",
         "item"),
        ('{"type": "response.cancel", "event_id": "e5", "response_id": "r"}',
         "response_not_active", "response_id"),
    ]
    with ws_open(served.ws_url) as ws:
        session(ws)
        say(ws, "Hi")
        for text, code, param in cases:
            ws.send(text)
            error = recv(ws)
            assert error["type"] == "error", error
            assert (error["error"]["code"], error["error"]["param"]) == (code, param)
        ws.send(b"\x00binary")
        assert recv(ws)["error"]["code"] == "binary_not_supported"
        # prompt + max_output_tokens beyond the context (2048): created, then failed.
        send(ws, {"type": "response.create", "event_id": "big",
                  "response": {"max_output_tokens": 2040}})
        created, _ = recv_until(ws, of_type("response.created", client_event_id="big"))
        error, _ = recv_until(ws, of_type("error"))
        assert error["error"]["code"] == "context_length_exceeded"
        assert error["error"]["param"] == "response.max_output_tokens"
        assert error["client_event_id"] == "big"
        _, done, _ = collect(ws, created["response"]["id"])
        assert done["response"]["status"] == "failed"
        rid = respond(ws, **SHORT)  # still usable
        assert collect(ws, rid)[1]["response"]["status"] == "completed"
    served.wait_idle(baseline)


def test_invalid_utf8_closes_1007(served):
    with ws_open(served.ws_url) as ws:
        session(ws)
        ws.send(b'{"type": "\xff\xfe"}', text=True)
        with pytest.raises(ConnectionClosed) as info:
            recv(ws)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1007


def test_oversize_message_closes_1009(served):
    limit = served.gateway.settings.max_message_size
    with ws_open(served.ws_url) as ws:
        session(ws)
        with pytest.raises(ConnectionClosed) as info:
            send(ws, {"type": "conversation.item.create",
                      "item": {"role": "user", "content": "x" * (limit + 10)}})
            recv(ws)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    with ws_open(served.ws_url) as ws:  # a message just under the limit is fine
        session(ws)
        ws.send('{"type": "nope", "pad": "' + "y" * (limit - 100) + '"}')
        assert recv(ws)["error"]["code"] == "unknown_event_type"


def slow_link(served, sock: socket.socket) -> None:
    """Shrink both ends' buffers for this connection, as a slow network would."""
    port = sock.getsockname()[1]
    [conn] = [c for c in served.server.server_state.connections
              if c.transport.get_extra_info("peername")[1] == port]
    conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                       4096)
    conn.transport.set_write_buffer_limits(high=4096)


def test_lagging_client_never_blocks_the_engine(served):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    sock.connect((served.host, served.port))
    with ws_open(served.ws_url, sock=sock, max_queue=1, compression=None) as ws:
        session(ws)
        slow_link(served, sock)
        say(ws, "Stream a lot.")
        # one token a step (no speculation): 200 deltas, enough to fill the small window
        rid = respond(ws, max_output_tokens=200, temperature=0, ignore_eos=True,
                      speculation="off")
        # Read nothing while the engine runs the whole answer: it must finish regardless.
        deadline = time.monotonic() + 60
        while served.gateway.admission.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served.gateway.admission.in_flight == 0
        text, done, deltas = collect(ws, rid)
    assert done["response"]["usage"]["output_tokens"] == 200
    assert sum(d["num_tokens"] for d in deltas) == 200
    assert len(deltas) < 200 and max(d["num_tokens"] for d in deltas) > 10  # merged
    assert [d["sequence_number"] for d in deltas] == list(range(len(deltas)))
    assert text == done["response"]["output"][0]["content"][0]["text"]
