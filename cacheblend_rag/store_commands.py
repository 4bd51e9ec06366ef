"""CLI commands of the KV store: ``cache stats``, ``cache clear`` and ``warm``.

``warm`` reads chunks from files:

* ``.txt`` (or any other extension): one chunk per paragraph; paragraphs are separated
  by blank lines;
* ``.jsonl``: one JSON object per line; its ``text`` field is the chunk. A ``metadata`` object
  is rendered into the chunk as LlamaIndex renders a node's metadata for the LLM (``topic: ...``
  above the text), by llama-index-postprocessor-cacheblend's own function, so a warmed chunk is
  what a LlamaIndex query over nodes with that metadata looks up; the record may also hold the
  node's ``excluded_llm_metadata_keys``, ``text_template``, ``metadata_template`` and
  ``metadata_separator`` (a ``node.dict()`` is such a record). ``--for langchain`` warms ``text``
  alone, as a LangChain ``Document``'s ``page_content``.

Each chunk is stripped of surrounding whitespace, the form the integrations announce and look
up chunks in. A chunk is a cache hit later only if a blend sees exactly the same text behind
the same prefix, so feed ``warm`` the texts your retriever returns. By default chunks are
computed behind the prefix the integrations' defaults look them up behind
(``condition_chunks=True``: the model's chat-template lead and a stand-in passage, unless the
model's saved calibration chose chunks alone), so a warm job serves ``CacheBlendLLM`` and
``ChatCacheBlend`` as they come; ``--no-condition`` computes each
chunk alone (for ``condition_chunks=False``), ``--prefix TEXT`` behind a prefix of your own.

A large corpus is warmed by N workers at once, each given the same files and its own
``--shard I/N`` (I = 0..N-1). Chunks are split by their key, so the split is the same in
every worker and every chunk is computed by exactly one of them; chunks already in the
store are skipped, so a rerun adds only what is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.reuse.prompt import chunk_texts, default_conditioning_prefix
from cacheblend_rag.store.backends.base import KVStore
from cacheblend_rag.store.format.codec import DEFAULT_GROUP, STORAGE_DTYPES
from cacheblend_rag.store.factory import open_store
from cacheblend_rag.store.inventory import inventory
from cacheblend_rag.store.store_key import require_store_key, store_key


def _add_store_options(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--path", help="directory of a disk store")
    where.add_argument("--store", help="store spec: a directory, disk:PATH, tiered:PATH, memory, or SCHEME://...")
    parser.add_argument("--size-limit", help="bound a disk store, e.g. 20GB (whole chunks are evicted, oldest first)")


def _open(args: argparse.Namespace, *, create: bool = False) -> KVStore:
    if args.path is not None and not create and not Path(args.path).is_dir():
        raise ConfigError(f"there is no store at {args.path}; check the path (warm creates a store)")
    return open_store(args.path if args.path is not None else args.store, size_limit=args.size_limit)


def register(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="inspect or empty a chunk KV store")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)

    stats = cache_sub.add_parser("stats", help="entries, bytes, hits, misses, evictions and corrupt entries")
    _add_store_options(stats)
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.set_defaults(func=_cmd_stats)

    clear = cache_sub.add_parser("clear", help="remove every entry and reset the counters")
    _add_store_options(clear)
    clear.set_defaults(func=_cmd_clear)

    warm = subparsers.add_parser("warm", help="precompute chunk KV of text (.txt) or JSONL (.jsonl) files into a store",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_store_options(warm)
    warm.add_argument("files", nargs="+", type=Path, metavar="FILES", help=".txt or .jsonl files of chunks")
    warm.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2-135M-Instruct)")
    warm.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cuda if available, else cpu)")
    warm.add_argument("--dtype", default=None, help="compute dtype, e.g. bfloat16 (default: the loader's choice)")
    warm.add_argument("--for", dest="for_integration", choices=["llamaindex", "langchain"], default=None,
                      help="warm what that integration renders: llamaindex renders a JSONL record's metadata "
                           "into its chunk (also the default where a record has metadata), langchain its text "
                           "alone; both look chunks up behind the same default prefix")
    behind = warm.add_mutually_exclusive_group()
    behind.add_argument("--no-condition", action="store_true",
                        help="compute each chunk alone (for integrations set to condition_chunks=False)")
    behind.add_argument("--prefix", default=None, help="compute chunks behind this text instead")
    warm.add_argument("--storage-dtype", default="auto", choices=list(STORAGE_DTYPES),
                      help="how values are stored: auto (16 bits), float16, bfloat16, float32, or quantized int8 "
                           "(about 0.51 of the 16-bit bytes) or int4 (about 0.28); readers must use the same")
    warm.add_argument("--storage-group", type=int, default=DEFAULT_GROUP,
                      help=f"group size of int8/int4 quantization (default {DEFAULT_GROUP})")
    warm.add_argument("--document-special-tokens", choices=["text", "control"], default="text",
                      help="special-token strings in a chunk (<|im_end|>, say) as plain text (default) or as control "
                           "tokens (trusted text only); readers must use the same (document_special_tokens)")
    warm.add_argument("--require-store-key", action="store_true",
                      help="refuse to run without a store key ($CACHEBLEND_STORE_KEY); readers need the same key")
    warm.add_argument("--batch-size", type=int, default=8, help="chunks per forward pass")
    warm.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    warm.add_argument("--shard", type=parse_shard, default=None, metavar="I/N",
                      help="warm only shard I of N (I = 0..N-1); run N workers on the same files to split the work")
    warm.set_defaults(func=_cmd_warm)


def _cmd_stats(args: argparse.Namespace) -> int:
    with _open(args) as store:
        stats = store.stats()  # never raises: a store that cannot be asked says so
        by_codec = inventory(store) if stats.available else {}
    if args.json:
        codecs = {label: share.to_dict() for label, share in by_codec.items()}
        print(json.dumps({"store": store.describe(), **stats.to_dict(), "by_codec": codecs}, indent=2))
        return 0
    print(store.describe())
    if not stats.available:
        print(f"  unavailable: {stats.error} (the counts below are this process's own)")
    for name in ("entries", "bytes", "hits", "misses", "load_failures", "evictions", "corrupt", "foreign_key_entries",
                 "writes_skipped", "write_backs_dropped"):
        print(f"  {name:<19} {getattr(stats, name):>14,}")
    if stats.details.get("writes", "ok") != "ok":
        print(f"  writes         {stats.details['writes']}")
    if by_codec:
        print(f"  {'codec':<22} {'entries':>9} {'tokens':>12} {'bytes':>15} {'bytes/token':>12}")
        for label, share in by_codec.items():
            print(f"  {label:<22} {share.entries:>9,} {share.tokens:>12,} {share.bytes:>15,} "
                  f"{share.bytes_per_token:>12,.1f}")
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    with _open(args) as store:
        entries = store.stats().entries
        store.clear()
    print(f"cleared {entries} entries from {store.describe()}")
    return 0


# Integrations that render chunks their own way register a function ``record -> text`` here
# (llama-index-postprocessor-cacheblend: "llamaindex"); the core names no framework.
RENDERERS_GROUP = "cacheblend_rag.chunk_renderers"


def chunk_renderer(name: str) -> Callable[[dict[str, Any]], str]:
    """The function the integration registered as ``name`` to render a JSONL record as its chunk text."""
    found = [ep for ep in entry_points(group=RENDERERS_GROUP) if ep.name == name]
    if not found:
        raise ConfigError(f"records with metadata are warmed as {name} renders them, and no renderer {name!r} is "
                          f"installed (entry points {RENDERERS_GROUP}): pip install llama-index-postprocessor-cacheblend "
                          "for LlamaIndex's; or pass --for langchain to warm each record's text alone")
    return found[0].load()


def read_chunks(path: Path, target: str | None = None) -> Iterator[str]:
    """Chunk texts of one file (see the module docstring for the formats), as ``target`` renders them:
    ``"llamaindex"`` (also ``None`` for a record with metadata) or ``"langchain"`` (the text alone)."""
    if not path.is_file():
        raise ConfigError(f"{path} is not a file; pass .txt or .jsonl files of chunks")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() != ".jsonl":
        yield from chunk_texts(text.replace("\r\n", "\n").split("\n\n"))
        return
    render: Callable[[dict[str, Any]], str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = _record(path, number, line)
        if target == "langchain" or target is None and not record.get("metadata"):
            yield from chunk_texts([record["text"]])
            continue
        render = render or chunk_renderer("llamaindex")
        try:
            yield from chunk_texts([render(record)])
        except ValueError as exc:  # pydantic's ValidationError is one
            raise ConfigError(f"{path}:{number} is not a node LlamaIndex can render: {exc}") from None


def _record(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{number} is not valid JSON ({exc.msg}); write one JSON object per line") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ConfigError(f'{path}:{number} has no string "text" field; write {{"text": "..."}} per line')
    if not isinstance(record.get("metadata", {}), dict):
        raise ConfigError(f'{path}:{number} has a "metadata" field that is not an object; write '
                          '{"text": "...", "metadata": {"topic": "..."}}')
    return record


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"shard {text!r} must be I/N with 0 <= I < N, e.g. 0/4 ... 3/4")
    return index, count


def shard_of(key: str, count: int) -> int:
    """The shard (of ``count``) a chunk key belongs to; keys are SHA-256 hex, so shards come out even."""
    return int(key[:16], 16) % count


def _cmd_warm(args: argparse.Namespace) -> int:
    from cacheblend_rag.engine import CacheBlendEngine
    from cacheblend_rag.store.chunk_cache import ChunkCache

    if args.require_store_key:  # before the model loads
        require_store_key(store_key(None) is not None, "--require-store-key")
    texts = [chunk for path in args.files for chunk in read_chunks(path, args.for_integration)]
    engine = CacheBlendEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    calibrated = engine.calibration()
    if args.no_condition:
        prefix: Sequence[int] = ()
    elif args.prefix is not None:
        prefix = engine.tokenize(args.prefix)
    elif calibrated is not None and not calibrated.condition_chunks:
        # The integrations follow the model's calibration when left to their defaults: so does warm.
        print(f"warm: computing chunks alone, as {calibrated.source} chose ({calibrated.name})", file=sys.stderr)
        prefix = ()
    else:
        prefix = default_conditioning_prefix(engine.tokenizer)
    corpus_size = len(texts)
    with ChunkCache(engine, _open(args, create=True), prefix_ids=prefix, batch_size=args.batch_size,
                    storage_dtype=args.storage_dtype, storage_group=args.storage_group) as cache:
        if args.shard is not None:
            index, count = args.shard
            fingerprint = engine.fingerprint
            special = args.document_special_tokens
            texts = [t for t in texts
                     if shard_of(cache.key_for(engine.tokenize(t, special_tokens=special), fingerprint=fingerprint),
                                 count) == index]
        summary = cache.warm(texts, show_progress=not args.no_progress, special_tokens=args.document_special_tokens)
        stats = cache.stats()
        cache.store.close()
    shard = None if args.shard is None else "{}/{}".format(*args.shard)
    print(json.dumps({"store": cache.store.describe(), "shard": shard, "corpus_chunks": corpus_size,
                      "chunks": len(texts), "new": summary.new,
                      "present": summary.present, "failed": summary.failed,
                      "bytes_written": summary.bytes_written, "entries": stats.entries, "bytes": stats.bytes}))
    return 1 if summary.failed else 0


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="cacheblend-rag")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
