"""Passwords in URLs: kept out of everything shown, put back only where a connection is made.

A store spec may carry a password: ``redis://:PASSWORD@host:6379/0``, ``rediss://USER:PASSWORD@...``,
``redis://host/0?password=PASSWORD`` (redis-py reads that too), or any of these behind ``tiered:PATH,``.
Whatever is shown (a repr, a dump, LangChain's identifying params and traces, a log line, an error, a
store's ``describe()``) goes through :func:`redact` or :func:`redact_url`, which write :data:`MASK` in its
place. The integrations keep the password apart from ``store_path`` (:func:`password_apart`), which then
holds the masked spelling, and :func:`with_password` puts it back when the store is opened. A masked spec
that reaches :func:`~cacheblend_rag.store.open_store` without its password (a dump loaded elsewhere) takes
``$CACHEBLEND_STORE_PASSWORD`` (:func:`password_from_env`), else is refused saying so.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional
from urllib.parse import quote, quote_plus, unquote, unquote_plus, urlsplit, urlunsplit

MASK = "***"
STORE_PASSWORD_ENV = "CACHEBLEND_STORE_PASSWORD"

# In free text: scheme://[user]:PASSWORD@host, the password running to the last "@" of the authority (as
# urlsplit reads it). Quotes and spaces end it, so that the repr or JSON around a URL is not swallowed. The
# slashes may be missing: a malformed URL (redis:/:PASSWORD@host) is quoted by the error that refuses it.
_USERINFO_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*:/{0,2}[^:/?#@\s\"']*:)(?P<password>[^\s/?#\"']*)(?=@)")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&](?:password|passwd|pwd)=)(?P<password>[^&#\s\"']*)", re.IGNORECASE)
_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def redact(text: Any) -> str:
    """``text`` (an error, a log line, a spec) with the password of every URL in it replaced by :data:`MASK`."""
    text = _USERINFO_PASSWORD.sub(lambda m: m["head"] + (MASK if m["password"] else ""), str(text))
    return _QUERY_PASSWORD.sub(lambda m: m["head"] + MASK, text)


def redact_url(url: str) -> str:
    """``url`` without its password and its query (kept: scheme, user, host, port, path); never raises."""
    try:
        return redact(urlunsplit(urlsplit(url)._replace(query="", fragment="")))
    except ValueError:
        return f"{url.partition('://')[0]}://{MASK}" if "://" in url else MASK


def _url_in(spec: str) -> tuple[str, str]:
    """``spec`` as what comes before its URL (``tiered:PATH,``) and the URL (``""``: none)."""
    start = _URL_START.search(spec)
    return (spec, "") if start is None else (spec[:start.start()], spec[start.start():])


def split_password(spec: str) -> tuple[str, Optional[str]]:
    """``spec`` with its URL's password replaced by :data:`MASK`, and the password (decoded; ``None`` where
    there is none, or only the mask). A URL's query ``password=`` counts where the authority has none."""
    lead, url = _url_in(spec)
    if not url:
        return spec, None
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL open_store takes (it says why): masked all the same
        return redact(spec), None
    userinfo, at, hostport = parts.netloc.rpartition("@")
    password = None
    if at and ":" in userinfo:
        user, _, raw = userinfo.partition(":")
        password = None if raw == MASK else unquote(raw)
        userinfo = f"{user}:{MASK}"
    query = parts.query
    found = _QUERY_PASSWORD.search("?" + query)
    if found is not None:
        if password is None and found["password"] != MASK:
            password = unquote_plus(found["password"])
        query = _QUERY_PASSWORD.sub(lambda m: m["head"] + MASK, "?" + query)[1:]
    masked = urlunsplit(parts._replace(netloc=userinfo + at + hostport, query=query))
    return lead + masked, password


def is_masked(spec: str) -> bool:
    """Whether ``spec``'s URL has :data:`MASK` where its password was: the password must come from elsewhere."""
    _, url = _url_in(spec)
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    userinfo, at, _ = parts.netloc.rpartition("@")
    in_query = _QUERY_PASSWORD.search("?" + parts.query)
    return bool(at and userinfo.partition(":")[2] == MASK) or (in_query is not None and in_query["password"] == MASK)


def with_password(spec: str, password: Optional[str]) -> str:
    """``spec`` whose URL carries ``password``: in place of :data:`MASK`, else added to a URL that has none
    (``redis://host/0`` -> ``redis://:PASSWORD@host/0``). A URL with a password of its own, a spec without a
    URL or a URL without a host (``file:///kv``) is returned as is; so is everything when ``password`` is None."""
    lead, url = _url_in(spec)
    if password is None or not url:
        return spec
    try:
        parts = urlsplit(url)
    except ValueError:
        return spec
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not hostport:
        return spec
    query = parts.query
    if f"={MASK}" in query:
        query = _QUERY_PASSWORD.sub(lambda m: m["head"] + (quote_plus(password) if m["password"] == MASK
                                                           else m["password"]), "?" + query)[1:]
    if at and ":" in userinfo:
        user, _, raw = userinfo.partition(":")
        if raw == MASK:
            userinfo = f"{user}:{quote(password, safe='')}"
    elif query == parts.query:  # no password anywhere yet: the authority takes it
        userinfo, at = f"{userinfo}:{quote(password, safe='')}", "@"
    return lead + urlunsplit(parts._replace(netloc=userinfo + at + hostport, query=query))


def password_from_env(spec: str) -> str:
    """``spec`` with its masked (or missing) password taken from ``$CACHEBLEND_STORE_PASSWORD`` when that is set."""
    return with_password(spec, os.environ.get(STORE_PASSWORD_ENV) or None)


def password_apart(values: Any, url_field: str, password_field: str) -> Any:
    """A model's input with the password of ``values[url_field]`` moved to ``values[password_field]``, so that
    the URL field holds the masked spelling. Raises ``ValueError`` where the two name different passwords."""
    if not isinstance(values, dict) or not isinstance(values.get(url_field), (str, os.PathLike)):
        return values
    masked, password = split_password(os.fspath(values[url_field]))
    if password is None:
        return values
    given = values.get(password_field)
    given = given.get_secret_value() if hasattr(given, "get_secret_value") else given
    if given is not None and given != password:
        raise ValueError(f"{url_field}={masked!r} and {password_field} name two different passwords; give it once, "
                         f"in the URL or as {password_field}=")
    return {**values, url_field: masked, password_field: password}


__all__ = ["MASK", "STORE_PASSWORD_ENV", "is_masked", "password_apart", "password_from_env", "redact",
           "redact_url", "split_password", "with_password"]
