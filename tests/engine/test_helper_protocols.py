"""The engine fits the protocols its helpers take in its place.

Decoding, generation and the gate name what they use of an engine (so they never import the
facade that imports them); nothing checks types here, so this test keeps those names and the
engine's in step.
"""

from __future__ import annotations

import inspect

import pytest

from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.engine.decode import DecodingModel, Sampler
from cacheblend_rag.engine.gate import GatedModel
from cacheblend_rag.engine.generate import BlendingModel, TokenSampler
from cacheblend_rag.testing import tiny_engine


def _members(protocol: type) -> dict[str, object]:
    """The protocol's attributes (``None``) and methods or properties, its bases' included."""
    members: dict[str, object] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        members.update(dict.fromkeys(cls.__dict__.get("__annotations__", {})))
        members.update({k: v for k, v in cls.__dict__.items()
                        if not k.startswith("_") and (callable(v) or isinstance(v, property))})
        if "__call__" in cls.__dict__:
            members["__call__"] = cls.__dict__["__call__"]
    return members


def _misfits(obj: object, protocol: type) -> list[str]:
    misfits = []
    for name, member in _members(protocol).items():
        try:
            found = inspect.getattr_static(obj, name)
        except AttributeError:
            misfits.append(f"{name}: missing")
            continue
        if inspect.isfunction(member) and inspect.isfunction(found):
            wanted = inspect.signature(member).parameters
            got = inspect.signature(found).parameters
            for param in wanted.values():
                if param.name not in got or got[param.name].kind != param.kind:
                    misfits.append(f"{name}: takes no {param.kind.description} parameter {param.name!r}")
            for param in got.values():
                if param.name not in wanted and param.default is param.empty and param.kind not in (
                        param.VAR_POSITIONAL, param.VAR_KEYWORD):
                    misfits.append(f"{name}: needs {param.name!r}, which the protocol does not pass")
    return misfits


@pytest.mark.parametrize("protocol", [DecodingModel, BlendingModel, GatedModel], ids=lambda p: p.__name__)
def test_the_engine_fits_what_its_helpers_take(protocol):
    assert not _misfits(tiny_engine("llama", seed=3), protocol)


def test_the_token_sampler_fits_what_a_decoding_takes():
    assert not _misfits(TokenSampler(GenerationConfig().resolved(None)), Sampler)


def test_a_misfit_is_reported():
    class Half:
        model = tokenizer = adapter = device = None

    assert _misfits(Half(), DecodingModel) == ["context_window: missing"]
