"""An EAGLE-3-style draft head: the module, its config, and its files.

One decoder layer drafts the target's next tokens from the target's own hidden states
(arXiv 2503.01840). At position ``t`` its input is

* ``g_t = fc(cat(h_low_t, h_mid_t, h_high_t))``: three of the target's residual streams
  (``aux_layers``, HF's ``hidden_states[i]``) fused into one ``[hidden]`` vector, and
* ``e(x_{t+1})``: the target's (frozen, not stored) embedding of the token after ``t``;

the layer attends over the head's own K/V of earlier positions, and ``lm_head`` predicts
``x_{t+2}`` over a *draft vocabulary* (the ``draft_vocab_size`` most frequent target tokens;
``draft_to_target`` maps a draft id back). A token outside it is simply never drafted.
Drafting further, position ``t + 1`` takes the head's own output ``o_t`` in place of
``g_{t+1}`` (which the target has not computed yet)::

    in_t   = cat(rms(e(x_{t+1}), input_norm), rms(g_t or o_{t-1}, hidden_norm))  # [2h]
    a_t    = g_t + o_proj(attention(qkv(in_t)))                                  # [h]
    o_t    = a_t + mlp(rms(a_t, post_norm))                                       # [h]
    logits = lm_head(rms(o_t, norm))                                              # [V_d]

Training unrolls this (EAGLE-3's training-time test, :meth:`DraftHead.unrolled_logits`):
step 0 feeds every position the target's features; step ``j`` feeds position ``t`` the
step ``j - 1`` output at ``t - 1``, and attends to step-0 keys at positions ``<= t - j``
plus the keys of its own chain (steps ``1..j`` at positions ``t - j + 1 .. t``), exactly the
keys it sees when drafting ``j`` tokens past a verified position (see
:func:`unrolled_attention`). The paged runner (:mod:`spec.draft_head_runner`) computes the
same maths over the KV cache.

Files: ``draft_head.json`` (:class:`DraftHeadConfig`, keyed to the target's fingerprint) and
``draft_head.safetensors`` (the weights and ``draft_to_target``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from quickdraft.engine.models.llama_layers import ModelShape
from quickdraft.engine.weight_format import DERIVED_FILE_PREFIX
from quickdraft.kernels import torch_ops

CONFIG_NAME = "draft_head.json"
WEIGHTS_NAME = "draft_head.safetensors"
HEAD_FORMAT = 1


class DraftHeadError(ValueError):
    """A draft head that cannot serve this target; ``field`` names what disagrees."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high residual streams, as EAGLE-3 picks them."""
    return (min(2, num_layers), num_layers // 2, max(num_layers - 3, 0))


@dataclass(frozen=True)
class DraftHeadConfig:
    target_fingerprint: str  # model_fingerprint() of the target it was trained on
    target_vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    aux_layers: tuple[int, ...]
    draft_vocab_size: int
    format: int = HEAD_FORMAT

    def __post_init__(self) -> None:
        for name in ("target_vocab_size", "hidden_size", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "draft_vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise DraftHeadError(name, f"must be a positive integer, not "
                                           f"{getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise DraftHeadError("num_kv_heads", "must divide num_heads")
        if self.draft_vocab_size > self.target_vocab_size:
            raise DraftHeadError("draft_vocab_size", "larger than the target's vocabulary")
        if len(self.aux_layers) != 3 or any(i < 0 for i in self.aux_layers):
            raise DraftHeadError("aux_layers", f"three layer indices, not {self.aux_layers}")
        if self.format != HEAD_FORMAT:
            raise DraftHeadError("format", f"version {self.format}; this quickdraft reads "
                                           f"version {HEAD_FORMAT}")

    @classmethod
    def for_target(cls, shape: ModelShape, fingerprint: str,
                   draft_vocab_size: int) -> DraftHeadConfig:
        return cls(fingerprint, shape.vocab_size, shape.hidden_size, shape.num_heads,
                   shape.num_kv_heads, shape.head_dim, shape.intermediate_size,
                   shape.rms_norm_eps, default_aux_layers(shape.num_layers),
                   min(draft_vocab_size, shape.vocab_size))

    def check_target(self, shape: ModelShape, fingerprint: str | None) -> None:
        """Raise :class:`DraftHeadError` unless this head was made for this target."""
        for name, want in (("hidden_size", shape.hidden_size), ("num_heads", shape.num_heads),
                           ("num_kv_heads", shape.num_kv_heads), ("head_dim", shape.head_dim),
                           ("target_vocab_size", shape.vocab_size)):
            if getattr(self, name) != want:
                raise DraftHeadError(name, f"the head has {getattr(self, name)}, the target "
                                           f"model {want}")
        if max(self.aux_layers) > shape.num_layers:
            raise DraftHeadError("aux_layers", f"{self.aux_layers}: the target has only "
                                               f"{shape.num_layers} layers")
        if fingerprint is not None and fingerprint != self.target_fingerprint:
            raise DraftHeadError("target_fingerprint", (
                f"the head was trained on target {self.target_fingerprint}, this model is "
                f"{fingerprint}: train one for it with `quickdraft draft-head train`"))

    def to_json(self) -> str:
        data = asdict(self)
        data["aux_layers"] = list(self.aux_layers)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DraftHeadConfig:
        data = json.loads(text)
        known = set(cls.__dataclass_fields__)
        if unknown := sorted(set(data) - known):
            raise DraftHeadError(unknown[0], "unknown field in the head's config")
        if missing := sorted(known - set(data) - {"format"}):
            raise DraftHeadError(missing[0], "missing from the head's config")
        data["aux_layers"] = tuple(data["aux_layers"])
        return cls(**data)


def model_fingerprint(model_dir: Path) -> str:
    """A short digest naming a target model's weights: its config (less the fields naming
    the tools that wrote it), and each weight file's name, size, safetensors header and
    first and last MiB (cheap, and any retrained or requantised checkpoint differs there).
    Caches quickdraft derives beside the weights (the 4-bit copy, written on first use) are
    not the model and are left out: the digest is the same before and after them."""
    digest = hashlib.sha256()
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        config.pop(key, None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in sorted(model_dir.glob("*.safetensors")):
        if path.name.startswith(DERIVED_FILE_PREFIX):
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(size - (1 << 20), 0))
            digest.update(f.read())
    return digest.hexdigest()[:16]


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch_ops.rms_norm(x, weight, eps)


class DraftHead(nn.Module):
    """The head's weights and its maths (training in dense form; see the module doc)."""

    draft_to_target: torch.Tensor  # [V_d] int64 buffer: draft id -> target token id

    def __init__(self, config: DraftHeadConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = self.config = config
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_size, self.kv_size = q, kv
        self.fc = nn.Linear(len(c.aux_layers) * h, h, bias=False, dtype=dtype)
        self.input_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.hidden_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.qkv = nn.Linear(2 * h, q + 2 * kv, bias=False, dtype=dtype)
        self.o = nn.Linear(q, h, bias=False, dtype=dtype)
        self.post_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.gate_up = nn.Linear(h, 2 * c.intermediate_size, bias=False, dtype=dtype)
        self.down = nn.Linear(c.intermediate_size, h, bias=False, dtype=dtype)
        self.norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False, dtype=dtype)
        self.register_buffer("draft_to_target",
                             torch.arange(c.draft_vocab_size, dtype=torch.int64))
        # the small ops (torch's; serving may hand the target's fused CPU kernels over)
        self.rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms
        self.silu_mul: Callable[[torch.Tensor], torch.Tensor] = torch_ops.silu_mul

    # ------------------------------------------------------------------ pieces

    def layer_input(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``[..., h]`` fused features (or the head's previous output) and token embeddings
        -> ``[..., 2h]`` normalised, as the qkv projection takes them."""
        eps = self.config.rms_norm_eps
        return torch.cat((self.rms_norm(embeds, self.input_norm, eps),
                          self.rms_norm(hidden, self.hidden_norm, eps)), dim=-1)

    def finish_layer(self, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``attn [..., q]`` attention output, ``hidden [..., h]`` the layer's input stream
        -> the head's output ``o`` ``[..., h]``."""
        a = hidden + self.o(attn)
        gate_up = self.gate_up(self.rms_norm(a, self.post_norm, self.config.rms_norm_eps))
        return a + self.down(self.silu_mul(gate_up))

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [..., h] -> [..., V_d]
        return self.lm_head(self.rms_norm(out, self.norm, self.config.rms_norm_eps))

    # ------------------------------------------------------------------ training form

    def unrolled_logits(self, features: torch.Tensor, embeds: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """EAGLE-3's training-time test over whole sequences: ``features [B, T, 3h]`` the
        target's, ``embeds [B, T, h]`` of the tokens after each position, ``cos``/``sin``
        ``[T, head_dim]`` -> per step ``j`` the logits ``[B, T, V_d]`` of drafting ``j + 1``
        tokens past position ``t - j`` (rows ``t < j`` are meaningless)."""
        c = self.config
        b, t, _ = features.shape
        hidden = self.fc(features)  # [B, T, h]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out_logits: list[torch.Tensor] = []
        for _ in range(steps):
            qkv = self.qkv(self.layer_input(hidden, embeds))  # [B, T, q + 2kv]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = _rope(q.reshape(b, t, c.num_heads, c.head_dim), cos, sin)
            keys.append(_rope(k.reshape(b, t, c.num_kv_heads, c.head_dim), cos, sin))
            values.append(v.reshape(b, t, c.num_kv_heads, c.head_dim))
            attn = unrolled_attention(q, keys, values, c.head_dim ** -0.5)  # [B, T, H, D]
            out = self.finish_layer(attn.reshape(b, t, self.q_size), hidden)
            out_logits.append(self.logits(out))
            hidden = F.pad(out, (0, 0, 1, 0))[:, :t]  # position t takes o_{t-1}
        return out_logits


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, T, heads, D]`` rotated at positions ``0..T-1`` (``cos``/``sin`` ``[T, D]``)."""
    _b, t, _heads, d = x.shape
    half = d // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.view(1, t, 1, d) + rotated * sin.view(1, t, 1, d)


def unrolled_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       scale: float) -> torch.Tensor:
    """Attention of unroll step ``j = len(keys) - 1``: query ``q[:, t]`` ``[B, T, H, D]``
    sees step-0 keys at positions ``<= t - j`` and, for ``i = 1..j``, step ``i``'s key at
    position ``t - j + i`` (its own draft chain; ``i = j`` is itself). Keys and values
    ``[B, T, KVH, D]`` (grouped heads). Returns ``[B, T, H, D]``."""
    j = len(keys) - 1
    _b, t, heads, _d = q.shape
    group = heads // keys[0].shape[2]
    positions = torch.arange(t, device=q.device)
    k0 = keys[0].repeat_interleave(group, dim=2)
    v0 = values[0].repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k0) * scale  # [B, H, T, T]
    visible = positions[None, :] <= positions[:, None] - j  # [T, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    extra_scores: list[torch.Tensor] = []
    extra_values: list[torch.Tensor] = []
    for i in range(1, j + 1):
        shift = j - i  # step i's key for query t sits at t - shift
        ki = F.pad(keys[i], (0, 0, 0, 0, shift, 0))[:, :t].repeat_interleave(group, dim=2)
        vi = F.pad(values[i], (0, 0, 0, 0, shift, 0))[:, :t].repeat_interleave(group, dim=2)
        s = (q * ki).sum(-1).transpose(1, 2) * scale  # [B, H, T]
        s = s.masked_fill((positions < shift)[None, None, :], float("-inf"))
        extra_scores.append(s.unsqueeze(-1))
        extra_values.append(vi)
    if extra_scores:
        scores = torch.cat([scores, *extra_scores], dim=-1)  # [B, H, T, T + j]
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.einsum("bhts,bshd->bthd", probs[..., :t], v0)
    for i, vi in enumerate(extra_values):
        out = out + probs[..., t + i].transpose(1, 2).unsqueeze(-1) * vi
    return out


# ---------------------------------------------------------------------- files


def save_head(head: DraftHead, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``draft_head.json`` and ``draft_head.safetensors`` (weights in ``dtype``)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous()
               for name, t in head.state_dict().items()}
    tmp = directory / (WEIGHTS_NAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": str(HEAD_FORMAT)})
    tmp.replace(directory / WEIGHTS_NAME)
    (directory / CONFIG_NAME).write_text(head.config.to_json())


def load_head(directory: Path, dtype: torch.dtype | None = None) -> DraftHead:
    """The head saved in ``directory`` (weights in their stored dtype unless ``dtype``)."""
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise DraftHeadError("draft_head", f"{path} does not exist")
    config = DraftHeadConfig.from_json(config_path.read_text())
    tensors = load_file(str(weights_path))
    stored = next(t.dtype for t in tensors.values() if t.is_floating_point())
    head = DraftHead(config, dtype or stored)
    state = head.state_dict()
    for name, tensor in tensors.items():
        if name not in state:
            raise DraftHeadError(name, "unexpected tensor in the head's weights")
        if tuple(tensor.shape) != tuple(state[name].shape):
            raise DraftHeadError(name, f"shape {tuple(tensor.shape)}, the config says "
                                       f"{tuple(state[name].shape)}")
    if missing := sorted(set(state) - set(tensors)):
        raise DraftHeadError(missing[0], "missing from the head's weights")
    head.load_state_dict({n: t.to(state[n].dtype) for n, t in tensors.items()})
    ids = head.draft_to_target
    if int(ids.min()) < 0 or int(ids.max()) >= config.target_vocab_size:
        raise DraftHeadError("draft_to_target", "token ids outside the target's vocabulary")
    return head.eval()


SHIPPED_HEADS = Path(__file__).resolve().parent / "heads"  # one directory per head


def find_head(setting: str | None, model_dir: Path, shape: ModelShape) -> DraftHead | None:
    """The draft head an engine uses: ``setting`` None / "none" = none; "auto" = a shipped
    head trained on exactly this target (fingerprint), else none; else a head directory,
    which must match the target (:class:`DraftHeadError` naming the field otherwise)."""
    if setting is None or setting == "none":
        return None
    fingerprint = model_fingerprint(model_dir)
    if setting == "auto":
        for path in sorted(SHIPPED_HEADS.glob(f"*/{CONFIG_NAME}")):
            if DraftHeadConfig.from_json(path.read_text()).target_fingerprint == fingerprint:
                head = load_head(path.parent)
                head.config.check_target(shape, fingerprint)
                return head
        return None
    head = load_head(Path(setting).expanduser())
    head.config.check_target(shape, fingerprint)
    return head
