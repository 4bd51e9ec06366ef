"""Fixtures of langchain-cacheblend's tests. Tiny random models make most tests fast; the SmolLM2 test is slow.
``cacheblend_server``: a real ``cacheblend-rag serve`` in a subprocess, one per test module that uses it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterator

import pytest

# How long a server may take to load the tiny model and listen (a busy 2-core machine imports torch slowly).
_SERVER_START_S = 120.0
_READY = re.compile(r"serving \S+ on (http://[\w.\-]+:\d+)")


@pytest.fixture(scope="session")
def smollm2_engine():
    """The embedded SmolLM2-135M-Instruct (converted once into the user cache). Test prompts are
    shorter than the engine's ``min_blend_tokens``: they must blend, not fall back to full prefill."""
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained(min_blend_tokens=0)


@dataclass
class RunningServer:
    """A ``cacheblend-rag serve`` of the tiny Qwen2 answering at ``base_url``, which takes ``api_key`` only."""

    base_url: str
    api_key: str
    process: subprocess.Popen
    output: list[str] = field(default_factory=list)  # what it printed, for a failing test's message

    def log(self) -> str:
        return "".join(self.output[-60:])


def _drain(process: subprocess.Popen, output: list[str], ready: list[str], seen: threading.Event) -> None:
    """Read the server's output to its end (a full pipe would block it), noting the line that says it listens."""
    assert process.stdout is not None
    for line in process.stdout:
        output.append(line)
        match = _READY.search(line)
        if match and not seen.is_set():
            ready.append(match.group(1))
            seen.set()
    seen.set()  # it ended: whoever waits stops waiting


def _wait_healthy(base_url: str, api_key: str, process: subprocess.Popen, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline and process.poll() is None:
        try:
            answer = httpx.get(f"{base_url}/health", headers={"Authorization": f"Bearer {api_key}"}, timeout=5)
            if answer.status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {base_url} did not answer GET /health with 200")


@pytest.fixture(scope="module")
def cacheblend_server() -> Iterator[RunningServer]:
    """``cacheblend-rag serve --model tiny-qwen2 --port 0 --store memory`` with an API key, started once per
    module (on a free port the server picks) and stopped by its own pid when the module's tests are done."""
    pytest.importorskip("fastapi", reason="the server needs cacheblend-rag's [server] extra")
    pytest.importorskip("uvicorn", reason="the server needs cacheblend-rag's [server] extra")
    api_key = f"test-{uuid.uuid4().hex}"
    command = [sys.executable, "-m", "cacheblend_rag.cli", "serve", "--model", "tiny-qwen2", "--port", "0",
               "--store", "memory", "--api-key", api_key]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CACHEBLEND_API_KEY", None)  # the key is the one on the command line
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output: list[str] = []
    ready: list[str] = []
    seen = threading.Event()
    threading.Thread(target=_drain, args=(process, output, ready, seen), daemon=True).start()
    server = None
    try:
        deadline = time.monotonic() + _SERVER_START_S
        seen.wait(_SERVER_START_S)
        if not ready:
            raise RuntimeError(f"`{' '.join(command[1:])}` did not say where it serves (exit code "
                               f"{process.poll()}):\n{''.join(output[-60:])}")
        _wait_healthy(ready[0], api_key, process, deadline)
        server = RunningServer(ready[0], api_key, process, output)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
