"""``cacheblend-rag serve`` as a subprocess of a test: started, its URL read from its first line, and stopped
by a signal to its own pid (never by a name pattern). Imported by the tests of this folder."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

URL_LINE = re.compile(r"serving (?P<name>\S+) on (?P<url>http://127\.0\.0\.1:\d+)")


def command() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).parent / "cacheblend-rag"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cacheblend_rag.cli"]


class ServeProcess:
    """One ``cacheblend-rag serve ARGS`` process; ``stderr`` goes to ``log`` (read back on failure)."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._log_file = open(log, "w")
        self.process = subprocess.Popen([*command(), "serve", *args], stdout=subprocess.PIPE, stderr=self._log_file,
                                        text=True, env={**os.environ, **(env or {})})
        self.name, self.url = self._first_line(timeout=120)

    def _first_line(self, timeout: float) -> tuple[str, str]:
        lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.process.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        match = URL_LINE.fullmatch(line.strip())
        if match is None:
            self.stop()
            raise AssertionError(f"serve printed {line!r}, not its URL; its log:\n{self.log.read_text()}")
        return match["name"], match["url"]

    def wait_healthy(self, timeout: float = 180.0) -> list[int]:
        """Poll ``/health`` until it answers 200; the statuses seen, in order (repeats collapsed)."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while not seen or seen[-1] != 200:
            assert self.process.poll() is None, f"serve exited with {self.process.returncode}:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, f"/health never said 200 (saw {seen}):\n{self.log.read_text()}"
            status = httpx.get(f"{self.url}/health", timeout=10).status_code
            if not seen or seen[-1] != status:
                seen.append(status)
            time.sleep(0.05)
        return seen

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM to this process; its exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        self._log_file.close()
