"""End to end on the real default model (SmolLM2-135M-Instruct): a two-turn WebSocket chat
whose second turn only sends the new message (the session keeps the conversation), and the
same first answer through the OpenAI client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.conftest import (
    Served,
    collect,
    make_settings,
    respond,
    say,
    send,
    serve,
    session,
    ws_open,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(default_model_dir) -> Iterator[Served]:
    from quickdraft.engine.async_engine import AsyncLLM
    from quickdraft.engine.config import EngineConfig
    from quickdraft.engine.llm_engine import LLMEngine

    config = EngineConfig(model=str(default_model_dir), num_threads=1, speculation="ngram",
                          kv_cache_memory=64 << 20)
    with serve(make_settings(), lambda: AsyncLLM(LLMEngine(config, progress=False))) as s:
        yield s


def test_two_turn_chat(real):
    baseline = real.free_blocks()
    with ws_open(real.ws_url) as ws:
        session(ws)
        send(ws, {"type": "session.update",
                  "session": {"instructions": "You are a helpful assistant.",
                              "temperature": 0, "max_output_tokens": 40}})
        # Questions whose greedy answers hold on every serving path (bf16, int4): the 135M
        # model's "capital of France" answer is a near-tie ("The" 24.14 vs "La" 24.05 in fp32)
        # that bf16 rounding alone can flip.
        say(ws, "Who wrote Romeo and Juliet?")
        first, done, _ = collect(ws, respond(ws, event_id="t1"))
        assert done["response"]["status"] == "completed", done
        assert "Shakespeare" in first, first
        say(ws, "In which country was he born?")  # "he" only makes sense with turn one
        second, done2, _ = collect(ws, respond(ws, event_id="t2"))
        assert done2["response"]["status"] == "completed"
        assert "Romeo" in second or "Shakespeare" in second, second
        # The second prompt held the first turn: instructions + 2 user turns + 1 answer.
        assert done2["response"]["usage"]["input_tokens"] > \
            done["response"]["usage"]["input_tokens"] + done["response"]["usage"][
                "output_tokens"]
    real.wait_idle(baseline)

    client = openai.OpenAI(base_url=f"{real.http}/v1", api_key="-", max_retries=0)
    reply = client.chat.completions.create(
        model=real.gateway.model_name, max_tokens=40, temperature=0,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Who wrote Romeo and Juliet?"}])
    assert reply.choices[0].message.content == first  # the same greedy answer
