"""The command line as a new user meets it: every flag explained with its default, every
command listed, one seed flag, model names, version, and light start-up (``--help`` and the
HTTP-only commands import neither torch nor the engine)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

import quickdraft
from quickdraft.engine import model_fetch
from quickdraft.engine.model_names import (
    DEFAULT_MODEL_NAME,
    KNOWN_MODELS,
    canonical_model,
    served_name,
)
from quickdraft.server.cli import build_parser
from quickdraft.server.models_cli import FETCH_GROUPS

COMMANDS = {"chat", "generate", "serve", "batch", "models", "draft-head"}


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def every_parser() -> list[tuple[str, argparse.ArgumentParser]]:
    found, todo = [], [("quickdraft", build_parser())]
    while todo:
        name, parser = todo.pop()
        found.append((name, parser))
        todo += [(f"{name} {sub}", p) for sub, p in subparsers(parser).items()]
    return found


def test_top_level_help_lists_every_command_without_markup():
    text = build_parser().format_help()
    for command in COMMANDS:
        assert re.search(rf"\n    {command}\s", text), command  # long names wrap
    assert "``" not in text
    assert set(subparsers(build_parser())) == COMMANDS


@pytest.mark.parametrize(("name", "parser"), every_parser(), ids=lambda x: str(x))
def test_every_flag_has_help_and_shows_its_default(name, parser):
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        assert action.help, f"{name} {flag} has no help"
        shown = parser.formatter_class(prog=name)._get_help_string(action)  # type: ignore[attr-defined]
        switch = action.nargs == 0
        if not switch and action.default not in (None, [], argparse.SUPPRESS):
            assert "default" in shown, f"{name} {flag}: default {action.default!r} not shown"


def test_one_seed_flag():
    for name, parser in every_parser():
        flags = [f for a in parser._actions for f in a.option_strings if "seed" in f]
        assert flags in ([], ["--seed"]), (name, flags)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"quickdraft {quickdraft.__version__}"


def test_model_names_resolve_to_what_the_loader_takes(tmp_path, monkeypatch):
    assert canonical_model(None) is None
    for spelling in (DEFAULT_MODEL_NAME, "smollm2", "SMOLLM2-135M-Instruct", "default"):
        assert canonical_model(spelling) is None  # the embedded default
        assert served_name(spelling) == DEFAULT_MODEL_NAME
    assert canonical_model("qwen-coder-1.5b") == "qwen2.5-coder-1.5b"
    assert served_name("Qwen2.5-Coder-1.5B-Instruct") == "qwen2.5-coder-1.5b"
    assert canonical_model("/some/dir/model.gguf") == "/some/dir/model.gguf"
    assert served_name("/some/dir/My-Model.gguf") == "My-Model"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # an existing path wins over a name
    assert canonical_model("smollm2") == "smollm2"
    # the names the CLI knows are the models `quickdraft models fetch` fetches
    assert {m.name for m in KNOWN_MODELS if m.fetched} == set(model_fetch.CHUNKED_MODELS)
    assert set(FETCH_GROUPS) == set(model_fetch.MODEL_GROUPS)


def test_models_list_shows_the_default_and_the_fetched_models():
    out = run("models", "list").stdout
    assert DEFAULT_MODEL_NAME in out and "smollm2" in out
    for name in model_fetch.CHUNKED_MODELS:
        assert name in out


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quickdraft", *args], capture_output=True,
                          text=True, timeout=120, cwd=Path(quickdraft.__file__).parent.parent)


HEAVY = ("torch", "transformers", "quickdraft.engine.llm_engine", "quickdraft.engine.loader")


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["chat", "--help"],
                                  ["batch", "--help"]])
def test_help_imports_no_torch(argv):
    code = ("import sys, runpy; sys.argv = ['quickdraft', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('quickdraft', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120)
    assert "usage: quickdraft" in done.stdout
    assert "HEAVY []" in done.stderr, done.stderr


@pytest.mark.parametrize("no_color", [False, True])
def test_colours_only_on_a_terminal_without_no_color(tiny_model_dir, no_color):
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    if no_color:
        env["NO_COLOR"] = "1"
    child = pexpect.spawn(sys.executable, ["-m", "quickdraft", "generate", "hi", "--quiet",
                                           "--model", str(tiny_model_dir), "--max-tokens", "3",
                                           "--kv-cache-memory", "0.01"],
                          env=env, encoding="utf-8", timeout=120)
    child.expect(pexpect.EOF)
    out = child.before or ""
    assert "tokens, TTFT" in out
    assert ("\x1b[2m" in out) is not no_color
