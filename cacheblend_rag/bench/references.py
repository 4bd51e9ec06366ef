"""Full prefill's reference for a prompt, computed once and kept on disk.

Every method is scored against full prefill: its greedy answer (the teacher-forced tokens) and
its logits along that answer (KL, top-1). Both depend only on the model, the prompt's token ids
and the decoding settings, so a rerun of the benchmark, or a new method added to an old table,
need not run full prefill again. With ``kv=True`` an entry also holds full prefill's per-layer
K/V of the prompt (keys after RoPE), which the diagnostics compare a blend's cache with.

An entry is one safetensors file per part under ``DIR/ab/<key>``:

* ``<key>.safetensors``: ``answer_ids``, ``teacher_ids`` (int64), ``teacher_logits`` (float32,
  ``[teacher tokens, vocab]``: KL needs the whole distribution), and JSON metadata (the key's
  fields, the answer text, the token that stopped decoding, a digest per tensor);
* ``<key>.kv.safetensors`` (optional): ``k.<layer>``, ``v.<layer>``, ``[kv_heads, tokens, head_dim]``
  in the model's dtype, with a digest per tensor.

safetensors never unpickles. Its header check catches truncation; the XXH3 digests catch a
flipped byte inside a tensor. A damaged entry (unreadable, wrong key, wrong shapes, digest
mismatch) is reported with a warning naming the file, removed, and computed again, never used.
Writes go to a temporary file renamed into place, so a reader never sees half an entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import xxhash

logger = logging.getLogger(__name__)

REFERENCE_FORMAT = 1
DEFAULT_REFERENCE_DIR = Path("~/.cache/cacheblend-rag/references")
_DOMAIN = "cacheblend-rag/full-prefill-reference"

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [kv_heads, tokens, head_dim]


class CorruptReferenceError(Exception):
    """A stored reference that cannot be trusted; it is recomputed."""


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 of the prompt's token ids (little-endian int64, length-prefixed)."""
    array = np.asarray(list(token_ids), dtype="<i8")
    return hashlib.sha256(struct.pack("<Q", array.size) + array.tobytes()).hexdigest()


def reference_key(fingerprint: str, token_ids: Sequence[int], *, max_new_tokens: int, teacher_tokens: int) -> str:
    """The entry's key: the model, the prompt and the decoding settings that shape the reference."""
    if not fingerprint:
        raise ValueError("fingerprint is empty; pass engine.fingerprint")
    fields = _key_fields(fingerprint, prompt_digest(token_ids), max_new_tokens, teacher_tokens)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _key_fields(fingerprint: str, prompt_sha: str, max_new_tokens: int, teacher_tokens: int) -> dict[str, Any]:
    return {"domain": _DOMAIN, "format": REFERENCE_FORMAT, "fingerprint": fingerprint, "prompt_sha256": prompt_sha,
            "max_new_tokens": int(max_new_tokens), "teacher_tokens": int(teacher_tokens)}


@dataclass
class Reference:
    """Full prefill on one prompt: what every other method is measured against."""

    answer_ids: list[int]  # greedy answer, without the end-of-sequence token
    stopped_by: int | None  # the end-of-sequence token that ended decoding, if one did
    text: str
    teacher_ids: list[int]  # the tokens every method is teacher-forced along
    teacher_logits: torch.Tensor  # [len(teacher_ids), vocab] float32
    kv: KV | None = None  # full prefill's prompt K/V per layer (keys after RoPE), when kept


def _digest(tensor: torch.Tensor) -> str:
    # Raw bytes of any dtype (bfloat16 has no numpy twin): reinterpret as bytes first.
    flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_128_hexdigest(flat.tobytes())


class ReferenceCache:
    """Full prefill references under ``root`` (created on first write)."""

    def __init__(self, root: str | Path = DEFAULT_REFERENCE_DIR) -> None:
        self.root = Path(root).expanduser()
        self.hits = 0
        self.misses = 0
        self.corrupt = 0

    def paths(self, key: str) -> tuple[Path, Path]:
        folder = self.root / key[:2]
        return folder / f"{key}.safetensors", folder / f"{key}.kv.safetensors"

    # ------------------------------------------------------------------ reads
    def get(self, fingerprint: str, token_ids: Sequence[int], *, max_new_tokens: int, teacher_tokens: int,
            need_kv: bool = False, kv_shape: tuple[int, int, int] | None = None) -> Reference | None:
        """The stored reference, or ``None`` if there is none (or, with ``need_kv``, none with K/V).
        ``kv_shape`` is ``(num_layers, kv_heads, head_dim)``, checked against the stored K/V."""
        key = reference_key(fingerprint, token_ids, max_new_tokens=max_new_tokens, teacher_tokens=teacher_tokens)
        main, kv_path = self.paths(key)
        if not main.exists():
            self.misses += 1
            return None
        expected = _key_fields(fingerprint, prompt_digest(token_ids), max_new_tokens, teacher_tokens)
        try:
            reference = self._read_main(main, key, expected, teacher_tokens)
        except CorruptReferenceError as exc:
            self._discard(main, kv_path, exc)
            return None
        if need_kv:
            if not kv_path.exists():
                self.misses += 1
                return None
            try:
                reference.kv = self._read_kv(kv_path, key, len(token_ids), kv_shape)
            except CorruptReferenceError as exc:
                self._discard(kv_path, None, exc)
                return None
        self.hits += 1
        return reference

    def _read_main(self, path: Path, key: str, expected: dict[str, Any], teacher_tokens: int) -> Reference:
        tensors, meta = _read(path)
        if meta.get("key") != key or meta.get("fields") != expected:
            raise CorruptReferenceError(f"it names another key or other settings than {key[:16]}...")
        if set(tensors) != {"answer_ids", "teacher_ids", "teacher_logits"}:
            raise CorruptReferenceError(f"it holds tensors {sorted(tensors)}")
        _check_digests(tensors, meta)
        logits, teacher = tensors["teacher_logits"], tensors["teacher_ids"]
        if logits.dtype != torch.float32 or logits.dim() != 2 or teacher.dim() != 1 \
                or logits.shape[0] != teacher.shape[0] or not 1 <= teacher.shape[0] <= teacher_tokens + 1:
            raise CorruptReferenceError(f"teacher logits {tuple(logits.shape)} do not fit {teacher.shape[0]} teacher tokens")
        if not torch.isfinite(logits).all():
            raise CorruptReferenceError("teacher logits hold NaN or infinite numbers")
        stopped = meta.get("stopped_by")
        if not isinstance(meta.get("text"), str) or not (stopped is None or isinstance(stopped, int)):
            raise CorruptReferenceError("its metadata lacks the answer text")
        return Reference(answer_ids=tensors["answer_ids"].tolist(), stopped_by=stopped, text=meta["text"],
                         teacher_ids=teacher.tolist(), teacher_logits=logits)

    def _read_kv(self, path: Path, key: str, tokens: int, kv_shape: tuple[int, int, int] | None) -> KV:
        tensors, meta = _read(path)
        if meta.get("key") != key:
            raise CorruptReferenceError(f"it names another key than {key[:16]}...")
        _check_digests(tensors, meta)
        layers = int(meta.get("num_layers", -1))
        if set(tensors) != {f"{p}.{i}" for i in range(layers) for p in "kv"} or layers < 1:
            raise CorruptReferenceError("it does not hold one K and one V per layer")
        if kv_shape is not None and layers != kv_shape[0]:
            raise CorruptReferenceError(f"it has {layers} layers, the model {kv_shape[0]}")
        want = None if kv_shape is None else (kv_shape[1], tokens, kv_shape[2])
        kv: KV = []
        for i in range(layers):
            k, v = tensors[f"k.{i}"], tensors[f"v.{i}"]
            if k.shape != v.shape or k.dim() != 3 or k.shape[1] != tokens or (want and tuple(k.shape) != want):
                raise CorruptReferenceError(f"layer {i} has K {tuple(k.shape)}, V {tuple(v.shape)}; "
                                            f"expected {want or ('?', tokens, '?')}")
            kv.append((k, v))
        return kv

    def _discard(self, path: Path, other: Path | None, exc: Exception) -> None:
        self.corrupt += 1
        self.misses += 1
        message = f"reference cache entry {path} is corrupt ({exc}); computing it again"
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        logger.warning(message)
        for p in (path, other):
            if p is not None:
                try:
                    p.unlink()
                except OSError:
                    pass

    # ----------------------------------------------------------------- writes
    def put(self, fingerprint: str, token_ids: Sequence[int], reference: Reference, *, max_new_tokens: int,
            teacher_tokens: int) -> Path:
        """Store ``reference`` (its K/V too, when it has them); returns the main file."""
        key = reference_key(fingerprint, token_ids, max_new_tokens=max_new_tokens, teacher_tokens=teacher_tokens)
        main, kv_path = self.paths(key)
        fields = _key_fields(fingerprint, prompt_digest(token_ids), max_new_tokens, teacher_tokens)
        tensors = {
            "answer_ids": torch.tensor(reference.answer_ids, dtype=torch.int64),
            "teacher_ids": torch.tensor(reference.teacher_ids, dtype=torch.int64),
            "teacher_logits": reference.teacher_logits.detach().float().cpu().contiguous(),
        }
        _write(main, tensors, {"key": key, "fields": fields, "text": reference.text,
                               "stopped_by": reference.stopped_by})
        if reference.kv is not None:
            kv_tensors = {}
            for i, (k, v) in enumerate(reference.kv):
                kv_tensors[f"k.{i}"] = k.detach().cpu().contiguous()
                kv_tensors[f"v.{i}"] = v.detach().cpu().contiguous()
            _write(kv_path, kv_tensors, {"key": key, "num_layers": len(reference.kv)})
        return main


def _write(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    meta = {**meta, "digests": {name: _digest(t) for name, t in tensors.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"reference": json.dumps(meta)})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("reference", "null"))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except CorruptReferenceError:
        raise
    except Exception as exc:  # safetensors raises its own error types, and OSError, for a damaged file
        raise CorruptReferenceError(f"unreadable: {type(exc).__name__}: {exc}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("digests"), dict):
        raise CorruptReferenceError("its metadata is missing")
    return tensors, meta


def _check_digests(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    digests = meta["digests"]
    for name, tensor in tensors.items():
        if digests.get(name) != _digest(tensor):
            raise CorruptReferenceError(f"tensor {name!r} fails its checksum")
