"""The wheel as a user installs it: built from this checkout, installed into a fresh virtual
environment, run from outside the repository. It holds one top-level package (``quickdraft``)
with the C/C++ kernel sources and the web UI, and an installed ``quickdraft serve`` serves the
UI and a chat with every native kernel loaded.

The venv sees the base environment's packages (``--system-site-packages``: torch & co. are
not downloaded again) but quickdraft itself comes only from the wheel: the test checks where
it is imported from.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, timeout=600)
    (found,) = out.glob("quickdraft-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed; its bin/ directory."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    bin_dir = env_dir / "bin"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install",
                    "--no-deps", "-q", str(wheel)], check=True, timeout=600)
    return bin_dir


def test_the_wheel_holds_one_package_with_kernel_sources_and_the_ui(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"quickdraft"}
    for needed in ("quickdraft/kernels/cpu_gemv.c", "quickdraft/kernels/cpu_fused.c",
                   "quickdraft/kernels/cpu_attention.c", "quickdraft/kernels/cpu_layer.cpp",
                   "quickdraft/kernels/cpu_attention_lane.h", "quickdraft/kernels/cpu_bf16.h",
                   "quickdraft/kernels/cpu_attention_tasks.h",
                   "quickdraft/kernels/cpu_attention_amx.h", "quickdraft/kernels/cpu_amx.h",
                   "quickdraft/spec/suffix_tree.c", "quickdraft/web/index.html",
                   "quickdraft/web/app.js", "quickdraft/web/vendor/marked.esm.js",
                   "quickdraft/engine/models/llama.py", "quickdraft/__main__.py"):
        assert needed in names, needed
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["quickdraft"]


def test_installed_package_imports_from_the_venv(installed: Path, tmp_path: Path):
    done = subprocess.run([str(installed / "python"), "-c",
                           "import quickdraft, quickdraft.server.app as a; "
                           "print(quickdraft.__file__); print(a.__file__)"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    for line in done.stdout.split():
        assert Path(line).is_relative_to(installed.parent), line
    version = subprocess.run([str(installed / "quickdraft"), "--version"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, check=True)
    assert version.stdout.startswith("quickdraft ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(installed: Path, tmp_path: Path) -> Iterator[str]:
    """The installed ``quickdraft serve`` on the default model; its base URL once healthy."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(installed / "quickdraft"), "serve", "--port", str(port), "--log-level",
             "warning", "--batch-db", str(tmp_path / "b.sqlite3")],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text(errors="replace")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("never healthy:\n" + log_path.read_text(errors="replace"))
        yield url
        assert "ERROR" not in log_path.read_text(errors="replace")
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.slow
def test_installed_server_serves_the_ui_and_a_chat_on_the_fast_path(served: str):
    health = httpx.get(f"{served}/health", timeout=10).json()
    native = health["native_kernels"]
    assert {"cpu_gemv", "cpu_fused", "cpu_attention"} <= set(native), native
    assert set(native.values()) == {"ok"}, native
    assert "errors" not in health
    page = httpx.get(f"{served}/", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()
    assert httpx.get(f"{served}/static/app.js", timeout=10).status_code == 200
    answer = httpx.post(f"{served}/v1/chat/completions", timeout=120, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
    assert answer["choices"][0]["message"]["content"].strip()
    assert answer["usage"]["completion_tokens"] > 0
