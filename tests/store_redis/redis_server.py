"""A real redis-server for the tests: started on 127.0.0.1, a free port, with a password and no persistence."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

PASSWORD = "cacheblend-test-password"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; ``kill`` crashes it, ``start`` brings it back on the same port (empty)."""

    def __init__(self, directory: Path, password: str = PASSWORD, extra_args: tuple[str, ...] = ()) -> None:
        self.executable = shutil.which("redis-server")
        if self.executable is None:
            raise FileNotFoundError("redis-server is not installed; `make test` installs it "
                                    "(apt-get install redis-server)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.extra_args = extra_args
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    def url(self, password: str | None = None, db: int = 0) -> str:
        return f"redis://:{self.password if password is None else password}@127.0.0.1:{self.port}/{db}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def start(self, timeout: float = 20.0) -> "RedisServer":
        self.process = subprocess.Popen(
            [self.executable, "--bind", "127.0.0.1", "--port", str(self.port), "--requirepass", self.password,
             "--save", "", "--appendonly", "no", "--dir", str(self.directory),
             "--logfile", str(self.directory / "redis.log"), "--daemonize", "no", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.client() as client:
                    client.ping()
                return self
            except redis.exceptions.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (self.directory / "redis.log")
                    raise RuntimeError(f"redis-server did not start on port {self.port}: "
                                       f"{log.read_text()[-2000:] if log.exists() else 'no log'}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the server vanishes as in a crash, with every connection open."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
            self.process = None


class RedisClusterServers:
    """Three masters of a Redis Cluster on loopback (no replicas), each slot range on one of them."""

    def __init__(self, directory: Path, password: str = PASSWORD) -> None:
        self.password = password
        self.nodes = [
            RedisServer(Path(directory) / f"node{i}", password,
                        ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--masterauth", password,
                         "--cluster-port", str(free_port())))  # the default (port + 10000) may not exist
            for i in range(3)
        ]

    def url(self, password: str | None = None) -> str:
        return self.nodes[0].url(password) + "?cluster=true"

    def start(self, timeout: float = 30.0) -> "RedisClusterServers":
        for node in self.nodes:
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise FileNotFoundError("redis-cli is not installed (it comes with the redis-server package)")
        subprocess.run([cli, "-a", self.password, "--no-auth-warning", "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes), "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
        deadline = time.monotonic() + timeout
        with self.nodes[0].client() as client:
            while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
                time.sleep(0.1)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
