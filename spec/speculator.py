"""Engine-side speculation: choose drafts for the next step and keep acceptance statistics.

After each step the engine calls :meth:`Speculator.propose` with the running requests. For
every request in its decode phase (all but the newest token computed) whose settings allow
speculation, the proposer drafts up to ``max_k`` tokens, the adaptive policy decides how many
of them are worth verifying, and they are stored in ``request.spec_token_ids``; the scheduler
then schedules them with the request's next token and the runner verifies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request
from spec.ngram import NgramProposer
from spec.params import SpeculationParams
from spec.policy import AcceptanceTracker, SpeculationPolicy
from spec.rejection_sampler import supports_speculation


@dataclass
class SpeculationStats:
    """Global counters (for the metrics endpoint)."""

    num_steps: int = 0  # verification steps (request-steps with >= 1 draft)
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [max_k]
    drafted_per_position: list[int] = field(default_factory=list)  # [max_k]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the one sampled token)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0


class Speculator:
    def __init__(self, method: str, max_k: int, ngram_min: int, ngram_max: int,
                 policy: SpeculationPolicy) -> None:
        self.method = method
        self.max_k = max_k
        self.proposer = NgramProposer(min_n=ngram_min, max_n=ngram_max, k=max_k)
        self.policy = policy
        self._trackers: dict[str, AcceptanceTracker] = {}
        self.stats = SpeculationStats(accepted_per_position=[0] * max_k,
                                      drafted_per_position=[0] * max_k)

    def _wants(self, request: Request) -> int:
        """Most drafts this request may take (0 = no speculation for it)."""
        params: SpeculationParams | None = request.spec_params
        method = (params.method if params and params.method else self.method)
        if method == "off" or not supports_speculation(request.sampling_params):
            return 0
        if request.num_computed_tokens != request.num_tokens - 1:
            return 0  # still prefilling, or just preempted
        k = params.k if params and params.k is not None else self.max_k
        return min(k, self.max_k)

    def propose(self, running: list[Request], num_plain_tokens: int) -> None:
        """Fill ``spec_token_ids`` of the running requests for the next step."""
        candidates: list[tuple[Request, list[int], AcceptanceTracker]] = []
        for request in running:
            request.spec_token_ids = []
            k = self._wants(request)
            if k == 0:
                continue
            drafts = self.proposer.propose(_context(request, self.proposer.max_context))[:k]
            if drafts:
                tracker = self._trackers.setdefault(request.request_id, AcceptanceTracker())
                candidates.append((request, drafts, tracker))
        if not candidates:
            return
        alphas = [t.alpha for _, _, t in candidates]
        ks = self.policy.allocate(alphas, [len(d) for _, d, _ in candidates], num_plain_tokens)
        for (request, drafts, tracker), k in zip(candidates, ks, strict=True):
            tracker.steps_since_probe += 1
            if k == 0 and tracker.steps_since_probe >= self.policy.probe_interval:
                k = 1  # re-test a request whose acceptance had collapsed
            if k:
                tracker.steps_since_probe = 0
            request.spec_token_ids = drafts[:k]

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Account one verification of ``num_drafted`` drafts for ``request``."""
        if num_drafted == 0:
            return
        tracker = self._trackers.get(request.request_id)
        if tracker is not None:
            tracker.update(num_drafted, num_accepted)
        request.num_spec_steps += 1
        request.num_drafted_tokens += num_drafted
        request.num_accepted_tokens += num_accepted
        s = self.stats
        s.num_steps += 1
        s.num_drafted += num_drafted
        s.num_accepted += num_accepted
        for pos in range(num_drafted):
            s.drafted_per_position[pos] += 1
            if pos < num_accepted:
                s.accepted_per_position[pos] += 1

    def forget(self, request_id: str) -> None:
        self._trackers.pop(request_id, None)


def _context(request: Request, limit: int) -> list[int]:
    """The last ``limit`` tokens of prompt + output (earlier chat turns are in the prompt)."""
    out = request.output_token_ids
    if len(out) >= limit:
        return out[-limit:]
    return request.prompt_token_ids[-(limit - len(out)):] + out
