"""ServerSettings: validated once, errors name the setting; the served model name."""

from __future__ import annotations

import pytest

from quickdraft.engine.config import EngineConfig
from quickdraft.server.settings import ServerSettings, SettingsError, read_api_key_file


@pytest.mark.parametrize(("kw", "word"), [
    (dict(port=70000), "port"),
    (dict(max_connections=0), "max_connections"),
    (dict(max_inflight_requests=0), "max_inflight_requests"),
    (dict(max_message_size=10), "max_message_size"),
    (dict(drain_timeout=-1), "drain_timeout"),
    (dict(api_keys=("short",)), "API key"),
    (dict(api_keys=("has a space in it",)), "API key"),
    (dict(allowed_origins=("not-an-origin",)), "origin"),
    (dict(allowed_origins=("https://x.example/path",)), "origin"),
    (dict(log_level="loud"), "log_level"),
])
def test_invalid_settings_are_refused(kw, word):
    with pytest.raises(SettingsError, match=word):
        ServerSettings(**kw)


def test_defaults_and_normalization():
    s = ServerSettings(allowed_origins=("HTTPS://App.Example:8443/",),
                       api_keys=("k" * 8,))
    assert (s.host, s.port, s.max_message_size) == ("127.0.0.1", 8000, 1 << 20)
    assert s.allowed_origins == ("https://app.example:8443",)
    assert s.auth_enabled and s.model_name == "SmolLM2-135M-Instruct"
    assert ServerSettings(engine=EngineConfig(model="/models/Qwen2-0.5B/")).model_name \
        == "Qwen2-0.5B"
    assert ServerSettings(engine=EngineConfig(model="/m/tiny.Q8_0.gguf")).model_name \
        == "tiny.Q8_0"
    assert ServerSettings(served_model_name="chat").model_name == "chat"
    with pytest.raises(AttributeError):
        s.port = 1  # type: ignore[misc]


def test_api_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nfirst-key-123\n\n  second-key-456  \n")
    assert read_api_key_file(str(path)) == ["first-key-123", "second-key-456"]
    path.write_text("# nothing\n")
    with pytest.raises(SettingsError, match="no key"):
        read_api_key_file(str(path))
    with pytest.raises(SettingsError, match="cannot read"):
        read_api_key_file(str(tmp_path / "missing"))
