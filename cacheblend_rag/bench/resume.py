"""``cacheblend-rag bench --resume``: carry on from the run's own JSON.

The harness writes its document after every (question, method) pair. With ``--resume`` it reads
that file back, keeps every finished pair whose settings match this run's, and runs only the
pairs that are missing: the questions a stopped run never reached, and methods added since (a
new method on an old table costs that method alone).

What must match is everything that changes a pair's numbers: the model (its fingerprint), the
device, the data (its SHA-256), the prompt (passages, truncation, answerable), the decoding and
teacher-forcing lengths, the storage dtype, the blend settings, and the timing settings (repeats,
cold and throughput passes). ``--n``, ``--methods`` and ``--ratios`` may differ: that is the point.
A mismatch is an error naming the first difference, never a silent mix.

A file that is not a complete JSON document (a run killed mid-write before writes were atomic,
an edit gone wrong) is reported and left as it is; the new document is written only after the
old one is copied aside (:func:`backup`).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Sequence

from cacheblend_rag.errors import ConfigError

# Settings under "args" that change what a finished pair measured.
MATCHED_ARGS = ("passages", "max_passage_tokens", "answerable", "max_new_tokens", "teacher_tokens", "storage_dtype",
                "check_layer", "blend_options", "repeats", "cold_examples", "throughput_requests",
                "throughput_new_tokens")


def data_digest(path: str | Path) -> str | None:
    """SHA-256 of the data file (``None`` if it cannot be read: loading it reports that)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def load_result(path: str | Path) -> dict[str, Any] | None:
    """The document at ``path``, ``None`` if there is no file; a :class:`ConfigError` if it is not one."""
    path = Path(path)
    if not path.exists():
        return None
    what = f"--resume: {path}"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{what} is not a readable JSON document ({exc}); it is left as it is. Move it away "
                          "(or restore its .bak copy) and resume, or run without --resume into another --out") from None
    if not isinstance(document, dict) or not all(k in document for k in ("args", "model", "methods", "examples")):
        raise ConfigError(f"{what} is not a `cacheblend-rag bench` result (no args/model/methods/examples); "
                          "it is left as it is")
    for i, example in enumerate(document["examples"]):
        if not isinstance(example, dict) or not isinstance(example.get("methods"), dict) or "index" not in example:
            raise ConfigError(f"{what}: examples[{i}] is damaged (no index or methods); it is left as it is")
    return document


def check_resumable(previous: dict[str, Any], current: dict[str, Any], specs: Sequence[dict[str, Any]] = ()) -> None:
    """Raise a :class:`ConfigError` naming the first setting in which ``previous`` and ``current``
    (a document of this run, with no examples yet) differ. ``specs``: this run's methods
    (``MethodSpec.to_dict()``); a method of the same name in ``previous`` must agree on every field
    both record (a name that resolves to another setting, say, is not the same method)."""
    def differ(what: str, old: Any, new: Any) -> None:
        raise ConfigError(f"--resume: {what} differs (the result: {old!r}, this run: {new!r}); rerun with the "
                          "result's settings, or write to another --out")

    if previous["model"].get("fingerprint") != current["model"]["fingerprint"]:
        differ("the model fingerprint", previous["model"].get("fingerprint"), current["model"]["fingerprint"])
    old_device = (previous.get("machine") or {}).get("device")
    if old_device is not None and old_device != current["machine"]["device"]:
        differ("the device", old_device, current["machine"]["device"])
    old_data, new_data = previous.get("data") or {}, current["data"]
    if old_data.get("sha256") is not None:
        if old_data["sha256"] != new_data.get("sha256"):
            differ("the data (SHA-256)", old_data["sha256"], new_data.get("sha256"))
    elif old_data.get("path") != new_data["path"]:
        differ("the data path", old_data.get("path"), new_data["path"])
    for name in MATCHED_ARGS:
        old, new = previous["args"].get(name), current["args"].get(name)
        if old != new and not (name == "blend_options" and not old and not new):
            differ(name, old, new)
    earlier = {m.get("name"): m for m in previous["methods"] if isinstance(m, dict)}
    for spec in specs:
        before = earlier.get(spec["name"])
        for key, value in spec.items():
            if before is not None and key in before and before[key] != value:
                differ(f"method {spec['name']}: {key}", before[key], value)
    if previous.get("blend_config") is not None and previous["blend_config"] != current["blend_config"]:
        keys = sorted(set(previous["blend_config"]) | set(current["blend_config"]))
        first = next(k for k in keys if previous["blend_config"].get(k) != current["blend_config"].get(k))
        differ(f"blend_config.{first}", previous["blend_config"].get(first), current["blend_config"].get(first))


def backup(path: str | Path) -> Path | None:
    """Copy ``path`` aside as ``<path>.<UTC time>.bak`` before it is overwritten; the copy, or ``None``."""
    path = Path(path)
    if not path.exists():
        return None
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = path.with_name(f"{path.name}.{stamp}.bak")
    shutil.copy2(path, target)
    return target
