"""Gateway settings: one frozen dataclass, validated once in ``__post_init__``, built by the CLI
(``quickdraft serve``) or by tests, and handed to :func:`server.app.create_app`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from quickdraft.engine.config import EngineConfig
from quickdraft.engine.model_names import served_name

# What a browser may put after `quickdraft.api-key.` in Sec-WebSocket-Protocol (an HTTP token).
_TOKEN_SAFE = re.compile(r"^[A-Za-z0-9._~!#$%&'*+^`|-]+$")


# --- batch jobs (server/batch_api.py) ---
def default_batch_db_path() -> str:
    """``batches.sqlite3`` in the cache directory (``$QUICKDRAFT_CACHE`` or
    ``~/.cache/quickdraft``)."""
    from quickdraft.engine.loader import cache_root

    return str(cache_root() / "batches.sqlite3")
# --- end batch jobs ---


class SettingsError(ValueError):
    """A gateway setting is invalid; the message names the setting."""


def normalize_origin(origin: str) -> str:
    """``scheme://host[:port]`` in lower case without a trailing slash; ``*`` stays ``*``."""
    origin = origin.strip().rstrip("/").lower()
    if origin == "*":
        return origin
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise SettingsError(f"allowed origin must look like https://host[:port], got {origin!r}")
    return origin


@dataclass(frozen=True)
class ServerSettings:
    """Everything ``quickdraft serve`` can be told; limits apply per process."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: derived from the model path
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    allowed_origins: tuple[str, ...] = ()  # besides same-origin and localhost
    max_connections: int = 256  # open WebSocket sessions
    max_responses_per_connection: int = 8  # concurrent responses on one WebSocket
    max_inflight_requests: int = 64  # engine requests, WebSocket and HTTP together
    max_message_size: int = 1 << 20  # bytes: one WebSocket message or one HTTP body
    drain_timeout: float = 30.0  # seconds in-flight answers get to finish on SIGTERM
    max_conversation_items: int = 1024  # per WebSocket session
    log_level: str = "info"
    # --- batch jobs (server/batch_api.py) ---
    batch_db_path: str = field(default_factory=default_batch_db_path)  # created on first use
    batch_max_in_flight: int = 8  # batch lines in the engine at once (background priority)
    max_upload_size: int = 200 << 20  # bytes: one file uploaded to POST /v1/files
    # --- end batch jobs ---

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise SettingsError("engine must be an EngineConfig")
        if not self.host:
            raise SettingsError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_connections", "max_responses_per_connection", "max_inflight_requests",
                     "max_conversation_items"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1024 <= self.max_message_size <= 1 << 30:
            raise SettingsError("max_message_size must be in [1 KiB, 1 GiB], "
                                f"got {self.max_message_size}")
        if not 0 <= self.drain_timeout <= 3600:
            raise SettingsError(f"drain_timeout must be in [0, 3600] s, got {self.drain_timeout}")
        if self.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise SettingsError(f"unknown log_level {self.log_level!r}")
        object.__setattr__(self, "api_keys", self._checked_keys(self.api_keys))
        object.__setattr__(self, "allowed_origins",
                           tuple(normalize_origin(o) for o in self.allowed_origins))
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise SettingsError("served_model_name must not be blank")
        # --- batch jobs ---
        if not str(self.batch_db_path).strip():
            raise SettingsError("batch_db_path must not be empty")
        if self.batch_max_in_flight < 1:
            raise SettingsError(f"batch_max_in_flight must be >= 1, "
                                f"got {self.batch_max_in_flight}")
        if not 1024 <= self.max_upload_size <= 1 << 32:
            raise SettingsError("max_upload_size must be in [1 KiB, 4 GiB], "
                                f"got {self.max_upload_size}")
        # --- end batch jobs ---

    @staticmethod
    def _checked_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
        keys = tuple(keys)
        for key in keys:
            if not isinstance(key, str) or len(key) < 8 or not _TOKEN_SAFE.match(key):
                raise SettingsError("each API key must be at least 8 characters of letters, "
                                    "digits and -._~!#$%&'*+^`| (no spaces)")
        return keys

    @property
    def model_name(self) -> str:
        """The name clients pass as ``model`` and see in ``/v1/models``."""
        if self.served_model_name:
            return self.served_model_name
        return served_name(self.engine.model)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)


def read_api_key_file(path: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise SettingsError(f"cannot read API key file {path}: {exc.strerror}") from exc
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise SettingsError(f"API key file {path} holds no key")
    return keys
