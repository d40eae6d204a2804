"""engine.sampler's draws: seeded requests reproducible alone or batched, rows independent of
each other's generators, and chi-square tests that sampling emits the filtered softmax."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from quickdraft.engine.sampler import sample, sample_from_probs
from quickdraft.engine.sampling_params import SamplingParams
from tests.engine.sampler_oracle import make_batch, reference_probs, seeded

# ---------------------------------------------------------------------------------------
# Seeded reproducibility
# ---------------------------------------------------------------------------------------


def _draw_sequence(seed: int, steps: list[torch.Tensor], with_others: bool) -> list[int]:
    """Sample our request (row of ``steps``) for several steps, alone or in a batch."""
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=seed)
    gen = seeded(seed)
    others = [SamplingParams(temperature=0.8, top_k=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, seed=99, frequency_penalty=0.5)]
    other_gens = [None, None, seeded(99)]
    tokens: list[int] = []
    for step, logits in enumerate(steps):
        if not with_others:
            out = sample(logits[:1], make_batch([params], generators=[gen]))
            tokens.append(int(out.token_ids[0]))
            continue
        batch_logits = torch.cat([logits[1:2], logits[:1], logits[2:]])  # ours is row 1
        batch = make_batch([others[0], params, *others[1:]],
                           generators=[other_gens[0], gen, *other_gens[1:]],
                           outputs=[[], [], [], [step, 3]])
        tokens.append(int(sample(batch_logits, batch).token_ids[1]))
    return tokens


def test_seeded_request_reproducible_alone_or_batched() -> None:
    steps = [torch.randn(4, 1000, generator=seeded(10 + s)) * 0.3 for s in range(6)]
    alone = _draw_sequence(1234, steps, with_others=False)
    assert alone == _draw_sequence(1234, steps, with_others=False)
    assert alone == _draw_sequence(1234, steps, with_others=True)
    assert alone != _draw_sequence(4321, steps, with_others=False)


def test_sample_from_probs_rows_depend_only_on_their_generator() -> None:
    probs = torch.softmax(torch.randn(3, 500, generator=seeded(5)), dim=-1)
    alone = sample_from_probs(probs[1:2], [seeded(42)])
    batched = sample_from_probs(probs, [None, seeded(42), seeded(7)], seeded(0))
    assert batched[1] == alone[0]
    with pytest.raises(ValueError):
        sample_from_probs(probs, [None])


def test_default_generator_makes_unseeded_rows_reproducible() -> None:
    logits = torch.randn(6, 200, generator=seeded(6))
    params = [SamplingParams(temperature=1.0)] * 6
    a = sample(logits, make_batch(params, default_generator=seeded(3))).token_ids
    b = sample(logits, make_batch(params, default_generator=seeded(3))).token_ids
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------

STAT_LOGITS = [1.2, 0.3, -0.5, 2.0, 0.0, -1.5, 0.8, 1.6]


@pytest.mark.parametrize(
    "row",
    [(1.0, 0, 1.0, 0.0), (0.6, 0, 1.0, 0.0), (2.5, 0, 1.0, 0.0), (1.5, 3, 1.0, 0.0),
     (1.0, 0, 0.8, 0.0), (1.2, 5, 0.7, 0.0), (1.0, 0, 1.0, 0.3)],
    ids=["t1", "t0.6", "t2.5", "top-k", "top-p", "top-k+top-p", "min-p"],
)
def test_empirical_distribution_matches_filtered_softmax(
    row: tuple[float, int, float, float],
) -> None:
    t, k, p, min_p = row
    n = 20_000
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p)
    logits = torch.tensor([STAT_LOGITS]).expand(n, -1)
    batch = make_batch([params] * n, default_generator=seeded(2024))
    counts = torch.bincount(sample(logits, batch).token_ids, minlength=8).tolist()
    _check_distribution(counts, reference_probs(STAT_LOGITS, t, k, p, min_p))


def test_seeded_generators_give_the_right_distribution() -> None:
    t, k, p = 1.3, 6, 0.9
    n = 4_000
    params = SamplingParams(temperature=t, top_k=k, top_p=p)
    logits = torch.tensor([STAT_LOGITS]).expand(n, -1)
    batch = make_batch([params] * n, generators=[seeded(s) for s in range(n)])
    counts = torch.bincount(sample(logits, batch).token_ids, minlength=8).tolist()
    _check_distribution(counts, reference_probs(STAT_LOGITS, t, k, p, 0.0))


def _check_distribution(counts: list[int], probs: list[float]) -> None:
    n = sum(counts)
    support = [i for i, q in enumerate(probs) if q > 0]
    assert all(counts[i] == 0 for i in range(len(probs)) if probs[i] == 0), counts
    observed = [counts[i] for i in support]
    expected = [probs[i] * n for i in support]
    if len(support) > 1:
        assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)
    else:
        assert observed == [n]
