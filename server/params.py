"""Reading request fields from parsed JSON: types checked here, ranges by the engine's own
dataclasses; every error names the field's full path. Shared by the WebSocket protocol and the
OpenAI-compatible HTTP API."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from quickdraft.engine.outputs import Usage
from quickdraft.engine.sampling_params import InvalidParameterError, SamplingParams
from quickdraft.server.errors import (
    ProtocolError,
    from_engine,
    invalid,
    join_path,
    missing,
    model_not_found,
    unknown,
    unsupported,
    wrong_type,
)
from quickdraft.spec.params import SpeculationParams

JSON = dict[str, Any]
# Priority classes, the one place they map to the engine's numbers (lower runs first).
PRIORITY_CLASSES = {"interactive": 0, "background": 10}
DEFAULT_PRIORITY = "interactive"
# API name -> kind, for the sampling fields both protocols accept.
SAMPLING_FIELDS = {
    "temperature": "number", "top_p": "number", "top_k": "int", "min_p": "number",
    "seed": "int", "presence_penalty": "number", "frequency_penalty": "number",
    "repetition_penalty": "number", "stop": "stop", "stop_token_ids": "int_list",
    "ignore_eos": "bool",
}
TEXT_PART_TYPES = ("text", "input_text", "output_text")
# Message role -> the role the chat template sees ("developer" is OpenAI's newer "system").
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant"}
# Roles OpenAI defines that need tool calling, which this server does not do.
TOOL_ROLES = ("tool", "function")
# Message fields of tool calling: refused as unsupported, never silently dropped.
TOOL_CALL_FIELDS = ("tool_calls", "function_call")
# OpenAI request fields for features this server does not have, refused whatever their value.
UNSUPPORTED_FIELDS = ("tools", "functions", "audio", "prediction", "suffix")


class Fields:
    """Typed access to the fields of one JSON object; ``null`` counts as absent."""

    def __init__(self, obj: Any, path: str = "") -> None:
        if not isinstance(obj, dict):
            raise wrong_type(path or "message", "a JSON object")
        self.obj: JSON = obj
        self.path = path

    def param(self, key: str) -> str:
        return join_path(self.path, key)

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def only(self, allowed: Iterable[str], *, where: str | None = None,
             renamed: Mapping[str, str] | None = None) -> None:
        """Refuse fields this object does not know (a typo must not be silently ignored);
        ``renamed`` maps names people try to the field meant, for the message."""
        known = set(allowed)
        for key in self.obj:
            if key not in known:
                raise unknown(self.param(key), where, (renamed or {}).get(key))

    def get(self, key: str, kind: str, *, required: bool = False) -> Any:
        value = self.obj.get(key)
        if value is None:
            if required:
                raise missing(self.param(key))
            return None
        return _READERS[kind](value, self.param(key))

    def string(self, key: str, *, required: bool = False, max_len: int | None = None) -> str | None:
        value: str | None = self.get(key, "str", required=required)
        if value is not None and max_len is not None and len(value) > max_len:
            raise invalid(self.param(key), f"at most {max_len} characters")
        return value

    def choice(self, key: str, options: Iterable[str], default: str | None = None) -> str | None:
        value = self.string(key)
        if value is None:
            return default
        options = tuple(options)
        if value not in options:
            raise invalid(self.param(key), f"must be one of {list(options)}, got {value!r}")
        return value

    def child(self, key: str, *, required: bool = False) -> Fields | None:
        value = self.obj.get(key)
        if value is None:
            if required:
                raise missing(self.param(key))
            return None
        return Fields(value, self.param(key))


def _as_str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise wrong_type(param, "a string")
    return value


def _as_int(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(param, "an integer")
    return value


def _as_number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise wrong_type(param, "a number")
    return float(value)


def _as_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise wrong_type(param, "true or false")
    return value


def _as_stop(value: Any, param: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise wrong_type(param, "a string or a list of strings")
    return tuple(items)


def _as_int_list(value: Any, param: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise wrong_type(param, "a list of integers")
    return tuple(_as_int(v, f"{param}[{i}]") for i, v in enumerate(value))


_READERS = {"str": _as_str, "int": _as_int, "number": _as_number, "bool": _as_bool,
            "stop": _as_stop, "int_list": _as_int_list}


def read_sampling(f: Fields) -> JSON:
    """The sampling fields present in ``f`` as engine keyword arguments (types checked)."""
    kwargs: JSON = {}
    for name, kind in SAMPLING_FIELDS.items():
        value = f.get(name, kind)
        if value is not None:
            kwargs[name] = value
    if kwargs.get("top_k") == -1:  # vLLM's spelling of "off"
        kwargs["top_k"] = 0
    return kwargs


def build_sampling(kwargs: JSON, prefix: str, max_tokens_name: str) -> SamplingParams:
    """``SamplingParams(**kwargs)``; its range errors renamed to the API's field path."""
    try:
        return SamplingParams(**kwargs)
    except InvalidParameterError as exc:
        raise from_engine(exc, prefix, {"max_tokens": max_tokens_name}) from exc


def read_max_tokens(f: Fields, key: str, *, allow_inf: bool = False) -> int | None:
    """A positive token limit; ``"inf"`` (WebSocket only) or absent = up to the context."""
    value = f.obj.get(key)
    if value is None or (allow_inf and value == "inf"):
        return None
    n = _as_int(value, f.param(key))
    if n < 1:
        raise invalid(f.param(key), "must be an integer >= 1")
    return n


def read_speculation(f: Fields, key: str = "speculation") -> SpeculationParams | None:
    """``"ngram"`` or ``{"method": "ngram", "k": 4}``; absent = the engine's default."""
    value = f.obj.get(key)
    if value is None:
        return None
    param = f.param(key)
    if isinstance(value, str):
        value = {"method": value}
    spec = Fields(value, param)
    spec.only(("method", "k"))
    try:
        return SpeculationParams(method=spec.get("method", "str"), k=spec.get("k", "int"))
    except InvalidParameterError as exc:  # exc.param is "speculation.method" or ".k"
        raise invalid(f"{param}.{exc.param.rsplit('.', 1)[-1]}", exc.message) from exc


MAX_CACHE_SALT_LEN = 256


def read_cache_salt(f: Fields, key: str = "cache_salt") -> str | None:
    """The client's own cache namespace (as vLLM's ``cache_salt``): requests with different
    salts share neither prefix-cache blocks nor the suffix proposer's earlier answers."""
    value = f.string(key, max_len=MAX_CACHE_SALT_LEN)
    if value is not None and not value:
        raise invalid(f.param(key), "must be a non-empty string")
    return value


def cache_namespace(tenant: str | None, salt: str | None) -> str | None:
    """The engine's ``cache_salt``: the API key's tenant (see ``server.guard``), refined by the
    client's salt; a client salt can never name another key's namespace."""
    if salt is None:
        return tenant
    return f"{tenant or 'open'}/{salt}"


def read_priority(f: Fields, key: str = "priority") -> int:
    name = f.choice(key, PRIORITY_CLASSES, DEFAULT_PRIORITY)
    assert name is not None
    return PRIORITY_CLASSES[name]


def read_content(value: Any, param: str) -> str:
    """Message content: a string, or a list of text parts (``{"type": "text", "text": ...}``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise wrong_type(param, "a string or a list of text parts")
    texts = []
    for i, part in enumerate(value):
        p = Fields(part, f"{param}[{i}]")
        kind = p.string("type", required=True)
        if kind not in TEXT_PART_TYPES:
            raise unsupported(p.param("type"), f"only text parts are supported, got {kind!r}")
        texts.append(p.string("text", required=True) or "")
    return "".join(texts)


def read_role(m: Fields) -> str:
    """A message's role, one of :data:`CHAT_ROLES`; a tool-calling role is unsupported, any
    other name invalid."""
    role = m.string("role", required=True) or ""
    if role in TOOL_ROLES:
        raise unsupported(m.param("role"), f"role {role!r} needs tool calling, which this "
                          f"server does not support; use one of {sorted(CHAT_ROLES)}")
    if role not in CHAT_ROLES:
        raise invalid(m.param("role"), f"must be one of {sorted(CHAT_ROLES)}, got {role!r}")
    return role


def read_message(m: Fields) -> tuple[str, str]:
    """(role, text) of a chat message or conversation item: the same checks, in the same order,
    for the HTTP API and the WebSocket."""
    role = read_role(m)
    for key in TOOL_CALL_FIELDS:
        if m.has(key):
            raise unsupported(m.param(key), "tool calls are not supported")
    if not m.has("content"):
        raise missing(m.param("content"))
    return role, read_content(m.obj["content"], m.param("content"))


def check_model(f: Fields, served: str, key: str = "model") -> None:
    """``model`` is optional, but when given it must name the served model."""
    name = f.string(key)
    if name is not None and name != served:
        raise model_not_found(name, f.param(key))


def fit_max_tokens(prompt_len: int, requested: int | None, max_model_len: int, *,
                   param: str, prompt_param: str) -> int:
    """The completion's token limit: ``requested`` if prompt + it fits, else an error naming
    the field at fault; absent = whatever room the context leaves (vLLM's behaviour)."""
    if prompt_len >= max_model_len:
        raise ProtocolError(
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens and at least one new token must fit.", prompt_param)
    room = max_model_len - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise ProtocolError(
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Reduce the prompt or {param}.", param)
    return requested


def timings_view(u: Usage) -> JSON:
    return {"queue_time": round(u.queue_time, 6),
            "time_to_first_token": None if u.ttft is None else round(u.ttft, 6),
            "decode_time": round(u.decode_time, 6)}


def speculation_view(u: Usage) -> JSON:
    return {"num_steps": u.num_spec_steps, "drafted_tokens": u.num_drafted_tokens,
            "accepted_tokens": u.num_accepted_tokens,
            "mean_acceptance_length": round(u.mean_acceptance_length, 4)}


def sampling_view(p: SamplingParams) -> JSON:
    """The effective sampling fields, under their API names."""
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
            "min_p": p.min_p, "seed": p.seed, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty, "stop": list(p.stop),
            "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos}
