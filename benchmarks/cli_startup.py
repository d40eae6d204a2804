"""Start-up time of the ``quickdraft`` command line, this checkout against a baseline commit.

    python benchmarks/cli_startup.py --baseline acfd2cb --runs 7

Each command runs ``--runs`` times, alternating baseline and current (so load on the machine
hits both alike); the table and plot give the median wall time:

- ``--help``: the top-level help;
- ``batch --url``: a batch against a closed port (argument parsing, imports, one refused
  connection, the error);
- ``chat``: in a pseudo-terminal, the time until the first output appears and until the
  prompt takes input (the model loads in-process).

The baseline is checked out into a temporary git worktree and run from there (commits before
the ``quickdraft.*`` namespace ran as ``python -m server.cli``). Writes
``benchmarks/results/cli_startup.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pexpect

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed once the with-block ends


def entry(tree: Path) -> list[str]:
    """How to run the CLI of the checkout at ``tree``."""
    if (tree / "quickdraft" / "__main__.py").exists():
        return [sys.executable, "-m", "quickdraft"]
    return [sys.executable, "-m", "server.cli"]


def time_command(tree: Path, args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([*entry(tree), *args], cwd=tree, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(tree)})
    return time.perf_counter() - start


def time_chat(tree: Path) -> tuple[float, float]:
    """(seconds to the first output, seconds until the prompt takes input)."""
    cmd = entry(tree)
    start = time.perf_counter()
    child = pexpect.spawn(cmd[0], [*cmd[1:], "chat", "--temperature", "0"], cwd=str(tree),
                          env={**os.environ, "PYTHONPATH": str(tree)}, encoding="utf-8",
                          timeout=300, dimensions=(40, 120))
    child.expect(r"\S")
    first = time.perf_counter() - start
    child.expect(r"\n> ")  # the prompt, both before and after the terminal-chat rework
    ready = time.perf_counter() - start
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    return first, ready


def measure(tree: Path, port: int, batch_file: Path) -> dict[str, float]:
    """One run of each command."""
    first, ready = time_chat(tree)
    return {"--help": time_command(tree, ["--help"]),
            "batch --url": time_command(
                tree, ["batch", str(batch_file), "-o", str(batch_file.with_suffix(".out")),
                       "--url", f"http://127.0.0.1:{port}", "--quiet"]),
            "chat: first output": first, "chat: ready": ready}


def plot(result: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(result.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.38
    for i, (label, row) in enumerate(result.items()):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        ax.bar(xs, [row[n] for n in names], width, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("median seconds (log scale)")
    ax.set_title("quickdraft CLI start-up")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="git commit to compare against")
    parser.add_argument("--runs", type=int, default=7, help="runs per command (median)")
    args = parser.parse_args()
    port = closed_port()
    with tempfile.TemporaryDirectory(prefix="qd-startup-") as tmp:
        base = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base),
                        args.baseline], check=True)
        batch_file = Path(tmp) / "in.jsonl"
        batch_file.write_text(json.dumps({
            "custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}) + "\n")
        try:
            samples = {"baseline": {}, "current": {}}  # type: dict[str, dict[str, list[float]]]
            for i in range(args.runs):  # alternate, one run each per round
                for label, tree in (("baseline", base), ("current", ROOT)):
                    print(f"round {i + 1}/{args.runs}: {label}", file=sys.stderr, flush=True)
                    for k, v in measure(tree, port, batch_file).items():
                        samples[label].setdefault(k, []).append(v)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                           check=False)
    result = {label: {k: statistics.median(v) for k, v in rows.items()}
              for label, rows in samples.items()}
    print(f"{'command':22} {'baseline':>10} {'current':>10}")
    for name in result["current"]:
        print(f"{name:22} {result['baseline'][name]:9.2f}s {result['current'][name]:9.2f}s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cli_startup.json").write_text(json.dumps({
        "baseline": args.baseline, "runs": args.runs, "machine": platform.processor()
        or platform.machine(), "median_seconds": result, "samples": samples}, indent=1))
    plot(result, RESULTS / "cli_startup.png")


if __name__ == "__main__":
    main()
