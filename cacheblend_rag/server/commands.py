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

from pydantic import ByteSize, ValidationError

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.server.options import DEFAULT_GRACEFUL_SHUTDOWN_S, ServerConfig, default_store_path
from cacheblend_rag.serving.setting_groups import GROUPS, SettingsGroup
from cacheblend_rag.store.store_key import require_store_key, store_key
from cacheblend_rag.store.urls import redact

API_KEY_VARIABLE = "CACHEBLEND_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="serve a model over HTTP: OpenAI's chat completions, with documents",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help=f"require 'Authorization: Bearer KEY' on every request but /health (default: "
                       f"${API_KEY_VARIABLE}, else none)")
    serve.add_argument("--served-model-name", default=None, metavar="NAME",
                       help="the model's name in requests and responses (default: --model as given)")
    serve.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                       help="largest request body accepted, 413 beyond (default: 64 bytes a token of the context "
                       "window + 1 MiB)")
    serve.add_argument("--max-tokens", type=int, default=None, metavar="N", dest="default_max_tokens",
                       help="answer length when a request sets none (default: 256, or the room left in the window)")
    serve.add_argument("--graceful-shutdown", type=int, default=DEFAULT_GRACEFUL_SHUTDOWN_S, metavar="S",
                       help="seconds running requests get to finish on SIGINT/SIGTERM "
                       f"(default: {DEFAULT_GRACEFUL_SHUTDOWN_S})")
    serve.add_argument("--access-log", action="store_true", help="log one line per request (uvicorn's access log)")
    _add_replica_flags(serve.add_argument_group("replicas on Ray Serve (pip install 'cacheblend-rag[ray]')"))
    for group in GROUPS.values():
        if group.server_flags:
            _add_group_flags(serve.add_argument_group(group.title), group)
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


def _add_group_flags(parser: argparse._ArgumentGroup, group: type[SettingsGroup]) -> None:
    """The group's server flags, each typed from the field's annotation and helped by the flag's own text, else
    the field's description. A flag not given sets nothing (``SUPPRESS``), so the field keeps the settings' own
    default, or the model's saved calibration for a blend field."""
    for name, spec in group.server_flags.items():
        info = group.model_fields[name]
        help_text = spec.help or (info.description or "").rstrip(".") + f" (built-in: {info.default})"
        common: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        kind, optional = _field_type(info.annotation)
        if spec.action is not None:
            parser.add_argument(spec.flag, action=spec.action, **common)
        elif kind is bool:
            parser.add_argument(spec.flag, action=argparse.BooleanOptionalAction, **common)
        elif typing.get_origin(kind) is typing.Literal:
            parser.add_argument(spec.flag, choices=typing.get_args(kind), **common)
        else:
            if not isinstance(kind, type) or issubclass(kind, ByteSize):
                kind = str  # a size (int or str, or pydantic's ByteSize): the text as given, read by the field
            parser.add_argument(spec.flag, type=_parser(kind, optional),
                                metavar=spec.metavar or kind.__name__.upper() + ("|none" if optional else ""), **common)


def _field_type(annotation: Any) -> tuple[Any, bool]:
    """``Optional[float]`` -> ``(float, True)``; ``int`` -> ``(int, False)``; ``Optional[Union[int, str]]`` ->
    ``(Union[int, str], True)``."""
    args = typing.get_args(annotation)
    if args and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return (inner[0] if len(inner) == 1 else typing.Union[tuple(inner)]), True
    return annotation, False


def _parser(kind: type, optional: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if optional and text.lower() in ("none", "null"):
            return None
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _config(args: argparse.Namespace) -> ServerConfig:
    settings = {name: getattr(args, name) for group in GROUPS.values() for name in group.server_flags
                if hasattr(args, name)}
    model, store = settings.pop("model", DEFAULT_MODEL_NAME), settings.pop("store_path", None)
    for group in GROUPS.values():  # a bad value fails now, not after the socket is up and the model loaded
        _check_group(group, {name: value for name, value in settings.items() if name in group.model_fields})
    if settings.get("require_store_key"):
        # Before the socket is bound: the key is read from the environment only (a flag would show it in ps).
        require_store_key(store_key(None) is not None, "--require-store-key")
    http: dict[str, Any] = {}
    if args.default_max_tokens is not None:
        if args.default_max_tokens < 1:
            raise ConfigError(f"--max-tokens {args.default_max_tokens} must be at least 1")
        http["default_max_tokens"] = args.default_max_tokens
    return ServerConfig(model=model, store=store or default_store_path(), settings=settings,
                        served_model_name=args.served_model_name,
                        api_key=args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
                        max_body_bytes=args.max_body_bytes, **http)


def _check_group(group: type[SettingsGroup], values: dict[str, Any]) -> None:
    """The flags' values as their group's fields take them (its validators, BlendConfig's checks among them): a
    misspelt size, choice or ratio fails before the model loads, in the check's own words, after the flag it names."""
    try:
        group(**values)
    except ValidationError as error:
        problems = []
        for e in error.errors():
            reason = str(e.get("ctx", {}).get("error") or e["msg"])
            problems.append(f"{_flag_of(group, str(e['loc'][0]))}: {reason}" if e["loc"] else reason)
        raise ConfigError("; ".join(problems)) from None


def _flag_of(group: type[SettingsGroup], name: str) -> str:
    spec = group.server_flags.get(name)
    return spec.flag if spec is not None else name


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

    if getattr(args, "store_path", None) is None:
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
