"""The draft head: its maths against references, its files, its errors, serving and
training on a tiny random model."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from quickdraft.engine.backend import select_backend
from quickdraft.engine.config import EngineConfig
from quickdraft.engine.models.llama import LlamaForCausalLM
from quickdraft.engine.models.llama_layers import ModelShape
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.spec.draft_head import (
    DraftHead,
    DraftHeadConfig,
    DraftHeadError,
    find_head,
    load_head,
    model_fingerprint,
    save_head,
    unrolled_attention,
)
from quickdraft.spec.draft_head_runner import DraftHeadRunner, HeadInput
from quickdraft.spec.draft_head_train import TrainConfig, run
from quickdraft.spec.suffix_corpus import read_texts, read_tokens, tokens_file, write_corpus
from tests.conftest import make_tiny_model


def small_config(**overrides: object) -> DraftHeadConfig:
    fields: dict[str, object] = dict(
        target_fingerprint="0" * 16, target_vocab_size=100, hidden_size=32, num_heads=4,
        num_kv_heads=2, head_dim=8, intermediate_size=48, rms_norm_eps=1e-5,
        aux_layers=(1, 2, 3), draft_vocab_size=40)
    fields.update(overrides)
    return DraftHeadConfig(**fields)  # type: ignore[arg-type]


def reference_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                        scale: float) -> torch.Tensor:
    """Query by query: step j's query at t sees step-0 keys at s <= t - j and step i's key
    at t - j + i (i = 1..j)."""
    j = len(keys) - 1
    b, t, heads, _d = q.shape
    group = heads // keys[0].shape[2]
    out = torch.zeros_like(q)
    for bi in range(b):
        for ti in range(t):
            for h in range(heads):
                kh = h // group
                ks = [keys[0][bi, s, kh] for s in range(0, ti - j + 1)]
                vs = [values[0][bi, s, kh] for s in range(0, ti - j + 1)]
                for i in range(1, j + 1):
                    pos = ti - j + i
                    if pos >= 0:
                        ks.append(keys[i][bi, pos, kh])
                        vs.append(values[i][bi, pos, kh])
                scores = torch.stack([q[bi, ti, h] @ k for k in ks]) * scale
                out[bi, ti, h] = torch.softmax(scores, 0) @ torch.stack(vs)
    return out


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_unrolled_attention_matches_reference(steps: int) -> None:
    g = torch.Generator().manual_seed(steps)
    q = torch.randn(2, 7, 4, 8, generator=g, dtype=torch.float64)
    keys = [torch.randn(2, 7, 2, 8, generator=g, dtype=torch.float64) for _ in range(steps)]
    values = [torch.randn(2, 7, 2, 8, generator=g, dtype=torch.float64) for _ in range(steps)]
    got = unrolled_attention(q, keys, values, 0.3)
    torch.testing.assert_close(got, reference_attention(q, keys, values, 0.3))


def test_save_and_load_are_bit_identical(tmp_path: Path) -> None:
    torch.manual_seed(0)
    head = DraftHead(small_config())
    for p in head.parameters():
        torch.nn.init.normal_(p.data)
    head.draft_to_target.copy_(torch.randperm(100)[:40])
    for dtype in (torch.float32, torch.bfloat16):
        save_head(head, tmp_path / str(dtype), dtype)
        loaded = load_head(tmp_path / str(dtype))
        for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items(),
                                     strict=True):
            expect = a.to(dtype) if a.is_floating_point() else a
            assert b.dtype == expect.dtype and torch.equal(b, expect), name
        save_head(loaded, tmp_path / "again", dtype)
        assert (tmp_path / "again" / "draft_head.safetensors").read_bytes() == \
            (tmp_path / str(dtype) / "draft_head.safetensors").read_bytes()


def test_config_errors_name_the_field() -> None:
    with pytest.raises(DraftHeadError) as err:
        small_config(draft_vocab_size=200)
    assert err.value.field == "draft_vocab_size"
    with pytest.raises(DraftHeadError) as err:
        small_config(aux_layers=(1, 2))
    assert err.value.field == "aux_layers"
    with pytest.raises(DraftHeadError) as err:
        DraftHeadConfig.from_json(small_config().to_json().replace('"head_dim"', '"x"'))
    assert err.value.field in ("x", "head_dim")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("head-target"), default_model_dir,
                           num_layers=4)


@pytest.fixture(scope="module")
def trained(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The training command's pipeline end to end on the tiny model (seconds)."""
    out = tmp_path_factory.mktemp("head")
    report = run(TrainConfig(out_dir=out, work_dir=out / "work", model=str(tiny_target),
                             num_prompts=12, num_second_stage=4, num_eval_prompts=3,
                             max_new_tokens=20, draft_vocab_size=512, epochs=4, batch_size=3,
                             ttt_steps=2, warmup_steps=2, checkpoint_every=2))
    return out, report


def test_training_runs_end_to_end_and_lowers_the_loss(trained: tuple[Path, dict]) -> None:
    out, report = trained
    assert report["optimizer_steps"] > 4
    assert report["loss_last"] < report["loss_first"]
    assert (out / "draft_head.safetensors").is_file()
    assert 0 <= report["eval"]["mean_accepted"] <= 5
    # the training answers become the head's public suffix corpus, for the same target
    corpus = report["suffix_corpus"]
    assert corpus["target_fingerprint"] == report["target_fingerprint"]
    assert 0 < corpus["sequences"] <= report["train_conversations"]
    assert read_tokens(tokens_file(out)).size == corpus["tokens"] + corpus["sequences"]
    # and their text, which other targets' tokenizers re-tokenize
    assert len(read_texts(out)) == corpus["sequences"] and all(read_texts(out))


def test_training_resumes_without_redoing_finished_stages(
        trained: tuple[Path, dict], tiny_target: Path) -> None:
    out, report = trained
    again = run(TrainConfig(out_dir=out, work_dir=out / "work", model=str(tiny_target),
                            num_prompts=12, num_second_stage=4, num_eval_prompts=3,
                            max_new_tokens=20, draft_vocab_size=512, epochs=4, batch_size=3,
                            ttt_steps=2, warmup_steps=2, checkpoint_every=2))
    assert again["optimizer_steps"] == report["optimizer_steps"]
    assert again["train_conversations"] == report["train_conversations"]


def test_reused_corpus_on_the_engine_path(trained: tuple[Path, dict], tiny_target: Path,
                                         tmp_path: Path) -> None:
    """``reuse_corpus`` on the served engine's path: the corpus's new answers are trained on
    (its repeats of this run's answers are not); feature shards captured for other rows
    are not taken; ``compare_head`` is evaluated on the same held-apart positions."""
    out, report = trained
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus, [[5, 6, 7, 8], [9, 10, 11]], report["target_fingerprint"], "test")
    config = TrainConfig(out_dir=tmp_path / "head", work_dir=tmp_path / "work",
                         model=str(tiny_target), num_prompts=12, num_second_stage=4,
                         num_eval_prompts=3, max_new_tokens=20, draft_vocab_size=512,
                         epochs=1, batch_size=3, ttt_steps=2, warmup_steps=2,
                         checkpoint_every=1000)
    plain = run(config)
    (tmp_path / "work" / "checkpoint.pt").unlink(missing_ok=True)  # train again, below
    again = run(replace(config, reuse_corpus=corpus, compare_head=out))
    assert again["train_conversations"] == plain["train_conversations"] + 2
    shards = sorted((tmp_path / "work" / "features-train").glob("shard-*.pt"))
    assert len(shards) == 2  # the first run's shard and one for the new rows
    compared = again["eval"]["compared"]
    assert compared["head"] == str(out)
    assert compared["positions"] == again["eval"]["positions"] == plain["eval"]["positions"]


def test_head_for_another_target_is_refused(trained: tuple[Path, dict],
                                            default_model_dir: Path) -> None:
    out, _ = trained
    from quickdraft.engine import loader

    shape = ModelShape.from_config(loader.load_config(default_model_dir))
    with pytest.raises(DraftHeadError) as err:
        find_head(str(out), default_model_dir, shape)
    assert err.value.field == "hidden_size"


def _served_head(out: Path, tiny_target: Path,
                 ) -> tuple[LlamaForCausalLM, DraftHead, DraftHeadRunner]:
    """The tiny target and the trained head in fp32, with a runner over 8 blocks of 16."""
    from quickdraft.engine import loader
    from quickdraft.engine.model_runner import load_model

    backend = select_backend(EngineConfig(model=str(tiny_target), dtype="float32"))
    target = load_model(tiny_target, loader.load_config(tiny_target), torch.float32, 256,
                        backend)
    head = load_head(out, torch.float32)
    runner = DraftHeadRunner(head, target, 16, backend, torch.Generator().manual_seed(0))
    runner.allocate(8)
    return target, head, runner


def _unrolled(target: LlamaForCausalLM, head: DraftHead, feats: torch.Tensor,
              next_tokens: list[int], drafts: list[int]) -> torch.Tensor:
    """The training form's logits ``[len(drafts) + 1, V_d]`` of drafting ``j + 1`` tokens
    past the last verified position (features ``feats [n, 3h]``, the tokens after each
    position ``next_tokens``), teacher-forced with ``drafts``."""
    n, m = feats.shape[0], len(drafts)
    embeds = target.embed_tokens[torch.tensor(next_tokens + drafts)]
    features = torch.cat([feats, torch.zeros(m, feats.shape[1])])
    t = features.shape[0]
    logits = head.unrolled_logits(features[None], embeds[None], target.rotary.cos[:t],
                                  target.rotary.sin[:t], m + 1)
    return torch.stack([logits[j][0, n - 1 + j] for j in range(m + 1)])


def test_paged_drafting_equals_the_unrolled_training_form(trained: tuple[Path, dict],
                                                          tiny_target: Path) -> None:
    """The runner's catch-up + chain over the paged cache computes what the training form
    computes for the same positions: train and serve agree."""
    target, head, runner = _served_head(trained[0], tiny_target)
    g = torch.Generator().manual_seed(1)
    n = 12  # positions 0..n-1 verified; drafting from position n - 1
    feats = torch.randn(n, 3 * head.config.hidden_size, generator=g)
    tokens = head.draft_to_target[torch.randint(0, 512, (n + 4,), generator=g)].tolist()
    inp = HeadInput(feats, tokens[1:n + 1], 0, 3, tuple(range(4)),
                    _greedy(), None, tree=False)
    chain = runner.propose([inp])[0].tree.token_ids
    # training form: teacher-forced with the chain's own tokens after position n
    logits = _unrolled(target, head, feats, tokens[1:n + 1], list(chain[:-1]))
    expect = [int(head.draft_to_target[logits[j].argmax()]) for j in range(len(chain))]
    assert list(chain) == expect


def test_tree_nodes_draft_what_their_own_path_predicts(trained: tuple[Path, dict],
                                                      tiny_target: Path) -> None:
    """Tree drafting: every node's children are among the top candidates the training form
    gives for the node's own path, with the path log-probability it gives (its ancestors
    only: siblings and cousins fed in the same rounds must not leak into its attention)."""
    from quickdraft.spec.head_search import CHILDREN

    target, head, runner = _served_head(trained[0], tiny_target)
    g = torch.Generator().manual_seed(2)
    n = 10
    feats = torch.randn(n, 3 * head.config.hidden_size, generator=g)
    tokens = head.draft_to_target[torch.randint(0, 512, (n + 1,), generator=g)].tolist()
    drafted = runner.propose([HeadInput(feats, tokens[1:n + 1], 0, 12, tuple(range(4)),
                                        _greedy(), None)])[0]
    tree, scores = drafted.tree, drafted.scores
    parents = list(tree.parents)
    assert max(parents) >= 0 and len(set(parents)) < len(parents)  # deep and branching
    for node in [-1, *range(len(parents))]:
        children = {tree.token_ids[c] for c, p in enumerate(parents) if p == node}
        if not children:
            continue
        path, cur = [], node
        while cur >= 0:
            path.insert(0, tree.token_ids[cur])
            cur = parents[cur]
        logits = _unrolled(target, head, feats, tokens[1:n + 1], path)[len(path)]
        top = set(head.draft_to_target[logits.topk(CHILDREN).indices].tolist())
        assert children <= top, (node, path)
        log_probs = torch.log_softmax(logits.detach(), -1)
        to_draft = {int(t): i for i, t in enumerate(head.draft_to_target.tolist())}
        for c, p in enumerate(parents):
            if p == node:
                want = (scores[node] if node >= 0 else 0.0) + float(
                    log_probs[to_draft[tree.token_ids[c]]])
                assert scores[c] == pytest.approx(want, abs=1e-4), (c, path)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0)


def test_fingerprint_ignores_the_writing_tool(tmp_path: Path, tiny_target: Path) -> None:
    import json
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_target, copy)
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.0"
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy) == model_fingerprint(tiny_target)
    from quickdraft.engine.weight_format import Q4_CACHE_FILE

    (copy / Q4_CACHE_FILE).write_bytes(b"derived on first use")  # a cache, not the model
    (copy / "q4_weights.safetensors").write_bytes(b"an older cache version")
    assert model_fingerprint(copy) == model_fingerprint(tiny_target)
    config["hidden_size"] += 1
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy) != model_fingerprint(tiny_target)


def test_head_q_keeps_the_target_distribution(trained: tuple[Path, dict],
                                              tiny_target: Path) -> None:
    """Rejection sampling of the head's own q (its filtered draft-vocabulary softmax) emits
    the target's distribution: chi-square over 4000 draws."""
    from quickdraft.engine.sampler import SamplingBatch
    from quickdraft.spec.rejection_sampler import rejection_sample

    out, _ = trained
    config = EngineConfig(model=str(tiny_target), dtype="float32")
    backend = select_backend(config)
    from quickdraft.engine import loader
    from quickdraft.engine.model_runner import load_model

    target = load_model(tiny_target, loader.load_config(tiny_target), torch.float32, 256,
                        backend)
    runner = DraftHeadRunner(load_head(out, torch.float32), target, 16, backend,
                             torch.Generator().manual_seed(0))
    vocab = runner.vocab_size
    g = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=1.0, top_k=8, seed=0)
    inp = HeadInput(torch.zeros(1, 1), [0], 0, 1, (0,), params, g)
    head_logits = torch.randn(runner.head.config.draft_vocab_size, generator=g) * 3
    log_q = torch.log_softmax(head_logits, 0)
    target_logits = torch.full((vocab,), -1e9)
    support = runner.draft_to_target[torch.topk(head_logits, 12).indices]
    target_logits[support] = torch.randn(12, generator=g)
    p = torch.softmax(target_logits, 0)
    counts = torch.zeros(vocab)
    for _ in range(4000):
        token, q = runner.sample_child(log_q, inp)
        batch = SamplingBatch([SamplingParams(temperature=1.0, seed=None)], [g], [[0]], [[]],
                              g)
        res = rejection_sample(target_logits.repeat(2, 1), [[token]], q[None], batch)
        counts[res.token_ids[0][0]] += 1
    expected = p * 4000
    mask = expected > 5
    chi2 = float((((counts - expected) ** 2) / expected.clamp_min(1e-9))[mask].sum())
    dof = int(mask.sum()) - 1
    assert counts[~mask].sum() < 20
    assert chi2 < dof + 4 * math.sqrt(2 * dof)


def test_soft_labels_align_with_the_hard_labels() -> None:
    """The soft label at a batch position is the target's top-k distribution of the token
    the hard label names (top-1 = argmax), mapped to draft ids, zero off the loss mask and
    outside the draft vocabulary."""
    from quickdraft.spec.draft_head_data import Conversation
    from quickdraft.spec.draft_head_fit import make_batch, soft_labels

    g = torch.Generator().manual_seed(3)
    n, vocab, k = 9, 20, 4
    top_ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    top_probs = torch.softmax(torch.randn(n, k, generator=g), -1).sort(descending=True).values
    conv = Conversation(torch.randint(0, vocab, (n,), generator=g), torch.randn(n, 6),
                        top_ids[:, 0].clone(), 3, top_ids, top_probs.half())
    draft_vocab = torch.arange(0, vocab, 2)  # even ids only
    t2d = torch.full((vocab,), -100, dtype=torch.int64)
    t2d[draft_vocab] = torch.arange(len(draft_vocab))
    _f, _e, labels, mask = make_batch([conv], torch.randn(vocab, 4), t2d, 64)
    soft = soft_labels([conv], t2d, mask)
    assert soft is not None
    ids, probs = soft
    assert not bool(probs[~mask].any())
    for t in mask[0].nonzero().flatten().tolist():
        for j in range(k):
            token = int(top_ids[t + 1, j])
            if token % 2:
                assert float(probs[0, t, j]) == 0.0
            else:
                assert int(ids[0, t, j]) == token // 2
                assert float(probs[0, t, j]) == float(top_probs[t + 1, j].half())
        if int(labels[0, t]) != -100:
            assert int(ids[0, t, 0]) == int(labels[0, t])
    conv.top_ids = None  # an older capture: hard labels only
    assert soft_labels([conv], t2d, mask) is None
