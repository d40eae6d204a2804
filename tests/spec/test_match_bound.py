"""A suffix look-up that cannot pay is not made (``Proposers._may_pay``): the longest match
a request's tries can hold now is bounded by the last look-up's longest continued match
plus the tokens since (``SuffixProposer.match_bound``), and a kind of draft after a longer
match than that cannot be found; a node scores at most its kind's acceptance. So skipping
gives the same proposals as looking and refusing the kind, on random token streams with
long repeats, tenants learning outputs on the way, and every kind's acceptance drawn."""

from __future__ import annotations

import random

import pytest

from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec import suffix_tree
from quickdraft.spec.proposals import Candidate, Proposers

pytestmark = pytest.mark.skipif(not suffix_tree.available(), reason="needs gcc")

KINDS = [f"suffix/{k}" for k in ("1-3", "4-7", "8+")]


def _proposers(alphas: dict[str, float]) -> Proposers:
    proposers = Proposers("suffix", max_k=8, ngram_min=2, ngram_max=4)
    for kind, alpha in alphas.items():
        proposers.pool(kind).alpha = alpha
    return proposers


def _request(rid: str, prompt: list[int], salt: str) -> Request:
    request = Request(rid, list(prompt), SamplingParams(max_tokens=4096), frozenset(),
                      cache_salt=salt)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def _summary(c: Candidate | None) -> tuple | None:
    if c is None:
        return None
    assert c.tree is not None
    return c.source, c.tree.token_ids, c.tree.parents, c.scores


@pytest.mark.parametrize("seed", range(6))
def test_skipped_lookups_change_no_proposal(seed: int) -> None:
    rng = random.Random(seed)
    # (as measured: shorter matches' drafts are accepted less often)
    alphas = {kind: rng.choice(choices) for kind, choices in
              zip(KINDS, ([0.2, 0.5], [0.5, 0.8], [0.8, 0.95]), strict=True)}
    skipping, looking = _proposers(alphas), _proposers(alphas)
    vocab = rng.choice([6, 40])
    prompt = [rng.randrange(vocab) for _ in range(rng.choice([5, 60]))]
    salt = f"tenant-{seed}"
    mine, mirror = _request("r", prompt, salt), _request("r", prompt, salt)
    skipped = looked_up = 0
    for step in range(200):
        min_gain = rng.choice([0.0, 0.3, 0.6, 0.9])
        assert skipping.suffix is not None and looking.suffix is not None
        bound = skipping.suffix.match_bound(mine)
        before = skipping.num_unpayable_lookups
        got = skipping._suffix_tree(mine, False, min_gain)
        want = looking._suffix_tree(mirror, False, 0.0)
        if want is not None and want.tracker.alpha <= min_gain:
            want = None  # what the look-up refuses (every node scores <= alpha)
        assert _summary(got) == _summary(want), step
        if bound is not None:  # the bound holds: the true longest match is within it
            assert looking.suffix._requests["r"].longest <= bound, step
        if skipping.num_unpayable_lookups > before:
            skipped += 1
        else:
            looked_up += 1
        # the text goes on: new tokens, now and then a copy of an earlier stretch
        if rng.random() < 0.1:
            start = rng.randrange(mine.num_tokens - 1)
            new = mine.token_ids_slice(start, min(start + rng.randrange(2, 30), mine.num_tokens))
        else:
            new = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 3]))]
        for token in new:
            mine.append_output(token)
            mirror.append_output(token)
        mine.num_computed_tokens = mirror.num_computed_tokens = mine.num_tokens - 1
        if rng.random() < 0.03:  # the tenant learns an output: the bound starts again
            output = [rng.randrange(vocab) for _ in range(40)] + new
            for proposers in (skipping, looking):
                earlier = _request(f"done-{step}", [1, 2], salt)
                for token in output:
                    earlier.append_output(token)
                assert proposers.suffix is not None
                proposers.suffix.finish(earlier)
            assert skipping.suffix.match_bound(mine) is None
    assert looked_up > 0 and skipped > 0


def test_a_look_up_is_skipped_only_while_no_kind_it_could_find_pays() -> None:
    """A request whose text never repeats: after its first look-up only 1-3-token matches
    are possible for a while; a kind of long match that pays is looked for again once the
    bound allows one, whatever the short kinds' acceptance."""
    proposers = _proposers({"suffix/1-3": 0.4, "suffix/4-7": 0.5, "suffix/8+": 0.9})
    request = _request("r", list(range(100, 110)), "t")
    assert proposers.suffix is not None
    assert proposers._suffix_tree(request, False, 0.6) is None  # looked up: no bound yet
    assert proposers.num_unpayable_lookups == 0
    assert proposers.suffix.match_bound(request) == 1  # (nothing of 2 or more continued)
    for i in range(6):
        request.append_output(200 + i)
        proposers._suffix_tree(request, False, 0.6)
    # bounds 2..7 (a kind of 1-3 or 4-7 at most): nothing could pay, nothing was looked up
    assert proposers.num_unpayable_lookups == 6
    request.append_output(300)  # bound 8: an 8+ match (alpha 0.9) could be there now
    proposers._suffix_tree(request, False, 0.6)
    assert proposers.num_unpayable_lookups == 6
    assert proposers.suffix.match_bound(request) == 1
