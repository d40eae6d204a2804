"""Fitting a draft head (stage 3 and 4 of ``quickdraft draft-head train``,
:mod:`spec.draft_head_train`): a new head initialised from the target, AdamW over the
answers' positions with EAGLE-3's training-time test (``ttt_steps`` unrolled steps, step
``j`` weighted ``STEP_DECAY ** j``; hard or soft labels in the head's reduced vocabulary),
checkpoints to resume from, an optional time budget the schedule is fitted to, and the
greedy chain acceptance on held-apart conversations.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.spec.draft_head import DraftHead, DraftHeadConfig
from quickdraft.spec.draft_head_data import Conversation

if TYPE_CHECKING:
    from quickdraft.spec.draft_head_train import TrainConfig

STEP_DECAY = 0.8  # weight of unroll step j: STEP_DECAY ** j
FIT_AFTER_STEPS = 30  # steps timed before a time-bounded schedule is fitted


@dataclass(frozen=True)
class TargetParts:
    """What training needs of the target model, in fp32 on the training device."""

    embed: torch.Tensor  # [V, h] input embedding
    lm_head: torch.Tensor  # [V, h]
    norm: torch.Tensor  # [h] final norm weight
    cos: torch.Tensor  # [max_positions, head_dim] RoPE, as the served model rounds it
    sin: torch.Tensor

    @classmethod
    def of(cls, model: LlamaForCausalLM, device: str | torch.device = "cpu") -> TargetParts:
        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().to(device)
        return cls(f32(model.embed_tokens), f32(model.lm_head.weight), f32(model.norm.weight),
                   f32(model.rotary.cos), f32(model.rotary.sin))


def init_head(config: DraftHeadConfig, target: TargetParts,
              draft_vocab: torch.Tensor) -> DraftHead:
    """A new head on the target's device: random layer, ``lm_head`` rows and final norm
    from the target."""
    head = DraftHead(config).to(target.embed.device)
    with torch.no_grad():
        head.draft_to_target.copy_(draft_vocab)
        head.lm_head.weight.copy_(target.lm_head[draft_vocab.to(target.lm_head.device)])
        head.norm.copy_(target.norm)
    return head


def _batches(data: list[Conversation], batch_size: int, generator: torch.Generator,
             ) -> list[list[int]]:
    """One epoch: conversations sorted by length into batches, batches shuffled."""
    order = sorted(range(len(data)), key=lambda i: len(data[i].tokens))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    perm = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in perm]


def make_batch(items: list[Conversation], embed: torch.Tensor, t2d: torch.Tensor,
               max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(features [B, T, 3h] f32, embeds [B, T, h], labels [B, T] draft ids or -100,
    loss mask [B, T])`` for positions ``t`` with input token ``tokens[t + 1]`` and label
    ``argmax[t + 1]``; losses on answer positions only."""
    t = min(max(len(c.tokens) - 1 for c in items), max_len)
    b, width, dev = len(items), items[0].features.shape[1], embed.device
    features = torch.zeros(b, t, width, device=dev)
    embeds = torch.zeros(b, t, embed.shape[1], device=dev)
    labels = torch.full((b, t), -100, dtype=torch.int64, device=dev)
    mask = torch.zeros(b, t, dtype=torch.bool, device=dev)
    for row, c in enumerate(items):
        n = min(len(c.tokens) - 1, t)
        features[row, :n] = c.features[:n].float()
        embeds[row, :n] = embed[c.tokens[1:n + 1].to(dev)]
        labels[row, :n] = t2d[c.argmax[1:n + 1].to(dev)]
        mask[row, max(c.prompt_len - 1, 0):n] = True
    labels[~mask] = -100
    return features, embeds, labels, mask


def soft_labels(items: list[Conversation], t2d: torch.Tensor, mask: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's top-k next-token distribution at each batch position, as
    ``(draft ids [B, T, K] (0 where unused), probs [B, T, K] (0 outside the draft vocabulary
    and off the loss mask))``, aligned with :func:`make_batch`'s labels; None when a
    conversation was captured without it."""
    if any(c.top_ids is None or c.top_probs is None for c in items):
        return None
    b, t = mask.shape
    k = items[0].top_ids.shape[1]  # type: ignore[union-attr]
    ids = torch.zeros(b, t, k, dtype=torch.int64, device=mask.device)
    probs = torch.zeros(b, t, k, device=mask.device)
    for row, c in enumerate(items):
        n = min(len(c.tokens) - 1, t)
        draft = t2d[c.top_ids[1:n + 1].to(t2d.device)]  # type: ignore[index]
        ids[row, :n] = draft.clamp(min=0)
        probs[row, :n] = (c.top_probs[1:n + 1].float().to(mask.device)  # type: ignore[index]
                          * (draft >= 0))
    probs[~mask] = 0.0
    return ids, probs


def draft_ids(target_vocab_size: int, draft_vocab: torch.Tensor,
              device: torch.device) -> torch.Tensor:
    """``[V]`` target id -> draft id, -100 outside the draft vocabulary."""
    t2d = torch.full((target_vocab_size,), -100, dtype=torch.int64, device=device)
    t2d[draft_vocab.to(device)] = torch.arange(len(draft_vocab), device=device)
    return t2d


def train(head_config: DraftHeadConfig, target: TargetParts, draft_vocab: torch.Tensor,
          data: list[Conversation], config: TrainConfig, work: Path, *,
          fit_to_time: bool = False, log: Callable[[str], None] | None = None,
          ) -> tuple[DraftHead, int, list[float]]:
    """Train (or resume) the head on ``target``'s device; returns it, the optimiser steps
    taken in all and the mean loss of each tenth of this run's steps (first and last: did
    it learn). ``fit_to_time`` (with ``max_train_minutes``): after the first
    ``FIT_AFTER_STEPS`` steps the schedule is shortened to the steps that fit in the time
    left, so the learning rate still decays to zero (otherwise the clock cuts the cosine
    short)."""
    torch.manual_seed(config.seed)
    head = init_head(head_config, target, draft_vocab)
    embed, cos, sin = target.embed, target.cos, target.sin
    t2d = draft_ids(head_config.target_vocab_size, draft_vocab, embed.device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=0.0,
                                  betas=(0.9, 0.95))
    per_epoch = math.ceil(len(data) / config.batch_size)
    total = max(int(per_epoch * config.epochs), 1)
    horizon = [total]  # the cosine's length (fit_to_time may shorten it)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / config.warmup_steps,
        0.5 * (1 + math.cos(math.pi * min(s / horizon[0], 1.0)))))
    ckpt_path = work / "checkpoint.pt"
    step = 0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False, map_location=embed.device)
        head.load_state_dict(ckpt["head"])
        optimizer.load_state_dict(ckpt["optimizer"])
        schedule.load_state_dict(ckpt["schedule"])
        step = ckpt["step"]
    generator = torch.Generator().manual_seed(config.seed)
    plan: list[list[int]] = []
    for _ in range(math.ceil(config.epochs)):
        plan += _batches(data, config.batch_size, generator)
    plan = plan[:total]
    deadline = (time.monotonic() + 60 * config.max_train_minutes
                if config.max_train_minutes else math.inf)
    bar = tqdm(total=total, initial=step, desc="train", unit="step", dynamic_ncols=True,
               disable=log is not None)
    history: list[float] = []
    head.train()
    first_step, fit_start = step, time.monotonic()
    while step < total and time.monotonic() < deadline:
        if fit_to_time and deadline < math.inf and step == first_step + FIT_AFTER_STEPS:
            per_step = (time.monotonic() - fit_start) / FIT_AFTER_STEPS
            fits = step + int(0.95 * (deadline - time.monotonic()) / per_step)
            if fits < total:
                total = horizon[0] = max(fits, step + 1)
                if log:
                    log(f"train: {per_step * 1000:.0f} ms a step; schedule fitted to "
                        f"{total} steps")
        items = [data[i] for i in plan[step]]
        features, embeds, labels, mask = make_batch(items, embed, t2d, config.max_seq_len)
        soft = soft_labels(items, t2d, mask) if config.soft_labels else None
        t = features.shape[1]
        logits = head.unrolled_logits(features, embeds, cos[:t], sin[:t], config.ttt_steps)
        loss = torch.zeros((), device=embed.device)
        accs = []
        for j, step_logits in enumerate(logits):
            lab = labels.clone()
            lab[:, :j] = -100  # no input from step j - 1 there
            if soft is None:
                step_loss = F.cross_entropy(step_logits.reshape(-1, step_logits.shape[-1]),
                                            lab.reshape(-1), ignore_index=-100)
            else:  # cross-entropy against the target's (truncated) distribution
                ids, probs = soft
                log_q = torch.log_softmax(step_logits.float(), dim=-1).gather(-1, ids)
                weight = probs[:, j:]
                step_loss = -(weight * log_q[:, j:]).sum() / (mask[:, j:].sum() + 1e-6)
            loss = loss + STEP_DECAY ** j * step_loss
            valid = lab != -100
            accs.append(float((step_logits.argmax(-1) == lab)[valid].float().mean())
                        if valid.any() else 0.0)
        history.append(float(loss.detach()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        schedule.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{history[-1]:.3f}", acc="/".join(f"{a:.2f}" for a in accs))
        if log and step % 50 == 0:
            log(f"train: step {step}/{total} loss {history[-1]:.3f} "
                f"acc {'/'.join(f'{a:.2f}' for a in accs)}")
        if step % config.checkpoint_every == 0 or step == total:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                        "schedule": schedule.state_dict(), "step": step}, tmp)
            tmp.replace(ckpt_path)
    bar.close()
    tenth = max(len(history) // 10, 1)
    losses = [sum(history[i:i + tenth]) / len(history[i:i + tenth])
              for i in range(0, len(history), tenth)]
    return head.eval(), step, [round(x, 4) for x in losses]


@torch.no_grad()
def evaluate(head: DraftHead, target: TargetParts, data: list[Conversation],
             depth: int) -> dict[str, Any]:
    """Greedy chain acceptance on ``data``: at each answer position, the head's drafts
    ``1..depth`` are taken while each equals the target's argmax (teacher-forced unrolling
    equals real drafting on an accepted prefix). Returns mean accepted drafts, tokens per
    verification (accepted + 1) and the per-depth acceptance."""
    embed, cos, sin = target.embed, target.cos, target.sin
    t2d = draft_ids(head.config.target_vocab_size, head.draft_to_target, embed.device)
    accepted_total, positions = 0, 0
    reached = [0] * depth
    for c in data:
        features, embeds, labels, mask = make_batch([c], embed, t2d, 4096)
        t = features.shape[1]
        logits = head.unrolled_logits(features, embeds, cos[:t], sin[:t], depth)
        hits = torch.stack([(lg.argmax(-1) == labels)[0] for lg in logits]).cpu()  # [depth, T]
        answer = mask[0].cpu()
        for v in answer.nonzero().flatten().tolist():
            a = 0
            while a < depth and v + a < t and answer[v + a] and bool(hits[a, v + a]):
                reached[a] += 1
                a += 1
            accepted_total += a
            positions += 1
    mean = accepted_total / max(positions, 1)
    return {"positions": positions, "mean_accepted": round(mean, 3),
            "tokens_per_verification": round(mean + 1, 3),
            "accepted_at_depth": [round(r / max(positions, 1), 3) for r in reached]}
