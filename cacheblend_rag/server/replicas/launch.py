"""``cacheblend-rag serve --ray``: the server as a Ray Serve application of N engine replicas.

:func:`build_application` makes the application (the front end bound to the engine deployment, the
chunk router on its handle); :func:`app_builder` is the same for Ray's own ``serve run`` / ``serve
deploy`` config files (docs/operations.md). :func:`run` is the command: a local Ray it starts (or the
cluster at ``--ray-address``), the application deployed, the URL printed once every replica has loaded
its model, and on SIGINT / SIGTERM the application deleted (Ray drains each replica's requests) and the
local Ray stopped, leaving no process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Optional

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.server.options import DEFAULT_GRACEFUL_SHUTDOWN_S, ServerConfig
from cacheblend_rag.server.replicas.routing import DEFAULT_SPILL_THRESHOLD
from cacheblend_rag.store.urls import redact

APP_NAME = "cacheblend"
# Requests Ray lets one replica hold at once; its scheduler batches them and queues the rest itself.
MAX_ONGOING_REQUESTS = 32
# How often each replica tells the routers what its memory tier holds.
ROUTING_STATS_PERIOD_S = 2.0
SHARED_SCHEMES = ("redis://", "rediss://")
# Seconds the command waits, once Ray says the application runs, for its router to reach every replica.
ROUTED_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ReplicaOptions:
    """How many replicas, where, routed how. ``min_replicas``/``max_replicas`` turn on Ray Serve's
    autoscaling (starting at ``replicas``); ``threads``: torch threads per replica (``None``: the
    machine's cores shared out between the replicas of a local Ray, torch's default on a cluster)."""

    replicas: int = 2
    min_replicas: Optional[int] = None
    max_replicas: Optional[int] = None
    ray_address: Optional[str] = None
    router: Literal["chunk", "default"] = "chunk"
    spill_threshold: int = DEFAULT_SPILL_THRESHOLD
    threads: Optional[int] = None
    graceful_shutdown_s: int = DEFAULT_GRACEFUL_SHUTDOWN_S

    def __post_init__(self) -> None:
        for name, flag in (("replicas", "--replicas"), ("min_replicas", "--min-replicas"),
                           ("max_replicas", "--max-replicas"), ("threads", "--replica-threads"),
                           ("spill_threshold", "spill_threshold")):  # the router refuses it too, but inside Ray
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{flag} {value!r} must be a positive whole number")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ConfigError("autoscaling needs both --min-replicas and --max-replicas")
        if self.min_replicas is not None and not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ConfigError(f"--replicas {self.replicas} (the replicas to start with) must lie between "
                              f"--min-replicas {self.min_replicas} and --max-replicas {self.max_replicas}")
        if self.router not in ("chunk", "default"):
            raise ConfigError(f"--router {self.router!r}: choose chunk (by documents) or default (Ray's own)")

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.max_replicas is not None else self.replicas


def check_shared_store(store: Optional[str], replicas: int) -> None:
    """Replicas share chunk K/V only through a store they all reach: Redis, or a tiered store with Redis
    behind its disk. A local folder or memory would give each replica its own, each computing every
    chunk again and none finding another's."""
    if replicas < 2:
        return
    spec = store or ""
    behind = spec.partition(",")[2] if spec.startswith("tiered:") else spec
    shared = behind.lower().startswith(SHARED_SCHEMES)  # open_store reads a URL's scheme in any case (REDIS://)
    if not shared:
        raise ConfigError(f"--store {redact(spec) or '(none)'} is not shared: {replicas} replicas would each keep "
                          "chunk K/V of their own, computing every document again and never finding another "
                          "replica's; give them one Redis: --store redis://HOST:6379/0 (a Redis Cluster too), or "
                          "tiered:PATH,redis://HOST:6379/0 for a disk tier on each machine in front of it")


def replica_resources(options: ReplicaOptions, *, local: bool) -> tuple[float, Optional[int]]:
    """Ray CPUs each replica asks for and its torch threads. On one machine the replicas share its cores,
    so that Ray places them all and their threads do not fight; on a cluster each asks for ``threads``
    (else one CPU, torch's default threads)."""
    if not local:
        return float(options.threads or 1), options.threads
    cores = os.cpu_count() or 1
    share = cores / options.most_replicas
    # Ray takes fractions of one CPU only; rounded down, so that all of them fit (3 on 2 cores: 0.66, not 0.67).
    share = float(int(share)) if share >= 1 else cores * 100 // options.most_replicas / 100
    threads = options.threads or max(1, int(share))
    return min(float(threads), share), threads


def build_application(config: ServerConfig, options: ReplicaOptions = ReplicaOptions(), *, local: bool = True) -> Any:
    """The Ray Serve application: ``CacheBlendFront`` bound to ``CacheBlendEngine`` (``options.replicas`` of
    them, or autoscaled), the chunk router (or Ray's default) on the front end's handle; ``local``: all on
    this machine (:func:`replica_resources`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cacheblend_rag.server.replicas.deployments import CacheBlendEngine, front_deployment

    check_shared_store(config.store, options.most_replicas)
    cpus, threads = replica_resources(options, local=local)
    if options.router == "chunk":
        from cacheblend_rag.server.replicas.router import ChunkAffinityRouter

        router = RequestRouterConfig(request_router_class=ChunkAffinityRouter,
                                     request_router_kwargs={"spill_threshold": options.spill_threshold},
                                     request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)
    else:
        router = RequestRouterConfig()
    scaling: dict[str, Any] = {"num_replicas": options.replicas}
    if options.min_replicas is not None:
        scaling = {"autoscaling_config": {"min_replicas": options.min_replicas, "max_replicas": options.max_replicas,
                                          "initial_replicas": options.replicas, "target_ongoing_requests": 4}}
    engine = serve.deployment(CacheBlendEngine).options(
        name="CacheBlendEngine", max_ongoing_requests=MAX_ONGOING_REQUESTS, request_router_config=router,
        ray_actor_options={"num_cpus": cpus},
        graceful_shutdown_timeout_s=options.graceful_shutdown_s, health_check_period_s=5, **scaling)
    front = serve.deployment(front_deployment(config.max_body_bytes)).options(
        name="CacheBlendFront", num_replicas=1, max_ongoing_requests=4 * MAX_ONGOING_REQUESTS * options.most_replicas,
        ray_actor_options={"num_cpus": 0})
    return front.bind(engine.bind(config, threads))


def app_builder(args: dict[str, Any]) -> Any:
    """For Ray's config files (``import_path: cacheblend_rag.server.replicas.launch:app_builder``): ``args``
    are ``model``, ``store``, ``served_model_name``, ``settings`` (CacheBlendSettings fields) and the
    :class:`ReplicaOptions` fields, e.g. ``{"model": "qwen2.5-coder-1.5b", "store": "redis://redis:6379/0",
    "replicas": 4}``."""
    args = dict(args)
    config = ServerConfig(model=args.pop("model", ServerConfig.model), store=args.pop("store", None),
                          settings=dict(args.pop("settings", {})), served_model_name=args.pop("served_model_name", None),
                          api_key=os.environ.get("CACHEBLEND_API_KEY") or None)
    fields = set(ReplicaOptions.__dataclass_fields__) - {"ray_address"}
    unknown = sorted(set(args) - fields)
    if unknown:
        raise ConfigError(f"unknown args {unknown}: known are model, store, served_model_name, settings, "
                          f"{', '.join(sorted(fields))}")
    return build_application(config, ReplicaOptions(**args), local=False)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _wait_routed(url: str, replicas: int, *, api_key: Optional[str], stop: threading.Event,
                 timeout: float = ROUTED_TIMEOUT_S) -> int:
    """Poll ``/health`` until the front end's router has sent it to ``replicas`` distinct replicas (Ray reports the
    application running a moment before every router knows every replica; a document set first seen then would
    make its home on the one replica known, and keep it); the replicas seen (fewer on a timeout: served anyway)."""
    import httpx

    seen: set[str] = set()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while len(seen) < replicas and time.monotonic() < deadline and not stop.is_set():
        try:
            replica = httpx.get(f"{url}/health", headers=headers, timeout=10).headers.get("x-cacheblend-replica")
        except httpx.HTTPError:
            replica = None
        if replica:
            seen.add(replica)
        time.sleep(0.05)
    return len(seen)


def run(config: ServerConfig, options: ReplicaOptions, *, host: str = "127.0.0.1", port: int = 8000,
        verbose: bool = False) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean stop, 1 if the application could not start."""
    from cacheblend_rag.server.replicas.local_ray import LocalRay

    check_shared_store(config.store, options.most_replicas)
    local = options.ray_address is None
    port = port or free_port(host)
    stop = threading.Event()
    head = LocalRay() if local else None
    try:
        # Before Ray is imported: it reads the head's token from the environment once, at import.
        address = head.start() if head is not None else options.ray_address
        import ray
        from ray import serve

        ray.init(address=address, log_to_driver=verbose, logging_level="INFO" if verbose else "WARNING",
                 namespace="cacheblend")
        for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs a SIGTERM handler that dies
            signal.signal(sig, lambda *_: stop.set())
        serve.start(http_options={"host": host, "port": port},
                    logging_config={"log_level": "INFO" if verbose else "WARNING"})
        try:
            serve.run(build_application(config, options, local=local), name=APP_NAME, route_prefix="/")
        except Exception as exc:  # noqa: BLE001 - a replica that cannot load its model fails the deployment
            print(f"cacheblend-rag serve --ray: the replicas could not start: {type(exc).__name__}: {redact(exc)}",
                  file=sys.stderr)
            return 1
        seen = _wait_routed(f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}", options.replicas,
                            api_key=config.api_key, stop=stop)
        print(f"serving {config.name} on http://{host}:{port}", flush=True)
        print(f"{options.replicas} replicas on {'a local Ray' if local else options.ray_address} "
              f"({seen} answering through the router so far), router: {options.router}", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        serve.delete(APP_NAME)  # drains each replica's running requests (graceful_shutdown_s at most)
        return 0
    finally:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            from ray import serve

            if local:
                serve.shutdown()
            ray.shutdown()
        if head is not None:
            head.stop()


__all__ = ["APP_NAME", "ReplicaOptions", "app_builder", "build_application", "check_shared_store", "replica_resources",
           "run"]
