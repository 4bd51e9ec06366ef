"""A local Ray of the command's own, started and stopped by process id.

``ray.init()`` would start Ray's processes in the command's process group, where a terminal's Ctrl-C
(or a supervisor's SIGTERM to the group) reaches them at the same moment as the command: they die
before the command has drained the replicas. So the head runs as ``ray start --head --block`` in a
session of its own; the command connects to it, and at the end signals that process alone, which
stops what it started; should the command itself be killed outright, the kernel signals the head
(``PR_SET_PDEATHSIG``), which then stops the same way. Whatever of it is still alive after ``STOP_TIMEOUT_S`` (its own descendants,
found by process id, never by name) is killed.

Ray's token authentication stays on, with a token of this head's own (``RAY_AUTH_TOKEN`` in the head's
environment and in this process's, which Ray's workers inherit): its ports listen on the machine's
address, where anyone else could otherwise run code in it.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
_ADDRESS = re.compile(r"ray start --address='(?P<address>[^']+)'")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_READY = "This command will now block forever"


def _stop_with_parent() -> None:
    """In the head's process before ``exec``: SIGTERM when this command's process dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # elsewhere the head outlives a killed command; stop() still stops it on every other exit


def _ray_command() -> list[str]:
    script = Path(sys.executable).parent / "ray"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def _free_port() -> int:
    # Above Ray's own worker port range (10002-19999), which a head port may not fall in.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRay:
    """``start()`` returns the address to ``ray.init``; ``stop()`` leaves no process of it behind."""

    def __init__(self, num_cpus: Optional[int] = None) -> None:
        self.num_cpus = num_cpus
        self.process: Optional[subprocess.Popen] = None
        self.log = Path(tempfile.mkdtemp(prefix="cacheblend-ray-")) / "ray-start.log"

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        port = _free_port()
        while 10002 <= port <= 19999:
            port = _free_port()
        command = [*_ray_command(), "start", "--head", "--block", f"--port={port}", "--include-dashboard=false",
                   "--disable-usage-stats"]
        if self.num_cpus is not None:
            command.append(f"--num-cpus={self.num_cpus}")
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, preexec_fn=_stop_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = _ANSI.sub("", self.log.read_text(errors="replace"))
            if _READY in text and (match := _ADDRESS.search(text)):
                return match["address"]
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        tail = self.log.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"a local Ray head did not start within {timeout:.0f} s; `ray start` said:\n{tail}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            descendants = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        process.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        _, alive = psutil.wait_procs(descendants, timeout=5)
        for leftover in alive:
            try:
                leftover.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)


__all__ = ["LocalRay"]
