"""kernels.triton_rejection against the torch reference spec.rejection_sampler.

Without a GPU this runs on CPU tensors through the Triton interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported); skipped without triton. On a GPU
machine ``TRITON_INTERPRET=0 pytest tests/kernels/test_triton_rejection.py`` runs the kernel
compiled (the reference then still runs on CPU: the random numbers are drawn on CPU either
way, so the results agree except where a sum taken in another order flips a decision that
sits within one rounding of its threshold, about 1e-7 per decision).

Both verifiers get generators created from the same seeds, so they start from the same
states; they must emit the same tokens and leave the generators in the same states. The
vocabulary tile is shrunk (32, 128) so that rows span several tiles, the last one partial.
"""


import pytest
import torch

pytest.importorskip("triton")

from scipy.stats import chisquare

from quickdraft.engine.sampler import SamplingBatch, apply_temperature_and_filters
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.kernels import triton_rejection as tr
from quickdraft.spec import rejection_sampler as ref

if tr.INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("TRITON_INTERPRET is off and there is no GPU", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0)
Seeds = list[int | None]


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tr, "_BLOCK_V", 32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(params: list[SamplingParams], seeds: Seeds, default_seed: int) -> SamplingBatch:
    """Fresh generators: request i's from ``seeds[i]`` (None: the shared default)."""
    n = len(params)
    return SamplingBatch(params=params,
                         generators=[None if s is None else _gen(s) for s in seeds],
                         prompt_token_ids=[[]] * n, output_token_ids=[[]] * n,
                         default_generator=_gen(default_seed))


def _next_draws(batch: SamplingBatch) -> list[float]:
    """One more uniform from every generator: equal lists mean equal generator states."""
    gens = [g for g in batch.generators if g is not None] + [batch.default_generator]
    return [torch.rand(1, generator=g).item() for g in gens if g is not None]


def _both(
    logits: torch.Tensor, drafts: list[list[int]], probs: torch.Tensor | None,
    params: list[SamplingParams], seeds: Seeds | None = None, default_seed: int = 0,
) -> ref.VerifyOutput:
    """Run the reference (CPU) and the kernel on the same inputs and generator states; check
    that they agree (logprobs to float rounding) and return the reference's output."""
    seeds = seeds if seeds is not None else [None] * len(params)
    want_batch = _batch(params, seeds, default_seed)
    got_batch = _batch(params, seeds, default_seed)
    want = ref.rejection_sample(logits, drafts, probs, want_batch)
    got = tr.rejection_sample(logits.to(DEVICE), drafts,
                              None if probs is None else probs.to(DEVICE), got_batch)
    assert got.token_ids == want.token_ids
    assert got.num_accepted == want.num_accepted
    assert _next_draws(got_batch) == _next_draws(want_batch)
    if want.logprobs is None:
        assert got.logprobs is None
    else:
        assert got.logprobs is not None
        for g, w in zip(got.logprobs, want.logprobs, strict=True):
            assert g == pytest.approx(w, abs=1e-5)
    return want


def _rows_with_argmax(argmaxes: list[int], vocab: int, seed: int) -> torch.Tensor:
    """Random logits ``[len(argmaxes), vocab]`` whose maximum is at the given tokens."""
    logits = torch.randn(len(argmaxes), vocab, generator=_gen(seed))  # [R, V]
    logits[torch.arange(len(argmaxes)), argmaxes] = 5.0
    return logits


def _draft_rows(num_drafts: list[int]) -> torch.Tensor:
    """``[D]`` target row of each draft (request i owns ``num_drafts[i] + 1`` rows)."""
    rows: list[int] = []
    start = 0
    for k in num_drafts:
        rows += range(start, start + k)
        start += k + 1
    return torch.tensor(rows, dtype=torch.long)


# ------------------------------------------------------------------------------------- greedy


def test_greedy_rejected_at_each_position_and_plain_decode() -> None:
    vocab, k = 100, 4
    target = [3, 40, 77, 99, 64]  # argmax of rows 0 .. k (row k: the bonus)
    drafts, argmaxes, expected = [], [], []
    for wrong_at in range(k + 1):  # k: every draft right
        drafts.append([t if j != wrong_at else (t + 1) % vocab
                       for j, t in enumerate(target[:k])])
        argmaxes += target
        expected.append(wrong_at)
    drafts.append([])  # plain decode
    argmaxes.append(31)
    expected.append(0)
    out = _both(_rows_with_argmax(argmaxes, vocab, 1), drafts, None, [GREEDY] * len(drafts))
    assert out.num_accepted == expected
    assert out.token_ids[1] == [3, 40]  # recovered: the argmax of the rejected row
    assert out.token_ids[k] == target  # all accepted + bonus
    assert out.token_ids[-1] == [31]


def test_greedy_ties_pick_the_first_maximum_across_tiles() -> None:
    vocab = 100  # tiles of 32: [0, 32), [32, 64), [64, 96), [96, 100)
    logits = torch.randn(8, vocab, generator=_gen(2))
    logits[0, [40, 70, 99]] = 9.0  # tie across tiles: 40 (draft 40 accepted)
    logits[1, [33, 34]] = 9.0  # tie inside a tile: 33 (draft 33 accepted)
    logits[2, [97, 98]] = 9.0  # tie in the last, partial tile: 97 (draft 98 rejected)
    logits[4] = 0.0  # all equal: 0
    logits[5, [5, 96]] = 9.0  # draft 96 rejected, recovered 5
    logits[7, 1] = 9.0
    drafts = [[40, 33, 98], [], [96], []]
    out = _both(logits, drafts, None, [GREEDY] * 4)
    assert out.token_ids == [[40, 33, 97], [0], [5], [1]]
    assert out.num_accepted == [2, 0, 0, 0]


def test_empty_batch() -> None:
    out = _both(torch.zeros(0, 50), [], None, [])
    assert out.token_ids == [] and out.num_accepted == []


# ------------------------------------------------------------------------------------ sampled

FILTERED = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=7),
            SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.6, min_p=0.05),
            SamplingParams(temperature=1.1, top_k=20, top_p=0.9)]


def _sampled_case(seed: int, vocab: int, num_drafts: list[int], mostly_right: bool,
                  ) -> tuple[torch.Tensor, list[list[int]], torch.Tensor]:
    """Target logits ``[R, V]``, drafts, and their distributions ``[D, V]``: q is a distorted
    softmax of the draft's target row; drafts are drawn from q, or are the target's argmax
    when ``mostly_right`` (for long accepted runs)."""
    g = _gen(seed)
    logits = 2.0 * torch.randn(sum(num_drafts) + len(num_drafts), vocab, generator=g)  # [R, V]
    rows = _draft_rows(num_drafts)  # [D]
    q = torch.softmax(logits[rows] + torch.randn(len(rows), vocab, generator=g), dim=-1)
    if mostly_right or not len(rows):
        tokens = logits[rows].argmax(dim=-1).tolist()
    else:
        tokens = torch.multinomial(q, 1, generator=g).squeeze(1).tolist()
    drafts: list[list[int]] = []
    i = 0
    for k in num_drafts:
        drafts.append(tokens[i:i + k])
        i += k
    return logits, drafts, q


@pytest.mark.parametrize("mostly_right", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_sampled_with_draft_probs(seed: int, mostly_right: bool) -> None:
    num_drafts = [3, 0, 1, 4, 2]
    logits, drafts, q = _sampled_case(seed, 70, num_drafts, mostly_right)
    params = [FILTERED[(seed + i) % len(FILTERED)] for i in range(len(num_drafts))]
    _both(logits, drafts, q, params, seeds=[None, 10 + seed, None, 20 + seed, None],
          default_seed=seed)


@pytest.mark.parametrize("seed", range(4))
def test_sampled_ngram_drafts(seed: int) -> None:
    num_drafts = [2, 4, 0, 3]
    logits, drafts, _ = _sampled_case(seed + 100, 90, num_drafts, mostly_right=seed % 2 == 0)
    params = [FILTERED[(seed + i) % len(FILTERED)] for i in range(len(num_drafts))]
    _both(logits, drafts, None, params, seeds=[5, None, None, 6], default_seed=seed)


@pytest.mark.parametrize("with_probs", [True, False])
def test_mixed_greedy_and_sampled_seeded_and_not(with_probs: bool) -> None:
    num_drafts = [2, 3, 0, 1, 3, 0]
    logits, drafts, q = _sampled_case(7, 64, num_drafts, mostly_right=True)
    params = [GREEDY, FILTERED[0], GREEDY, FILTERED[1], FILTERED[2], FILTERED[3]]
    for seed in range(3):
        _both(logits, drafts, q if with_probs else None, params,
              seeds=[None, 30 + seed, None, None, 40 + seed, None], default_seed=seed)


def test_all_seeded_and_all_unseeded() -> None:
    num_drafts = [1, 2, 3]
    logits, drafts, q = _sampled_case(8, 50, num_drafts, mostly_right=False)
    params = [FILTERED[4]] * 3
    _both(logits, drafts, q, params, seeds=[1, 2, 3])
    _both(logits, drafts, q, params, seeds=[None] * 3, default_seed=4)


def test_vocab_1000_several_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tr, "_BLOCK_V", 128)  # 7 full tiles and one of 104
    num_drafts = [3, 2]
    logits, drafts, q = _sampled_case(9, 1000, num_drafts, mostly_right=True)
    _both(logits, drafts, q, [FILTERED[2], GREEDY], seeds=[3, None])
    _both(logits, drafts, None, [FILTERED[0], FILTERED[1]], seeds=[None, 4], default_seed=1)


def test_draft_filtered_out_by_the_target_is_always_rejected() -> None:
    """top-k = 3 around a peaked row: a draft outside the top 3 has p(x) = 0, whatever q."""
    vocab = 80
    logits = torch.randn(3, vocab, generator=_gen(11))
    logits[0, [5, 50, 70]] = torch.tensor([6.0, 5.5, 5.0])
    q = torch.zeros(2, vocab)
    q[:, 20] = 1.0  # the draft model was sure
    params = [SamplingParams(temperature=1.0, top_k=3)]
    q_zero = torch.zeros(2, vocab)
    q_zero[:, 5] = 1.0  # q(x) = 0 too: u * 0 < 0 is false, still rejected
    for seed in range(8):
        out = _both(logits, [[20, 20]], q, params, seeds=[seed])
        assert out.num_accepted == [0] and out.token_ids[0][0] in (5, 50, 70)
        out = _both(logits, [[20, 20]], q_zero, params, seeds=[seed])
        assert out.num_accepted == [0] and out.token_ids[0][0] in (50, 70)  # residual
        out = _both(logits, [[20, 20]], None, params, default_seed=seed)
        assert out.num_accepted == [0] and out.token_ids[0][0] in (5, 50, 70)


def _processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    n = logits.shape[0]
    filtered = apply_temperature_and_filters(
        logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k),
        torch.full((n,), params.top_p), torch.full((n,), params.min_p))
    return torch.softmax(filtered, dim=-1)  # [R, V]


def test_q_equal_to_p_is_always_accepted() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95)
    logits = torch.randn(4, 60, generator=_gen(12))
    p = _processed_probs(logits, params)
    drafts = torch.multinomial(p[:3], 1, generator=_gen(13)).squeeze(1).tolist()
    for seed in range(4):
        out = _both(logits, [drafts], p[:3], [params], seeds=[seed])
        assert out.num_accepted == [3]


def test_empty_residual_falls_back_to_the_target() -> None:
    """q = 2p (not normalised): the residual max(0, p - q) is all zeros at every rejection."""
    params = SamplingParams(temperature=1.0, top_k=10)
    logits = torch.randn(3, 60, generator=_gen(14))
    p = _processed_probs(logits, params)
    drafts = torch.multinomial(p[:2], 1, generator=_gen(15)).squeeze(1).tolist()
    rejected = 0
    for seed in range(12):
        out = _both(logits, [drafts], 2 * p[:2], [params], default_seed=seed)
        rejected += out.num_accepted[0] < 2
    assert rejected >= 3  # the fallback ran


def test_logprobs_and_half_precision_inputs() -> None:
    num_drafts = [2, 0, 3]
    logits, drafts, q = _sampled_case(16, 70, num_drafts, mostly_right=True)
    params = [SamplingParams(temperature=0.9, logprobs=True), GREEDY,
              SamplingParams(temperature=0.0, logprobs=True)]
    out = _both(logits, drafts, q, params, seeds=[1, None, None])
    assert out.logprobs is not None and len(out.logprobs[0]) == out.num_accepted[0] + 1
    # bf16 target logits, fp16 draft probs, a strided logits view
    wide = torch.randn(logits.shape[0], 2 * 70, generator=_gen(17))
    wide[:, ::2] = logits
    _both(wide[:, ::2], drafts, q.half(), params, seeds=[2, None, None])
    _both(logits.bfloat16(), drafts, q.half(), params, seeds=[3, None, None])


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="target rows"):
        tr.rejection_sample(torch.zeros(2, 5, device=DEVICE), [[1], []], None,
                            _batch([GREEDY] * 2, [None, None], 0))
    with pytest.raises(ValueError, match="penalties"):
        tr.rejection_sample(torch.zeros(2, 5, device=DEVICE), [[1]], None,
                            _batch([SamplingParams(presence_penalty=0.5)], [None], 0))


# --------------------------------------------------------------------------------- statistics


def test_emitted_first_token_follows_the_target() -> None:
    """With a draft model that likes the target's favourite far too much, the rejected path
    must avoid that token (residual), and the emitted token is still distributed as p."""
    n = 400
    params = SamplingParams(temperature=1.0)
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.5], [0.0, 1.5, -1.0, 2.0, 0.5, -0.5]])
    p = torch.softmax(row[0], dim=-1)  # [V]
    q = torch.tensor([0.85, 0.03, 0.03, 0.03, 0.03, 0.03])  # [V]
    gen = _gen(18)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).unsqueeze(1).tolist()
    batch = SamplingBatch([params] * n, [None] * n, [[]] * n, [[]] * n, gen)
    out = tr.rejection_sample(row.repeat(n, 1).to(DEVICE), drafts,
                              q.repeat(n, 1).to(DEVICE), batch)
    first = torch.tensor([t[0] for t in out.token_ids])
    counts = torch.bincount(first, minlength=6).double()
    expected = p.double() / p.double().sum() * n
    assert chisquare(counts, expected).pvalue > 1e-3, (counts.tolist(), expected.tolist())
    # after a rejection the favourite is never emitted (its residual is 0: q > p there)
    assert all(t[0] != 0 for t, a in zip(out.token_ids, out.num_accepted, strict=True) if a == 0)
