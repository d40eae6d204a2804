"""One mistake, one error: the OpenAI-compatible HTTP API (/v1/chat/completions and, where the
field exists there, /v1/completions) and the WebSocket answer the same mistake with the same
``code`` and the same field (under each protocol's name for it), on the real app with a tiny
random model; no KV block leaks. Also the hints ``response.create`` gives for Chat Completions
names (Sans-I/O, on the protocol core alone)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from quickdraft.server.limits import Admission
from quickdraft.server.protocol import Session, StartResponse
from tests.server.conftest import done_for, recv, recv_until, send, session, ws_open

JSON = dict[str, Any]
USER = {"role": "user", "content": "hi"}
CHAT_BASE: JSON = {"messages": [USER], "max_tokens": 2}
COMPLETION_BASE: JSON = {"prompt": "hi", "max_tokens": 2}
# Chat Completions fields that /v1/completions does not have (or types differently).
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs"}
HTTP_STATUS = {"model_not_found": 404}  # every other mistake here is a 400


@dataclass(frozen=True)
class Case:
    name: str
    chat: JSON  # merged into a valid /v1/chat/completions body
    ws: list[JSON]  # client events on a fresh socket; the last one draws the error
    code: str
    params: tuple[str, str]  # (HTTP param, WebSocket param): the same field, each one's name


def message(**fields: Any) -> JSON:
    return {"messages": [fields]}


def item(**fields: Any) -> list[JSON]:
    return [{"type": "conversation.item.create", "item": fields}]


def response(**fields: Any) -> list[JSON]:
    """``response.create`` with ``fields``, after one user item."""
    return [*item(**USER), {"type": "response.create", "response": fields}]


def same(field: str) -> tuple[str, str]:
    """A request field: top level over HTTP, in ``response`` over the WebSocket."""
    return field, f"response.{field}"


def in_message(field: str) -> tuple[str, str]:
    return f"messages[0].{field}", f"item.{field}"


TOOL_CALL = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
IMAGE = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
MAX = "max_output_tokens"
CASES = [
    # messages / conversation items
    Case("unknown role", message(role="robot", content="x"), item(role="robot", content="x"),
         "invalid_value", in_message("role")),
    Case("tool role", message(role="tool", content="x", tool_call_id="c1"),
         item(role="tool", content="x", tool_call_id="c1"), "unsupported_parameter",
         in_message("role")),
    Case("function role", message(role="function", content="x", name="f"),
         item(role="function", content="x", name="f"), "unsupported_parameter",
         in_message("role")),
    Case("role not a string", message(role=5, content="x"), item(role=5, content="x"),
         "invalid_type", in_message("role")),
    Case("no role", message(content="x"), item(content="x"), "missing_required_parameter",
         in_message("role")),
    Case("tool calls", message(role="assistant", content=None, tool_calls=TOOL_CALL),
         item(role="assistant", content=None, tool_calls=TOOL_CALL), "unsupported_parameter",
         in_message("tool_calls")),
    Case("function call", message(role="assistant", content="", function_call={"name": "f"}),
         item(role="assistant", content="", function_call={"name": "f"}),
         "unsupported_parameter", in_message("function_call")),
    Case("no content", message(role="user"), item(role="user"),
         "missing_required_parameter", in_message("content")),
    Case("content not text", message(role="user", content=3), item(role="user", content=3),
         "invalid_type", in_message("content")),
    Case("image part", message(role="user", content=IMAGE), item(role="user", content=IMAGE),
         "unsupported_parameter", in_message("content[0].type")),
    Case("part without text", message(role="user", content=[{"type": "text"}]),
         item(role="user", content=[{"type": "text"}]), "missing_required_parameter",
         in_message("content[0].text")),
    Case("message not an object", {"messages": ["hi"]},
         [{"type": "conversation.item.create", "item": "hi"}], "invalid_type",
         ("messages[0]", "item")),
    Case("nothing to answer", {"messages": []}, [{"type": "response.create"}],
         "empty_conversation", ("messages", "conversation")),
    # what the server does not do
    Case("n > 1", {"n": 2}, response(n=2), "unsupported_parameter", same("n")),
    Case("best_of > 1", {"best_of": 3}, response(best_of=3), "unsupported_parameter",
         same("best_of")),
    Case("tools", {"tools": [TOOL]}, response(tools=[TOOL]), "unsupported_parameter",
         same("tools")),
    Case("top_logprobs", {"top_logprobs": 5}, response(top_logprobs=5),
         "unsupported_parameter", same("top_logprobs")),
    Case("logit_bias", {"logit_bias": {"1": 5}}, response(logit_bias={"1": 5}),
         "unsupported_parameter", same("logit_bias")),
    Case("json output", {"response_format": {"type": "json_object"}},
         response(response_format={"type": "json_object"}), "unsupported_parameter",
         ("response_format.type", "response.response_format")),
    Case("unknown model", {"model": "gpt-4o"}, response(model="gpt-4o"), "model_not_found",
         same("model")),
    Case("model not a string", {"model": 4}, response(model=4), "invalid_type", same("model")),
    # sampling types and ranges
    Case("temperature too high", {"temperature": 5000}, response(temperature=5000),
         "invalid_value", same("temperature")),
    Case("temperature not a number", {"temperature": "hot"}, response(temperature="hot"),
         "invalid_type", same("temperature")),
    Case("top_p 0", {"top_p": 0}, response(top_p=0), "invalid_value", same("top_p")),
    Case("top_p not a number", {"top_p": [1]}, response(top_p=[1]), "invalid_type",
         same("top_p")),
    Case("top_k negative", {"top_k": -5}, response(top_k=-5), "invalid_value", same("top_k")),
    Case("top_k fractional", {"top_k": 1.5}, response(top_k=1.5), "invalid_type",
         same("top_k")),
    Case("seed negative", {"seed": -1}, response(seed=-1), "invalid_value", same("seed")),
    Case("seed a string", {"seed": "7"}, response(seed="7"), "invalid_type", same("seed")),
    Case("stop not strings", {"stop": [1]}, response(stop=[1]), "invalid_type", same("stop")),
    Case("empty stop", {"stop": [""]}, response(stop=[""]), "invalid_value", same("stop")),
    Case("17 stops", {"stop": list("abcdefghijklmnopq")}, response(stop=list("abcdefghijklmnopq")),
         "invalid_value", same("stop")),
    Case("penalty too high", {"presence_penalty": 3}, response(presence_penalty=3),
         "invalid_value", same("presence_penalty")),
    Case("stop token negative", {"stop_token_ids": [-1]}, response(stop_token_ids=[-1]),
         "invalid_value", same("stop_token_ids")),
    Case("ignore_eos not a bool", {"ignore_eos": "yes"}, response(ignore_eos="yes"),
         "invalid_type", same("ignore_eos")),
    Case("bad speculation", {"speculation": "warp"}, response(speculation="warp"),
         "invalid_value", same("speculation.method")),
    Case("bad priority", {"priority": "urgent"}, response(priority="urgent"), "invalid_value",
         same("priority")),
    Case("empty cache_salt", {"cache_salt": ""}, response(cache_salt=""), "invalid_value",
         same("cache_salt")),
    # token limits
    Case("max_tokens 0", {"max_tokens": 0}, response(**{MAX: 0}), "invalid_value",
         ("max_tokens", f"response.{MAX}")),
    Case("max_completion_tokens 0", {"max_completion_tokens": 0}, response(**{MAX: 0}),
         "invalid_value", ("max_completion_tokens", f"response.{MAX}")),
    Case("max_tokens a string", {"max_tokens": "8"}, response(**{MAX: "8"}), "invalid_type",
         ("max_tokens", f"response.{MAX}")),
    Case("max_tokens beyond the context", {"max_tokens": 10**6}, response(**{MAX: 10**6}),
         "context_length_exceeded", ("max_tokens", f"response.{MAX}")),
]


def http_error(base: str, path: str, body: JSON) -> tuple[str, str | None]:
    r = httpx.post(f"{base}{path}", content=orjson.dumps(body), timeout=60)
    error = r.json()["error"]
    assert r.status_code == HTTP_STATUS.get(error["code"], 400), (path, body, r.text)
    return error["code"], error["param"]


def ws_error(url: str, events: list[JSON]) -> tuple[str, str | None]:
    """Send ``events`` on a fresh socket; the error the last one draws (its response, if it was
    created first, must then be done as failed)."""
    with ws_open(url) as ws:
        session(ws)
        for event in events[:-1]:
            send(ws, event)
            assert recv(ws)["type"] == "conversation.item.created"
        send(ws, events[-1])
        error, _ = recv_until(ws, lambda e: e["type"] == "error")
        if "response_id" in error:
            done, _ = recv_until(ws, done_for(error["response_id"]))
            assert done["response"]["status"] == "failed"
        return error["error"]["code"], error["error"]["param"]


def test_the_base_requests_are_valid(served):
    """Every case differs from a request that succeeds only by its fragment."""
    baseline = served.free_blocks()
    for path, body in (("/v1/chat/completions", CHAT_BASE),
                       ("/v1/completions", COMPLETION_BASE)):
        assert httpx.post(f"{served.http}{path}", json=body, timeout=60).status_code == 200
    with ws_open(served.ws_url) as ws:
        session(ws)
        for event in response(**{MAX: 2}):
            send(ws, event)
        created, _ = recv_until(ws, lambda e: e["type"] == "response.created")
        done, _ = recv_until(ws, done_for(created["response"]["id"]))
        assert done["response"]["status"] == "completed"
    served.wait_idle(baseline)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_same_mistake_same_error(served, case: Case):
    baseline = served.free_blocks()
    http_param, ws_param = case.params
    chat = http_error(served.http, "/v1/chat/completions", {**CHAT_BASE, **case.chat})
    assert chat == (case.code, http_param), "chat completions"
    if not CHAT_ONLY & case.chat.keys():
        text = http_error(served.http, "/v1/completions", {**COMPLETION_BASE, **case.chat})
        assert text == (case.code, http_param), "completions"
    assert ws_error(served.ws_url, case.ws) == (case.code, ws_param), "websocket"
    served.wait_idle(baseline)


# ---------------------------------------------------------------------- hints (Sans-I/O)


def new_session() -> Session:
    s = Session("sess_test", model="tiny", max_model_len=2048, admission=Admission(8))
    s.open()
    s.next_event()
    return s


def error_of(s: Session, event: JSON) -> JSON:
    assert s.receive_text(orjson.dumps(event).decode()) == []
    error = s.next_event()
    assert error is not None and error["type"] == "error", error
    assert s.next_event() is None
    result: JSON = error["error"]
    return result


@pytest.mark.parametrize(("event", "param", "message"), [
    ({"type": "response.create", "response": {"max_tokens": 5}}, "response.max_tokens",
     "unknown field 'max_tokens' in response.create — use max_output_tokens"),
    ({"type": "response.create", "response": {"max_completion_tokens": 5}},
     "response.max_completion_tokens",
     "unknown field 'max_completion_tokens' in response.create — use max_output_tokens"),
    ({"type": "response.create", "response": {"messages": [USER]}}, "response.messages",
     "unknown field 'messages' in response.create — use conversation.item.create events "
     "(one per message) before response.create"),
    ({"type": "response.create", "response": {"system": "Be terse."}}, "response.system",
     "unknown field 'system' in response.create — use instructions"),
    ({"type": "response.create", "temperature": 0}, "temperature",
     "unknown field 'temperature' in response.create — use response.temperature"),
    ({"type": "response.create", "max_tokens": 5}, "max_tokens",
     "unknown field 'max_tokens' in response.create — use response.max_output_tokens"),
    ({"type": "session.update", "session": {"max_response_output_tokens": 5}},
     "session.max_response_output_tokens",
     "unknown field 'max_response_output_tokens' in session.update — use max_output_tokens"),
    ({"type": "conversation.item.create", "role": "user", "content": "hi"}, "role",
     "unknown field 'role' in conversation.item.create — use item.role"),
    ({"type": "response.create", "response": {"temprature": 1}}, "response.temprature",
     "unknown field 'temprature' in response.create"),
])
def test_unknown_fields_name_the_field_meant(event, param, message):
    error = error_of(new_session(), event)
    assert (error["code"], error["param"], error["message"]) == \
        ("unknown_parameter", param, message)


def test_developer_items_are_system_messages_and_the_model_may_be_named():
    s = new_session()
    for role in ("developer", "user"):
        s.receive_text(orjson.dumps({"type": "conversation.item.create",
                                     "item": {"role": role, "content": role}}).decode())
    assert s.conversation[0]["role"] == "developer"  # as the client sent it
    [command] = s.receive_text(orjson.dumps(
        {"type": "response.create", "response": {"model": "tiny"}}).decode())
    assert isinstance(command, StartResponse)
    assert [m["role"] for m in command.messages] == ["system", "user"]
    while s.next_event() is not None:
        pass
    error = error_of(s, {"type": "session.update", "session": {"model": "gpt-4o"}})
    assert (error["code"], error["param"]) == ("model_not_found", "session.model")
