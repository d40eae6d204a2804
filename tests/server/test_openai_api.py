"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client (streaming and not,
errors) and by raw HTTP (completions, bad bodies, SSE shape); /metrics parses and its counters
move; a client that disconnects mid-stream aborts its request."""

from __future__ import annotations

import threading

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_models(client, served):
    [model] = client.models.list().data
    assert model.id == served.gateway.model_name and model.owned_by == "quickdraft"
    assert client.models.retrieve(model.id).id == model.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_stream_equals_whole(client, served):
    kw = dict(model=served.gateway.model_name, messages=MESSAGES, max_tokens=12,
              temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens > 5
    extra = whole.usage.model_extra
    assert extra["timings"]["time_to_first_token"] > 0
    assert "mean_acceptance_length" in extra["speculation"]

    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same answer
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_errors(client, served):
    name = served.gateway.model_name
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, messages=MESSAGES, temperature=5000)
    assert info.value.code == "invalid_value" and info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, messages=MESSAGES, n=2)
    assert info.value.code == "unsupported_parameter" and info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=5000)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, messages=[])
    assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, messages=[{"role": "tool", "content": "x",
                                                              "tool_call_id": "1"}])
    assert info.value.param == "messages[0].role"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, messages=MESSAGES, stream=True,
                                       extra_body={"speculation": {"method": "warp"}})
    assert info.value.param == "speculation.method"


def test_logprobs_and_extensions(client, served):
    r = client.chat.completions.create(
        model=served.gateway.model_name, messages=MESSAGES, max_tokens=5, temperature=0,
        logprobs=True, extra_body={"speculation": "ngram", "priority": "background",
                                   "top_k": 5, "ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == r.choices[0].message.content


def test_completions_raw_http(served):
    url = f"{served.http}/v1/completions"
    r = httpx.post(url, json={"prompt": "Once upon a time", "temperature": 0,
                              "ignore_eos": True, "logprobs": 0})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens
    assert len(body["choices"][0]["logprobs"]["tokens"]) == 16
    r = httpx.post(url, json={"prompt": [1, 2, 3], "max_tokens": 3, "stream": True,
                              "ignore_eos": True})
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    chunks = [orjson.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)
    for body, status, code, param in [
        (b"{oops", 400, "invalid_json", None),
        (b"[]", 400, "invalid_json", None),
        (b'{"prompt": ["a", "b"]}', 400, "unsupported_parameter", "prompt"),
        (b'{"prompt": 5}', 400, "invalid_type", "prompt"),
        (b'{"max_tokens": 3}', 400, "missing_required_parameter", "prompt"),
        (b'{"prompt": "x", "max_tokens": -1}', 400, "invalid_value", "max_tokens"),
        (b'{"prompt": "x", "echo": true}', 400, "unsupported_parameter", "echo"),
        (b'{"prompt": [999999]}', 400, "invalid_value", "prompt"),
    ]:
        r = httpx.post(url, content=body)
        assert r.status_code == status, (body, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param), body
    limit = served.gateway.settings.max_message_size
    r = httpx.post(url, content=b'{"prompt": "' + b"x" * limit + b'"}')
    assert r.status_code == 413
    assert httpx.get(url).status_code == 405
    assert httpx.get(f"{served.http}/nope").json()["error"]["code"] == "not_found"
    assert served.gateway.admission.in_flight == 0  # every slot given back


def test_stream_disconnect_aborts(served):
    baseline = served.free_blocks()
    body = {"prompt": "Go", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.http}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert served.gateway.admission.in_flight == 1
    served.wait_idle(baseline)  # leaving the stream closed the connection


def test_whole_request_disconnect_aborts(served):
    baseline = served.free_blocks()
    body = orjson.dumps({"prompt": "Go", "max_tokens": 1500, "ignore_eos": True})
    with httpx.Client(timeout=0.5) as http, pytest.raises(httpx.TimeoutException):
        http.post(f"{served.http}/v1/completions", content=body)
    served.wait_idle(baseline)


def metric_values(served) -> dict[str, float]:
    text = httpx.get(f"{served.http}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())
                                        if k != "model_name")
            values[key] = sample.value
    return values


def test_metrics_move(client, served):
    before = metric_values(served)
    for name in ("quickdraft:num_requests_running", "quickdraft:num_requests_waiting",
                 "quickdraft:kv_cache_usage_perc", "quickdraft:num_preemptions_total",
                 "quickdraft:prefix_cache_queries_total", "quickdraft:prefix_cache_hits_total",
                 "quickdraft:spec_decode_num_drafts_total"):
        assert name in before, name
    r = client.chat.completions.create(model=served.gateway.model_name, messages=MESSAGES,
                                       max_tokens=30, temperature=0,
                                       extra_body={"speculation": "ngram", "ignore_eos": True})
    spec = r.usage.model_extra["speculation"]
    after = metric_values(served)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert moved("quickdraft:generation_tokens_total{priority=interactive}") == 30
    assert moved("quickdraft:prompt_tokens_total{priority=interactive}") > 5
    assert moved("quickdraft:e2e_request_latency_seconds_count{priority=interactive}") == 1
    assert moved("quickdraft:time_to_first_token_seconds_count{priority=interactive}") == 1
    assert moved("quickdraft:time_per_output_token_seconds_count{priority=interactive}") == 1
    assert moved("quickdraft:request_success_total{finished_reason=length}"
                 "{priority=interactive}") == 1
    # Whether the policy drafts at all is the engine's call; the counters must agree with it.
    assert moved("quickdraft:spec_decode_num_draft_tokens_total") == spec["drafted_tokens"]
    assert moved("quickdraft:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
    assert moved("quickdraft:spec_decode_num_drafts_total") == spec["num_steps"]
    assert any(k.startswith("quickdraft:spec_decode_num_accepted_tokens_per_pos_total")
               for k in after)


def test_concurrent_http_streams(client, served):
    results: list[str] = []

    def ask(i: int) -> None:
        stream = client.chat.completions.create(
            model=served.gateway.model_name, stream=True, max_tokens=6 + i, temperature=0,
            messages=[{"role": "user", "content": f"Question {i}"}],
            extra_body={"ignore_eos": True})
        results.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3 and all(results)


def test_usage_reports_cached_prompt_tokens(client, served):
    """A repeated long prompt is served from the prefix cache, and usage says how much of it
    (OpenAI's ``prompt_tokens_details.cached_tokens``)."""
    messages = [{"role": "system", "content": "You answer briefly. " * 40},
                {"role": "user", "content": "Hi"}]
    first, second = (client.chat.completions.create(model=served.gateway.model_name,
                                                     messages=messages, max_tokens=2,
                                                     temperature=0) for _ in range(2))
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
