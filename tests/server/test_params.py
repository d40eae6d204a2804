"""Field readers shared by both protocols: types checked, ranges from the engine's dataclasses,
errors naming the field's path; the context fit; the views of usage."""

from __future__ import annotations

import pytest

from quickdraft.engine.outputs import Usage
from quickdraft.server.errors import ProtocolError
from quickdraft.server.params import (
    PRIORITY_CLASSES,
    Fields,
    build_sampling,
    cache_namespace,
    fit_max_tokens,
    read_cache_salt,
    read_content,
    read_max_tokens,
    read_priority,
    read_sampling,
    read_speculation,
    speculation_view,
    timings_view,
)


def error_of(fn, *args, **kw) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args, **kw)
    return info.value


def test_sampling_fields_types_and_ranges():
    f = Fields({"temperature": 0, "top_p": 0.5, "top_k": -1, "stop": "END", "seed": 3,
                "ignore_eos": True, "stop_token_ids": [5]}, "response")
    kwargs = read_sampling(f)
    assert kwargs == {"temperature": 0.0, "top_p": 0.5, "top_k": 0, "stop": ("END",),
                      "seed": 3, "ignore_eos": True, "stop_token_ids": (5,)}
    params = build_sampling({**kwargs, "max_tokens": 4}, "response", "max_output_tokens")
    assert params.greedy and params.stop == ("END",)
    err = error_of(build_sampling, {"max_tokens": 0}, "response", "max_output_tokens")
    assert (err.code, err.param) == ("invalid_value", "response.max_output_tokens")
    err = error_of(read_sampling, Fields({"seed": 1.5}, ""))
    assert (err.code, err.param) == ("invalid_type", "seed")
    err = error_of(read_sampling, Fields({"stop_token_ids": [1, "x"]}, ""))
    assert err.param == "stop_token_ids[1]"
    err = error_of(read_sampling, Fields({"temperature": True}, ""))
    assert err.code == "invalid_type"


def test_max_tokens_speculation_priority_content():
    assert read_max_tokens(Fields({"m": "inf"}), "m", allow_inf=True) is None
    assert error_of(read_max_tokens, Fields({"m": "inf"}), "m").code == "invalid_type"
    assert read_max_tokens(Fields({}), "m") is None
    assert read_speculation(Fields({"speculation": "ngram"})).method == "ngram"
    spec = read_speculation(Fields({"speculation": {"method": None, "k": 2}}))
    assert spec.method is None and spec.k == 2
    err = error_of(read_speculation, Fields({"speculation": {"k": 2, "x": 1}}, "r"))
    assert err.param == "r.speculation.x"
    assert read_priority(Fields({})) == PRIORITY_CLASSES["interactive"]
    assert read_priority(Fields({"priority": "background"})) == PRIORITY_CLASSES["background"]
    assert PRIORITY_CLASSES["interactive"] < PRIORITY_CLASSES["background"]  # lower runs first
    assert read_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "c") \
        == "ab"
    assert error_of(read_content, [{"type": "text"}], "c").param == "c[0].text"


def test_cache_salt_and_namespace():
    assert read_cache_salt(Fields({})) is None
    assert read_cache_salt(Fields({"cache_salt": "team-1"}, "response")) == "team-1"
    for bad, code in (("", "invalid_value"), (5, "invalid_type"), ("x" * 257, "invalid_value")):
        err = error_of(read_cache_salt, Fields({"cache_salt": bad}, "response"))
        assert (err.code, err.param) == (code, "response.cache_salt")
    assert cache_namespace(None, None) is None
    assert cache_namespace("key:ab", None) == "key:ab"
    assert cache_namespace("key:ab", "x") == "key:ab/x"
    assert cache_namespace(None, "x") == "open/x"
    # a client salt never names a key's namespace
    assert cache_namespace(None, "key:ab") != cache_namespace("key:ab", None)


def test_fit_max_tokens():
    kw = dict(param="max_tokens", prompt_param="messages")
    assert fit_max_tokens(10, None, 100, **kw) == 90
    assert fit_max_tokens(10, 90, 100, **kw) == 90
    err = error_of(fit_max_tokens, 10, 91, 100, **kw)
    assert (err.code, err.param) == ("context_length_exceeded", "max_tokens")
    assert "101" in err.message
    err = error_of(fit_max_tokens, 100, None, 100, **kw)
    assert (err.code, err.param) == ("context_length_exceeded", "messages")


def test_usage_views():
    u = Usage(3, 4, queue_time=0.1, ttft=None, decode_time=0.2, num_spec_steps=2,
              num_drafted_tokens=6, num_accepted_tokens=4)
    assert timings_view(u) == {"queue_time": 0.1, "time_to_first_token": None,
                               "decode_time": 0.2}
    assert speculation_view(u) == {"num_steps": 2, "drafted_tokens": 6, "accepted_tokens": 4,
                                   "mean_acceptance_length": 3.0}
