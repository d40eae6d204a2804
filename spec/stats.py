"""The speculator's global counters (what the metrics endpoint and benchmarks read)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_DEPTH = 16  # deepest draft: a chain of the most drafts a request may take


@dataclass
class SpeculationStats:
    """Global counters (for the metrics endpoint)."""

    num_steps: int = 0  # verification steps (request-steps with >= 1 draft)
    num_drafted: int = 0
    num_accepted: int = 0
    # by depth in the draft (a chain's position): verifications that reached a draft at
    # that depth, and those that accepted one there
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    drafted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    proposer_seconds: float = 0.0  # wall time spent choosing drafts (all proposers)
    model_draft_seconds: float = 0.0  # of which the draft model's or head's forwards
    num_tree_steps: int = 0  # verifications of a tree (not a chain)
    num_tree_nodes: int = 0  # their drafts (tree size = num_tree_nodes / num_tree_steps)
    # per source (ngram / suffix / recycling / draft; combined counts its best source):
    # [verification steps, drafted, accepted]
    by_source: dict[str, list[int]] = field(default_factory=dict)
    num_skipped_lookups: int = 0  # proposals not made by the lookup back-off (spec.state)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the one sampled token)."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else 0.0


    def add(self, source: str, depth: int, num_drafted: int, num_accepted: int) -> None:
        """One verification of ``num_drafted`` drafts from ``source``, ``depth`` deep (a
        chain's length, a tree's deepest path), ``num_accepted`` of them accepted."""
        self.num_steps += 1
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        for pos in range(min(depth, MAX_DEPTH)):
            self.drafted_per_position[pos] += 1
            if pos < num_accepted:
                self.accepted_per_position[pos] += 1
        if num_drafted > depth:  # a tree
            self.num_tree_steps += 1
            self.num_tree_nodes += num_drafted
        counts = self.by_source.setdefault(source, [0, 0, 0])
        counts[0] += 1
        counts[1] += num_drafted
        counts[2] += num_accepted
