"""Token recycling: the adjacency table's update and chain drafting against a plain-Python
oracle; rows reach their own tenant's table only; inside the engine, greedy output with
recycling drafts equals output without
speculation, in a staggered batch with preemptions and the prefix cache on, and no KV block
leaks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.llm_engine import LLMEngine
from quickdraft.engine.request import Request
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.engine.step_plan import StepPlan
from quickdraft.spec.recycling import (
    UNSEEN,
    RecyclingConfig,
    RecyclingProposer,
    draft_chain,
    new_table,
    scored_rows,
    top_successors,
    update_table,
)
from tests.spec.test_spec_engine import GREEDY, PROMPTS, run_staggered

# ---------------------------------------------------------------------- oracle


def update_reference(table: dict[int, list[int]], tokens: list[int],
                     successors: list[list[int]]) -> None:
    """Rows in order: each overwrites its input token's successors (the last one wins)."""
    for token, succ in zip(tokens, successors, strict=True):
        table[token] = list(succ)


def chain_reference(table: dict[int, list[int]], start: int, k: int, stop_on_cycle: bool
                    ) -> list[int]:
    out: list[int] = []
    prev, cur = None, start
    while len(out) < k:
        nxt = table.get(cur, [UNSEEN])[0]
        if nxt == UNSEEN or (stop_on_cycle and nxt == prev and nxt != cur):
            break
        out.append(nxt)
        prev, cur = cur, nxt
    return out


def as_dict(table: np.ndarray) -> dict[int, list[int]]:
    return {t: row.tolist() for t, row in enumerate(table) if row[0] != UNSEEN}


@pytest.mark.parametrize("seed", range(5))
def test_update_and_chains_match_the_oracle(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab, width = 12, 3  # a small vocabulary: repeated tokens within a step, cycles
    table = new_table(vocab, width)
    ref: dict[int, list[int]] = {}
    for _ in range(20):
        rows = int(rng.integers(0, 9))
        tokens = rng.integers(0, vocab, size=rows)
        successors = rng.integers(0, vocab, size=(rows, width)).astype(np.int32)
        update_table(table, tokens, successors)
        update_reference(ref, tokens.tolist(), successors.tolist())
        assert as_dict(table) == ref
        for start in range(vocab):
            for k in (0, 1, 4, 7):
                for stop in (True, False):
                    assert draft_chain(table, start, k, stop) == \
                        chain_reference(ref, start, k, stop), (start, k, stop)


def test_chain_stops_at_unseen_tokens_and_2_cycles_but_follows_self_loops() -> None:
    table = new_table(10, 2)
    update_table(table, np.array([1, 2, 3, 5]), np.array([[2, 0], [3, 0], [2, 0], [5, 0]]))
    assert draft_chain(table, 1, 8) == [2, 3]  # 3 -> 2 would close 2 -> 3 -> 2
    assert draft_chain(table, 1, 8, stop_on_cycle=False) == [2, 3, 2, 3, 2, 3, 2, 3]
    assert draft_chain(table, 5, 3) == [5, 5, 5]  # a repetition run is drafted
    assert draft_chain(table, 4, 3) == []  # never an input row


def test_top_successors_are_ranked_and_padded() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    want = torch.argsort(logits, dim=1, descending=True)[:, :5].numpy()
    assert (top_successors(logits, 5) == want).all()
    narrow = top_successors(logits[:, :3], 5)  # a vocabulary narrower than the table
    assert (narrow[:, :3] == torch.argsort(logits[:, :3], 1, descending=True).numpy()).all()
    assert (narrow[:, 3:] == UNSEEN).all() and narrow.dtype == np.int32


def _plan() -> StepPlan:
    # seq 0: a prefill chunk (not sampled); seq 1: a verification (1 + 2 drafts); seq 2: decode
    return StepPlan(input_ids=[10, 11, 12, 20, 21, 22, 30], positions=[0, 1, 2, 5, 6, 7, 3],
                    query_start_loc=[0, 3, 6, 7], seq_lens=[3, 8, 4],
                    block_tables=[[0], [1, 2], [3]], logits_indices=[3, 4, 5, 6],
                    sample_requests=[1, 2])


def test_scored_rows_name_each_logits_rows_sequence_and_input_token() -> None:
    seqs, tokens = scored_rows(_plan())
    assert seqs.tolist() == [1, 1, 1, 2] and tokens.tolist() == [20, 21, 22, 30]


def _request(rid: str, tokens: list[int], salt: str | None,
             params: SamplingParams = GREEDY) -> Request:
    return Request(rid, tokens, params, frozenset(), cache_salt=salt)


def test_rows_feed_only_their_tenants_table() -> None:
    proposer = RecyclingProposer(vocab_size=40, config=RecyclingConfig(width=2))
    logits = torch.full((4, 40), -1.0)
    for row, (best, second) in enumerate([(21, 0), (22, 1), (23, 2), (31, 3)]):
        logits[row, best], logits[row, second] = 2.0, 1.0
    proposer.observe_step(logits, _plan(), tenants=["p", "a", "b"], wanted=[True, True, True])
    assert proposer.tenants() == ["a", "b"]  # seq 0 scored no row
    assert proposer.propose(_request("x", [5, 20], "a"), 4) == [21, 22, 23]
    assert proposer.propose(_request("y", [5, 20], "b"), 4) == []  # b saw only token 30
    assert proposer.propose(_request("z", [5, 30], "b"), 4) == [31]
    assert proposer.propose(_request("w", [5, 30], None), 4) == []  # no table for None
    proposer.observe_step(logits, _plan(), tenants=["p", "c", "c"], wanted=[True, False, True])
    assert proposer.propose(_request("v", [5, 20], "c"), 4) == []  # seq 1 not wanted
    assert proposer.propose(_request("u", [5, 30], "c"), 4) == [31]


def test_tables_are_bounded_lru_and_seeded_sampled_requests_get_none() -> None:
    proposer = RecyclingProposer(vocab_size=8, config=RecyclingConfig(width=2, max_tenants=2))
    for salt in ("a", "b", "a", "c"):  # "b" is the least recently used when "c" arrives
        proposer.observe(salt, np.array([1]), np.array([[2, 3]]))
    assert proposer.tenants() == ["a", "c"]
    seeded = SamplingParams(max_tokens=8, temperature=0.8, seed=1)
    assert proposer.propose(_request("s", [1], "a", seeded), 3) == []
    unseeded = SamplingParams(max_tokens=8, temperature=0.8)
    assert proposer.propose(_request("u", [1], "a", unseeded), 3) == [2]


# ---------------------------------------------------------------------- engine


def make_engine(model_dir, speculation: str, num_kv_blocks: int = 256) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype="float32", speculation=speculation,
                          measure_step_cost=False, num_kv_blocks=num_kv_blocks, block_size=4,
                          enable_prefix_caching=True)
    return LLMEngine(config, progress=False)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return make_engine(tiny_model_dir, "off")


def _count_recycled(engine: LLMEngine) -> list[int]:
    """Wrap the recycling proposer: the returned list counts its non-empty proposals."""
    recycling = engine.speculator.recycling
    assert recycling is not None
    count = [0]
    propose = recycling.propose_tree

    def counting(request: Request, max_nodes: int) -> tuple[list[int], list[int], list[int]]:
        drafts = propose(request, max_nodes)
        count[0] += bool(drafts[0])
        return drafts

    recycling.propose_tree = counting  # type: ignore[method-assign]
    return count


def test_greedy_batch1_equal_with_recycling(plain, tiny_model_dir):
    spec = make_engine(tiny_model_dir, "recycling")
    accepted = 0
    for prompt in PROMPTS:
        want = plain.generate([prompt], GREEDY)[0].token_ids
        free = spec.kv.num_free_blocks
        got = spec.generate([prompt], GREEDY)[0]
        assert got.token_ids == want
        assert spec.kv.num_free_blocks == free
        accepted += got.usage.num_accepted_tokens
    assert accepted > 0


def test_greedy_staggered_batch_with_preemption_equal(plain, tiny_model_dir):
    want, _ = run_staggered(plain, PROMPTS, GREEDY)
    spec = make_engine(tiny_model_dir, "recycling", num_kv_blocks=48)  # too small for all 8
    recycled = _count_recycled(spec)
    free = spec.kv.num_free_blocks
    got, usage = run_staggered(spec, PROMPTS, GREEDY)
    assert got == want
    assert spec.scheduler.num_preemptions > 0
    assert spec.kv.num_free_blocks == free
    assert recycled[0] > 0
    drafted = sum(u.num_drafted_tokens for u in usage.values())
    accepted = sum(u.num_accepted_tokens for u in usage.values())
    assert 0 < accepted <= drafted
    assert not spec.scheduler.requests  # per-request state (request.spec_state) went with them
    # a second run drafts from tables warmed by the first (one tenant): still lossless
    assert run_staggered(spec, PROMPTS, GREEDY)[0] == want


def test_seeded_sampling_with_recycling_is_reproducible(tiny_model_dir):
    spec = make_engine(tiny_model_dir, "recycling")
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
    a = spec.generate([PROMPTS[0]], params)[0].token_ids
    b = spec.generate([PROMPTS[1], PROMPTS[0]], params)[1].token_ids
    assert a == b
