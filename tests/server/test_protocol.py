"""The Sans-I/O WebSocket core (server.protocol.Session) without sockets, asyncio or engine:
events in, commands and events out; deltas coalesce while queued; every malformed event gets an
``error`` naming the field and the session goes on; admission slots are always given back."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from quickdraft.engine.outputs import RequestOutput, Usage
from quickdraft.server.errors import ProtocolError
from quickdraft.server.limits import Admission
from quickdraft.server.protocol import CancelResponse, Session, StartResponse

USAGE = Usage(prompt_tokens=7, completion_tokens=3, queue_time=0.01, ttft=0.02,
              decode_time=0.03, num_spec_steps=1, num_drafted_tokens=2, num_accepted_tokens=1)


def new_session(admission: Admission | None = None, **kw: Any) -> Session:
    s = Session("sess_test", model="tiny", max_model_len=2048,
                admission=admission or Admission(8), **kw)
    s.open()
    assert s.next_event()["type"] == "session.created"
    return s


def drain(s: Session) -> list[dict[str, Any]]:
    events = []
    while (event := s.next_event()) is not None:
        events.append(event)
    return events


def feed(s: Session, event: dict[str, Any] | str) -> list[Any]:
    text = event if isinstance(event, str) else orjson.dumps(event).decode()
    return s.receive_text(text)


def only_error(s: Session) -> dict[str, Any]:
    [event] = drain(s)
    assert event["type"] == "error", event
    return event["error"]


def start(s: Session, text: str = "Hi", **response: Any) -> StartResponse:
    feed(s, {"type": "conversation.item.create", "item": {"role": "user", "content": text}})
    [command] = feed(s, {"type": "response.create", "event_id": "c1", "response": response})
    assert isinstance(command, StartResponse)
    drain(s)
    return command


def out(rid: str, text: str, n: int = 1, finished: bool = False, reason: str | None = None,
        usage: Usage | None = None) -> RequestOutput:
    return RequestOutput(rid, text, list(range(n)), finished, reason, usage=usage)


def test_session_created_first():
    s = Session("sess_1", model="tiny", max_model_len=2048, admission=Admission(1))
    assert s.next_event() is None
    s.open()
    [created] = drain(s)
    assert created["type"] == "session.created"
    assert created["session"]["id"] == "sess_1" and created["session"]["model"] == "tiny"
    assert created["session"]["max_output_tokens"] == "inf"


def test_turn_builds_prompt_and_appends_answer():
    s = new_session()
    feed(s, {"type": "session.update", "event_id": "u1",
             "session": {"instructions": "Be terse.", "temperature": 0.5}})
    [updated] = drain(s)
    assert updated["type"] == "session.updated" and updated["client_event_id"] == "u1"
    assert updated["session"]["instructions"] == "Be terse."
    assert updated["session"]["temperature"] == 0.5

    feed(s, {"type": "conversation.item.create", "event_id": "i1",
             "item": {"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": "Hel"},
                                  {"type": "input_text", "text": "lo"}]}})
    [item] = drain(s)
    assert item["type"] == "conversation.item.created" and item["client_event_id"] == "i1"
    assert item["item"]["content"] == [{"type": "input_text", "text": "Hello"}]

    [cmd] = feed(s, {"type": "response.create", "event_id": "r1",
                     "response": {"max_output_tokens": 5, "priority": "background",
                                  "speculation": {"method": "ngram", "k": 2},
                                  "cache_salt": "team-1"}})
    assert isinstance(cmd, StartResponse)
    assert cmd.cache_salt == "team-1"
    assert cmd.messages == [{"role": "system", "content": "Be terse."},
                            {"role": "user", "content": "Hello"}]
    assert cmd.params.temperature == 0.5 and cmd.max_tokens == 5 and cmd.priority == 10
    assert cmd.speculation is not None and cmd.speculation.method == "ngram"
    [created] = drain(s)
    assert created["type"] == "response.created" and created["client_event_id"] == "r1"
    assert created["response"]["id"] == cmd.response_id

    s.on_output(cmd.response_id, out(cmd.response_id, "Hi", 1))
    s.on_output(cmd.response_id, out(cmd.response_id, " there", 2, True, "stop", USAGE))
    delta, done = drain(s)
    assert delta["delta"] == "Hi there" and delta["num_tokens"] == 3  # merged while queued
    response = done["response"]
    assert done["type"] == "response.done" and done["client_event_id"] == "r1"
    assert response["status"] == "completed" and response["finish_reason"] == "stop"
    assert response["usage"]["input_tokens"] == 7 and response["usage"]["output_tokens"] == 3
    assert response["timings"]["time_to_first_token"] == 0.02
    assert response["speculation"]["drafted_tokens"] == 2
    assert response["speculation"]["mean_acceptance_length"] == 2.0
    assert s.conversation[-1]["role"] == "assistant"
    assert s.conversation[-1]["content"][0]["text"] == "Hi there"

    [next_cmd] = feed(s, {"type": "response.create"})
    assert isinstance(next_cmd, StartResponse)
    assert next_cmd.messages[-1] == {"role": "assistant", "content": "Hi there"}


def test_deltas_coalesce_only_while_queued_and_sequence_is_gap_free():
    s = new_session()
    rid = start(s).response_id
    s.on_output(rid, out(rid, "a"))
    s.on_output(rid, out(rid, "b"))
    first = s.next_event()
    assert first is not None and first["delta"] == "ab" and first["sequence_number"] == 0
    s.on_output(rid, out(rid, "c"))
    s.on_output(rid, out(rid, "", 0))  # nothing new: no event
    s.on_output(rid, out(rid, "d", 2))
    second = s.next_event()
    assert second is not None and second["delta"] == "cd" and second["num_tokens"] == 3
    assert second["sequence_number"] == 1
    assert s.next_event() is None


def test_concurrent_responses_stay_separate_and_ordered():
    s = new_session()
    a = start(s, "one").response_id
    [cmd] = feed(s, {"type": "response.create", "event_id": "c2"})
    b = cmd.response_id
    drain(s)
    s.on_output(a, out(a, "A1"))
    s.on_output(b, out(b, "B1"))
    s.on_output(a, out(a, "A2", finished=True, reason="length", usage=USAGE))
    s.on_output(b, out(b, "B2"))
    events = drain(s)
    assert [(e["type"], e.get("response_id") or e["response"]["id"]) for e in events] == [
        ("response.output_text.delta", a), ("response.output_text.delta", b),
        ("response.done", a)]
    assert events[0]["delta"] == "A1A2" and events[1]["delta"] == "B1B2"
    assert s.active_responses == [b]


def test_cancel_by_id_and_all():
    admission = Admission(8)
    s = new_session(admission)
    rid = start(s).response_id
    assert feed(s, {"type": "response.cancel", "response_id": rid}) == [CancelResponse(rid)]
    s.on_output(rid, out(rid, "", 0, True, "abort", USAGE))
    [done] = drain(s)
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"]["reason"] == "client_cancelled"
    assert len(s.conversation) == 1  # a cancelled answer is not appended
    assert admission.in_flight == 0

    feed(s, {"type": "response.cancel", "event_id": "x", "response_id": rid})
    error = only_error(s)
    assert error["code"] == "response_not_active" and error["param"] == "response_id"
    assert error["event_id"] == "x"

    a, b = start(s).response_id, start(s).response_id
    assert feed(s, {"type": "response.cancel"}) == [CancelResponse(a), CancelResponse(b)]


def test_cancel_before_engine_and_failure_release_slots():
    admission = Admission(8)
    s = new_session(admission)
    rid = start(s).response_id
    feed(s, {"type": "response.cancel", "response_id": rid})
    s.on_cancelled(rid)
    [done] = drain(s)
    assert done["response"]["status"] == "cancelled" and done["response"]["usage"] is None

    rid = start(s).response_id
    s.on_failure(rid, ProtocolError("context_length_exceeded", "too long", "conversation"))
    error, done = drain(s)
    assert error["type"] == "error" and error["client_event_id"] == "c1"
    assert error["response_id"] == rid and error["error"]["param"] == "conversation"
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["code"] == "context_length_exceeded"
    rid = start(s).response_id
    s.on_output(rid, RequestOutput(rid, "", [], True, "error", error="boom", usage=USAGE))
    [done] = drain(s)
    assert done["response"]["status"] == "failed"
    assert done["response"]["status_details"]["error"]["message"] == "boom"
    assert admission.in_flight == 0


def test_connection_lost_releases_everything():
    admission = Admission(8)
    s = new_session(admission)
    ids = {start(s).response_id, start(s).response_id}
    assert admission.in_flight == 2
    assert set(s.connection_lost()) == ids
    assert admission.in_flight == 0
    s.on_output(next(iter(ids)), out("x", "late"))  # ignored
    assert s.next_event() is None


def test_cancel_all_for_shutdown():
    s = new_session()
    rid = start(s).response_id
    assert s.cancel_all("server_shutdown") == [CancelResponse(rid)]
    s.on_output(rid, out(rid, "", 0, True, "abort", USAGE))
    [done] = drain(s)
    assert done["response"]["status_details"]["reason"] == "server_shutdown"


def test_limits_per_connection_and_global():
    admission = Admission(2)
    s = new_session(admission, max_responses=1)
    start(s)
    feed(s, {"type": "response.create", "event_id": "r2"})
    error = only_error(s)
    assert error["code"] == "rate_limited" and error["event_id"] == "r2"
    other = new_session(admission)
    start(other)
    feed(other, {"type": "conversation.item.create", "item": {"role": "user", "content": "x"}})
    drain(other)
    feed(other, {"type": "response.create"})
    assert only_error(other)["code"] == "rate_limited"  # the global limit (2) is reached
    admission.draining = True
    s.connection_lost()
    feed(other, {"type": "response.create"})
    assert only_error(other)["code"] == "server_shutting_down"


BAD_EVENTS = [
    ("not json", "invalid_json", None),
    ("[1, 2]", "invalid_event", None),
    ({"event_id": "e"}, "missing_required_parameter", "type"),
    ({"type": 5}, "invalid_type", "type"),
    ({"type": "response.explode"}, "unknown_event_type", "type"),
    ({"type": "response.create", "bogus": 1}, "unknown_parameter", "bogus"),
    ({"type": "response.create", "event_id": 7}, "invalid_type", "event_id"),
    ({"type": "response.create", "response": []}, "invalid_type", "response"),
    ({"type": "response.create", "response": {"temperature": "hot"}}, "invalid_type",
     "response.temperature"),
    ({"type": "response.create", "response": {"temperature": 500}}, "invalid_value",
     "response.temperature"),
    ({"type": "response.create", "response": {"top_p": 0}}, "invalid_value", "response.top_p"),
    ({"type": "response.create", "response": {"max_output_tokens": 0}}, "invalid_value",
     "response.max_output_tokens"),
    ({"type": "response.create", "response": {"max_output_tokens": True}}, "invalid_type",
     "response.max_output_tokens"),
    ({"type": "response.create", "response": {"priority": "urgent"}}, "invalid_value",
     "response.priority"),
    ({"type": "response.create", "response": {"speculation": "magic"}}, "invalid_value",
     "response.speculation.method"),
    ({"type": "response.create", "response": {"speculation": {"k": 99}}}, "invalid_value",
     "response.speculation.k"),
    ({"type": "response.create", "response": {"stop": [1]}}, "invalid_type", "response.stop"),
    ({"type": "response.create", "response": {"conversation": "some"}}, "invalid_value",
     "response.conversation"),
    ({"type": "session.update"}, "missing_required_parameter", "session"),
    ({"type": "session.update", "session": {"top_k": -5}}, "invalid_value", "session.top_k"),
    ({"type": "session.update", "session": {"voice": "x"}}, "unknown_parameter",
     "session.voice"),
    ({"type": "conversation.item.create"}, "missing_required_parameter", "item"),
    ({"type": "conversation.item.create", "item": {"content": "x"}},
     "missing_required_parameter", "item.role"),
    ({"type": "conversation.item.create", "item": {"role": "tool", "content": "x"}},
     "unsupported_parameter", "item.role"),
    ({"type": "conversation.item.create", "item": {"role": "robot", "content": "x"}},
     "invalid_value", "item.role"),
    ({"type": "conversation.item.create", "item": {"role": "user"}},
     "missing_required_parameter", "item.content"),
    ({"type": "conversation.item.create", "item": {"role": "user", "content": 3}},
     "invalid_type", "item.content"),
    ({"type": "conversation.item.create",
      "item": {"role": "user", "content": [{"type": "input_image", "url": "x"}]}},
     "unsupported_parameter", "item.content[0].type"),
    ({"type": "conversation.item.delete", "item_id": "nope"}, "item_not_found", "item_id"),
    ({"type": "response.cancel", "response_id": "resp_x"}, "response_not_active",
     "response_id"),
]


@pytest.mark.parametrize(("event", "code", "param"), BAD_EVENTS)
def test_bad_events_get_an_error_and_the_session_goes_on(event, code, param):
    admission = Admission(8)
    s = new_session(admission)
    feed(s, {"type": "conversation.item.create", "item": {"role": "user", "content": "x"}})
    drain(s)
    assert feed(s, event) == []
    error = only_error(s)
    assert (error["code"], error["param"]) == (code, param), error
    assert error["message"]
    assert admission.in_flight == 0
    start(s)  # still usable


def test_empty_conversation_binary_and_event_id_echo():
    s = new_session()
    feed(s, {"type": "response.create", "event_id": "e9"})
    error = only_error(s)
    assert error["code"] == "empty_conversation" and error["event_id"] == "e9"
    s.receive_bytes()
    assert only_error(s)["code"] == "binary_not_supported"


def test_session_update_null_resets_and_items_can_be_deleted():
    s = new_session()
    feed(s, {"type": "session.update", "session": {"temperature": 0.2, "max_output_tokens": 9,
                                                   "speculation": "ngram"}})
    drain(s)
    feed(s, {"type": "session.update", "session": {"temperature": None}})
    [updated] = drain(s)
    assert updated["session"]["temperature"] == 1.0
    assert updated["session"]["max_output_tokens"] == 9
    assert updated["session"]["speculation"] == {"method": "ngram", "k": None}
    feed(s, {"type": "conversation.item.create", "item": {"id": "mine", "role": "user",
                                                          "content": "x"}})
    feed(s, {"type": "conversation.item.create", "item": {"id": "mine", "role": "user",
                                                          "content": "y"}})
    created, dup = drain(s)
    assert created["item"]["id"] == "mine" and dup["error"]["param"] == "item.id"
    feed(s, {"type": "conversation.item.delete", "event_id": "d", "item_id": "mine"})
    [deleted] = drain(s)
    assert deleted == {"type": "conversation.item.deleted", "client_event_id": "d",
                       "item_id": "mine"}
    assert s.conversation == []


def test_conversation_limits():
    s = new_session(max_items=2)
    for text in ("a", "b", "c"):
        feed(s, {"type": "conversation.item.create", "item": {"role": "user", "content": text}})
    events = drain(s)
    assert events[-1]["error"]["code"] == "conversation_full"
    small = Session("s", model="m", max_model_len=4, admission=Admission(1))
    feed(small, {"type": "conversation.item.create",
                 "item": {"role": "user", "content": "x" * 1000}})
    assert only_error(small)["code"] == "conversation_full"
