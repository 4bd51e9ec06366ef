"""``cacheblend-rag serve``: the OpenAI-compatible HTTP server (docs/serving.md).

With no argument it serves the embedded SmolLM2-135M-Instruct on http://127.0.0.1:8000, keeping chunk K/V
in a disk store in the package's cache folder (``~/.cache/cacheblend-rag/chunks``), so a restarted server
finds the chunks it computed before. The socket is bound first and one line says where it is
(``serving NAME on http://HOST:PORT``, the real port with ``--port 0``); the model then loads and
``GET /health`` answers 200 once it has answered a one-token request. SIGINT or SIGTERM stops accepting,
lets the running requests finish (``--graceful-shutdown`` seconds), closes the scheduler and exits 0.

Each BlendConfig field is a flag of its own (``--recompute-ratio 0.2``); only the flags given are set, so a
saved calibration of the model (``cacheblend-rag calibrate``) still applies to the others.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import typing
from typing import Any, Callable

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.server.options import DEFAULT_GRACEFUL_SHUTDOWN_S, ServerConfig, default_store_path
from cacheblend_rag.store.store_key import require_store_key, store_key
from cacheblend_rag.store.urls import redact

API_KEY_VARIABLE = "CACHEBLEND_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="serve a model over HTTP: OpenAI's chat completions, with documents",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--model", default=DEFAULT_MODEL_NAME,
                       help="the embedded SmolLM2-135M-Instruct (default), a catalog name (qwen2.5-coder-1.5b), a "
                       "model folder, a .gguf file, a hub id, or tiny-<llama|mistral|qwen2|qwen3> (tests)")
    serve.add_argument("--store", default=None, metavar="URL|PATH",
                       help="where chunk K/V lives: a folder, memory, tiered:PATH[,SPEC] or redis://... "
                       f"(default: {default_store_path()})")
    serve.add_argument("--require-store-key", action="store_true",
                       help="refuse to start without a store key ($CACHEBLEND_STORE_KEY): without one, anyone who can "
                       "write the store can plant chunk K/V that steers the answers (a warning says so)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on every request but /health (default: "
                       f"${API_KEY_VARIABLE}, else none)")
    serve.add_argument("--no-blend", action="store_true",
                       help="answer every request by full prefill of its whole prompt (a baseline on the same server)")
    serve.add_argument("--chunk-sharing", choices=("shared", "per_salt"), default=None,
                       help="whether requests of different cache_salt share the chunk store: shared (default: a "
                       "corpus is warmed once; another salt learns only that a chunk was seen) or per_salt (each "
                       "salt's chunks keyed apart, so no hit tells one tenant of another's documents)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model's name in requests and responses (default: --model as given)")
    serve.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                       help="requests that may wait beyond the running ones; one more gets 429 (default: 256)")
    serve.add_argument("--kv-budget", default=None, metavar="SIZE",
                       help="KV memory the running requests may hold together, e.g. 4GB (default: sized from the "
                       "free memory)")
    # The memory tier's size decides how much of a corpus each replica answers without a store read, so a
    # benchmark of the replicas' routing (benchmarks/bench_replicas.py) has to set it below the corpus.
    serve.add_argument("--resident-bytes", default=None, metavar="SIZE",
                       help="host-memory tier of chunk K/V in front of the store, e.g. 1GB; 0 turns it off "
                       "(default: 1 GiB on a CPU, at most a sixteenth of its memory; 2 GiB on a GPU)")
    # The prompt caches grow until full: a soak reading RSS idle to idle (benchmarks/soak_replicas.py) fills them
    # in its warm-up, as the in-process soak does, which needs them bounded below their defaults.
    serve.add_argument("--prefix-cache-bytes", default=None, metavar="SIZE",
                       help="host memory of the prompt-prefix K/V cache, e.g. 256MB; 0 turns it off (default: 256MB)")
    serve.add_argument("--segment-cache-bytes", default=None, metavar="SIZE",
                       help="host memory of the segment cache of prompt spans, e.g. 32MB; 0 turns it off (default: 64MB)")
    serve.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the loader's choice)")
    serve.add_argument("--device", default=None, help="torch device, e.g. cuda:0 (default: cuda if available)")
    serve.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                       help="largest request body accepted, 413 beyond (default: 64 bytes a token of the context "
                       "window + 1 MiB)")
    serve.add_argument("--max-tokens", type=int, default=None, metavar="N", dest="default_max_tokens",
                       help="answer length when a request sets none (default: 256, or the room left in the window)")
    serve.add_argument("--graceful-shutdown", type=int, default=DEFAULT_GRACEFUL_SHUTDOWN_S, metavar="S",
                       help="seconds running requests get to finish on SIGINT/SIGTERM "
                       f"(default: {DEFAULT_GRACEFUL_SHUTDOWN_S})")
    serve.add_argument("--access-log", action="store_true", help="log one line per request (uvicorn's access log)")
    serve.add_argument("--document-special-tokens", choices=("text", "control"), default=None,
                       help="special-token strings (<|im_end|>, say) in documents and chunks: text (default: "
                       "tokenized as the characters they spell, so a document cannot open a turn or end the text) or "
                       "control (as control tokens, for trusted documents only); warm with the same")
    _add_replica_flags(serve.add_argument_group("replicas on Ray Serve (pip install 'cacheblend-rag[ray]')"))
    _add_blend_flags(serve.add_argument_group("blend settings (default: the model's saved calibration, else "
                                              "the built-in; each flag given overrides it)"))
    serve.set_defaults(func=_cmd_serve)


def _add_replica_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--ray", action="store_true",
                       help="serve as a Ray Serve application of --replicas engine replicas sharing --store (Redis), "
                       "each request routed to the replica whose memory holds its documents")
    group.add_argument("--replicas", type=int, default=2, metavar="N", help="engine replicas (default: 2)")
    group.add_argument("--min-replicas", type=int, default=None, metavar="N",
                       help="with --max-replicas: let Ray Serve's autoscaling vary the replicas, from --replicas")
    group.add_argument("--max-replicas", type=int, default=None, metavar="N")
    group.add_argument("--ray-address", default=None, metavar="ADDRESS",
                       help="an existing Ray cluster (e.g. ray://head:10001, or auto); default: a local Ray this "
                       "command starts and stops")
    group.add_argument("--router", choices=("chunk", "default"), default="chunk",
                       help="chunk: by the documents each replica holds (default); default: Ray's own "
                       "(power of two choices), for comparison")
    group.add_argument("--replica-threads", type=int, default=None, metavar="N",
                       help="torch threads per replica (default: a local Ray shares the machine's cores out)")


def _add_blend_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per BlendConfig field, typed from CacheBlendSettings' annotation, helped by its description."""
    from cacheblend_rag.serving.arguments import BLEND_FIELDS
    from cacheblend_rag.serving.settings import CacheBlendSettings

    for name in BLEND_FIELDS:
        info = CacheBlendSettings.model_fields[name]
        flag = "--" + name.replace("_", "-")
        kind, optional = _field_type(info.annotation)
        help_text = (info.description or "").rstrip(".").replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=f"{help_text} (built-in: {info.default})")
            continue
        group.add_argument(flag, dest=name, type=_parser(kind, optional), default=argparse.SUPPRESS,
                           metavar=kind.__name__.upper() + ("|none" if optional else ""),
                           help=f"{help_text} (built-in: {info.default})")


def _field_type(annotation: Any) -> tuple[type, bool]:
    """``Optional[float]`` -> ``(float, True)``; ``int`` -> ``(int, False)``."""
    args = typing.get_args(annotation)
    if args and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return annotation, False


def _parser(kind: type, optional: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if optional and text.lower() in ("none", "null"):
            return None
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _config(args: argparse.Namespace) -> ServerConfig:
    from cacheblend_rag.serving.arguments import BLEND_FIELDS, checked_as_given

    settings: dict[str, Any] = {name: getattr(args, name) for name in BLEND_FIELDS if hasattr(args, name)}
    checked_as_given(settings)  # a bad value fails now, not after the socket is up and the model loaded
    if args.no_blend:
        settings["reuse_chunk_kv"] = False
    if args.require_store_key:
        # Before the socket is bound: the key is read from the environment only (a flag would show it in ps).
        require_store_key(store_key(None) is not None, "--require-store-key")
        settings["require_store_key"] = True
    if args.document_special_tokens is not None:
        settings["document_special_tokens"] = args.document_special_tokens
    sizes = {"resident_bytes": args.resident_bytes, "prefix_cache_bytes": args.prefix_cache_bytes,
             "segment_cache_bytes": args.segment_cache_bytes}
    from cacheblend_rag.store.factory import parse_size

    for size in sizes.values():
        if size is not None:
            parse_size(size)  # a misspelt size fails now (ConfigError), not after the model loaded
    for name, value in (("device", args.device), ("dtype", args.dtype), ("kv_budget_bytes", args.kv_budget),
                        ("max_queued_requests", args.max_queued_requests), ("chunk_sharing", args.chunk_sharing),
                        *sizes.items()):
        if value is not None:
            settings[name] = value
    http: dict[str, Any] = {}
    if args.default_max_tokens is not None:
        if args.default_max_tokens < 1:
            raise ConfigError(f"--max-tokens {args.default_max_tokens} must be at least 1")
        http["default_max_tokens"] = args.default_max_tokens
    return ServerConfig(model=args.model, store=args.store or default_store_path(), settings=settings,
                        served_model_name=args.served_model_name,
                        api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
                        max_body_bytes=args.max_body_bytes, **http)


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as exc:
        print(f"cacheblend-rag serve needs {exc.name}: pip install 'cacheblend-rag[server]'", file=sys.stderr)
        return 2
    from cacheblend_rag.server.app import create_app
    from cacheblend_rag.server.background import bind_socket, url_of, uvicorn_server

    try:
        config = _config(args)
        if args.ray:
            return _serve_replicas(args, config)
    except (ConfigError, ValueError) as exc:
        print(f"cacheblend-rag serve: {redact(exc)}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(f"cacheblend-rag serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    holder: list[Any] = []

    def stop_on_failure(exc: BaseException) -> None:
        if holder:
            holder[0].should_exit = True

    app = create_app(config, on_failure=stop_on_failure)
    verbose = bool(getattr(args, "verbose", False)) or args.access_log
    server = uvicorn_server(app, access_log=args.access_log, log_level="info" if verbose else "warning",
                            graceful_shutdown_s=args.graceful_shutdown)
    holder.append(server)
    print(f"serving {config.name} on {url_of(sock)}", flush=True)
    _quiet_after_shutdown()
    server.run(sockets=[sock])
    state = app.state.server
    if state.error is not None:
        print(f"cacheblend-rag serve: the model could not be loaded: {type(state.error).__name__}: "
              f"{redact(state.error)}", file=sys.stderr)
        return 1
    return 0


def _serve_replicas(args: argparse.Namespace, config: ServerConfig) -> int:
    import importlib.util

    # Not imported here: a local Ray's head is started first, and Ray reads its token at import.
    if importlib.util.find_spec("ray") is None:
        print("cacheblend-rag serve --ray needs Ray Serve: pip install 'cacheblend-rag[ray]'", file=sys.stderr)
        return 2
    from cacheblend_rag.server.replicas.launch import ReplicaOptions, check_shared_store, run

    if args.store is None:
        raise ConfigError("--ray needs --store: the replicas share chunk K/V through one Redis, "
                          "e.g. --store redis://127.0.0.1:6379/0")
    options = ReplicaOptions(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                             ray_address=args.ray_address, router=args.router, threads=args.replica_threads,
                             graceful_shutdown_s=args.graceful_shutdown)
    check_shared_store(config.store, options.most_replicas)  # before Ray starts: seconds, and processes
    return run(config, options, host=args.host, port=args.port,
               verbose=bool(getattr(args, "verbose", False)) or args.access_log)


def _quiet_after_shutdown() -> None:
    """uvicorn handles SIGINT/SIGTERM while it runs (a graceful shutdown) and, once done, raises the signal again
    under the handlers it found; with these no-op handlers that ends nothing, so the command returns 0."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)


__all__ = ["register"]
