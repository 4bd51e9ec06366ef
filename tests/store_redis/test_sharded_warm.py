"""`cacheblend-rag warm --store redis://... --shard I/N`: N workers warm one corpus together, each chunk once."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from cacheblend_rag.cli import main
from cacheblend_rag.store_commands import parse_shard

from redis_workers import corpus, shard_worker  # noqa: E402


def test_two_workers_warm_each_chunk_exactly_once(engine, redis_server, redis_url, tmp_path, capsys, monkeypatch):
    texts = corpus(10)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=shard_worker, args=(redis_url, [str(docs)], f"{i}/2", results)) for i in range(2)]
    for w in workers:
        w.start()
    outputs = [results.get(timeout=600) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    for _shard, code, out, error in outputs:
        assert error is None, error
        assert code == 0 and out["failed"] == 0 and out["corpus_chunks"] == 10
        assert out["new"] == out["chunks"] > 0  # each worker computed its own shard, nothing else
    assert sum(out["chunks"] for _, _, out, _ in outputs) == 10

    with redis_server.client() as client:
        chunks = client.keys("cacheblend:*:{*}")
        assert len(chunks) == 10
        num_layers = engine.num_layers
        for name in chunks:  # one manifest and one write's layers per chunk: nobody wrote a chunk twice
            fields = client.hkeys(name)
            assert len(fields) == num_layers + 1 and b"m" in fields

    from cacheblend_rag.engine import CacheBlendEngine

    monkeypatch.setattr(CacheBlendEngine, "from_pretrained", classmethod(lambda cls, *a, **k: engine))
    for shard in ("0/2", "1/2"):  # a second run adds nothing
        assert main(["warm", "--store", redis_url, "--shard", shard, "--no-progress", str(docs)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["new"] == 0 and out["present"] == out["chunks"] and out["entries"] == 10
    with redis_server.client() as client:
        assert len(client.keys("cacheblend:*:{*}")) == 10


@pytest.mark.parametrize("text", ["2/2", "-1/2", "1", "a/b", "0/0"])
def test_bad_shards_are_refused(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="I/N"):
        parse_shard(text)
    assert parse_shard("3/4") == (3, 4)


def test_cache_stats_and_clear_of_a_redis_store(engine, redis_server, redis_url, tmp_path, capsys, monkeypatch):
    from cacheblend_rag.engine import CacheBlendEngine

    monkeypatch.setattr(CacheBlendEngine, "from_pretrained", classmethod(lambda cls, *a, **k: engine))
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(corpus(3)))
    assert main(["warm", "--store", redis_url, "--no-progress", str(docs)]) == 0
    assert json.loads(capsys.readouterr().out)["new"] == 3
    assert main(["cache", "stats", "--store", redis_url, "--json"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out)
    assert stats["entries"] == 3 and stats["bytes"] > 0
    assert redis_server.password not in out and ":***@" in stats["details"]["url"]  # never print the password
    assert main(["cache", "clear", "--store", redis_url]) == 0
    assert "cleared 3 entries" in capsys.readouterr().out
