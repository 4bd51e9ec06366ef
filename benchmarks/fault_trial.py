"""A fault trial on the embedded model: damage a disk store of 4 chunks in every way we know of,
then answer from it, and check that nothing broke (prints JSON, then a Markdown table).

    .venv/bin/python benchmarks/fault_trial.py [--data ../shared/data/musique_dev.json] [--out trial.json]
        [--model NAME] [--chunk-tokens 120] [--load-tokens N] [--answer-tokens N]

The test suite runs every case too, on a tiny random model and shorter passages and answers (``--model
tiny-llama --chunk-tokens 16 --load-tokens 48 --answer-tokens 3``): no fault is left out, only the work of
each request is smaller.

For each fault a copy of one healthy store is damaged, reopened (as a restarting replica would)
and a prompt over its 4 chunks (MuSiQue passages when the file is there, else the demo corpus) is
answered greedily. A fault is **survived** when the request completes, its answer and logits
equal the healthy store's (chunks stored at 32 bits, so a recomputed chunk is bit for bit the
stored one), the store counted what happened (corrupt, or eviction: never eviction as corruption)
and a file outside the store directory, planted beside it, is untouched after the request and
after ``cacheblend-rag cache clear``. Weight faults check instead that chunk KV of other weights is
never reused. One row is expected to fail: a forged entry in a store without a key (a checksum
tells damage from health, not a forger from the owner; that is what authenticated mode is for).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from cacheblend_rag import BlendConfig, CacheBlendEngine, FreshSegment, StoredSegment
from cacheblend_rag.bench.report import print_report
from cacheblend_rag.cli import main as cli_main
from cacheblend_rag.store import ChunkCache, DiskKVStore
from cacheblend_rag.store.format.codec import codec_named
from cacheblend_rag.store.format.chunk_bytes import encode_layer, encode_manifest, peek_manifest, value_digest
import fault_trial_env  # noqa: E402  (benchmarks/ is on sys.path when this runs as a script)
from cacheblend_rag.store.format.tampering import (
    damage_index,
    delete_as_another_program,
    index_rows,
    layer_name,
    manifest_name,
    nested_manifest,
    read_as_another_program,
    set_index_filename,
    write_as_another_program,
)

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"
KEY = b"fault-trial: a store key, 32 b.."
CONFIG = BlendConfig(recompute_ratio=0.15, min_blend_tokens=0)
# A chunk recomputed on a miss is computed alone, the stored one in a batch of four: the same math in
# another order, so logits may differ in the last bits (SmolLM2's logits are in the tens).
TOLERANCE = 1e-4


@dataclass
class Trial:
    """One prepared store and what a healthy answer from it is (``answer_tokens`` long, greedy)."""

    engine: CacheBlendEngine
    chunks: list[list[int]]
    segments: list[Any]
    healthy: torch.Tensor
    healthy_text: str
    pristine: Path
    work: Path
    victim: Path
    keys: list[str]  # the chunks' store keys
    answer_tokens: int = 8
    model: str | None = None  # --model: None is the embedded one (a child process loads the same)

    def key(self, index: int) -> str:
        return self.keys[index]


def _cache(engine: CacheBlendEngine, path: Path, *, size_limit: int | None = None,
           auth_key: bytes | None = None) -> ChunkCache:
    # No host-memory tier: its copies, verified once, would answer the reads these faults are aimed at.
    return ChunkCache(engine, DiskKVStore(path, size_limit=size_limit), storage_dtype="float32", auth_key=auth_key,
                      resident_bytes=0)


def _manifest(path: Path, key: str):
    return peek_manifest(read_as_another_program(path, manifest_name(key)))


def _layer_name(path: Path, key: str, index: int) -> str:
    return layer_name(key, _manifest(path, key).write_id, index)


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x10
    return bytes(out)


def _valid_layer(path: Path, key: str, index: int, fill: float) -> None:
    """A layer of ``fill`` with a checksum recomputed to match, and a manifest that names it."""
    manifest = _manifest(path, key)
    h, n, d = manifest.layer_shape
    blob = encode_layer(torch.full((h, n, d), fill), torch.full((h, n, d), fill), codec_named("float32"))
    write_as_another_program(path, _layer_name(path, key, index), blob, key)
    digests = list(manifest.layer_digests)
    digests[index] = value_digest(blob)
    write_as_another_program(path, manifest_name(key), encode_manifest(replace(manifest, layer_digests=tuple(digests))), key)


# --------------------------------------------------------------------------- the faults
# Each takes the trial and the damaged store's path, damages it, and returns what the check needs:
# "corrupt" (at least one entry must be counted corrupt), "quiet" (none may be), or "auth".
Fault = Callable[[Trial, Path], str]


def _value_faults() -> dict[str, Fault]:
    def layer_bytes(t: Trial, p: Path, index: int = 2) -> tuple[str, bytes]:
        name = _layer_name(p, t.key(1), index)
        return name, read_as_another_program(p, name)

    def payload_flip(t, p):
        name, data = layer_bytes(t, p)
        write_as_another_program(p, name, _flip(data, len(data) - 40), t.key(1))
        return "corrupt"

    def header_flip(t, p):
        name, data = layer_bytes(t, p)
        write_as_another_program(p, name, _flip(data, 5), t.key(1))
        return "corrupt"

    def manifest_flip(t, p):
        data = read_as_another_program(p, manifest_name(t.key(1)))
        write_as_another_program(p, manifest_name(t.key(1)), _flip(data, len(data) // 2), t.key(1))
        return "corrupt"

    def truncated_layer(t, p):
        name, data = layer_bytes(t, p)
        write_as_another_program(p, name, data[:100], t.key(1))
        return "corrupt"

    def truncated_manifest(t, p):
        data = read_as_another_program(p, manifest_name(t.key(1)))
        write_as_another_program(p, manifest_name(t.key(1)), data[: len(data) // 2], t.key(1))
        return "corrupt"

    def swapped_layers(t, p):
        (a, first), (b, second) = layer_bytes(t, p, 1), layer_bytes(t, p, 2)
        write_as_another_program(p, a, second, t.key(1))
        write_as_another_program(p, b, first, t.key(1))
        return "corrupt"

    def swapped_manifests(t, p):
        first, second = read_as_another_program(p, manifest_name(t.key(0))), read_as_another_program(p, manifest_name(t.key(1)))
        write_as_another_program(p, manifest_name(t.key(0)), second, t.key(0))
        write_as_another_program(p, manifest_name(t.key(1)), first, t.key(1))
        return "corrupt"

    def foreign_bytes(t, p):
        name, data = layer_bytes(t, p)
        write_as_another_program(p, name, os.urandom(len(data)), t.key(1))
        return "corrupt"

    def pickled_manifest(t, p):
        write_as_another_program(p, manifest_name(t.key(1)), {"a": ["pickled", "object"]}, t.key(1))
        return "corrupt"

    def str_manifest(t, p):
        write_as_another_program(p, manifest_name(t.key(1)), "a manifest? no", t.key(1))
        return "corrupt"

    def int_layer(t, p):
        write_as_another_program(p, _layer_name(p, t.key(1), 2), 12345, t.key(1))
        return "corrupt"

    def str_layer_file(t, p):
        # diskcache keeps a text this long in a file of its own
        write_as_another_program(p, _layer_name(p, t.key(1), 2), "x" * 100_000, t.key(1))
        return "corrupt"

    def deeply_nested_manifest(t, p):
        write_as_another_program(p, manifest_name(t.key(1)), nested_manifest(), t.key(1))
        return "corrupt"

    def nan_layer(t, p):
        _valid_layer(p, t.key(1), 3, math.nan)
        return "corrupt"

    def inf_layer(t, p):
        _valid_layer(p, t.key(1), 3, math.inf)
        return "corrupt"

    def deleted_layer_row(t, p):
        delete_as_another_program(p, _layer_name(p, t.key(1), 2))
        return "quiet"  # a missing layer is an eviction, not damage

    def evicted_layers(t, p):
        for index in (5, 17, 29):  # some layers of a chunk, as an eviction of single values would
            delete_as_another_program(p, _layer_name(p, t.key(2), index))
        return "quiet"

    return {
        "bit flip in a layer's payload": payload_flip,
        "bit flip in a layer's header": header_flip,
        "bit flip in a manifest": manifest_flip,
        "truncated layer": truncated_layer,
        "truncated manifest": truncated_manifest,
        "two layers of a chunk swapped": swapped_layers,
        "manifests of two chunks swapped": swapped_manifests,
        "random bytes as a layer": foreign_bytes,
        "pickled object as a manifest": pickled_manifest,
        "str as a manifest": str_manifest,
        "int as a layer": int_layer,
        "str in a layer's file": str_layer_file,
        "nested JSON manifest (50,000 deep), valid checksum": deeply_nested_manifest,
        "NaN layer, valid checksum": nan_layer,
        "infinite layer, valid checksum": inf_layer,
        "a layer's row deleted": deleted_layer_row,
        "three layers of a chunk evicted": evicted_layers,
    }


def _forgery_faults() -> dict[str, Fault]:
    def forged(t, p):
        _valid_layer(p, t.key(1), 3, 0.5)  # consistent, checksummed, and wrong
        return "forged"

    def forged_authenticated(t, p):
        shutil.rmtree(p)  # a store whose owner signs, and a forger who writes without the key
        with _cache(t.engine, p, auth_key=KEY) as signed:
            signed.warm(t.chunks)
        _valid_layer(p, t.key(1), 3, 0.5)
        return "auth"

    return {"forged layer, store without a key": forged, "forged layer, authenticated store": forged_authenticated}


def _index_faults() -> dict[str, Fault]:
    def outside(t, p, relative):
        rowid, _, _ = index_rows(p, "key LIKE 'l:%' AND filename IS NOT NULL")[0]
        set_index_filename(p, rowid, os.path.relpath(t.victim, p) if relative else str(t.victim))
        return "corrupt"

    def sparse(t, p):
        _, _, filename = index_rows(p, "key LIKE 'l:%' AND filename IS NOT NULL")[0]
        os.truncate(p / filename, 6 * 2**30)
        return "corrupt"

    def index(how):
        def apply(t, p):
            damage_index(p, how)
            return "reopen"
        return apply

    return {
        "index names a file outside the store (absolute)": lambda t, p: outside(t, p, False),
        "index names a file outside the store (../)": lambda t, p: outside(t, p, True),
        "sparse 6 GiB layer file": sparse,
        "index overwritten with garbage": index("garbage"),
        "index deleted": index("deleted"),
        "index pages corrupted": index("corrupt-pages"),
        "index emptied (full disk)": index("empty"),
    }


# --------------------------------------------------------------------------- running
def _answer(engine: CacheBlendEngine, segments: list[Any], cache: ChunkCache, *, blend_only: bool = False,
            tokens: int = 8) -> tuple[torch.Tensor, str | None, Any]:
    """Logits of a blend first (what the store held, before any write-back), then the greedy answer of
    ``tokens`` tokens."""
    blended = engine.blend(segments, config=CONFIG, store=cache)
    if blend_only:
        return blended.logits, None, blended.stats
    result = engine.generate(segments, config=CONFIG, store=cache, max_new_tokens=tokens)
    return blended.logits, result.text, blended.stats


def _run_store_fault(trial: Trial, name: str, fault: Fault) -> dict[str, Any]:
    path = trial.work / "kv"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(trial.pristine, path)
    row: dict[str, Any] = {"fault": name}
    try:
        expect = fault(trial, path)
        with _cache(trial.engine, path, auth_key=KEY if expect == "auth" else None) as cache:
            logits, text, _ = _answer(trial.engine, trial.segments, cache, tokens=trial.answer_tokens)
            cache.flush()
            stats = cache.stats()
        difference = float((logits - trial.healthy).abs().max())
        row.update(answer_same=text == trial.healthy_text and difference <= TOLERANCE, max_logit_difference=difference,
                   corrupt=stats.corrupt, evictions=stats.evictions)
        counted = {"corrupt": stats.corrupt >= 1, "quiet": stats.corrupt == 0, "auth": stats.corrupt >= 1,
                   "reopen": True, "forged": True}[expect]
        cleared = cli_main(["cache", "clear", "--path", str(path)]) == 0
        row.update(counted=counted, clear_works=cleared)
        row["survived"] = bool(row["answer_same"] and counted and cleared)
    except Exception as exc:  # a request that fails is what the trial looks for
        row.update(survived=False, error=f"{type(exc).__name__}: {exc}"[:300])
    row["outside_file_intact"] = trial.victim.read_text() == "precious"
    row["survived"] = row["survived"] and row["outside_file_intact"]
    return row


def _run_weight_faults(trial: Trial) -> list[dict[str, Any]]:
    rows = []
    for name in ("a copy of the model with one v_proj scaled by 1.5", "the loaded model's weights changed in place"):
        row: dict[str, Any] = {"fault": name}
        changed = trial.engine
        if name.startswith("a copy"):
            changed = CacheBlendEngine(copy.deepcopy(trial.engine.model), trial.engine.tokenizer, min_blend_tokens=0)
        target = changed.model.model.layers[0].self_attn.v_proj.weight
        original = target.detach().clone()
        with torch.no_grad():
            target.mul_(1.5)
        try:
            path = trial.work / "kv"  # the healthy store, of the weights before the change
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(trial.pristine, path)
            with _cache(changed, path) as cache:
                logits, _, stats = _answer(changed, trial.segments, cache)
            fresh = [trial.segments[0], *changed.prefill_chunks(trial.chunks), trial.segments[-1]]
            difference = float((logits - changed.blend(fresh, config=CONFIG).logits).abs().max())
            row.update(answer_same=difference <= TOLERANCE, max_logit_difference=difference, reused=stats.cache_hits,
                       survived=stats.cache_hits == 0 and difference <= TOLERANCE)
        except Exception as exc:
            row.update(survived=False, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            with torch.no_grad():
                target.copy_(original)
        row["outside_file_intact"] = trial.victim.read_text() == "precious"
        rows.append(row)
    return rows


def _eviction_faults(trial: Trial) -> list[dict[str, Any]]:
    """A size limit smaller than the working set, with and without a pickled row at the oldest position."""
    rows = []
    with _cache(trial.engine, trial.work / "probe") as probe:
        empty = probe.store.volume()  # SQLite's own pages
        per_chunk = probe.warm(trial.chunks[:1]).bytes_written
    limit = empty + int(1.5 * per_chunk)
    fresh_logits: dict[int, torch.Tensor] = {}  # the 4 pairs' logits from in-memory chunk KV, computed once

    def fresh_for(pair: int, chunks: list[list[int]]) -> torch.Tensor:
        if pair not in fresh_logits:
            fresh = [trial.segments[0], *trial.engine.prefill_chunks(chunks), trial.segments[-1]]
            fresh_logits[pair] = trial.engine.blend(fresh, config=CONFIG).logits
        return fresh_logits[pair]

    for name, pickled in (("size limit below the working set", False),
                          ("size limit, a pickled row at the oldest position", True)):
        path = trial.work / "small"
        shutil.rmtree(path, ignore_errors=True)
        row: dict[str, Any] = {"fault": name}
        try:
            if pickled:
                write_as_another_program(path, "m:" + "ab" * 32, {"a": "pickle"}, "ab" * 32)
            with _cache(trial.engine, path, size_limit=limit) as cache:
                same = True
                for request in range(8):
                    chunks = [trial.chunks[request % 4], trial.chunks[(request + 1) % 4]]
                    segments = [trial.segments[0], *map(StoredSegment, chunks), trial.segments[-1]]
                    result = trial.engine.blend(segments, config=CONFIG, store=cache)
                    same &= bool(torch.allclose(result.logits, fresh_for(request % 4, chunks), atol=TOLERANCE,
                                                rtol=0))
                    cache.flush()
                stats = cache.stats()
                bounded = cache.store.volume() <= limit + 2 * per_chunk
            # The pickled row is a foreign value: counted corrupt once and removed; nothing else may be.
            row.update(answer_same=same, corrupt=stats.corrupt, evictions=stats.evictions, store_bounded=bounded,
                       survived=same and stats.corrupt == int(pickled) and stats.evictions > 0 and bounded)
        except Exception as exc:
            row.update(survived=False, error=f"{type(exc).__name__}: {exc}"[:300])
        row["outside_file_intact"] = trial.victim.read_text() == "precious"
        rows.append(row)
    return rows


def _texts(data: Path) -> list[str]:
    if data.exists():
        return [f"{c['title']}\n{c['text']}\n" for c in json.loads(data.read_text())[0]["ctxs"][:4]]
    from cacheblend_rag.data import load_demo_corpus

    return [f"{doc.title}\n{doc.text}\n" for doc in load_demo_corpus()[:4]]


def _load_texts(data: Path, engine: CacheBlendEngine, tokens: int | None) -> list[str]:
    """The load case's passages: whole, or their first ``tokens`` tokens (still one passage per line block)."""
    texts = _texts(data)
    if tokens is None:
        return texts
    return [engine.tokenizer.decode(engine.tokenize(t)[:tokens]).rstrip() + "\n" for t in texts]


def _questions(data: Path) -> list[str]:
    if data.exists():
        return [q["question"] for q in json.loads(data.read_text())[:4]]
    return ["Who is named first?", "Where is it?", "When was it?", "What is it?"]


def _passages(data: Path, engine: CacheBlendEngine, tokens: int) -> list[list[int]]:
    passages = [engine.tokenize(t)[:tokens] for t in _texts(data)]
    if len({len(p) for p in passages}) != 1:
        # The eviction cases size the store's limit from one chunk: the four must be of one size.
        raise SystemExit(f"--chunk-tokens {tokens} is longer than a passage ({[len(p) for p in passages]} tokens); "
                         "pass a smaller one")
    return passages


def _at_least(smallest: int, why: str = "so that each layer of a chunk is a file of its own (the index faults "
              "damage those files)") -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < smallest:
            raise argparse.ArgumentTypeError(f"{value} is too small: at least {smallest} tokens, {why}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--skip", nargs="*", default=[], choices=["store", "file systems", "redis", "load"],
                        help="groups to leave out (store: the damaged-store, eviction and weight faults; file "
                             "systems need root, redis and load need redis-server)")
    parser.add_argument("--chunk-tokens", type=_at_least(8), default=120,
                        help="tokens of each of the 4 stored chunks (a passage's first ones)")
    parser.add_argument("--load-tokens", type=_at_least(8), default=None,
                        help="cut the load case's passages to their first N tokens (default: whole passages)")
    parser.add_argument("--model", default=None,
                        help="the model (default: the embedded SmolLM2); tiny-llama and the other tiny-* names "
                             "are random test models, on which every case runs in a fraction of the time")
    parser.add_argument("--answer-tokens", type=_at_least(2, "so that an answer decodes from the blended KV"),
                        default=8, help="tokens of each greedy answer compared with the healthy one (the load case's "
                                        "requests keep their 6)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    engine = fault_trial_env.trial_engine(args.model)
    root = Path(tempfile.mkdtemp(prefix="fault-trial-"))
    victim = root / "outside" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    chunks = _passages(args.data, engine, args.chunk_tokens)
    segments = [FreshSegment(engine.tokenize("<|im_start|>user\nPassages:\n")), *map(StoredSegment, chunks),
                FreshSegment(engine.tokenize("Question: what do the passages name first?<|im_end|>\n"
                                             "<|im_start|>assistant\n"))]
    pristine = root / "pristine"
    with _cache(engine, pristine) as cache:
        cache.warm(chunks)
        healthy, healthy_text, _ = _answer(engine, segments, cache, tokens=args.answer_tokens)
        keys = [cache.key_for(ids) for ids in chunks]
    trial = Trial(engine, chunks, segments, healthy, healthy_text, pristine, root, victim, keys,
                  args.answer_tokens, args.model)

    groups = {"values under our keys": _value_faults(), "forgery": _forgery_faults(),
              "index and files": _index_faults()}
    results: dict[str, list[dict[str, Any]]] = {}
    seconds: dict[str, float] = {}  # each group's, from the end of the one before
    mark = [time.perf_counter()]

    def done(group: str) -> None:
        seconds[group], mark[0] = round(time.perf_counter() - mark[0], 1), time.perf_counter()

    with tqdm(total=sum(map(len, groups.values())) + 4, desc="faults") as progress:
        for group, faults in groups.items() if "store" not in args.skip else ():
            results[group] = []
            for name, fault in faults.items():
                results[group].append(_run_store_fault(trial, name, fault))
                progress.update()
            done(group)
        if "store" not in args.skip:
            results["eviction"] = _eviction_faults(trial)
            progress.update(2)
            done("eviction")
            results["weights"] = _run_weight_faults(trial)
            progress.update(2)
            done("weights")
        answer = lambda cache, blend_only=False: _answer(engine, segments, cache, blend_only=blend_only,  # noqa: E731
                                                         tokens=trial.answer_tokens)
        if "file systems" not in args.skip:
            results["file systems"] = fault_trial_env.file_system_faults(
                trial, answer, lambda path: _cache(engine, path), TOLERANCE)
            done("file systems")
        if "redis" not in args.skip:
            results["redis"] = fault_trial_env.redis_faults(trial, answer, TOLERANCE)
            done("redis")
        if "load" not in args.skip:
            results["load"] = fault_trial_env.load_case(trial, _load_texts(args.data, engine, args.load_tokens),
                                                        _questions(args.data))
            done("load")
    intact = victim.read_text() == "precious"
    shutil.rmtree(root, ignore_errors=True)

    summary = {group: {"tried": len(rows), "survived": sum(r["survived"] for r in rows), "seconds": seconds[group]}
               for group, rows in results.items()}
    report = {
        "benchmark": "fault_trial", "model": engine.model_name, "chunks": len(chunks),
        "chunk_tokens": [len(c) for c in chunks], "load_passage_tokens": args.load_tokens or "whole",
        "answer_tokens": trial.answer_tokens,
        "store": "disk, float32 (bit-exact recompute)",
        "summary": summary,
        "total": {"tried": sum(s["tried"] for s in summary.values()),
                  "survived": sum(s["survived"] for s in summary.values())},
        "outside_file_intact": intact,
        "results": results, "seconds": round(time.perf_counter() - started, 1),
    }
    print_report(report, args.out)
    print("\n| fault | survived | note |\n|---|---|---|")
    for group, rows in results.items():
        for r in rows:
            keys = ("corrupt", "evictions", "reused", "hits", "load_failures", "entries", "writes_skipped",
                    "files_left_by_failed_writes", "chunks_complete_at_kill", "healthy_p95_s", "cold_median_s", "stopped_median_s", "bound_s", "hits_resumed_after_s",
                    "seconds", "requests", "entries_after")
            note = r.get("error") or ", ".join(f"{k}={r[k]}" for k in keys if k in r)
            print(f"| {group}: {r['fault']} | {'yes' if r['survived'] else '**no**'} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
