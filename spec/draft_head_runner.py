"""The draft head at serving time: its paged K/V and tree drafting, batched over requests.

Like the draft model (:mod:`spec.draft_model`) the head keeps its own K/V (one layer) in the
target's block tables: head position ``t`` (the pair ``g_t``, ``x_{t+1}``) lives in the slot
of position ``t``. ``head_valid = d``: head K/V is valid for positions ``[0, d)``; invariant
``d <= num_computed_tokens`` (only verified positions, whose target features exist), so a
rejected draft never leaves anything the head trusts. After a preemption ``d`` restarts at 0.

One :meth:`DraftHeadRunner.propose` call, for a request with ``n`` tokens (the last one
pending, target features known for positions ``< n - 1``):

1. catch-up (one batched forward over all requests): feed the pairs
   ``(fc(features[p]), x_{p+1})`` for ``p`` in ``[d, n - 1)``; the last row's output ``o``
   gives the distribution of the first draft. Now ``d = n - 1``. (Natively only that row
   goes on past the attention: the others' outputs are never read, only their K/V; the
   torch path still computes them.)
2. rounds: a best-first search over tree nodes scored by the product of the head's
   probabilities along their path, ``rounds = min(ROUNDS, max_depth - 1)`` of them (a
   tree no deeper than the drafts the policy granted). Each round takes the best
   ``k // (rounds + 1)`` candidates into the tree and feeds them (with their parent's
   ``o`` and their token, rotated at ``base`` + depth, ``base = n - 2`` the root pair's
   position) to learn their children. Node ``i``'s K/V go to the head's own cache in the
   slot of flat position ``base + 1 + i`` (the pending token's slot and the drafts'
   reserved ones, as in the target's tree verification); those positions are ``>= d``, so
   nothing there is trusted and the next catch-up overwrites them. A round is one paged
   tree-attention call: every node fed so far is a tree row over the request's cached
   positions ``[0, base]``, with its path as its ancestor mask. Only the new nodes are
   computed: earlier rounds' rows get a zero query and write nothing (their K/V are
   cached). On q4q8 weights (bf16 on the CPU) the whole forward is one native call
   (:func:`kernels.cpu_layer.run_head_stack` with the new nodes' ``rows``: fc on a
   catch-up's features, the embedding and RoPE rows, the layer, the LM head's fp32
   logits), the same bits as the torch calls around the layer, each slow after a target
   step has left the dispatcher's code and data cold (on the 2-core AMX Xeon, proposals
   of 1 / 4 / 8 nodes right after a target step took 0.73x / 0.80x / 0.78x the time of the
   layer alone native). (The layer used to recompute every fed node there, rewriting
   earlier rounds' K/V with the same values, in rounds of at most 8 rows: on the 2-core
   AVX2-only Zen 3 a head layer costs ~50 us a row more, and proposals of 4 and 8 nodes
   took 0.91x and 0.90x the time without it.)
3. fill: the best remaining candidates complete the tree to ``k`` nodes (leaves).

The search itself (candidates, rounds, the tree) is :class:`spec.head_search.HeadSearch`.

Greedy requests get a tree; sampled requests a chain drawn from the head's own ``q`` (the
request's temperature and filters over the draft vocabulary, zero elsewhere), which the
rejection sampler verifies against the target exactly.
"""

from __future__ import annotations

import time

import torch

from quickdraft.engine.backend import KernelBackend, synchronize
from quickdraft.engine.kv_cache import kv_bytes_per_block
from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.sampler import apply_temperature_and_filters, sample_from_probs
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.engine.step_plan import CHECK_INVARIANTS, StepPlan
from quickdraft.kernels import cpu_fused, cpu_layer
from quickdraft.kernels.attention_metadata import AttentionMetadata, pack_step
from quickdraft.spec.draft_head import DraftHead
from quickdraft.spec.draft_head_linears import (
    native_forward_weights,
    native_layer_weights,
    put_on_target_kernels,
)
from quickdraft.spec.head_search import CHILDREN, HeadInput, HeadOutput, HeadSearch
from quickdraft.spec.token_tree import TokenTree

__all__ = ["DraftHeadRunner", "HeadInput", "HeadOutput"]


class DraftHeadRunner:
    """Owns the head (in the target's dtype) and its K/V; reads block tables only."""

    def __init__(self, head: DraftHead, target: LlamaForCausalLM, block_size: int,
                 backend: KernelBackend, default_generator: torch.Generator) -> None:
        device = target.embed_tokens.device
        self.head = head.to(device=device, dtype=target.dtype).eval()
        self.embed = target.embed_tokens
        self.rotary = target.rotary
        self.block_size = block_size
        self.backend = backend
        self.attention = backend.attention
        self.default_generator = default_generator
        self.vocab_size = head.config.target_vocab_size
        self.draft_to_target = head.draft_to_target.to(device)
        self.draft_ids: list[int] = head.draft_to_target.tolist()  # draft id -> target id
        self.kv_cache = torch.zeros(0)
        c = head.config
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim ** -0.5
        self.kernel = put_on_target_kernels(self.head, target)
        # the target's small ops (fused CPU kernels where it uses them): a head forward is
        # ~40 small ops, so their per-call cost is most of a proposal's
        self.head.rms_norm = target.ops.rms_norm
        self.head.silu_mul = target.ops.silu_mul
        self.rope = target.ops.rope
        # the layer in one native call (kernels.cpu_layer.head_layer) where the target runs
        # its own layers natively on q4q8 weights; None: the Python layer
        self.native = native_layer_weights(self.head, self.kernel, target)
        # ... and the whole forward (fc, the gathers, the layer, the LM head) in one call
        # where fc and the LM head have q4q8 copies too: kernels.cpu_layer.head_stack, its
        # weights bound once, each step's metadata and indices as plain lists
        self.native_forward = native_forward_weights(self.head, self.native)
        self.native_stack = None if self.native_forward is None else cpu_layer.head_stack(
            self.native_forward, self.embed, (self.rotary.cos, self.rotary.sin), self.heads,
            self.kv_heads, c.rms_norm_eps, self.scale)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.config.aux_layers

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.block_size, 1, self.kv_heads, self.head_dim,
                                  self.head.lm_head.weight.dtype.itemsize)

    def allocate(self, num_blocks: int) -> None:
        self.kv_cache = torch.zeros(2, num_blocks, self.block_size, self.kv_heads,
                                    self.head_dim, dtype=self.head.lm_head.weight.dtype,
                                    device=self.embed.device)

    # ------------------------------------------------------------------ forward

    def _qkv(self, hidden: torch.Tensor, token_ids: list[int], positions: list[int],
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's rotated ``q [R, H, D]``, ``k``, ``v [R, KVH, D]`` for rows of ``hidden
        [R, h]`` (fused features or parent outputs) with their tokens and positions."""
        device = self.embed.device
        head = self.head
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        emb = torch.nn.functional.embedding(ids, self.embed)  # [R, h]
        qkv = head.qkv(head.layer_input(hidden, emb))  # [R, q + 2kv]
        q, k, v = qkv.split([head.q_size, head.kv_size, head.kv_size], dim=-1)
        cos, sin = self.rotary.cos_sin(torch.tensor(positions, device=device))
        q = self.rope(q.reshape(-1, self.heads, self.head_dim), cos, sin)
        k = self.rope(k.reshape(-1, self.kv_heads, self.head_dim), cos, sin)
        return q, k, v.reshape(-1, self.kv_heads, self.head_dim)

    def _native_layer(self, hidden: torch.Tensor, token_ids: list[int], positions: list[int],
                      meta: AttentionMetadata, rows: torch.Tensor | None = None,
                      ) -> torch.Tensor | None:
        """The layer in one native call over the rows of ``meta``'s step (``rows``: only
        those, their K/V written at their slots): ``hidden [r, h]`` with their tokens and
        RoPE positions -> ``o [r, h]``; None where it does not run."""
        if self.native is None:
            return None
        device = self.embed.device
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        emb = self.embed.index_select(0, ids)  # [r, h]
        cos_sin = self.rotary.cos_sin(torch.tensor(positions, device=device))
        return cpu_layer.head_layer(emb, hidden.contiguous(), self.native, cos_sin,
                                    self.kv_cache, meta, self.heads, self.kv_heads,
                                    self.head.config.rms_norm_eps, self.scale, rows)

    def _whole_forward(self, hidden: torch.Tensor, token_ids: list[int], positions: list[int],
                       plan: StepPlan, rows: list[int] | None = None,
                       logit_rows: list[int] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The forward in one native call (:func:`kernels.cpu_layer.run_head_stack`) over
        ``plan``'s step (``rows``: only those, as :meth:`_round_native`'s): ``hidden`` (the
        target's features ``[R, 3h]``, or parent outputs ``[r, h]``) -> the outputs ``o`` of
        the rows ``logit_rows`` (None: all; the other rows only write their K/V) and their
        fp32 logits, the bits of :meth:`_forward` (or :meth:`_round_native`) then
        :meth:`_logits`; None where it does not run. The step's metadata goes as its packed
        values (no tensors: right after a target step each tensor made here costs tens of
        microseconds)."""
        if self.native_stack is None:
            return None
        if CHECK_INVARIANTS:
            plan.check_invariants(self.block_size)
        layout, packed = pack_step(plan.query_start_loc, plan.seq_lens, plan.block_tables,
                                   self.block_size)
        return cpu_layer.run_head_stack(self.native_stack, token_ids, positions,
                                        hidden.contiguous(), self.kv_cache, layout, packed,
                                        plan.tree_mask, rows, logit_rows)

    def _forward(self, hidden: torch.Tensor, token_ids: list[int], plan: StepPlan,
                 meta: AttentionMetadata) -> torch.Tensor:
        """One head layer over a flat batch of verified pairs (``plan``'s, with its
        ``meta``), writing their K/V into the paged cache: ``hidden [R, h]`` -> outputs
        ``o [R, h]``."""
        out = self._native_layer(hidden, token_ids, plan.positions, meta)
        if out is not None:
            return out
        q, k, v = self._qkv(hidden, token_ids, plan.positions)
        self.attention.write_kv(k, v, self.kv_cache, meta.slot_mapping)
        attn = self.attention.paged_attention(q, self.kv_cache, meta, self.scale)  # [R, H, D]
        return self.head.finish_layer(attn.reshape(-1, self.head.q_size), hidden)

    def _round_plan(self, active: list[HeadSearch]) -> StepPlan:
        """One drafting round's tree step: for each search, every node fed so far (nodes
        ``[0, num_fed)``, in this round or an earlier one: fed nodes are a prefix of the
        tree's nodes, asserted in :meth:`HeadSearch.take_round`) as a tree row after the cached
        positions ``[0, base]``."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tree_mask: list[int] = []
        for s in active:
            m = s.num_fed
            fed = TokenTree(tuple(s.tokens[:m]), tuple(s.parents[:m]))
            # the verifier's rows and masks without its root row (here the root pair is
            # cached context): node i's mask keeps bit i + 1 -> bit i
            input_ids += fed.token_ids
            positions += fed.positions(s.base)[1:]
            tree_mask += [mask >> 1 for mask in fed.row_masks()[1:]]
            query_start_loc.append(query_start_loc[-1] + m)
            seq_lens.append(s.base + 1 + m)
        return StepPlan(input_ids, positions, query_start_loc, seq_lens,
                        [s.inp.block_table for s in active], [], [], tree_mask)

    def _round_native(self, rows: list[tuple[HeadSearch, int]], hidden: torch.Tensor,
                      meta: AttentionMetadata, fed: torch.Tensor) -> torch.Tensor | None:
        """A round's new nodes' outputs ``[r, h]`` (``rows``: (search, node), ``hidden``
        their parents' outputs; flat rows ``fed`` of the round's step, which holds every node
        fed so far) from one native call that computes and writes only them; None where it
        does not run."""
        if self.native is None:
            return None
        return self._native_layer(hidden, [s.tokens[n] for s, n in rows],
                                  [s.base + s.depth[n] for s, n in rows], meta, fed)

    def _round_python(self, rows: list[tuple[HeadSearch, int]], hidden: torch.Tensor,
                      plan: StepPlan, meta: AttentionMetadata, fed: torch.Tensor,
                      ) -> torch.Tensor:
        """A round's new nodes' outputs ``[r, h]`` (``rows``: (search, node), ``hidden``
        their parents' outputs; flat rows ``fed`` of ``plan``), computing only them: earlier
        rounds' rows get a zero query."""
        head = self.head
        q, k, v = self._qkv(hidden, [s.tokens[n] for s, n in rows],
                            [s.base + s.depth[n] for s, n in rows])
        self.attention.write_kv(k, v, self.kv_cache, meta.slot_mapping[fed])
        q_rows = q.new_zeros(plan.num_tokens, *q.shape[1:])  # [rows, H, D]
        q_rows[fed] = q
        attn = self.attention.paged_attention(q_rows, self.kv_cache, meta,
                                              self.scale)[fed]  # [r, H, D]
        return head.finish_layer(attn.reshape(len(rows), head.q_size), hidden)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:  # [R, h] -> [R, V_d] float32
        return self.head.logits(out).float().contiguous()

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, inputs: list[HeadInput]) -> list[HeadOutput]:
        if not inputs:
            return []
        head = self.head
        # 1. catch-up: every request's pending pairs in one forward
        feeds = [inp.next_token_ids for inp in inputs]
        plan = StepPlan.from_feeds(feeds, [inp.start_pos for inp in inputs],
                                   [inp.block_table for inp in inputs])
        device = self.embed.device
        features = inputs[0].features if len(inputs) == 1 else \
            torch.cat([inp.features for inp in inputs])  # [R, 3h]
        if features.device != device or features.dtype != head.fc.weight.dtype:
            features = features.to(device, head.fc.weight.dtype)
        whole = self._whole_forward(features, plan.input_ids, plan.positions, plan,
                                    logit_rows=plan.logits_indices)
        if whole is not None:
            # every pair's K/V written; only each request's last row past the attention
            last, first = whole  # [B, h], [B, V_d]
        else:
            meta = plan.attention_metadata(self.block_size, device)
            out = self._forward(head.fc(features), plan.input_ids, plan, meta)  # [R, h]
            last = out[torch.tensor(plan.logits_indices, device=device)]  # [B, h]
            first = self._logits(last)
        roots = [HeadSearch(inp, last[b]) for b, inp in enumerate(inputs)]
        self._expand([(s, -1) for s in roots], first)
        # 2. rounds: feed the best candidates (K/V at their node slots), learn their children
        rounds = max(s.rounds for s in roots)
        for round_index in range(rounds):
            active = [s for s in roots if s.take_round(round_index)]
            if not active:
                break
            rows = [(s, node) for s in active for node in s.pending]
            plan = self._round_plan(active)
            flat = [plan.query_start_loc[a] + node for a, s in enumerate(active)
                    for node in s.pending]  # [r] the new nodes' rows of the step
            parents = torch.stack([s.parent_out(n) for s, n in rows])  # [r, h]
            whole = self._whole_forward(parents, [s.tokens[n] for s, n in rows],
                                        [s.base + s.depth[n] for s, n in rows], plan, flat)
            if whole is not None:
                out, logits = whole
            else:
                meta = plan.attention_metadata(self.block_size, device)
                fed = torch.tensor(flat, device=device)
                native = self._round_native(rows, parents, meta, fed)
                out = native if native is not None else \
                    self._round_python(rows, parents, plan, meta, fed)
                logits = self._logits(out)
            for i, (s, node) in enumerate(rows):
                s.outputs[node] = out[i]
            self._expand(rows, logits)
            for s in active:
                s.pending.clear()
        return [s.finish() for s in roots]

    def _expand(self, rows: list[tuple[HeadSearch, int]], logits: torch.Tensor) -> None:
        """Each (search, node)'s candidates from its row of ``logits [R, V_d]``: the greedy
        rows' best few with their log-probabilities in one call
        (:func:`kernels.cpu_fused.top_log_softmax`, no full log-softmax) and one copy to
        Python; a sampled row draws from its whole log-softmax."""
        greedy = [i for i, (s, _) in enumerate(rows) if s.greedy]
        if greedy:
            rows_g = logits if len(greedy) == len(rows) else logits[greedy]
            values, indices = cpu_fused.top_log_softmax(  # (torch's pair off the CPU)
                rows_g, min(CHILDREN, rows_g.shape[-1]))  # [g, CHILDREN] each
            ids = self.draft_ids
            for j, (lps, top) in enumerate(zip(values.tolist(), indices.tolist(),
                                               strict=True)):
                s, node = rows[greedy[j]]
                s.expand_top(node, lps, [ids[t] for t in top])
        for i, (s, node) in enumerate(rows):
            if not s.greedy:
                s.sample_below(node, torch.log_softmax(logits[i], dim=-1), self)

    def sample_child(self, log_probs: torch.Tensor, inp: HeadInput,
                     ) -> tuple[int, torch.Tensor]:
        """One draw from the request's filtered ``q`` over the target vocabulary: (token,
        ``q [vocab]``)."""
        p = inp.sampling_params
        logits = torch.full((1, self.vocab_size), float("-inf"))
        logits[0, self.draft_to_target.cpu()] = log_probs.float().cpu()
        filtered = apply_temperature_and_filters(
            logits, temperature=torch.tensor([p.temperature]),
            top_k=torch.tensor([p.top_k], dtype=torch.long), top_p=torch.tensor([p.top_p]),
            min_p=torch.tensor([p.min_p]))
        q = torch.softmax(filtered, dim=-1)  # [1, vocab]
        token = int(sample_from_probs(q, [inp.generator], self.default_generator)[0])
        return token, q[0]

    @torch.inference_mode()
    def time_propose(self, batch: int, k: int, context: int = 64,
                     max_depth: int | None = None, catch_up: int = 1) -> float:
        """Seconds for one greedy propose of ``k`` nodes at most ``max_depth`` deep for
        ``batch`` requests after ``context`` positions, each first catching up on
        ``catch_up`` verified positions. Uses the first blocks: call only while no request
        runs."""
        per_seq = -(-(context + catch_up + k + 1) // self.block_size)
        if per_seq > self.kv_cache.shape[1]:
            return float("nan")
        width = len(self.head.config.aux_layers) * self.head.config.hidden_size
        inp = HeadInput(torch.zeros(catch_up, width), [0] * catch_up, context, k,
                        tuple(range(per_seq)), SamplingParams(temperature=0.0), None,
                        max_depth=max_depth)
        synchronize(self.embed.device)
        start = time.perf_counter()
        self.propose([inp] * batch)
        synchronize(self.embed.device)
        return time.perf_counter() - start
