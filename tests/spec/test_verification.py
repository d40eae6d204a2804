"""spec.verification: the public steps both verifiers share, and that both really use them.

The torch reference (spec.rejection_sampler) and the Triton verifier (kernels.triton_rejection,
importable without triton) must take validation, layout, logits processing, the acceptance
uniforms and the output assembly from spec.verification's public API, so that their random
draws and outputs stay identical.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import ModuleType

import pytest
import torch

from quickdraft.engine.sampler import SamplingBatch
from quickdraft.engine.sampling_params import SamplingParams
from quickdraft.kernels import triton_rejection
from quickdraft.spec import rejection_sampler, verification
from quickdraft.spec.verification import (
    VerifyLayout,
    VerifyOutput,
    assemble_output,
    draft_uniforms,
    prepare_verification,
)

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8)
SHARED = ("VerifyLayout", "VerifyOutput", "assemble_output", "draft_uniforms",
          "prepare_verification")  # what both verifiers take from spec.verification


def _batch(params: list[SamplingParams], generators: list[torch.Generator | None],
           default_seed: int = 0, logprobs: bool = False) -> SamplingBatch:
    n = len(params)
    if logprobs:
        params = [dataclasses.replace(p, logprobs=True) for p in params]
    return SamplingBatch(params=params, generators=generators, prompt_token_ids=[[]] * n,
                         output_token_ids=[[]] * n,
                         default_generator=torch.Generator().manual_seed(default_seed))


def _spec_imports(path: Path) -> dict[str, list[str]]:
    """``{module: imported names}`` of the quickdraft.spec imports in a source file."""
    found: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quickdraft.spec"):
            found.setdefault(node.module or "", []).extend(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("quickdraft.spec"):
                    found.setdefault(alias.name, [])
    return found


@pytest.mark.parametrize("sampler", [rejection_sampler, triton_rejection],
                         ids=lambda m: m.__name__)
def test_both_samplers_use_the_public_steps(sampler: ModuleType) -> None:
    for name in SHARED:
        assert getattr(sampler, name) is getattr(verification, name), name
    assert set(SHARED) <= set(verification.__all__)


def test_triton_verifier_imports_only_spec_verification() -> None:
    imports = _spec_imports(ROOT / "kernels" / "triton_rejection.py")
    assert list(imports) == ["quickdraft.spec.verification"]
    assert all(not name.startswith("_") for name in imports["quickdraft.spec.verification"])


def test_reference_no_longer_defines_the_shared_steps() -> None:
    tree = ast.parse((ROOT / "spec" / "rejection_sampler.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    assert defined.isdisjoint({"_Layout", "_prepare", "_validate", "_processed_logits",
                               "_draft_uniforms", "_output", "_emitted_logprobs",
                               "VerifyOutput", "VerifyLayout"})
    # its public names stay importable from where they were
    assert rejection_sampler.VerifyOutput is VerifyOutput
    assert rejection_sampler.supports_speculation is verification.supports_speculation


def test_layout_of_a_batch() -> None:
    layout = VerifyLayout.build([[5, 6], [], [7]], torch.device("cpu"))
    assert layout.num_drafts.tolist() == [2, 0, 1]
    assert layout.starts.tolist() == [0, 3, 4]
    assert layout.draft_offsets.tolist() == [0, 2, 2]
    assert layout.draft_ids.tolist() == [5, 6, 7]
    assert layout.draft_req.tolist() == [0, 0, 2]
    assert layout.draft_pos.tolist() == [0, 1, 0]
    assert layout.draft_rows.tolist() == [0, 1, 4]
    assert layout.row_req.tolist() == [0, 0, 0, 1, 2, 2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.starts = layout.starts  # type: ignore[misc]


def test_prepare_validates_and_processes() -> None:
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).half()  # [R, V]
    batch = _batch([GREEDY, SAMPLED], [None, None])
    prep = prepare_verification(logits, [[1, 2], []], None, batch)
    assert prep.raw.dtype == torch.float32 and torch.equal(prep.raw, logits.float())
    assert prep.greedy.tolist() == [True, False]
    assert torch.equal(prep.logits[:3], prep.raw[:3])  # greedy rows untouched
    assert torch.allclose(prep.logits[3], prep.raw[3] / 0.8)  # temperature on the sampled row
    with pytest.raises(ValueError, match="target rows"):
        prepare_verification(logits, [[1], []], None, batch)
    with pytest.raises(ValueError, match="vocabulary"):
        prepare_verification(logits, [[1, 8], []], None, batch)
    penalised = _batch([SamplingParams(temperature=0.7, repetition_penalty=1.3), GREEDY],
                       [None, None])
    with pytest.raises(ValueError, match="penalties"):
        prepare_verification(logits, [[1, 2], []], None, penalised)


def test_draft_uniforms_order() -> None:
    """Shared generator first (unseeded sampled drafts, in order), then each seeded request."""
    seeded = torch.Generator().manual_seed(7)
    batch = _batch([SAMPLED, GREEDY, SAMPLED, SAMPLED], [None, None, seeded, None],
                   default_seed=3)
    u = draft_uniforms([2, 1, 2, 1], batch, "cpu")  # [D]
    shared = torch.rand(3, generator=torch.Generator().manual_seed(3))
    own = torch.rand(2, generator=torch.Generator().manual_seed(7))
    assert u.tolist() == [*shared[:2].tolist(), 0.0, *own.tolist(), shared[2].item()]
    nothing = _batch([GREEDY], [None], default_seed=3)
    draft_uniforms([3], nothing, "cpu")
    assert nothing.default_generator is not None
    assert torch.equal(torch.rand(2, generator=nothing.default_generator),
                       torch.rand(2, generator=torch.Generator().manual_seed(3)))


def test_assemble_output() -> None:
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))  # [R, V]
    drafts = [[1, 2], []]
    layout = VerifyLayout.build(drafts, torch.device("cpu"))
    accepted, tokens = torch.tensor([1, 0]), torch.tensor([4, 5])  # [B] each
    out = assemble_output(drafts, logits, layout, _batch([GREEDY, GREEDY], [None, None]),
                          accepted, tokens)
    assert out == VerifyOutput(token_ids=[[1, 4], [5]], num_accepted=[1, 0])
    out = assemble_output(drafts, logits, layout,
                          _batch([GREEDY, GREEDY], [None, None], logprobs=True),
                          accepted, tokens)
    lsm = torch.log_softmax(logits, dim=-1)  # [R, V]
    assert out.logprobs is not None and [len(v) for v in out.logprobs] == [2, 1]
    assert out.logprobs[0] == pytest.approx([lsm[0, 1].item(), lsm[1, 4].item()])
    assert out.logprobs[1] == pytest.approx([lsm[3, 5].item()])
