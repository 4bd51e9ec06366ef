"""A prompt beyond the model's window as langchain-core names it: ``ContextOverflowError`` (what an agent loop or
a retry policy catches), still the serving layer's ``ContextWindowError`` (a ``BlendInputError``, a ``ValueError``)
for code written against it."""

from __future__ import annotations

from cacheblend_rag.serving import ContextWindowError

try:
    from langchain_core.exceptions import ContextOverflowError
except ImportError:  # a langchain-core from before it: the serving layer's error alone
    ContextOverflowError = None  # type: ignore[assignment,misc]

if ContextOverflowError is not None:
    class CacheBlendContextOverflowError(ContextOverflowError, ContextWindowError):
        """The prompt has ``tokens`` tokens, more than the model's context ``window``."""
else:  # pragma: no cover - langchain-core < 1.1
    CacheBlendContextOverflowError = ContextWindowError  # type: ignore[misc]


def overflow_error(exc: ContextWindowError) -> ContextWindowError:
    return CacheBlendContextOverflowError(str(exc), tokens=exc.tokens, window=exc.window)


__all__ = ["CacheBlendContextOverflowError", "overflow_error"]
