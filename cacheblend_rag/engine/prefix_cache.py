"""The prefix cache: K/V of prompt openings the engine has computed, kept in token blocks.

Chat and RAG prompts open with what the previous requests opened with: the chat template's
lead, a system prompt, the instructions before the context, and in a conversation the whole
previous prompt and answer. The K/V full prefill computes for those tokens depends on nothing
after them, so it can be reused as is, as vLLM's prefix cache and SGLang's radix tree do.

* **Blocks.** A prompt's tokens are cut into blocks of ``block_size``; only full blocks are
  kept. A block's key is a chain hash: SHA-256 of the model fingerprint, an optional salt, the
  parent block's key and the block's token ids. So a key names the whole prefix up to the
  block's end under one model, prompts that share a lead share its blocks, and two tenants
  whose texts differ anywhere before a block never share it. SHA-256 and not a fast hash: a
  hash an attacker can collide would let one tenant's prompt read another's K/V (vLLM moved
  its prefix-cache keys to SHA-256 for that reason). ``salt`` (vLLM's ``cache_salt``) keeps
  tenants apart even where their texts agree.
* **Values.** One tensor per block, ``[layers, 2, kv_heads, block_size, head_dim]``: keys
  *rotated* (a prefix never moves, and the decoding cache holds them so; rotating them back to
  store them unrotated would round) and values.
* **Bounds.** ``max_bytes`` bounds the blocks held; the least recently used *leaf* block goes
  first (a block no other cached block continues), so what stays is always a prefix chain.
  :meth:`match` touches a chain leaf first, so the parents stay more recent than their children.
* **Replicas.** An optional :class:`PrefixBlockStore` (a KV store, in the store's safe format:
  :mod:`cacheblend_rag.store.prefix_blocks`) is read after the blocks in memory run out and
  written as blocks are added, so replicas sharing a store share prefixes too.

Only K/V that equals full prefill's belongs here: a caller inserts a request's tokens up to its
``BlendStats.exact_kv_tokens`` (all of them at ratio 1.0, the prompt before the first blended
chunk otherwise) and, when the whole prompt was exact, the answer decoded after it.

The cache holds no thread; a lock makes :meth:`stats` safe to read from other threads.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from cacheblend_rag.engine.segments import PrefixSegment
from cacheblend_rag.errors import ConfigError

_DOMAIN = b"cacheblend-rag/prefix-block\x00"
DEFAULT_BLOCK_SIZE = 16


def block_keys(fingerprint: str, token_ids: Sequence[int], block_size: int, salt: str = "") -> list[str]:
    """The chain keys of every full block of ``token_ids``, in order (hex SHA-256)."""
    if not fingerprint:
        raise ValueError("fingerprint is empty; pass engine.fingerprint")
    ids = np.asarray(list(token_ids), dtype="<i8")
    parent = hashlib.sha256(_DOMAIN + _framed(fingerprint.encode()) + _framed(salt.encode())).digest()
    keys = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + ids[start : start + block_size].tobytes()).digest()
        keys.append(parent.hex())
    return keys


def _framed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class PrefixBlockStore(Protocol):
    """Where a prefix cache keeps blocks for other replicas (:mod:`cacheblend_rag.store.prefix_blocks`)."""

    def load_blocks(self, keys: Sequence[str], block_size: int) -> list[torch.Tensor]:
        """The blocks of ``keys`` in order, as far as they are stored whole and valid (one missing or
        damaged ends the list; a damaged one is reported and removed)."""
        ...

    def save_block(self, key: str, token_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Keep one block (``[layers, 2, kv_heads, block_size, head_dim]``); may write in the background."""
        ...


@dataclass
class PrefixCacheStats:
    """What the cache holds and how it served: ``hits``/``misses`` count lookups that found at least
    one block or none, ``hit_tokens`` the tokens they reused of the ``queried_tokens`` they could
    have (vLLM's prefix-cache hit rate is their ratio); ``store_blocks`` the blocks read from the
    backing store."""

    blocks: int = 0
    bytes: int = 0
    max_bytes: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    inserted_blocks: int = 0
    evictions: int = 0
    store_blocks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Block:
    __slots__ = ("kv", "parent", "children", "nbytes")

    def __init__(self, kv: torch.Tensor, parent: str | None) -> None:
        self.kv = kv
        self.parent = parent
        self.children = 0
        self.nbytes = kv.numel() * kv.element_size()


class PrefixCache:
    """Block-keyed K/V of prompt prefixes for one model, bounded by ``max_bytes`` (see the module)."""

    def __init__(self, max_bytes: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 backing: PrefixBlockStore | None = None) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"max_bytes={max_bytes!r} must be a number of bytes >= 0 (0 disables the prefix cache)")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 4096:
            raise ConfigError(f"block_size={block_size!r} must be an integer in [1, 4096]")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.backing = backing
        self._blocks: OrderedDict[str, _Block] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._counts = PrefixCacheStats(max_bytes=max_bytes, block_size=block_size)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def hit_rate(self) -> float:
        """Share of the tokens looked up that came from the cache."""
        stats = self.stats()
        return stats.hit_tokens / stats.queried_tokens if stats.queried_tokens else 0.0

    # ------------------------------------------------------------------ lookups
    def match(self, token_ids: Sequence[int], fingerprint: str, *, max_tokens: int | None = None,
              salt: str = "") -> PrefixSegment | None:
        """The longest cached block-aligned prefix of ``token_ids`` of at most ``max_tokens`` tokens
        (default: all but the last, which a blend must compute), as a segment; ``None`` if no block."""
        limit = len(token_ids) - 1 if max_tokens is None else min(max_tokens, len(token_ids))
        if not self.enabled or limit < self.block_size:
            return None
        keys = block_keys(fingerprint, list(token_ids)[:limit], self.block_size, salt)
        with self._lock:
            found = []
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    break
                found.append(key)
            for key in reversed(found):  # the leaf first: parents stay more recent than their children
                self._blocks.move_to_end(key)
            parts = [self._blocks[key].kv for key in found]
        if len(found) < len(keys) and self.backing is not None:
            loaded = self.backing.load_blocks(keys[len(found):], self.block_size)
            if loaded:
                self._admit(keys[: len(found) + len(loaded)], len(found), loaded)
                parts.extend(loaded)
                with self._lock:
                    self._counts.store_blocks += len(loaded)
        with self._lock:
            self._counts.queried_tokens += limit
            if parts:
                self._counts.hits += 1
                self._counts.hit_tokens += len(parts) * self.block_size
            else:
                self._counts.misses += 1
        if not parts:
            return None
        n = len(parts) * self.block_size
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
        return PrefixSegment(list(token_ids)[:n], kv, fingerprint)

    # ------------------------------------------------------------------ inserts
    def insert(self, token_ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               fingerprint: str, *, salt: str = "") -> int:
        """Keep the full blocks of ``token_ids`` whose K/V is not cached yet; returns how many were added.

        ``keys[l]`` (rotated) and ``values[l]`` are layer ``l``'s ``[1, kv_heads, n, head_dim]`` with
        ``n >= len(token_ids)`` (a decoding cache, a blend's cache): they must be what full prefill
        computes for these tokens at positions 0..len-1. Blocks are copied, never views of the caller's
        buffers."""
        if not self.enabled or not keys:
            return 0
        chain = block_keys(fingerprint, token_ids, self.block_size, salt)
        with self._lock:
            have = 0
            while have < len(chain) and chain[have] in self._blocks:
                have += 1
        if have == len(chain):
            return 0
        B = self.block_size
        new = [torch.stack([torch.stack([k[0, :, i * B : (i + 1) * B], v[0, :, i * B : (i + 1) * B]])
                            for k, v in zip(keys, values)]) for i in range(have, len(chain))]
        added = self._admit(chain, have, new)
        if self.backing is not None:
            ids = list(token_ids)
            for i, kv in zip(range(have, have + added), new):
                self.backing.save_block(chain[i], ids[i * B : (i + 1) * B], kv)
        return added

    def _admit(self, chain: Sequence[str], start: int, blocks: Sequence[torch.Tensor]) -> int:
        """Add ``blocks`` as ``chain[start:]`` (their parents ``chain[:start]`` are held); stops where
        the bound leaves no room, so what is held stays a chain."""
        added = 0
        with self._lock:
            protected = set(chain[: start + len(blocks)])
            for offset, kv in enumerate(blocks):
                index = start + offset
                key = chain[index]
                parent = chain[index - 1] if index else None
                if key in self._blocks:
                    continue
                if parent is not None and parent not in self._blocks:
                    break  # its parent was evicted meanwhile: the rest cannot be reached
                block = _Block(kv, parent)
                if not self._make_room(block.nbytes, protected):
                    break
                self._blocks[key] = block
                self._bytes += block.nbytes
                if parent is not None:
                    self._blocks[parent].children += 1
                self._counts.inserted_blocks += 1
                added += 1
        return added

    def _make_room(self, nbytes: int, protected: set[str]) -> bool:
        """Evict least recently used leaves (not in ``protected``) until ``nbytes`` fit; False if they cannot."""
        if nbytes > self.max_bytes:
            return False
        while self._bytes + nbytes > self.max_bytes:
            victim = next((k for k, b in self._blocks.items() if b.children == 0 and k not in protected), None)
            if victim is None:
                return False
            block = self._blocks.pop(victim)
            self._bytes -= block.nbytes
            if block.parent is not None and block.parent in self._blocks:
                self._blocks[block.parent].children -= 1
            self._counts.evictions += 1
        return True

    # ------------------------------------------------------------------ admin
    def resize(self, max_bytes: int) -> None:
        """A new bound; blocks beyond it are evicted now (leaves first)."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"max_bytes={max_bytes!r} must be a number of bytes >= 0")
        with self._lock:
            self.max_bytes = self._counts.max_bytes = max_bytes
            if not self._make_room(0, set()):
                self._drop_all_locked()

    def clear(self) -> None:
        """Drop every block (the counters stay)."""
        with self._lock:
            self._drop_all_locked()

    def _drop_all_locked(self) -> None:
        self._counts.evictions += len(self._blocks)
        self._blocks.clear()
        self._bytes = 0

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            out = PrefixCacheStats(**asdict(self._counts))
            out.blocks, out.bytes = len(self._blocks), self._bytes
        return out

    def __len__(self) -> int:
        return len(self._blocks)

    def __repr__(self) -> str:
        return f"PrefixCache(blocks={len(self._blocks)}, bytes={self._bytes}, max_bytes={self.max_bytes})"
