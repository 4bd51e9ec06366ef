"""The prefix cache: K/V of prompt openings the engine has computed, kept in token blocks.

Chat and RAG prompts open with what the previous requests opened with: the chat template's
lead, a system prompt, the instructions before the context, and in a conversation the whole
previous prompt and answer. The K/V full prefill computes for those tokens depends on nothing
after them, so it can be reused as is, as vLLM's prefix cache and SGLang's radix tree do.

* **Blocks.** A prompt's tokens are cut into blocks of ``block_size``. A block's key is a chain hash: SHA-256 of the model fingerprint, an optional salt, the
  parent block's key and the block's token ids. So a key names the whole prefix up to the
  block's end under one model, prompts that share a lead share its blocks, and two tenants
  whose texts differ anywhere before a block never share it. SHA-256 and not a fast hash: a
  hash an attacker can collide would let one tenant's prompt read another's K/V (vLLM moved
  its prefix-cache keys to SHA-256 for that reason). ``salt`` (vLLM's ``cache_salt``) keeps
  tenants apart even where their texts agree.
* **Partial blocks.** The tokens after the last full block of what is inserted are kept too, as a
  *partial block* keyed by its parent's key and its exact ids (a separate domain in the hash, so it
  never names a full block), so a prefix is reused to the token, as SGLang's radix tree does, and
  not only to the last multiple of ``block_size`` as vLLM's. A match takes, after the full blocks
  whose keys it finds, the longest run of tokens that a block held after the last of them (full or
  partial) shares with the rest of the prompt (within ``max_tokens``): causal K/V of a block's
  first ``j`` tokens is theirs whatever follows. A partial block is always a leaf; inserting the same prefix extended to
  a full block (or to a longer partial one) supersedes it. Partial blocks stay in memory: the
  backing store holds full blocks only (a replica then recomputes at most ``block_size - 1``).
* **Values.** One tensor per block, ``[layers, 2, kv_heads, block_size, head_dim]``: keys
  *rotated* (a prefix never moves, and the decoding cache holds them so; rotating them back to
  store them unrotated would round) and values.
* **Bounds.** ``max_bytes`` bounds the blocks held; the least recently used *leaf* block goes
  first (a block no other cached block continues), so what stays is always a prefix chain.
  :meth:`match` touches a chain leaf first, so the parents stay more recent than their children.
* **Replicas.** An optional :class:`PrefixBlockStore` (a KV store, in the store's safe format:
  :mod:`cacheblend_rag.store.prefix_blocks`) is read after the blocks in memory run out and
  written as blocks are added, so replicas sharing a store share prefixes too.

* **Exact and approximate blocks.** Each block carries a flag. *Exact* blocks hold K/V that equals
  full prefill's: a caller inserts a request's tokens up to its ``BlendStats.exact_kv_tokens`` (all
  of them at ratio 1.0, the prompt before the first blended chunk otherwise) and, when the whole
  prompt was exact, the answer decoded after it. *Approximate* blocks (``insert(...,
  approximate=True)``) hold what a blend computed past that, prompt and answer: a chat's next turn
  opens with exactly those tokens, and reusing their K/V as is costs nothing while recomputing
  them would cost a blend (issue 31). One chain key names a block whatever its flag (a flag per
  block, checked on match, rather than a second key space, so an exact insert can upgrade an
  approximate block in place without orphaning the blocks after it). The rules:

  - ``match(..., approximate=False)`` (the default, and what a request that asks for exactness
    uses: recompute ratio 1.0, full prefill, reuse off) stops at the first approximate block, as if
    it were missing, and never takes an approximate partial block: what it returns is exact.
  - ``match(..., approximate=True)`` takes both; from the first approximate block on, every token
    counts as approximate (``PrefixSegment.approximate_tokens``), whatever the later blocks' flags.
  - Exact wins: an approximate insert never replaces, supersedes or drops an exact block (full or
    partial); an exact insert upgrades an approximate block of the same key in place (and writes it
    to the store under its exact key) and supersedes approximate partial blocks it extends. Where
    both an exact partial block and an approximate block continue the same parent, a match that
    allows approximate blocks prefers the exact one unless the approximate one reaches further.
  - The block in which a request's exact part ends is approximate (it holds blended tokens too); the
    exact part's tail is an exact partial block beside it. A match that meets the approximate block
    takes the tokens that exact partial block shares with the prompt from it, so the exact part of
    a hit reaches to the token as before.
  - The blend configuration is not part of the key: the next turn of one conversation uses the
    same ratio and selection, and an approximate block is an earlier blend's output either way.
    Exactness is guarded by who may read them (ratio < 1.0), not by the key.
  - Both kinds share the byte bound and the least-recently-used order.

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

from cacheblend_rag.kv.segments import PrefixSegment
from cacheblend_rag.errors import ConfigError

_DOMAIN = b"cacheblend-rag/prefix-block\x00"
_PARTIAL = b"cacheblend-rag/partial-block\x00"
DEFAULT_BLOCK_SIZE = 16


def root_key(fingerprint: str, salt: str = "") -> str:
    """The key the first block of a chain names as its parent (hex SHA-256; no block has it)."""
    if not fingerprint:
        raise ValueError("fingerprint is empty; pass engine.fingerprint")
    return hashlib.sha256(_DOMAIN + _framed(fingerprint.encode()) + _framed(salt.encode())).hexdigest()


def partial_key(parent: str, token_ids: Sequence[int]) -> str:
    """The key of a partial block: fewer than ``block_size`` ``token_ids`` after the block ``parent``
    (a :func:`block_keys` key, or :func:`root_key` for a prompt shorter than one block)."""
    ids = np.asarray(list(token_ids), dtype="<i8")
    return hashlib.sha256(_PARTIAL + bytes.fromhex(parent) + _framed(ids.tobytes())).hexdigest()


def block_keys(fingerprint: str, token_ids: Sequence[int], block_size: int, salt: str = "") -> list[str]:
    """The chain keys of every full block of ``token_ids``, in order (hex SHA-256)."""
    ids = np.asarray(list(token_ids), dtype="<i8")
    parent = bytes.fromhex(root_key(fingerprint, salt))
    keys = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + ids[start : start + block_size].tobytes()).digest()
        keys.append(parent.hex())
    return keys


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _framed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class PrefixBlockStore(Protocol):
    """Where a prefix cache keeps blocks for other replicas (:mod:`cacheblend_rag.store.prefix_blocks`)."""

    def load_blocks(self, keys: Sequence[str], block_size: int, *,
                    approximate: bool = False) -> list[tuple[torch.Tensor, bool]]:
        """The blocks of ``keys`` in order with their approximate flags, as far as they are stored whole
        and valid (one missing or damaged ends the list; a damaged one is reported and removed). Only
        exact blocks unless ``approximate``; an exact block is preferred to an approximate one."""
        ...

    def save_block(self, key: str, token_ids: Sequence[int], kv: torch.Tensor, *, approximate: bool = False) -> None:
        """Keep one block (``[layers, 2, kv_heads, block_size, head_dim]``), marked approximate or
        not, so that no reader takes an approximate block for an exact one; may write in the background."""
        ...


@dataclass
class PrefixCacheStats:
    """What the cache holds and how it served: ``hits``/``misses`` count lookups that found at least
    one block or none, ``hit_tokens`` the tokens they reused of the ``queried_tokens`` they could
    have (vLLM's prefix-cache hit rate is their ratio); ``store_blocks`` the blocks read from the
    backing store; ``partial_blocks`` those of ``blocks`` that are partial, ``partial_hits`` the
    lookups that ended in part of a block; ``approximate_blocks`` and ``approximate_bytes`` the
    share of ``blocks`` and ``bytes`` that is approximate (an earlier blend's K/V), and
    ``approximate_hit_tokens`` the share of ``hit_tokens`` that was; ``upgraded_blocks`` the
    approximate blocks an exact insert (or load) replaced."""

    blocks: int = 0
    bytes: int = 0
    max_bytes: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    inserted_blocks: int = 0
    partial_blocks: int = 0
    partial_hits: int = 0
    evictions: int = 0
    store_blocks: int = 0
    approximate_blocks: int = 0
    approximate_bytes: int = 0
    approximate_hit_tokens: int = 0
    upgraded_blocks: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Block:
    __slots__ = ("kv", "parent", "children", "nbytes", "ids", "under", "approximate")

    def __init__(self, kv: torch.Tensor, parent: str | None, ids: tuple[int, ...] | None = None,
                 under: str | None = None, approximate: bool = False) -> None:
        self.kv = kv
        self.parent = parent  # the parent block's key (None for the first block of a chain)
        self.children = 0
        self.nbytes = kv.numel() * kv.element_size()
        self.ids = ids  # the block's token ids (fewer than block_size: a partial block)
        self.under = under  # the parent block's key, or the chain's root key for a first block
        self.approximate = approximate  # an earlier blend's K/V, not full prefill's


class PrefixCache:
    """Block-keyed K/V of prompt prefixes for one model, bounded by ``max_bytes`` (see the module)."""

    def __init__(self, max_bytes: int, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 backing: PrefixBlockStore | None = None, partial_blocks: bool = True) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"max_bytes={max_bytes!r} must be a number of bytes >= 0 (0 disables the prefix cache)")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= 4096:
            raise ConfigError(f"block_size={block_size!r} must be an integer in [1, 4096]")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.backing = backing
        self.partial_blocks = partial_blocks  # False: whole blocks only, as vLLM's prefix cache
        self._kids: dict[str, set[str]] = {}  # parent (or root) key -> keys of the blocks after it
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
              salt: str = "", approximate: bool = False) -> PrefixSegment | None:
        """The longest cached prefix of ``token_ids`` of at most ``max_tokens`` tokens (default: all but
        the last, which a blend must compute), as a segment: full blocks, then the longest run of
        tokens a block after them shares with the rest; ``None`` if none.

        Exact blocks only unless ``approximate`` (then the segment's ``approximate_tokens`` counts the
        tokens from the first approximate block on); see the module's rules."""
        limit = len(token_ids) - 1 if max_tokens is None else min(max_tokens, len(token_ids))
        if not self.enabled or limit < 1 or (limit < self.block_size and not self.partial_blocks):
            return None
        ids = list(token_ids)
        keys = block_keys(fingerprint, ids[:limit], self.block_size, salt)
        with self._lock:
            found = []
            for key in keys:
                block = self._blocks.get(key)
                if block is None or (block.approximate and not approximate):
                    break
                found.append(key)
            for key in reversed(found):  # the leaf first: parents stay more recent than their children
                self._blocks.move_to_end(key)
            parts = [self._blocks[key].kv for key in found]
            flags = [self._blocks[key].approximate for key in found]
        if len(found) < len(keys) and self.backing is not None:
            loaded = self.backing.load_blocks(keys[len(found):], self.block_size, approximate=approximate)
            if loaded:
                self._admit(keys[: len(found) + len(loaded)], len(found), [kv for kv, _ in loaded], ids,
                            root_key(fingerprint, salt), [flag for _, flag in loaded])
                parts.extend(kv for kv, _ in loaded)
                flags.extend(flag for _, flag in loaded)
                with self._lock:
                    self._counts.store_blocks += len(loaded)
        n = len(parts) * self.block_size
        if self.partial_blocks and n < limit:  # where the full blocks end, however far they reach
            under = keys[len(parts) - 1] if parts else root_key(fingerprint, salt)
            partial = self._match_partial(under, ids[n:limit], approximate)
            if partial is not None:
                parts.append(partial[0])
                flags.append(partial[1])
                n += partial[0].shape[3]
                with self._lock:
                    self._counts.partial_hits += 1
        # From the first approximate block on, every token is approximate (it attended to approximate K/V),
        # but where an exact partial block continues the same parent, its tokens are taken from it.
        first = next((i for i, flag in enumerate(flags) if flag), None)
        exact, overlay = n, None
        if first is not None:
            exact = first * self.block_size
            under = keys[first - 1] if first else root_key(fingerprint, salt)
            overlay = self._match_partial(under, ids[exact:n], False)
            if overlay is not None:
                exact += overlay[0].shape[3]
        with self._lock:
            self._counts.queried_tokens += limit
            if parts:
                self._counts.hits += 1
                self._counts.hit_tokens += n
                self._counts.approximate_hit_tokens += n - exact
            else:
                self._counts.misses += 1
        if not parts:
            return None
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
        if overlay is not None:
            start = exact - overlay[0].shape[3]
            kv = kv.clone() if len(parts) == 1 else kv  # never write into a held block
            kv[:, :, :, start:exact] = overlay[0]
        return PrefixSegment(ids[:n], kv, fingerprint, approximate_tokens=n - exact)

    def _match_partial(self, under: str, rest: Sequence[int], approximate: bool) -> tuple[torch.Tensor, bool] | None:
        """The K/V of the longest run of tokens that opens ``rest`` and a block held after ``under``
        (full or partial; exact only unless ``approximate``, an exact one preferred where it reaches as
        far; the block is touched) and that block's flag; ``None`` if no such block opens with ``rest[0]``."""
        rest = tuple(rest)
        with self._lock:
            best, most = None, 0
            for key in self._kids.get(under, ()):
                block = self._blocks[key]
                if block.approximate and not approximate:
                    continue
                assert block.ids is not None
                j = _common(block.ids, rest)
                if j > most or (j == most and best is not None and self._blocks[best].approximate
                                and not block.approximate):
                    best, most = key, j
            if best is None or most == 0:
                return None
            self._blocks.move_to_end(best)
            block = self._blocks[best]
            return (block.kv if most == block.kv.shape[3] else block.kv[:, :, :, :most]), block.approximate

    # ------------------------------------------------------------------ inserts
    def insert(self, token_ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
               fingerprint: str, *, salt: str = "", approximate: bool = False) -> int:
        """Keep the blocks of ``token_ids`` whose K/V is not cached yet, the last partial one too (unless
        ``partial_blocks`` is off); returns how many were added (a partial block counts as one, and so
        does an approximate block an exact insert upgraded).

        ``keys[l]`` (rotated) and ``values[l]`` are layer ``l``'s ``[1, kv_heads, n, head_dim]`` with
        ``n >= len(token_ids)`` (a decoding cache, a blend's cache): they must be what full prefill
        computes for these tokens at positions 0..len-1, or, with ``approximate``, what a blend computed
        for them there (kept as approximate blocks, which never replace exact ones). Blocks are copied,
        never views of the caller's buffers."""
        if not self.enabled or not keys:
            return 0
        ids = list(token_ids)
        chain = block_keys(fingerprint, ids, self.block_size, salt)
        root = root_key(fingerprint, salt)
        with self._lock:
            have = 0  # blocks held as good as these: any for an approximate insert, exact ones for an exact one
            while have < len(chain) and chain[have] in self._blocks and (
                    approximate or not self._blocks[chain[have]].approximate):
                have += 1
        B = self.block_size
        added = 0
        if have < len(chain):
            new = [torch.stack([torch.stack([k[0, :, i * B : (i + 1) * B], v[0, :, i * B : (i + 1) * B]])
                                for k, v in zip(keys, values)]) for i in range(have, len(chain))]
            kept = self._admit(chain, have, new, ids, root, [approximate] * len(new))
            added = len(kept)
            with self._lock:  # a full block supersedes the partial blocks after its parent that it extends
                for i in kept:
                    self._drop_partials_locked(chain[i - 1] if i else root, ids[i * B : (i + 1) * B], approximate)
            if self.backing is not None:
                for i in kept:
                    self.backing.save_block(chain[i], ids[i * B : (i + 1) * B], new[i - have], approximate=approximate)
            with self._lock:
                stopped = chain[-1] not in self._blocks
            if stopped:
                return added  # the bound stopped the chain: no partial block after a missing one
        start = len(chain) * B
        if self.partial_blocks and start < len(ids):
            tail = ids[start:]
            kv = torch.stack([torch.stack([k[0, :, start : len(ids)], v[0, :, start : len(ids)]])
                              for k, v in zip(keys, values)])
            added += self._admit_partial(chain[-1] if chain else None, chain[-1] if chain else root, tail, kv,
                                         set(chain), approximate)
        return added

    def _admit_partial(self, parent: str | None, under: str, tail: Sequence[int], kv: torch.Tensor,
                       protected: set[str], approximate: bool) -> int:
        """Keep ``tail`` (fewer than a block of ids after ``under``) as a partial block, unless one held
        there already covers it (an exact one, for an exact ``tail``); those it extends are dropped (exact
        ones only by an exact ``tail``). 1 if kept."""
        tail = tuple(tail)
        key = partial_key(under, tail)
        with self._lock:
            if parent is not None and parent not in self._blocks:
                return 0
            for held_key in self._kids.get(under, ()):
                held = self._blocks[held_key]
                assert held.ids is not None
                if (len(held.ids) >= len(tail) and held.ids[: len(tail)] == tail
                        and (approximate or not held.approximate)):
                    return 0  # the same tokens, or more, are held (a full block, a longer partial one)
            if key in self._blocks:  # the same tokens held approximate, now exact: replaced
                self._remove_locked(key)
                self._counts.upgraded_blocks += 1
            self._drop_partials_locked(under, tail, approximate)
            block = _Block(kv, parent, tail, under, approximate)  # kv is a new tensor (stacked)
            if not self._make_room(block.nbytes, protected):
                return 0
            self._blocks[key] = block
            self._bytes += block.nbytes
            self._kids.setdefault(under, set()).add(key)
            if parent is not None:
                self._blocks[parent].children += 1
            return 1

    def _drop_partials_locked(self, under: str, ids: Sequence[int], approximate: bool) -> None:
        """Drop the partial blocks after ``under`` whose ids open ``ids`` (a longer block supersedes them;
        an approximate one supersedes approximate ones only)."""
        ids = tuple(ids)
        for key in list(self._kids.get(under, ())):
            held = self._blocks[key]
            assert held.ids is not None
            if (len(held.ids) < min(len(ids), self.block_size) and ids[: len(held.ids)] == held.ids
                    and (held.approximate or not approximate)):
                self._remove_locked(key)

    def _remove_locked(self, key: str) -> _Block:
        block = self._blocks.pop(key)
        self._bytes -= block.nbytes
        if block.parent is not None and block.parent in self._blocks:
            self._blocks[block.parent].children -= 1
        if block.under is not None:
            held = self._kids.get(block.under)
            if held is not None:
                held.discard(key)
                if not held:
                    del self._kids[block.under]
        return block

    def _admit(self, chain: Sequence[str], start: int, blocks: Sequence[torch.Tensor], ids: Sequence[int],
               root: str, approximate: Sequence[bool]) -> list[int]:
        """Add ``blocks`` as ``chain[start:]`` (their parents ``chain[:start]`` are held; ``ids`` the
        chain's tokens, ``root`` its root key; ``approximate`` their flags); an exact block upgrades an
        approximate one held under its key, in place. Stops where the bound leaves no room, so what is
        held stays a chain. Returns the chain indices of the blocks added or upgraded."""
        B = self.block_size
        kept: list[int] = []
        with self._lock:
            protected = set(chain[: start + len(blocks)])
            for offset, (kv, flag) in enumerate(zip(blocks, approximate)):
                index = start + offset
                key = chain[index]
                parent = chain[index - 1] if index else None
                held = self._blocks.get(key)
                if held is not None:
                    if held.approximate and not flag:  # exact wins: same tokens, same place, same size
                        held.kv, held.approximate = kv, False
                        self._counts.upgraded_blocks += 1
                        kept.append(index)
                    continue
                if parent is not None and parent not in self._blocks:
                    break  # its parent was evicted meanwhile: the rest cannot be reached
                under = parent if parent is not None else root
                block = _Block(kv, parent, tuple(ids[index * B : (index + 1) * B]), under, flag)
                if not self._make_room(block.nbytes, protected):
                    break
                self._blocks[key] = block
                self._bytes += block.nbytes
                self._kids.setdefault(under, set()).add(key)
                if parent is not None:
                    self._blocks[parent].children += 1
                self._counts.inserted_blocks += 1
                kept.append(index)
        return kept

    def _make_room(self, nbytes: int, protected: set[str]) -> bool:
        """Evict least recently used leaves (not in ``protected``) until ``nbytes`` fit; False if they cannot."""
        if nbytes > self.max_bytes:
            return False
        while self._bytes + nbytes > self.max_bytes:
            victim = next((k for k, b in self._blocks.items() if b.children == 0 and k not in protected), None)
            if victim is None:
                return False
            self._remove_locked(victim)
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
        self._kids.clear()
        self._bytes = 0

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            out = PrefixCacheStats(**asdict(self._counts))
            out.blocks, out.bytes = len(self._blocks), self._bytes
            out.partial_blocks = sum(1 for b in self._blocks.values() if b.ids is not None and len(b.ids) < self.block_size)
            approximate = [b for b in self._blocks.values() if b.approximate]
            out.approximate_blocks, out.approximate_bytes = len(approximate), sum(b.nbytes for b in approximate)
        return out

    def __len__(self) -> int:
        return len(self._blocks)

    def __repr__(self) -> str:
        return f"PrefixCache(blocks={len(self._blocks)}, bytes={self._bytes}, max_bytes={self.max_bytes})"
