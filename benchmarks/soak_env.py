"""What the soak (benchmarks/soak.py) starts: a redis-server on a free loopback port, a disk tier (a tmpfs
when run as root, else a plain folder whose full-disk phase is simulated), the tiered store of the two,
SmolLM2 through both integrations sharing one engine and scheduler, the corpus, and the audit of healthy
entries. Imported by ``soak.py``."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(REPO / "tests" / "store_redis"))
from redis_server import RedisServer  # noqa: E402  (starts redis-server on a free port; shared with the tests)

from fault_trial_env import _Tmpfs  # noqa: E402  (a tmpfs mount that can be filled: shared with the fault trial)

from cacheblend_rag.store import DiskKVStore  # noqa: E402
from cacheblend_rag.store.errors import CorruptEntryError, StoreError  # noqa: E402
from cacheblend_rag.store.format.chunk_bytes import peek_manifest  # noqa: E402
from cacheblend_rag.store.backends.tiered import TieredKVStore  # noqa: E402

DEFAULT_DATA = REPO.parent / "shared" / "data" / "musique_dev.json"
TMPFS_BYTES = 512 << 20  # the disk tier's file system: the warmed corpus and every chunk written during a soak
# Small bounds on the prefix and segment caches, so that they fill during the warm-up: RSS growth after it
# is then growth nothing bounds (the shipped 256 MiB + 64 MiB would keep filling for the whole run).
PREFIX_CACHE_BYTES, SEGMENT_CACHE_BYTES = "24MB", "8MB"
# The same for the host-memory tier of chunks read or computed (1 GiB on a CPU by default): a ten-minute run on a
# 2-core EPYC in float32 grew RSS +25% idle to idle (1,301 to 1,630 MB) with Python objects and the two caches
# above flat, about the ~90 missed chunks' K/V (3.7 MB each) it had kept; 16 MB (4 chunks) fills in the warm-up.
RESIDENT_BYTES = "16MB"
READ_TIMEOUT_S, PROBE_INTERVAL_S = 0.5, 1.0


@dataclass
class Corpus:
    """Passages (cut to ``passage_tokens``) and questions: ``warm`` ones are precomputed before traffic,
    ``cold`` ones are announced but never warmed (the prompts that miss), ``job`` ones are what the warm job
    that gets killed writes."""

    questions: list[str]
    warm: list[list[str]]  # per question, its passages
    cold: list[str]
    job: list[str]

    @property
    def announced(self) -> list[str]:
        return [p for group in self.warm for p in group] + self.cold + self.job


def load_corpus(data: Path, tokenizer: Any, *, questions: int, passages: int, passage_tokens: int) -> Corpus:
    """MuSiQue questions and passages when ``data`` exists, else the demo corpus's articles and questions."""
    def cut(text: str) -> str:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:passage_tokens]
        return tokenizer.decode(ids).strip() + "\n"

    if data.exists():
        rows = json.loads(data.read_text())
        texts = [[cut(f"{c['title']}\n{c['text']}") for c in row["ctxs"]] for row in rows]
        asked = [row["question"] for row in rows[:questions]]
        spare = [t for group in texts[questions:] for t in group]
    else:
        from cacheblend_rag.data import load_demo_corpus, load_demo_questions

        paragraphs = [cut(p) for doc in load_demo_corpus() for p in doc.text.split("\n\n") if len(p) > 80]
        asked = [q.question for q in load_demo_questions()][:questions]
        texts = [paragraphs[i * passages:(i + 1) * passages] for i in range(len(asked))]
        spare = paragraphs[len(asked) * passages:]
    if len(asked) < questions or len(spare) < 40:
        raise SystemExit(f"{data} has too few questions or passages for --questions {questions}; pass fewer")
    warm = [group[:passages] for group in texts[:questions]]
    half = len(spare) // 2
    return Corpus(asked, warm, cold=spare[:half], job=spare[half:half + 8])


@dataclass
class SoakEnv:
    root: Path
    redis: RedisServer
    disk_path: Path
    tmpfs: _Tmpfs | None  # None: not root, the full disk is simulated
    disk: DiskKVStore
    store: TieredKVStore
    llms: dict[str, Any] = field(default_factory=dict)
    chunk_cache: Any = None

    @property
    def disk_simulated(self) -> bool:
        return self.tmpfs is None

    def close(self) -> None:
        if self.llms:  # one engine, so one scheduler for all of them
            next(iter(self.llms.values())).service.scheduler.close(5.0)
        if self.chunk_cache is not None:
            self.chunk_cache.close()
        self.store.close()
        self.redis.stop()
        if self.tmpfs is not None:
            self.tmpfs.__exit__(None, None, None)
        shutil.rmtree(self.root, ignore_errors=True)


def start_env(max_new_tokens: int, model: str | None = None) -> SoakEnv:
    """Redis, the disk tier, the tiered store and four LLM objects on one engine: LangChain and LlamaIndex at
    the default blend, and the control stream's pair (ratio 1.0, and full prefill with reuse off); ``model``: the
    embedded one unless named (``tiny-llama``: a smoke run)."""
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM

    from cacheblend_rag.store.backends.redis_store import RedisKVStore

    root = Path(tempfile.mkdtemp(prefix="soak-"))
    redis = RedisServer(root / "redis").start()
    disk_path = root / "disk"
    tmpfs = _Tmpfs(disk_path, TMPFS_BYTES) if os.geteuid() == 0 else None
    disk = DiskKVStore(disk_path / "kv")
    remote = RedisKVStore(redis.url(), read_timeout=READ_TIMEOUT_S, probe_interval=PROBE_INTERVAL_S)
    # Disk in front of Redis, no memory tier: a memory tier would serve every warmed chunk from process
    # memory and no fault of Redis or of the disk would reach a request.
    env = SoakEnv(root, redis, disk_path, tmpfs, disk, TieredKVStore(disk, remote))
    caches = dict(prefix_cache_bytes=PREFIX_CACHE_BYTES, segment_cache_bytes=SEGMENT_CACHE_BYTES)
    first = CacheBlendLLM(model=model, store_path=None, max_new_tokens=max_new_tokens, temperature=0.0, **caches)
    engine = first.engine
    from cacheblend_rag.serving.registry import chunk_cache_for

    env.chunk_cache = chunk_cache_for(engine, env.store, prefix_ids=first.service.chunk_cache.prefix_ids,
                                      resident_bytes=RESIDENT_BYTES)
    shared = dict(engine=engine, chunk_cache=env.chunk_cache, temperature=0.0, **caches)
    env.llms = {
        "llamaindex": CacheBlendLLM(max_new_tokens=max_new_tokens, **shared),
        "langchain": ChatCacheBlend(max_tokens=max_new_tokens, **shared),
        # Without the prefix cache: in bfloat16 an "exact" lead another request computed inside a blend is not
        # bit for bit full prefill's, and flips greedy answers at ratio 1.0 (2 of 12 SmolLM2 prompts, with or
        # without faults): the control stream is there to catch a wrong answer from the store, not that.
        "control": CacheBlendLLM(max_new_tokens=max_new_tokens, recompute_ratio=1.0,
                                 **{**shared, "prefix_cache_bytes": 0, "segment_cache_bytes": 0}),
        "full_prefill": CacheBlendLLM(max_new_tokens=max_new_tokens, reuse_chunk_kv=False, **shared),
    }
    return env


def healthy_keys(env: SoakEnv, tier: Any) -> set[str]:
    """Keys of ``tier`` whose entry is whole and valid for this engine: a manifest that passes the chunk cache's
    rules and every layer it names, checked (nothing is deleted or counted: this only reads)."""
    rules = env.chunk_cache.rules
    healthy = set()
    try:
        keys = list(tier.keys())
    except (StoreError, OSError):
        return healthy
    for key in keys:
        try:
            data = tier.get_manifest(key)
            if data is None:
                continue
            tokens = peek_manifest(data).layer_shape[1]
            manifest = rules.manifest(data, key, tokens)
            blobs = tier.get_layers([(key, manifest.write_id, i) for i in range(manifest.num_layers)])
            for i, blob in enumerate(blobs):
                if blob is None or isinstance(blob, CorruptEntryError):
                    raise CorruptEntryError(f"layer {i} missing")
                rules.layer(blob, manifest, i)
        except (CorruptEntryError, StoreError, OSError, ValueError):
            continue
        healthy.add(key)
    return healthy


@contextmanager
def disk_full(env: SoakEnv) -> Iterator[str]:
    """The disk tier's file system full: filled by an unrelated file on the tmpfs, or, without root, every
    write of the disk tier failing with ENOSPC (simulated, and said so in the report)."""
    if env.tmpfs is not None:
        filler = env.tmpfs.fill()
        try:
            yield "tmpfs filled"
        finally:
            filler.unlink()
        return
    disk = env.disk

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device (simulated: the soak is not root)")

    disk.put_layer = full  # type: ignore[method-assign]
    disk.add_manifest = full  # type: ignore[method-assign]
    try:
        yield "simulated (not root): the disk tier's writes fail with ENOSPC"
    finally:
        del disk.put_layer, disk.add_manifest
