"""The public suffix corpus: spec/suffix_corpus.c against its plain-Python oracle; the
proposer asks it only when the request's own tries find nothing; in the engine, greedy
output with it equals output without speculation, a corpus is refused for another target
unless it has its text, which is then re-tokenized for this one (once, cached)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec import suffix_corpus
from quickdraft.spec.draft_head import model_fingerprint
from quickdraft.spec.speculator import CORPUS_MAX_REQUESTS
from quickdraft.spec.suffix import SuffixConfig, SuffixProposer
from quickdraft.spec.suffix_corpus import (
    SuffixCorpus,
    derive_corpus,
    find_corpus,
    read_texts,
    read_tokens,
    tokens_file,
    write_corpus,
    write_texts,
)
from tests.spec.suffix_corpus_reference import reference_tree
from tests.spec.test_spec_engine import GREEDY, PROMPTS, assert_lossless, make_engine

pytestmark = pytest.mark.skipif(not suffix_corpus.available(), reason="needs gcc")


def _flat(seqs: list[list[int]]) -> list[int]:
    return [t for s in seqs for t in [*s, -1]]


@pytest.mark.parametrize("seed", range(12))
def test_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 9])
    seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            for _ in range(rng.randint(1, 12))]
    max_depth, max_sources = rng.choice([1, 4, 16]), rng.choice([1, 3, 256])
    corpus = SuffixCorpus(seqs, max_depth=max_depth, max_sources=max_sources)
    tokens = _flat(seqs)
    for _ in range(30):
        # (+ 2: tokens the corpus never holds, above its largest too: the first-level table)
        ctx = [rng.randrange(vocab + 2) for _ in range(rng.randint(0, 20))]
        max_nodes, factor = rng.randint(0, 12), rng.choice([0.5, 1.0, 4.0])
        min_prob, min_match = rng.choice([0.0, 0.2, 0.5]), rng.choice([1, 2, 3])
        got = corpus.speculate_tree(ctx, max_nodes, factor, min_prob, min_match)
        want = reference_tree(tokens, ctx, max_depth, max_nodes, factor, min_prob, min_match,
                              max_sources)
        assert (got.tokens, got.parents, got.match_len) == (want[0], want[1], want[3])
        assert got.probs == pytest.approx(want[2], rel=0, abs=0)  # the same float32 maths
        assert got.public
        chain = corpus.speculate(ctx, max_nodes, factor, min_prob, min_match)
        assert chain.tokens == got.tokens[:len(chain.tokens)] or got.parents[:1] == [-1]


def test_many_sources_and_nodes_match_the_reference() -> None:
    """Past one batch of prefetched sources (64), in the caller's scratch (room for 256
    sources x 16 nodes) and past it, where the look-up allocates its trie instead."""
    rng = random.Random(7)
    seqs = [[rng.randrange(4) for _ in range(rng.randint(20, 60))] for _ in range(300)]
    corpus = SuffixCorpus(seqs, max_depth=16, max_sources=256)
    tokens = _flat(seqs)
    for ctx, max_nodes, factor in (([0, 1], 16, 8.0), ([2, 3, 1], 16, 4.0),
                                   ([1, 2, 0, 3], 200, 64.0), ([3, 3], 256, 128.0)):
        got = corpus.speculate_tree(ctx, max_nodes, factor, 0.0, 1)
        want = reference_tree(tokens, ctx, 16, max_nodes, factor, 0.0, 1, 256)
        assert (got.tokens, got.parents, got.match_len) == (want[0], want[1], want[3])
        assert got.probs == pytest.approx(want[2], rel=0, abs=0)
        assert len(got.tokens) == max_nodes  # many sources: the trie has nodes to spare


def test_a_draft_continues_the_longest_match_by_frequency() -> None:
    corpus = SuffixCorpus([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 3, 4, 5, 8], [3, 4, 5, 8]])
    # context ...2 3 4: matched by the first two sequences (length 3): 5 and 6 once each
    tree = corpus.speculate_tree([0, 2, 3, 4], 4, 4.0, 0.0, 1)
    assert tree.match_len == 3 and tree.tokens[:2] == [5, 6] and tree.parents[:2] == [-1, -1]
    assert tree.probs[:2] == [0.5, 0.5]
    # context ...3 4 5 (first and third sequences and the fourth): 8 twice, end once
    assert corpus.speculate([3, 4, 5], 2, 4.0, 0.0, 1).tokens == [8]
    assert corpus.speculate_tree([42], 4, 4.0, 0.0, 1).tokens == []  # no match
    assert corpus.speculate_tree([2, 3, 4], 4, 4.0, 0.0, 4).tokens == []  # too short a match
    assert corpus.num_tokens == 19


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="token ids"):
        SuffixCorpus(np.array([1, -2, 3]))
    with pytest.raises(ValueError, match="max_depth"):
        SuffixCorpus([[1, 2]], max_depth=0)
    with pytest.raises(ValueError, match="max_nodes"):
        SuffixCorpus([[1, 2]]).speculate_tree([1], 257)


def test_file_round_trip_and_target_check(tmp_path: Path) -> None:
    seqs = [[5, 6, 7], [65534, 0]]
    config = write_corpus(tmp_path, seqs, "abc", "test")
    assert config["tokens"] == 5 and config["sequences"] == 2
    assert config["file"] == "suffix_corpus.u16.xz"
    assert read_tokens(tokens_file(tmp_path)).tolist() == _flat(seqs)
    wide = tmp_path / "wide"
    wide.mkdir()
    assert write_corpus(wide, [[151935, 65535], [7]], "abc", "t")["file"].endswith(".u32.xz")
    assert read_tokens(tokens_file(wide)).tolist() == [151935, 65535, -1, 7, -1]
    assert find_corpus(str(tmp_path), "abc", tmp_path.parent) is not None
    assert find_corpus("none", "abc", tmp_path.parent) is None
    assert find_corpus("auto", "other", tmp_path.parent) is None
    with pytest.raises(ValueError, match="target_fingerprint"):
        find_corpus(str(tmp_path), "other", tmp_path.parent)
    with pytest.raises(ValueError, match=r"no suffix_corpus\.json"):
        find_corpus(str(tmp_path / "missing"), "abc", tmp_path.parent)
    with pytest.raises(ValueError, match="token ids"):
        write_corpus(tmp_path, [[-3]], "abc", "test")


def test_another_target_s_text_is_tokenized_once_for_this_one(tmp_path: Path) -> None:
    shipped = tmp_path / "shipped"
    source = shipped / "other-model"
    source.mkdir(parents=True)
    texts = ["ab c", "d\u00e9", "ab c"]
    write_corpus(source, [[1, 2, 3], [5, 6], [1, 2, 3]], "other", "test")  # 8 tokens
    write_texts(source, texts)
    assert read_texts(source) == texts
    calls: list[list[str]] = []

    def tokenize(batch: list[str]) -> list[list[int]]:  # one id a character
        calls.append(batch)
        return [[ord(ch) for ch in text] for text in batch]

    cache = tmp_path / "cache"
    derived = derive_corpus(source, tokenize, "mine", cache)
    assert read_tokens(tokens_file(derived)).tolist() == _flat(tokenize(texts))
    assert derive_corpus(source, tokenize, "mine", cache) == derived and len(calls) == 2
    assert [p.name for p in derived.parent.iterdir()] == [derived.name]  # no staging left
    # ids the model has no embedding for cut the answers (a vocabulary of 99 ids: "c" is
    # 99, "d" 100, "é" 233)
    small = derive_corpus(source, tokenize, "small", cache, vocab_size=99)
    assert read_tokens(tokens_file(small)).tolist() == _flat([[97, 98, 32], [97, 98, 32]])
    # "auto": this target's own corpus first, else the text derived, else none
    mine = find_corpus("auto", "mine", shipped, tokenize, cache)
    assert mine is not None and mine.num_tokens == 10  # one id a character
    assert find_corpus("auto", "other", shipped, tokenize, cache).num_tokens == 8
    assert find_corpus("auto", "mine", shipped) is None
    assert find_corpus(str(source), "mine", shipped, tokenize, cache).num_tokens == 10
    with pytest.raises(ValueError, match="target_fingerprint"):  # no way to derive it
        find_corpus(str(source), "mine", shipped)
    (source / "suffix_corpus.txt.xz").unlink()
    with pytest.raises(ValueError, match="target_fingerprint"):  # no text to derive from
        find_corpus(str(source), "yours", shipped, tokenize, cache)
    with pytest.raises(ValueError, match="NUL"):
        write_texts(source, ["a\0b"])


def _request(prompt: list[int], output: list[int]) -> Request:
    r = Request(f"r{prompt}{output}", list(prompt), SamplingParams(max_tokens=64),
                frozenset(), cache_salt="t")
    r.output_token_ids = list(output)
    return r


def test_the_corpus_is_asked_only_when_the_request_s_tries_find_nothing() -> None:
    corpus = SuffixCorpus([[20, 21, 22, 30, 31, 32, 33]])
    config = SuffixConfig(max_spec_factor=2.0, min_match_len=2, corpus_min_match_len=3,
                          corpus_min_token_prob=0.5)
    proposer = SuffixProposer(config, corpus)
    # nothing in its own context: the corpus continues "20 21 22"
    tree = proposer.propose_tree(_request([1, 2], [20, 21, 22]), 4)
    assert tree.public and tree.tokens == [30, 31, 32, 33]
    # its own context matches "21 22" (-> 40): its own draft wins, the corpus is not asked
    own = proposer.propose_tree(_request([21, 22, 40, 41], [20, 21, 22]), 4)
    assert not own.public and own.tokens[0] == 40
    # a 2-token match is below the corpus's minimum
    assert proposer.propose_tree(_request([1, 2], [21, 22]), 4).tokens == []


@pytest.fixture(scope="module")
def corpus_dir(tiny_model_dir, tmp_path_factory):
    """A corpus of the tiny model's own greedy answers to the test prompts."""
    plain = make_engine(tiny_model_dir, "off")
    answers = [out.token_ids for out in plain.generate(PROMPTS, GREEDY)]
    directory = tmp_path_factory.mktemp("corpus")
    write_corpus(directory, answers, model_fingerprint(Path(tiny_model_dir)), "test")
    return directory


def test_greedy_equal_with_the_corpus_and_its_drafts_accepted(tiny_model_dir, corpus_dir):
    plain = make_engine(tiny_model_dir, "off")
    spec = make_engine(tiny_model_dir, "suffix", suffix_corpus=str(corpus_dir))
    assert spec.speculator.suffix is not None and spec.speculator.suffix.corpus is not None
    # every request its own tenant; the corpus holds these very answers: its drafts were
    # made, verified as "corpus" and accepted
    usage = assert_lossless(plain, spec, PROMPTS, GREEDY, "corpus")
    pools = spec.speculator.proposers.pools
    assert any(kind.startswith("corpus/") for kind in pools)
    assert sum(u.num_accepted_tokens for u in usage.values()) > 0


def test_another_target_s_corpus_text_drafts_for_this_one(tiny_model_dir, tmp_path,
                                                          monkeypatch):
    """A corpus written for another target, with its text: the engine tokenizes the text
    with its own tokenizer (under its cache directory) and drafts from it losslessly."""
    plain = make_engine(tiny_model_dir, "off")
    answers = [out.token_ids for out in plain.generate(PROMPTS, GREEDY)]
    write_corpus(tmp_path, answers, "another-model", "test")
    write_texts(tmp_path, [plain.tokenizer.decode(a, skip_special_tokens=False)
                           for a in answers])
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))
    spec = make_engine(tiny_model_dir, "suffix", suffix_corpus=str(tmp_path))
    assert spec.speculator.suffix is not None and spec.speculator.suffix.corpus is not None
    assert list((tmp_path / "cache" / "suffix_corpus").iterdir())
    assert_lossless(plain, spec, PROMPTS, GREEDY, "corpus")


def test_a_corpus_for_another_target_is_refused(tiny_model_dir, tmp_path):
    write_corpus(tmp_path, [[1, 2, 3]], "not-this-model", "test")
    with pytest.raises(ValueError, match="target_fingerprint"):
        make_engine(tiny_model_dir, "suffix", suffix_corpus=str(tmp_path))


def test_the_corpus_is_asked_in_small_steps_only(tiny_model_dir, tmp_path):
    answer = [10, 11, 12, 13, 14, 15, 16, 17]
    write_corpus(tmp_path, [answer], model_fingerprint(Path(tiny_model_dir)), "test")
    spec = make_engine(tiny_model_dir, "suffix", suffix_corpus=str(tmp_path))

    def requests(n: int) -> list[Request]:
        out = []
        for i in range(n):  # each has begun the corpus's answer: only the corpus continues it
            r = Request(f"r{n}-{i}", [1], SamplingParams(max_tokens=64), frozenset())
            r.output_token_ids = answer[:3]
            out.append(r)
        return out

    def corpus_kinds() -> set[str]:
        return {k for k in spec.speculator.proposers.pools if k.startswith("corpus/")}

    many = requests(CORPUS_MAX_REQUESTS + 1)
    spec.speculator.plan(many, [4] * len(many), len(many), 4 * len(many))
    assert corpus_kinds() == set() and all(not r.spec_token_ids for r in many)
    few = requests(CORPUS_MAX_REQUESTS)
    spec.speculator.plan(few, [4] * len(few), len(few), 4 * len(few))
    assert corpus_kinds() and all(r.spec_token_ids[:1] == [13] for r in few)


def test_a_request_backs_off_a_corpus_whose_drafts_it_never_accepts(tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    """After CORPUS_IDLE_BEFORE_BACKOFF corpus look-ups without an accepted corpus draft a
    request asks the corpus ever more rarely (its tries are still asked every step); one
    accepted corpus draft and it asks every time again."""
    answer = [10, 11, 12, 13, 14, 15, 16, 17]
    write_corpus(tmp_path, [answer], model_fingerprint(Path(tiny_model_dir)), "test")
    spec = make_engine(tiny_model_dir, "suffix", suffix_corpus=str(tmp_path))
    corpus = spec.speculator.suffix.corpus
    asked: list[int] = []
    real = corpus.speculate_tree
    monkeypatch.setattr(corpus, "speculate_tree",
                        lambda *a, **k: asked.append(now[0]) or real(*a, **k))
    request = Request("r", [1], SamplingParams(max_tokens=64), frozenset())
    request.output_token_ids = answer[:3]  # only the corpus continues it
    now = [0]  # the step being planned

    def run(steps: range, accept: bool) -> None:
        for now[0] in steps:
            spec.speculator.plan([request], [4], 1, 4)
            drafted = len(request.spec_token_ids)
            if drafted:  # verified: rejected (or its first draft accepted)
                spec.speculator.record(request, drafted, int(accept))
            request.clear_drafts()

    run(range(40), accept=False)  # (the tries' own back-off thins the chances too)
    gaps = [b - a for a, b in itertools.pairwise(asked)]
    assert asked[:8] == list(range(8)) and min(gaps[7:]) >= 2 and max(gaps) >= 4
    assert len(asked) < 20 and request.spec_state.corpus_idle == len(asked)
    assert request.spec_state.corpus_to_skip > 0
    # a corpus draft verified with a token accepted: the next chance asks it
    request.spec_state.in_flight_source = "corpus"
    spec.speculator.record(request, 2, 1)
    assert request.spec_state.corpus_idle == request.spec_state.corpus_to_skip == 0
    request.spec_state.lookups_to_skip = 0
    run(range(100, 101), accept=True)
    assert asked[-1] == 100
