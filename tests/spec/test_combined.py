"""``combined`` speculation: every model-free proposer drafts, and the chain with the largest
expected accepted length under the request's own acceptance of each source wins."""

from __future__ import annotations

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.policy import SpeculationPolicy
from quickdraft.spec.speculator import Speculator

# a repeated phrase: the n-gram and suffix proposers both find the continuation
PROMPT = [5, 6, 7, 8, 9, 10, 11, 1, 2, 5, 6, 7, 8, 9, 10, 11, 3, 4, 5, 6, 7]


def make() -> tuple[Speculator, Request]:
    spec = Speculator("combined", max_k=4, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    request = Request("r", list(PROMPT), SamplingParams(max_tokens=64), frozenset())
    request.num_computed_tokens = request.num_tokens - 1
    return spec, request


def test_the_source_the_request_accepts_more_wins():
    spec, request = make()
    found = dict(spec._model_free_drafts(request, 4))
    assert "ngram" in found and "suffix" in found  # (the suffix trie builds with gcc)
    sources = sorted(found)
    for favoured in sources:
        for source in sources:
            spec._tracker(request, source).alpha = 0.95 if source == favoured else 0.05
        chosen = spec._best_candidate(request, 4)
        assert chosen is not None and chosen.drafts == found[favoured]
        assert chosen.tracker is spec._tracker(request, favoured)


def test_nothing_to_draft_and_no_draft_model_gives_no_candidate():
    spec = Speculator("combined", max_k=4, ngram_min=2, ngram_max=4, policy=SpeculationPolicy())
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=64), frozenset())
    request.num_computed_tokens = 2
    assert spec._best_candidate(request, 4) is None
