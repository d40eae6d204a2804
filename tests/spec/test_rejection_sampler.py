"""Tests for spec.rejection_sampler: exact greedy tables and statistical checks of sampling."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binomtest, chisquare

from quickdraft.engine.sampler import SamplingBatch, apply_temperature_and_filters, sample
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.rejection_sampler import rejection_sample
from quickdraft.spec.verification import VerifyOutput, supports_speculation

GREEDY = SamplingParams(temperature=0.0)


def make_batch(
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    default_generator: torch.Generator | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params,
        generators=generators if generators is not None else [None] * n,
        prompt_token_ids=[[]] * n,  # read-only: one shared empty list
        output_token_ids=outputs if outputs is not None else [[]] * n,
        default_generator=default_generator,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def peaked_rows(argmaxes: list[int], vocab: int = 5) -> torch.Tensor:
    """Logits ``[len(argmaxes), vocab]`` with a clear maximum at each given token."""
    logits = torch.linspace(-1.0, 0.0, vocab).repeat(len(argmaxes), 1)  # [R, V]
    logits[torch.arange(len(argmaxes)), argmaxes] = 3.0
    return logits


# ---------------------------------------------------------------------------------------
# Exact tables
# ---------------------------------------------------------------------------------------


def test_greedy_accepts_none_some_all_and_bonus() -> None:
    drafts = [[1, 2, 3], [3], [], [4, 4], [0, 1]]
    argmaxes = [1, 2, 4, 0,  # request 0: two accepted, recovered 4
                0, 2,  # request 1: none accepted, recovered 0
                2,  # request 2: plain decode
                4, 4, 1,  # request 3: all accepted, bonus 1
                3, 1, 1]  # request 4: first draft rejected, later matches are ignored
    out = rejection_sample(peaked_rows(argmaxes), drafts, None, make_batch([GREEDY] * 5))
    assert out.token_ids == [[1, 2, 4], [0], [2], [4, 4, 1], [3]]
    assert out.num_accepted == [2, 0, 0, 2, 0]
    assert out.logprobs is None


def test_all_greedy_fast_path_equals_the_general_path() -> None:
    """An all-greedy batch takes a shortcut (one argmax, a Python walk); asking for logprobs
    takes the general path: the same tokens on random logits with ties and random drafts."""
    g = seeded(3)
    for trial in range(20):
        lengths = torch.randint(0, 5, (6,), generator=g).tolist()
        logits = torch.randint(0, 4, (sum(lengths) + 6, 7), generator=g).float()  # ties
        argmax = logits.argmax(-1).tolist()
        drafts, row = [], 0
        for n in lengths:  # drafts that follow the argmax for a while, then may not
            take = int(torch.randint(0, n + 1, (1,), generator=g))
            drafts.append(argmax[row:row + take]
                          + torch.randint(0, 7, (n - take,), generator=g).tolist())
            row += n + 1
        fast = rejection_sample(logits, drafts, None, make_batch([GREEDY] * 6))
        general = rejection_sample(logits, drafts, None,
                                   make_batch([SamplingParams(temperature=0.0, logprobs=1)] * 6))
        assert fast.token_ids == general.token_ids, trial
        assert fast.num_accepted == general.num_accepted


def test_greedy_ignores_draft_probs_and_matches_plain_greedy_ties() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # ties
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    out = rejection_sample(logits, [[2]], probs, make_batch([GREEDY]))
    assert out.token_ids == [[1]]  # argmax picks the first maximum, as sample() does
    out = rejection_sample(logits, [[1]], probs, make_batch([GREEDY]))
    assert out.token_ids == [[1, 0]] and out.num_accepted == [1]


def test_mixed_batch_greedy_and_deterministic_sampled_requests() -> None:
    # top_k=1 makes p one-hot: drafts equal to the top token are always accepted, others
    # always rejected, and the recovered / bonus token is the top token.
    top1 = SamplingParams(temperature=0.8, top_k=1, seed=3)
    drafts = [[2, 0], [], [1, 1, 1], [4]]
    argmaxes = [2, 0, 3,  1,  1, 1, 2, 0,  0, 4]
    params = [top1, GREEDY, top1, GREEDY]
    probs = torch.full((6, 5), 0.2)  # any draft distribution: the result is deterministic
    out = rejection_sample(peaked_rows(argmaxes), drafts, probs,
                           make_batch(params, generators=[seeded(1), None, seeded(2), None]))
    assert out.token_ids == [[2, 0, 3], [1], [1, 1, 2], [0]]
    assert out.num_accepted == [2, 0, 2, 0]
    ngram = rejection_sample(peaked_rows(argmaxes), drafts, None, make_batch(params))
    assert ngram == out


def test_empty_batch_and_all_plain_decode() -> None:
    out = rejection_sample(torch.zeros(0, 5), [], None, make_batch([]))
    assert out == VerifyOutput(token_ids=[], num_accepted=[])
    out = rejection_sample(peaked_rows([3, 1]), [[], []], torch.zeros(0, 5),
                           make_batch([GREEDY, GREEDY]))
    assert out.token_ids == [[3], [1]]


def test_plain_decode_matches_engine_sampler_exactly() -> None:
    """With no drafts the verifier is the ordinary sampler, penalties and seeds included."""
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=1), GREEDY,
              SamplingParams(temperature=1.2, top_k=7, repetition_penalty=1.3, seed=2),
              SamplingParams(temperature=0.0, frequency_penalty=1.5, logprobs=True)]
    outputs = [[1, 2], [3], [4, 4, 5], [6, 6]]
    logits = torch.randn(4, 32, generator=seeded(0))

    def batch(seed: int) -> SamplingBatch:
        gens = [seeded(seed), None, seeded(seed + 1), None]
        return make_batch(params, gens, outputs=outputs)

    for seed in range(5):
        expected = sample(logits, batch(seed))
        out = rejection_sample(logits, [[]] * 4, None, batch(seed))
        assert out.token_ids == [[t] for t in expected.token_ids.tolist()]
        assert expected.logprobs is not None and out.logprobs is not None
        assert [v for (v,) in out.logprobs] == pytest.approx(expected.logprobs.tolist())


def test_logprobs_are_raw_log_softmax_at_every_emitted_token() -> None:
    logits = torch.randn(7, 9, generator=seeded(4))
    drafts = [[1, 2, 3], [5, 6]]
    params = [SamplingParams(temperature=2.0, logprobs=True), GREEDY]
    out = rejection_sample(logits, drafts, None, make_batch(params, default_generator=seeded(0)))
    assert out.logprobs is not None
    log_probs = torch.log_softmax(logits, dim=-1)
    for tokens, values, start in zip(out.token_ids, out.logprobs, [0, 4], strict=True):
        expected = [log_probs[start + j, t].item() for j, t in enumerate(tokens)]
        assert values == pytest.approx(expected)


def test_penalties_and_speculation() -> None:
    assert supports_speculation(SamplingParams(temperature=0.7, top_k=5, min_p=0.1))
    for kwargs in ({"repetition_penalty": 1.1}, {"presence_penalty": 0.5},
                   {"frequency_penalty": -0.5}):
        params = SamplingParams(**kwargs)  # type: ignore[arg-type]
        assert not supports_speculation(params)
        with pytest.raises(ValueError, match="penalties"):
            rejection_sample(torch.zeros(2, 5), [[1]], None, make_batch([params]))


@pytest.mark.parametrize(("logits", "drafts", "probs", "n_params", "match"), [
    (torch.zeros(2, 5), [[1], []], None, 2, "target rows"),
    (torch.zeros(3, 5), [[1], []], torch.zeros(2, 5), 2, "draft_probs"),
    (torch.zeros(2, 5), [[5]], None, 1, "vocabulary"),
    (torch.zeros(2, 5), [[-1]], None, 1, "vocabulary"),
    (torch.zeros(2, 5), [[1]], None, 2, "draft lists"),
])
def test_bad_inputs_are_refused(
    logits: torch.Tensor, drafts: list[list[int]], probs: torch.Tensor | None,
    n_params: int, match: str,
) -> None:
    with pytest.raises(ValueError, match=match):
        rejection_sample(logits, drafts, probs, make_batch([GREEDY] * n_params))


# ---------------------------------------------------------------------------------------
# Reproducibility
# ---------------------------------------------------------------------------------------


def test_seeded_request_reproducible_alone_or_batched() -> None:
    params = SamplingParams(temperature=1.5, seed=11)
    target = torch.randn(4, 50, generator=seeded(5))  # [k + 1, V]
    probs = torch.softmax(torch.randn(3, 50, generator=seeded(6)), dim=-1)  # [k, V]
    drafts = [int(t) for t in torch.multinomial(probs, 1, generator=seeded(7)).squeeze(1)]
    alone = [rejection_sample(target, [drafts], probs, make_batch([params], [seeded(s)]))
             for s in range(20)]
    others = torch.randn(3, 50, generator=seeded(8))
    for s in range(20):
        batched = rejection_sample(
            torch.cat([others[:1], target, others[1:]]), [[], drafts, [7]],
            torch.cat([probs, torch.full((1, 50), 0.02)]),
            make_batch([SamplingParams(), params, GREEDY], [None, seeded(s), None]))
        assert batched.token_ids[1] == alone[s].token_ids[0]
    assert len({tuple(o.token_ids[0]) for o in alone}) > 1  # the seed matters
    again = rejection_sample(target, [drafts], probs, make_batch([params], [seeded(3)]))
    assert again == alone[3]


# ---------------------------------------------------------------------------------------
# Statistics: every emitted token is distributed as the processed target
# ---------------------------------------------------------------------------------------

TARGET = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.5],  # row 0
                       [0.0, 1.5, -1.0, 2.0, 0.5, -0.5],  # row 1
                       [-1.0, 0.0, 1.0, 0.3, 2.5, 0.2]])  # row 2 (bonus for k = 2)
FILTERS = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.3, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2),
}
NUM_TRIALS = 12_000
# How the (deterministic, one-hot) n-gram drafts of the trials are spread over the vocabulary:
# skewed, unlike the target (uniformly spread drafts would hide a wrong residual).
NGRAM_TOKENS = torch.tensor([[0.45, 0.05, 0.05, 0.1, 0.1, 0.25],
                             [0.05, 0.4, 0.05, 0.05, 0.15, 0.3]])


def target_probs(params: SamplingParams) -> torch.Tensor:
    """``[3, V]`` target distributions after temperature and filters."""
    n = TARGET.shape[0]
    filtered = apply_temperature_and_filters(
        TARGET, torch.full((n,), params.temperature), torch.full((n,), params.top_k),
        torch.full((n,), params.top_p), torch.full((n,), params.min_p))
    return torch.softmax(filtered, dim=-1)


def draft_distribution(kind: str, p: torch.Tensor) -> torch.Tensor | None:
    """``[2, V]`` draft distributions for positions 0 and 1, or None for n-gram drafts."""
    if kind == "bad":  # peaked on a token the target finds unlikely (or filters out)
        return torch.tensor([[0.02, 0.02, 0.02, 0.02, 0.02, 0.9],
                             [0.85, 0.03, 0.03, 0.03, 0.03, 0.03]])
    if kind == "good":  # the target, slightly distorted, mass leaking to filtered tokens
        noisy = p[:2] * torch.exp(0.3 * torch.randn(2, 6, generator=seeded(9))) + 0.01
        return noisy / noisy.sum(dim=-1, keepdim=True)
    return None


def check_distribution(tokens: list[int], expected: torch.Tensor, what: str) -> None:
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=expected.numel())
    support = expected > 0
    assert int(counts[~support].sum()) == 0, f"{what}: filtered-out tokens drawn"
    observed = counts[support].double()
    exp = expected[support].double()
    exp = exp / exp.sum() * observed.sum()
    assert chisquare(observed, exp).pvalue > 1e-3, (what, observed.tolist(), exp.tolist())


def run_trials(params: SamplingParams, q: torch.Tensor | None, n: int, seed: int,
               seeded_requests: bool = False) -> VerifyOutput:
    """``n`` requests with k = 2 drafts drawn from ``q`` (from NGRAM_TOKENS for n-gram)."""
    gen = seeded(seed)
    draw_from = q if q is not None else NGRAM_TOKENS
    drafts = torch.multinomial(draw_from, n, replacement=True, generator=gen).T  # [n, 2]
    probs = None if q is None else q.repeat(n, 1)  # [2n, V]
    gens: list[torch.Generator | None] | None = None
    if seeded_requests:
        gens = [seeded(seed * n + i) for i in range(n)]
    batch = make_batch([params] * n, gens, default_generator=gen)
    return rejection_sample(TARGET.repeat(n, 1), drafts.tolist(), probs, batch)


@pytest.mark.parametrize(("filters", "draft"), [
    *((f, d) for f in ("temperature", "top_k", "top_p") for d in ("bad", "good", "ngram")),
    ("min_p", "good"),
])
def test_emitted_tokens_follow_the_target(filters: str, draft: str) -> None:
    params = FILTERS[filters]
    p = target_probs(params)  # [3, V]
    q = draft_distribution(draft, p)
    out = run_trials(params, q, NUM_TRIALS, seed=len(filters) * 10 + len(draft))
    check_distribution([t[0] for t in out.token_ids], p[0], "first token")
    # Position j's token, given drafts 0 .. j-1 were accepted (the bonus for j = 2).
    for j in (1, 2):
        tokens = [t[j] for t, a in zip(out.token_ids, out.num_accepted, strict=True) if a >= j]
        if len(tokens) * p[j][p[j] > 0].min() >= 5:  # chi-square needs >= 5 expected a cell
            check_distribution(tokens, p[j], f"token {j}")
    # Acceptance of the first draft: sum(min(p, q)); sum(r * p) for n-gram tokens x ~ r.
    rate = (torch.minimum(p[0], q[0]).sum() if q is not None
            else (NGRAM_TOKENS[0] * p[0]).sum()).item()
    accepted = sum(a >= 1 for a in out.num_accepted)
    assert binomtest(accepted, NUM_TRIALS, rate).pvalue > 1e-3, (accepted / NUM_TRIALS, rate)


def test_seeded_generators_give_the_target_distribution() -> None:
    params = SamplingParams(temperature=1.1, top_k=4)
    p = target_probs(params)
    out = run_trials(params, draft_distribution("bad", p), 4000, seed=2, seeded_requests=True)
    check_distribution([t[0] for t in out.token_ids], p[0], "first token (seeded)")


def test_empty_residual_falls_back_to_the_target() -> None:
    """q = 2p everywhere (unnormalised): accept with prob 1/2, residual max(0, -p) is empty."""
    params = SamplingParams(temperature=1.0, top_p=0.9)
    p = target_probs(params)  # [3, V]
    n = 8000
    drafts = torch.multinomial(p[:2], n, replacement=True, generator=seeded(6)).T  # [n, 2]
    out = rejection_sample(TARGET.repeat(n, 1), drafts.tolist(), (2 * p[:2]).repeat(n, 1),
                           make_batch([params] * n, default_generator=seeded(7)))
    check_distribution([t[0] for t in out.token_ids], p[0], "first token")
    accepted = sum(a >= 1 for a in out.num_accepted)
    assert binomtest(accepted, n, 0.5).pvalue > 1e-3
