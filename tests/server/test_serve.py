"""``quickdraft serve`` argument wiring (settings from flags, key files, the environment) and
the log filter that keeps API keys out of access logs."""

from __future__ import annotations

import logging

import pytest

from quickdraft.server.cli import build_parser
from quickdraft.server.runner import RedactKeys
from quickdraft.server.serve import API_KEY_ENV, serve_settings


def settings_for(*argv: str):
    return serve_settings(build_parser().parse_args(["serve", *argv]))


def test_flags_to_settings(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    keys = tmp_path / "keys"
    keys.write_text("from-file-key-1\n")
    s = settings_for("--model", "/m/tiny", "--dtype", "float32", "--num-threads", "1",
                     "--port", "9001", "--api-key", "cli-key-0001", "--api-key-file",
                     str(keys), "--allowed-origins", "https://a.example,https://b.example",
                     "--allowed-origins", "http://c.example:8080", "--max-connections", "5",
                     "--max-inflight-requests", "7", "--drain-timeout", "2.5",
                     "--speculation", "off")
    assert s.api_keys == ("cli-key-0001", "from-file-key-1")
    assert s.allowed_origins == ("https://a.example", "https://b.example",
                                 "http://c.example:8080")
    assert (s.port, s.max_connections, s.max_inflight_requests, s.drain_timeout) == \
        (9001, 5, 7, 2.5)
    assert s.engine.num_threads == 1 and s.engine.dtype == "float32"
    assert s.engine.speculation == "off" and s.model_name == "tiny"
    d = settings_for()
    assert (d.host, d.port, d.max_message_size, d.api_keys) == ("127.0.0.1", 8000, 1 << 20, ())
    monkeypatch.setenv(API_KEY_ENV, "env-key-00001")
    assert settings_for().api_keys == ("env-key-00001",)


def test_bad_flags_exit_2(capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "--max-connections", "0"])
    assert args.func(args) == 2
    assert "max_connections" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculation", "warp"])


def test_keys_are_redacted_from_logs():
    record = logging.LogRecord("uvicorn.error", logging.INFO, "", 0,
                               '%s - "WebSocket %s" [accepted]',
                               ("127.0.0.1:5", "/v1/ws?x=1&api_key=s3cret-key&y=2"), None)
    assert RedactKeys().filter(record)
    assert "s3cret" not in record.getMessage() and "api_key=***&y=2" in record.getMessage()
    record = logging.LogRecord("x", logging.INFO, "", 0, "proto quickdraft.api-key.abcdefgh9",
                               (), None)
    RedactKeys().filter(record)
    assert record.getMessage() == "proto quickdraft.api-key.***"
