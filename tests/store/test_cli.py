"""`cacheblend-rag cache stats|clear` and `cacheblend-rag warm` (with a tiny model standing in for SmolLM2)."""

from __future__ import annotations

import json

import pytest

from cacheblend_rag.cli import main
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store_commands import read_chunks


@pytest.fixture
def tiny_model_cli(monkeypatch, engine):
    from cacheblend_rag.engine import CacheBlendEngine

    monkeypatch.setattr(CacheBlendEngine, "from_pretrained", classmethod(lambda cls, *a, **k: engine))


def test_read_chunks_from_txt_and_jsonl(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("First paragraph\nstill first.\n\n\n  Second one.  \n\n")
    assert list(read_chunks(txt)) == ["First paragraph\nstill first.", "Second one."]
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": " verbatim \n"}) + "\n\n" + json.dumps({"text": "two", "id": 2}) + "\n")
    assert list(read_chunks(jsonl)) == ["verbatim", "two"]  # the normal form every integration looks up


@pytest.mark.parametrize("line,message", [("{not json", "not valid JSON"), ('{"title": "x"}', "text")])
def test_bad_jsonl_says_which_line_is_wrong(tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=f"bad.jsonl:2 .*{message}"):
        list(read_chunks(bad))
    with pytest.raises(ConfigError, match="is not a file"):
        list(read_chunks(tmp_path / "missing.txt"))


def test_metadata_needs_the_renderer_of_the_framework_that_renders_it(tmp_path, monkeypatch):
    import cacheblend_rag.store_commands as commands

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "Paris.", "metadata": {"topic": "France"}}) + "\n")
    monkeypatch.setattr(commands, "entry_points", lambda group: [])  # no integration installed
    with pytest.raises(ConfigError, match=r"pip install llama-index-postprocessor-cacheblend.*--for langchain"):
        list(read_chunks(corpus))
    assert list(read_chunks(corpus, "langchain")) == ["Paris."]  # a Document's page_content
    corpus.write_text(json.dumps({"text": "Paris.", "metadata": ["France"]}) + "\n")
    with pytest.raises(ConfigError, match=r"c.jsonl:1 has a \"metadata\" field that is not an object"):
        list(read_chunks(corpus))


def test_warm_then_stats_then_clear(tmp_path, capsys, tiny_model_cli):
    store = tmp_path / "kv"
    (tmp_path / "docs.txt").write_text("Paris is the capital of France.\n\nMarie Curie was a physicist.\n")
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "The Amazon river flows."}) + "\n")
    files = [str(tmp_path / "docs.txt"), str(tmp_path / "more.jsonl")]
    assert main(["warm", "--path", str(store), "--no-progress", *files]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["chunks"], out["new"], out["present"], out["entries"]) == (3, 3, 0, 3)
    assert main(["warm", "--store", f"disk:{store}", "--no-progress", *files]) == 0
    assert json.loads(capsys.readouterr().out)["present"] == 3

    assert main(["cache", "stats", "--path", str(store), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 3 and stats["bytes"] > 0 and stats["corrupt"] == 0
    assert main(["cache", "stats", "--path", str(store)]) == 0
    table = capsys.readouterr().out
    for name in ("entries", "bytes", "hits", "misses", "evictions", "corrupt"):
        assert name in table

    assert main(["cache", "clear", "--path", str(store)]) == 0
    assert "cleared 3 entries" in capsys.readouterr().out
    main(["cache", "stats", "--path", str(store), "--json"])
    assert json.loads(capsys.readouterr().out)["entries"] == 0


def test_stats_of_a_missing_store_is_an_error_not_a_new_store(tmp_path):
    with pytest.raises(ConfigError, match="no store at"):
        main(["cache", "stats", "--path", str(tmp_path / "typo")])
    assert not (tmp_path / "typo").exists()


def test_store_options_are_required_and_exclusive(capsys):
    with pytest.raises(SystemExit):
        main(["cache", "stats"])
    with pytest.raises(SystemExit):
        main(["cache", "stats", "--path", "a", "--store", "b"])
