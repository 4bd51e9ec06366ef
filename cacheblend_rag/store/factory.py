"""Open a store from a short spec string, as the CLI and config files give it.

=====================  ==========================================================
spec                   store
=====================  ==========================================================
``memory``             :class:`MemoryKVStore`, bounded by default (``memory:2GB`` sets the bound)
``PATH``, ``disk:PATH`` :class:`DiskKVStore` at ``PATH``
``tiered:PATH``        :class:`TieredKVStore` of memory (bounded by default) in front of disk at ``PATH``
``tiered:PATH,SPEC``   the same, with the store ``SPEC`` behind the disk: a serving replica's
                       ``tiered:/var/cache/kv,redis://:PASSWORD@redis:6379/0``
``SCHEME://...``       a backend registered for ``SCHEME`` (``redis://``, ``rediss://``)
=====================  ==========================================================

Other backends plug in with :func:`register_store_scheme`; the modules named in
``_LAZY_SCHEMES`` are imported on first use so that they register themselves.

A URL without its password, or with ``***`` where it was (as :mod:`~cacheblend_rag.store.urls` shows
every spec), takes ``$CACHEBLEND_STORE_PASSWORD``; no message of this module shows a password.
"""

from __future__ import annotations

import functools
import importlib
import re
from pathlib import Path
from typing import Any

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.backends.base import KVStore
# register_store_scheme lives with the table a backend registers into (a leaf it can import); it is
# imported here too because the docstring above, and callers, find it on the factory.
from cacheblend_rag.store.schemes import SCHEMES as _SCHEMES, register_store_scheme  # noqa: F401
from cacheblend_rag.store.urls import MASK, STORE_PASSWORD_ENV, is_masked, password_from_env, redact

# scheme -> module that calls register_store_scheme(scheme, ...) when imported
_LAZY_SCHEMES = {"redis": "cacheblend_rag.store.backends.redis_store", "rediss": "cacheblend_rag.store.backends.redis_store"}

# What a size's unit may be, in the error message; ByteSize reads more (K, M, G, PB, EiB, Gbit...).
_UNIT_EXAMPLES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"


def parse_size(text: str | int) -> int:
    """``"512MB"``, ``"2GiB"``, ``"1e9"`` or an int -> bytes, read by pydantic's ``ByteSize``."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    byte_size, whole = _byte_size()
    # ByteSize has no exponent: a number such as 1e9 is written out for it (1000000000.000000).
    spelled = re.sub(r"^\s*[0-9]*\.?[0-9]+e[0-9]+", lambda m: format(float(m[0]), "f"), str(text))
    # ByteSize reads a size at the start of the text; the rest must be blank, or "2GB of it" would be 2GB.
    if whole.fullmatch(spelled):
        try:
            return int(byte_size.validate_python(spelled))
        except ValueError:  # pydantic's ValidationError: an unknown unit, or a size past any int
            pass
    raise ConfigError(f"size {text!r} is not understood; write a number of bytes with an optional unit "
                      f"({_UNIT_EXAMPLES}), e.g. 512MB or 2GiB")


@functools.cache
def _byte_size() -> tuple[Any, re.Pattern[str]]:
    """pydantic's ``ByteSize`` validator, and its pattern of a whole size (imported on first use, as
    opening a store does not need pydantic)."""
    from pydantic import ByteSize, TypeAdapter

    return TypeAdapter(ByteSize), re.compile(ByteSize.byte_string_pattern + r"\s*", re.IGNORECASE | re.ASCII)


def open_store(spec: str | Path | KVStore | None, *, size_limit: int | str | None = None, **options: Any) -> KVStore:
    """The store a spec names (see the module docstring); a :class:`KVStore` is returned as is.

    ``size_limit`` bounds a disk store (or the memory tier of ``memory``) in bytes or with a unit.
    """
    from cacheblend_rag.store.backends.disk import DiskKVStore
    from cacheblend_rag.store.backends.memory import MemoryKVStore
    from cacheblend_rag.store.backends.tiered import TieredKVStore

    if isinstance(spec, KVStore):
        return spec
    limit = None if size_limit is None else parse_size(size_limit)
    if spec is None or str(spec) == "memory":
        return MemoryKVStore(max_bytes="auto" if limit is None else limit)  # bounded by default (memory_budget)
    text = str(spec)
    if text.startswith("memory:"):
        return MemoryKVStore(max_bytes=parse_size(text.removeprefix("memory:")))
    scheme = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*)://", text)
    if scheme:
        name = scheme.group(1).lower()
        if name not in _SCHEMES and name in _LAZY_SCHEMES:
            try:
                importlib.import_module(_LAZY_SCHEMES[name])
            except ModuleNotFoundError as exc:
                raise ConfigError(f"store {redact(text)!r} needs the {name} backend, which is not available here: "
                                  f"{exc}") from None
        if name == "file":
            return DiskKVStore(text.removeprefix("file://"), size_limit=limit, **options)
        if name not in _SCHEMES:
            raise ConfigError(f"store {redact(text)!r} has an unknown scheme {name!r}; known: {_known_schemes()}, "
                              "or a directory path")
        text = password_from_env(text)
        if is_masked(text):  # a dump's spelling (repr, model_dump, LangChain's dumps), loaded without its password
            raise ConfigError(f"store {text!r} has {MASK} in place of its password (as a repr, a dump or a trace "
                              f"writes it); set ${STORE_PASSWORD_ENV}, pass store_password= (CacheBlendLLM, "
                              "ChatCacheBlend), or write the password in the URL")
        return _SCHEMES[name](text, size_limit=limit, **options)
    if text.startswith("tiered:"):
        path, _, shared = text.removeprefix("tiered:").partition(",")
        behind = open_store(shared) if shared else None  # first: a bad spec there must leave no folder here
        tiers = [MemoryKVStore(), DiskKVStore(_folder(path, text), size_limit=limit, **options)]
        return TieredKVStore(*tiers, *([behind] if behind is not None else []))
    return DiskKVStore(_folder(text.removeprefix("disk:"), text), size_limit=limit, **options)


def _known_schemes() -> str:
    return ", ".join(f"{name}://" for name in sorted({"file", *_SCHEMES, *_LAZY_SCHEMES}))


def _folder(path: str, spec: str) -> str:
    """``path`` as a disk store's folder, unless it looks like a URL gone wrong (``redis:/host``,
    ``redis:localhost``, ``s3:/bucket``): a typo in a URL must not quietly become a folder named after it."""
    # One letter before the colon is a Windows drive (C:/kv), not a scheme.
    scheme = re.match(r"([a-zA-Z][a-zA-Z0-9+.-]+):", path)
    if scheme is None:
        return path
    name = scheme.group(1).lower()
    accepted = (f"accepted: a folder path, disk:PATH, memory, memory:SIZE, tiered:PATH[,SPEC] or a URL "
                f"({_known_schemes()})")
    if name in {"file", *_SCHEMES, *_LAZY_SCHEMES}:
        rest = path[scheme.end():].lstrip("/")
        raise ConfigError(f"store {redact(spec)!r} is a malformed {name} URL: write {redact(f'{name}://{rest}')}; "
                          f"{accepted}")
    if path[scheme.end():].startswith("/"):
        raise ConfigError(f"store {redact(spec)!r} looks like a URL with the unknown scheme {name!r}; {accepted}. "
                          "A folder whose name holds a colon is given as ./NAME")
    return path
