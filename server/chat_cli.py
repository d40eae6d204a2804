"""``quickdraft chat``: a terminal chat with the model loaded in this process, or with a running
server (``--url``, over the WebSocket protocol with :mod:`quickdraft.client`).

The line is edited with readline (arrow keys, history, kept in
``$XDG_STATE_HOME/quickdraft/chat_history``); slash commands (``/help``) set the system prompt,
clear or save the conversation. Ctrl-C stops an answer; at the prompt it quits, as Ctrl-D does.
Start-up stays fast: torch, the engine and the client are imported only when they are used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from quickdraft.server.chat_backends import Chat, ChatError, LocalChat, RemoteChat, TurnError

if TYPE_CHECKING:
    from quickdraft.engine.sampling_params import SamplingParams

T = TypeVar("T")
HISTORY_LINES = 1000
HELP = """\
commands:
  /help            this list
  /system TEXT     set the system prompt and clear the conversation (/system alone removes it)
  /reset           clear the conversation
  /save [PATH]     write the conversation as JSON (default: chat-YYYYmmdd-HHMMSS.json here)
  /quit, /exit     leave (as do Ctrl-D and Ctrl-C at the prompt)
  //text           send "/text": a message that starts with a slash
Ctrl-C stops an answer. Left/Right edit the line, Up/Down recall earlier lines."""


def add_chat_parser(sub: Any) -> None:
    """Add ``chat`` to the ``quickdraft`` subcommands."""
    from quickdraft.server.cli import add_engine_args, add_sampling_args  # imports this module

    p = sub.add_parser("chat", help="streaming multi-turn chat in the terminal (in-process, "
                       "or with a server: --url)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--no-history", dest="history", action="store_false",
                   help="do not read or write the line history file "
                   "($XDG_STATE_HOME/quickdraft/chat_history)")
    r = p.add_argument_group("with a running server")
    r.add_argument("--url", default=None,
                   help="chat with this server (ws://HOST:PORT or http://HOST:PORT) instead of "
                   "loading the model here; the engine flags are then the server's business")
    r.add_argument("--api-key", default=None, help="API key (default: $QUICKDRAFT_API_KEY)")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    from quickdraft.server.cli import sampling_params, use_colour

    try:
        url = ws_url(args.url) if args.url else None
    except ValueError as exc:
        print(f"quickdraft: error: {exc}", file=sys.stderr)
        return 2
    params = sampling_params(args)  # a bad value fails here, before anything loads
    loop = LoopThread()
    chat: Chat | None = None
    try:
        chat = open_chat(args, url, params, loop)
        save_history = start_line_editing(history_path() if args.history else None)
        try:
            Repl(chat, loop, use_colour(sys.stderr)).run()
        finally:
            save_history()
        return 0
    except ChatError as exc:
        print(f"quickdraft: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nquickdraft: stopped", file=sys.stderr)
        return 130
    finally:
        if chat is not None:
            with contextlib.suppress(Exception, KeyboardInterrupt):
                loop.run(chat.close())
        loop.stop()


def open_chat(args: argparse.Namespace, url: str | None, params: SamplingParams,
              loop: LoopThread) -> Chat:
    """Load the model (or connect) behind a spinner; print the ready line."""
    from quickdraft.engine.model_names import served_name

    start = time.monotonic()
    chat: Chat
    if url is None:
        chat = wait_with_spinner(f"loading model {served_name(args.model)}",
                                 lambda: LocalChat.load(args, params))
    else:
        chat = wait_with_spinner(f"connecting to {url}", lambda: loop.run(
            RemoteChat.open(url, args.api_key, args.system, params)))
    where = f" at {url}" if url else ""
    print(f"ready: {chat.model}{where} ({time.monotonic() - start:.1f} s)\n"
          "quickdraft chat — /help lists the commands. Ctrl-C stops an answer, Ctrl-D quits.",
          file=sys.stderr, flush=True)
    return chat


def ws_url(url: str) -> str:
    """The server's chat socket: http(s) becomes ws(s), HOST:PORT gets ws://, no path /v1/ws."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "ws", url
    scheme = {"http": "ws", "https": "wss"}.get(scheme.lower(), scheme.lower())
    if scheme not in ("ws", "wss") or not rest.strip("/"):
        raise ValueError(f"--url takes ws://HOST:PORT or http://HOST:PORT, got {url!r}")
    host, _, path = rest.partition("/")
    return f"{scheme}://{host}/{path or 'v1/ws'}"


# ---------------------------------------------------------------------- terminal


def history_path() -> Path:
    """``$XDG_STATE_HOME/quickdraft/chat_history`` (default ``~/.local/state``)."""
    state = os.environ.get("XDG_STATE_HOME", "")
    root = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return root / "quickdraft" / "chat_history"


def start_line_editing(path: Path | None) -> Callable[[], None]:
    """Importing readline makes ``input()`` editable, with history; read the history file and
    return the function that writes it back. A file that cannot be read or written is skipped."""
    if not sys.stdin.isatty():
        return lambda: None
    try:
        import readline
    except ImportError:  # a Python built without it: plain input()
        return lambda: None
    readline.set_history_length(HISTORY_LINES)
    if path is None:
        return lambda: None
    with contextlib.suppress(OSError):
        readline.read_history_file(path)

    def save() -> None:
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
    return save


def wait_with_spinner(label: str, work: Callable[[], T]) -> T:
    """Run ``work`` in a background thread; meanwhile a spinner on stderr when it is a terminal
    (else one plain line). ``work``'s exception is raised here."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = work()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
    thread = threading.Thread(target=target, name="quickdraft-chat-load", daemon=True)
    thread.start()
    tty = sys.stderr.isatty()
    if not tty:
        print(f"{label}…", file=sys.stderr, flush=True)
    utf8 = (sys.stderr.encoding or "").lower().replace("-", "") == "utf8"
    start = time.monotonic()
    try:
        for frame in itertools.cycle("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏" if utf8 else "|/-\\"):
            if tty:
                sys.stderr.write(f"\r{frame} {label}… {time.monotonic() - start:.0f} s ")
                sys.stderr.flush()
            thread.join(0.1)
            if not thread.is_alive():
                break
    finally:
        if tty:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


class LoopThread:
    """An asyncio event loop in a daemon thread: the engine's streams and the client's socket
    live on it while the main thread waits for the keyboard."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="quickdraft-chat",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], cleanup_timeout: float = 10.0) -> T:
        """Run ``coro`` on the loop and wait for it. Ctrl-C cancels it, waits for it to clean
        up (the answer aborted), and raises KeyboardInterrupt (unless it had finished)."""
        done = threading.Event()
        tasks: list[asyncio.Task[T]] = []

        def start() -> None:
            tasks.append(self.loop.create_task(coro))
            tasks[0].add_done_callback(lambda _: done.set())
        self.loop.call_soon_threadsafe(start)
        try:
            done.wait()
        except KeyboardInterrupt:
            self.loop.call_soon_threadsafe(lambda: tasks[0].cancel())  # after start(): FIFO
            done.wait(cleanup_timeout)
            if not done.is_set() or tasks[0].cancelled():
                raise
        return tasks[0].result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)


# ---------------------------------------------------------------------- the prompt


class Repl:
    """Reads lines: slash commands run here, anything else is sent to the model."""

    def __init__(self, chat: Chat, loop: LoopThread, colour: bool) -> None:
        self.chat = chat
        self.loop = loop
        self.colour = colour
        self.commands: dict[str, Callable[[str], bool]] = {
            "/help": self.help, "/system": self.system, "/reset": self.reset,
            "/save": self.save, "/quit": self.quit, "/exit": self.quit}

    def run(self) -> None:
        """Until /quit, Ctrl-D or Ctrl-C at the prompt."""
        while True:
            sys.stdout.write("\n")
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return
            text = line.strip()
            if text.startswith("/") and not text.startswith("//"):
                if not self.command(text):
                    return
            elif text:
                self.ask(text.removeprefix("/") if text.startswith("//") else text)

    def command(self, text: str) -> bool:
        """Run a slash command; False means quit."""
        name, *rest = text.split(maxsplit=1)
        handler = self.commands.get(name)
        if handler is None:
            note(f"[unknown command {name} — /help lists the commands]")
            return True
        return handler(rest[0] if rest else "")

    def ask(self, text: str) -> None:
        try:
            meter = self.loop.run(self.chat.answer(text, write_out))
        except KeyboardInterrupt:
            note("\n[stopped]")
        except TurnError as exc:
            note(f"\n[error: {exc}]")
        except ChatError:
            note("")  # the error line goes below the answer so far
            raise
        else:
            note("\n" + meter.line(self.colour))

    def help(self, _: str) -> bool:
        note(HELP)
        return True

    def system(self, text: str) -> bool:
        if self.call(self.chat.set_system(text or None)):
            note(f"[system prompt {'set' if text else 'removed'}; conversation cleared]")
        return True

    def reset(self, _: str) -> bool:
        if self.call(self.chat.reset()):
            note("[conversation cleared]")
        return True

    def save(self, where: str) -> bool:
        path = Path(where or f"chat-{datetime.now():%Y%m%d-%H%M%S}.json").expanduser()
        messages = self.chat.messages()
        try:
            path.write_text(json.dumps(messages, indent=2, ensure_ascii=False) + "\n",
                            encoding="utf-8")
        except OSError as exc:
            note(f"[error: cannot write {path}: {exc.strerror or exc}]")
        else:
            count = f"{len(messages)} message{'s' if len(messages) != 1 else ''}"
            note(f"[saved {count} to {path.resolve()}]")
        return True

    def quit(self, _: str) -> bool:
        note("[bye]")
        return False

    def call(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run a command's coroutine; False (and a note) if it failed or was interrupted."""
        try:
            self.loop.run(coro)
        except TurnError as exc:
            note(f"[error: {exc}]")
        except KeyboardInterrupt:
            note("[interrupted]")
        else:
            return True
        return False


def write_out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def note(text: str) -> None:
    """A line for the user that is not part of an answer (stderr)."""
    print(text, file=sys.stderr, flush=True)
