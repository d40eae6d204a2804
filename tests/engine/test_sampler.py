"""Tests for engine.sampler (greedy, penalties, filters, logprobs) against the plain-loop
references in sampler_oracle.py; seeded draws and distributions: test_sampler_draws.py."""

from __future__ import annotations

import pytest
import torch

from quickdraft.engine.sampler import apply_penalties, apply_temperature_and_filters, sample
from quickdraft.engine.sampling_params import SamplingParams
from tests.engine.sampler_oracle import (
    make_batch,
    reference_filter,
    reference_penalties,
    seeded,
)


def run_filters(logits: torch.Tensor, rows: list[tuple[float, int, float, float]]) -> torch.Tensor:
    return apply_temperature_and_filters(
        logits,
        temperature=torch.tensor([r[0] for r in rows]),
        top_k=torch.tensor([r[1] for r in rows]),
        top_p=torch.tensor([r[2] for r in rows]),
        min_p=torch.tensor([r[3] for r in rows]),
    )


# ---------------------------------------------------------------------------------------
# Greedy and penalties
# ---------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_no_logprobs_by_default() -> None:
    logits = torch.randn(5, 100, generator=seeded(0))
    out = sample(logits, make_batch([SamplingParams(temperature=0.0)] * 5))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None


@pytest.mark.parametrize(
    ("row", "params", "prompt", "output", "expected_row", "expected_token"),
    [
        # repetition, positive logit divided: 3.0 -> 1.5 (token 0 came from the prompt)
        ([3.0, 2.0, 0.5, -1.0], SamplingParams(temperature=0.0, repetition_penalty=2.0),
         [0], [], [1.5, 2.0, 0.5, -1.0], 1),
        # repetition, negative logit multiplied: -1.0 -> -2.0
        ([-1.0, -1.5, -3.0, -4.0], SamplingParams(temperature=0.0, repetition_penalty=2.0),
         [], [0], [-2.0, -1.5, -3.0, -4.0], 1),
        # presence: subtracted once however often the token was emitted
        ([1.0, 0.8, 0.0, 0.0], SamplingParams(temperature=0.0, presence_penalty=0.5),
         [], [0, 0, 0], [0.5, 0.8, 0.0, 0.0], 1),
        # frequency: 3 occurrences * 0.4 = 1.2 -> 2.0 - 1.2 = 0.8 < 1.0
        ([2.0, 1.0, 0.0, 0.0], SamplingParams(temperature=0.0, frequency_penalty=0.4),
         [], [0, 0, 0], [0.8, 1.0, 0.0, 0.0], 1),
        # frequency: 2 occurrences -> 1.2 still wins
        ([2.0, 1.0, 0.0, 0.0], SamplingParams(temperature=0.0, frequency_penalty=0.4),
         [], [0, 0], [1.2, 1.0, 0.0, 0.0], 0),
        # presence / frequency ignore prompt tokens
        ([2.0, 1.0, 0.0, 0.0],
         SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0),
         [0, 0, 0], [], [2.0, 1.0, 0.0, 0.0], 0),
        # negative presence penalty encourages a token
        ([1.0, 0.5, 0.0, 0.0], SamplingParams(temperature=0.0, presence_penalty=-1.0),
         [], [1], [1.0, 1.5, 0.0, 0.0], 1),
    ],
)
def test_penalties_hand_computed(
    row: list[float], params: SamplingParams, prompt: list[int], output: list[int],
    expected_row: list[float], expected_token: int,
) -> None:
    logits = torch.tensor([row])
    before = logits.clone()
    batch = make_batch([params], [prompt], [output])
    torch.testing.assert_close(apply_penalties(logits, batch), torch.tensor([expected_row]))
    assert sample(logits, batch).token_ids.tolist() == [expected_token]
    assert torch.equal(logits, before)  # input untouched


def test_penalties_match_reference_on_mixed_batch() -> None:
    gen = seeded(1)
    vocab = 30
    params = [
        SamplingParams(),  # no penalty: row must be untouched
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(presence_penalty=0.7),
        SamplingParams(frequency_penalty=-0.5, repetition_penalty=0.8),
        SamplingParams(presence_penalty=1.1, frequency_penalty=0.3, repetition_penalty=2.5),
        SamplingParams(temperature=0.0, frequency_penalty=1.0),
    ]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 9, 0, 4, 7, 3)]
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 0, 8, 12, 5, 9)]
    got = apply_penalties(logits, make_batch(params, prompts, outputs))
    expected = [
        reference_penalties(logits[i].tolist(), params[i], prompts[i], outputs[i])
        for i in range(len(params))
    ]
    torch.testing.assert_close(got, torch.tensor(expected))
    assert torch.equal(got[0], logits[0])


def test_penalties_on_non_contiguous_logits_and_bad_ids() -> None:
    base = torch.randn(10, 3, generator=seeded(2))
    logits = base.t()  # [3, 10], non-contiguous
    params = [SamplingParams(frequency_penalty=0.5)] * 3
    outputs = [[1, 1], [], [9]]
    got = apply_penalties(logits, make_batch(params, outputs=outputs))
    expected = [reference_penalties(logits[i].tolist(), params[i], [], outputs[i])
                for i in range(3)]
    torch.testing.assert_close(got, torch.tensor(expected))
    with pytest.raises(ValueError):
        apply_penalties(logits, make_batch(params, outputs=[[10], [], []]))


def test_greedy_rows_in_mixed_batch_use_penalised_argmax() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=1.0, top_k=1),  # sampled, but only one token survives
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, make_batch(params, [[0], [], []], [[], [], []]))
    assert out.token_ids.tolist() == [1, 2, 1]


# ---------------------------------------------------------------------------------------
# Filters
# ---------------------------------------------------------------------------------------

MIXED_ROWS = [
    (1.0, 0, 1.0, 0.0),  # nothing
    (0.7, 5, 1.0, 0.0),  # top-k
    (1.3, 0, 0.9, 0.0),  # top-p
    (1.0, 10, 0.5, 0.0),  # top-k + top-p
    (0.5, 0, 1.0, 0.2),  # min-p
    (2.0, 3, 0.7, 0.05),  # everything
    (1.0, 40, 1.0, 0.0),  # k == vocab: off
    (1.0, 1, 1.0, 0.0),  # k == 1
    (1.0, 0, 0.999, 0.0),  # top-p close to 1
]
TOP_K_ONLY = [(1.0, 5, 1.0, 0.0), (0.8, 1, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (1.2, 17, 1.0, 0.0)]
TOP_K_AND_P = [(1.0, 5, 0.6, 0.0), (0.9, 12, 0.3, 0.0), (1.0, 0, 1.0, 0.1), (1.0, 7, 1.0, 0.0)]


@pytest.mark.parametrize("rows", [MIXED_ROWS, TOP_K_ONLY, TOP_K_AND_P],
                         ids=["mixed-full-sort", "top-k-only", "top-k-and-top-p"])
@pytest.mark.parametrize("seed", range(5))
def test_filters_match_reference(rows: list[tuple[float, int, float, float]], seed: int) -> None:
    logits = torch.randn(len(rows), 40, generator=seeded(seed)) * 2.5
    before = logits.clone()
    got = run_filters(logits, rows)
    assert torch.equal(logits, before)  # input untouched
    for i, (t, k, p, min_p) in enumerate(rows):
        expected = torch.tensor(reference_filter(logits[i].tolist(), t, k, p, min_p))
        assert torch.equal(torch.isinf(got[i]), torch.isinf(expected)), (i, rows[i])
        finite = ~torch.isinf(expected)
        torch.testing.assert_close(got[i][finite], expected[finite])


def test_filters_row_result_independent_of_batch() -> None:
    """The top-k/top-p candidate fast path and the full sort agree on the same row."""
    logits = torch.randn(2, 300, generator=seeded(3)) * 2
    row = (0.9, 20, 0.8, 0.0)
    alone = run_filters(logits[:1], [row])
    batched = run_filters(logits, [row, (1.0, 0, 0.9, 0.0)])  # forces a full sort
    assert torch.equal(alone[0], batched[0])
    assert torch.equal(run_filters(logits, [row, row]), run_filters(logits, [row, row]))


@pytest.mark.parametrize("scale", [6.0, 0.05], ids=["peaky-candidates", "flat-full-sort"])
def test_top_p_large_vocab_matches_reference(scale: float) -> None:
    """Vocab above the 1024-candidate guess: settled among candidates, or full-sort fallback."""
    rows = [(1.0, 0, 0.9, 0.0), (0.8, 0, 0.5, 0.0), (1.0, 30, 0.95, 0.0), (1.0, 0, 1.0, 0.0)]
    logits = torch.randn(len(rows), 3000, generator=seeded(11)) * scale
    got = run_filters(logits, rows)
    for i, (t, k, p, min_p) in enumerate(rows):
        expected = torch.tensor(reference_filter(logits[i].tolist(), t, k, p, min_p))
        assert torch.equal(torch.isinf(got[i]), torch.isinf(expected)), (i, rows[i])
    kept = (~torch.isinf(got[0])).sum().item()
    assert (kept < 1024) if scale > 1 else (kept > 1024)  # the path we meant to exercise
    assert torch.equal(run_filters(logits[:1], rows[:1])[0], got[0])


def test_top_p_always_keeps_at_least_the_top_token() -> None:
    logits = torch.randn(4, 50, generator=seeded(4))
    logits[0, 7] = 20.0  # a dominant token
    got = run_filters(logits, [(1.0, 0, 1e-6, 0.0)] * 4)
    kept = (~torch.isinf(got)).sum(dim=-1)
    assert kept.tolist() == [1, 1, 1, 1]
    assert torch.equal(got.argmax(dim=-1), logits.argmax(dim=-1))
    assert got[0, 7].item() == 20.0


def test_top_k_keeps_ties_at_the_cutoff() -> None:
    logits = torch.tensor([[4.0, 3.0, 3.0, 3.0, 1.0, 0.0]])
    got = run_filters(logits, [(1.0, 2, 1.0, 0.0)])
    assert torch.isinf(got).tolist() == [[False, False, False, False, True, True]]
    with_top_p = run_filters(logits, [(1.0, 2, 0.99, 0.0)])
    assert torch.isinf(with_top_p).tolist() == [[False, False, False, False, True, True]]


def test_min_p_one_keeps_only_the_max() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.9, -1.0]])
    got = run_filters(logits, [(1.0, 0, 1.0, 1.0)])
    assert torch.isinf(got).tolist() == [[True, False, True, True]]


# ---------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_raw_log_softmax_at_chosen_token(dtype: torch.dtype) -> None:
    logits = (torch.randn(5, 64, generator=seeded(8)) * 2).to(dtype)
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.7, top_k=4, logprobs=True, repetition_penalty=1.5),
        SamplingParams(temperature=1.0),  # did not ask; still gets a value
        SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=True),
        SamplingParams(temperature=2.0, top_p=0.5, presence_penalty=1.0, logprobs=True),
    ]
    outputs = [[1], [2, 3], [], [int(logits[3].float().argmax())] * 2, [0]]
    out = sample(logits, make_batch(params, [[4]] * 5, outputs, default_generator=seeded(1)))
    assert out.logprobs is not None
    assert out.logprobs.dtype == torch.float32
    reference = torch.log_softmax(logits.float(), dim=-1)
    expected = reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    assert int(out.token_ids[3]) != int(logits[3].float().argmax())  # penalty moved argmax
