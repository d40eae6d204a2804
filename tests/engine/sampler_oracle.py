"""Plain-loop references for engine.sampler's maths (penalties, temperature and the
filters, the resulting probabilities) and the small builders its tests share."""

from __future__ import annotations

import math

import torch

from quickdraft.engine.sampler import SamplingBatch
from quickdraft.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def make_batch(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    default_generator: torch.Generator | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params,
        generators=generators if generators is not None else [None] * n,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        default_generator=default_generator,
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------
# Reference computations (plain loops)
# ---------------------------------------------------------------------------------------


def reference_penalties(
    row: list[float], p: SamplingParams, prompt: list[int], output: list[int],
) -> list[float]:
    out = list(row)
    seen = set(prompt) | set(output)
    for tok in range(len(out)):
        if p.repetition_penalty != 1.0 and tok in seen:
            v = out[tok]
            out[tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        count = output.count(tok)
        out[tok] -= p.frequency_penalty * count + (p.presence_penalty if count > 0 else 0.0)
    return out


def reference_filter(row: list[float], t: float, k: int, p: float, min_p: float) -> list[float]:
    """Temperature, then top-k, then top-p over the renormalised survivors, then min-p."""
    x = [v / t for v in row]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = order[:k] if 0 < k < len(x) else order
    if p < 1.0:
        z = sum(math.exp(x[i]) for i in keep)
        chosen, mass = [], 0.0
        for i in keep:
            if mass >= p:
                break
            chosen.append(i)
            mass += math.exp(x[i]) / z
        keep = chosen
    top = max(x)
    # prob_i / prob_max = exp(x_i - x_max) computed on the unfiltered distribution
    kept = {i for i in keep if math.exp(x[i] - top) >= min_p}
    return [x[i] if i in kept else NEG_INF for i in range(len(x))]


def reference_probs(row: list[float], t: float, k: int, p: float, min_p: float) -> list[float]:
    x = reference_filter(row, t, k, p, min_p)
    m = max(x)
    e = [math.exp(v - m) if v != NEG_INF else 0.0 for v in x]
    return [v / sum(e) for v in e]
