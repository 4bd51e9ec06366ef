"""The compiled-index cache of constrained decoding: a schema compiled by one process is read back by the next
(not compiled again, the same tokens allowed), a damaged entry is reported, removed and compiled again, and the
cache can be turned off or be unwritable without the constraint failing."""

from __future__ import annotations

import json
import logging

import outlines_core
import pytest
import torch

from cacheblend_rag.engine import constraints
from cacheblend_rag.engine.constraints import INDEX_CACHE_ENV, JsonConstraint
from cacheblend_rag.testing import tiny_engine

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["answer", "n"]}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_engine("llama").tokenizer


@pytest.fixture
def compiles(monkeypatch):
    """Counts outlines-core compilations; each test starts as a new process would (no index in memory)."""
    constraints._VOCABULARIES.clear()
    count = {"n": 0}
    real = outlines_core.Index

    class Counting:
        from_binary = staticmethod(real.from_binary)

        def __new__(cls, *args):
            count["n"] += 1
            return real(*args)

    monkeypatch.setattr(outlines_core, "Index", Counting)
    yield count
    constraints._VOCABULARIES.clear()


def _allowed(tokenizer, steps: int = 6) -> list[list[int]]:
    """The tokens the constraint allows at each of ``steps`` greedy steps over flat logits."""
    constraint = JsonConstraint(tokenizer, tokenizer.eos_token_id, SCHEMA, budget=40)
    generated: list[int] = []
    allowed = []
    for _ in range(steps):
        masked = constraint.mask(torch.zeros(len(tokenizer)), generated)
        ids = torch.nonzero(masked == 0).flatten().tolist()
        allowed.append(ids)
        generated.append(ids[0])
    return allowed


def test_a_schema_compiled_once_is_read_back_with_the_same_tokens_allowed(tokenizer, compiles, tmp_path, monkeypatch):
    monkeypatch.setenv(INDEX_CACHE_ENV, str(tmp_path))
    first = _allowed(tokenizer)
    assert compiles["n"] == 1 and len(list(tmp_path.glob("*.idx"))) == 1
    constraints._VOCABULARIES.clear()  # as the next process
    assert _allowed(tokenizer) == first and compiles["n"] == 1


def test_a_damaged_entry_is_reported_removed_and_compiled_again(tokenizer, compiles, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(INDEX_CACHE_ENV, str(tmp_path))
    first = _allowed(tokenizer)
    (entry,) = tmp_path.glob("*.idx")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    constraints._VOCABULARIES.clear()
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.engine.constraints"):
        assert _allowed(tokenizer) == first
    assert compiles["n"] == 2 and "damaged" in caplog.text and str(entry) in caplog.text
    constraints._VOCABULARIES.clear()  # the entry was written again, whole
    assert _allowed(tokenizer) == first and compiles["n"] == 2


def test_a_truncated_entry_is_damaged_too(tokenizer, compiles, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(INDEX_CACHE_ENV, str(tmp_path))
    first = _allowed(tokenizer)
    (entry,) = tmp_path.glob("*.idx")
    entry.write_bytes(entry.read_bytes()[:20])
    constraints._VOCABULARIES.clear()
    with caplog.at_level(logging.WARNING, logger="cacheblend_rag.engine.constraints"):
        assert _allowed(tokenizer) == first
    assert "damaged" in caplog.text


def test_off_keeps_nothing_and_an_unwritable_cache_still_constrains(tokenizer, compiles, tmp_path, monkeypatch):
    monkeypatch.setenv(INDEX_CACHE_ENV, "off")
    first = _allowed(tokenizer)
    constraints._VOCABULARIES.clear()
    assert _allowed(tokenizer) == first and compiles["n"] == 2  # compiled per process
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(INDEX_CACHE_ENV, str(blocker / "json-indexes"))
    constraints._VOCABULARIES.clear()
    assert _allowed(tokenizer) == first


def test_the_entry_holds_no_pickle(tokenizer, compiles, tmp_path, monkeypatch):
    """What is read back is JSON and outlines-core's own serialized form: a pickle opcode stream it is not."""
    monkeypatch.setenv(INDEX_CACHE_ENV, str(tmp_path))
    _allowed(tokenizer)
    (entry,) = tmp_path.glob("*.idx")
    data = entry.read_bytes()
    size = int.from_bytes(data[24:32], "little")
    assert set(json.loads(data[32:32 + size])) == {"remaining", "worst"}
    assert not data[32 + size:].startswith(b"\x80")  # the pickle protocol's first opcode
