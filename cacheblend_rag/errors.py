"""Exceptions raised by cacheblend-rag. Each message says what is wrong and how to fix it."""

from __future__ import annotations


class CacheBlendError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(CacheBlendError, ValueError):
    """A configuration field holds a value outside what it accepts."""


class ModelLoadError(CacheBlendError, OSError):
    """A model could not be found, reached or converted."""


class UnsupportedArchitectureError(CacheBlendError, ValueError):
    """The model's architecture has no layer-wise adapter."""


class BlendInputError(CacheBlendError, ValueError):
    """The segments handed to ``blend`` cannot form a valid prompt."""


class ContextWindowError(BlendInputError):
    """The prompt has more tokens than the model's context window (``tokens`` and ``window`` say how many);
    LangChain's integration raises it as ``langchain_core.exceptions.ContextOverflowError`` too."""

    def __init__(self, message: str, *, tokens: int, window: int) -> None:
        super().__init__(message)
        self.tokens = tokens
        self.window = window


class ChunkMismatchError(BlendInputError):
    """A cached chunk was computed by another model or with another shape."""


class CorrectnessGateError(CacheBlendError, RuntimeError):
    """Blending at ratio 1.0 did not reproduce full prefill for this model."""
