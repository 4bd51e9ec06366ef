"""Saved calibration results: the blend setting measured best for one model, one JSON file per
model fingerprint (``cacheblend-rag calibrate`` writes them, :mod:`cacheblend_rag.bench.calibration`).

The engine and both integrations look here for their model's fingerprint when the user gave
no blend setting. A file is used only if it is well formed *and* names the same fingerprint
inside it (a file copied or renamed to another model's name is refused); a corrupt file is
reported once and ignored, never used in part. This module imports neither the engine nor the
calibration runner, so both can import it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.loader import cache_root

logger = logging.getLogger(__name__)

CALIBRATION_DIR_ENV = "CACHEBLEND_CALIBRATION_DIR"
# Whether the integrations compute chunk KV behind the prompt's lead when neither the user nor a
# calibration says (measured better than alone, docs/quality.md); the bench's ``default`` method too.
DEFAULT_CONDITION_CHUNKS = True
FORMAT = "cacheblend-rag-calibration"
VERSION = 1
# What a calibration chooses. The rest (gate, fallback, the short-prompt threshold, the cached segments'
# and approximate prefixes' shares, which calibration prompts have none of) is the user's policy and
# stays as the user's or the built-in config has it.
CALIBRATED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(BlendConfig)
    if f.name not in ("gate", "gate_tolerance", "fallback_to_full_prefill", "min_blend_tokens",
                      "segment_recompute_ratio", "approximate_prefix_recompute_ratio",
                      "approximate_prefix_chunk_factor")
)


def calibration_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """``directory``, else ``$CACHEBLEND_CALIBRATION_DIR``, else ``<cache root>/calibration``
    (``~/.cache/cacheblend-rag/calibration`` unless ``$CACHEBLEND_CACHE_DIR`` says otherwise)."""
    if directory is not None:
        return Path(directory)
    explicit = os.environ.get(CALIBRATION_DIR_ENV)
    return Path(explicit) if explicit else cache_root() / "calibration"


def calibration_path(fingerprint: str, directory: str | os.PathLike[str] | None = None) -> Path:
    return calibration_dir(directory) / f"{fingerprint}.json"


# Settings the project measured for the model catalog's models (docs/quality.md), one calibration document per
# fingerprint, shipped inside the package. They are used only when the user has calibrated none for that model:
# the user's own prompts are better evidence than ours.
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data" / "calibrations"


PROBE_SHIFT_STRIDE = 20  # the probe stride ``+probeshift`` stands for when it names none
PROBE_SHIFT_WINDOW = 100  # and the window each shift is estimated over


def correction_suffix(key: float, value: float = 0.0, stride: int = 0, window: int = 0) -> str:
    """How a method's name says its stale K/V corrections: ``+keyshift`` (``stale_key_correction`` 1),
    ``+keyshift0.5``; ``+probeshift`` (probes every 20 tokens, keys and values moved by their whole mean
    change per window of 100 tokens), ``+probeshift10``; other shares and windows in brackets; nothing when
    there is no correction."""
    if stride:
        name = "+probeshift" + ("" if stride == PROBE_SHIFT_STRIDE else str(stride))
        extras = [] if (key, value) == (1.0, 1.0) else [f"k{key:g}", f"v{value:g}"]
        extras += [] if window == PROBE_SHIFT_WINDOW else [f"w{window}"]
        return name + (f"({','.join(extras)})" if extras else "")
    name = "" if not key else "+keyshift" if key == 1.0 else f"+keyshift{key:g}"
    extras = ([f"v{value:g}"] if value else []) + ([f"w{window}"] if window and (key or value) else [])
    return name + (f"({','.join(extras)})" if extras else "")


def describe_config(config: BlendConfig, conditioned: bool = False) -> str:
    """A setting's short name, as ``--methods`` writes it: ``query_profiled+prefix@0.15``,
    ``kv_deviation+keyshift@0.15``, ``full_reuse``."""
    prefix = "+prefix" if conditioned else ""
    if config.recompute_ratio == 0:
        return f"full_reuse{prefix}"
    corrections = correction_suffix(config.stale_key_correction, config.stale_value_correction,
                                    config.shift_probe_stride, config.shift_window)
    return f"{config.selection}{prefix}{corrections}@{config.recompute_ratio:g}"


@dataclass(frozen=True)
class CalibratedSetting:
    """The setting a calibration chose for one model, as read back from its file."""

    path: Path
    fingerprint: str
    model: str
    config: dict[str, Any]  # CALIBRATED_FIELDS only
    condition_chunks: bool  # whether it was measured with chunks precomputed behind the prompt's lead
    name: str
    target_met: bool
    document: dict[str, Any]
    shipped: bool = False  # measured by the project and shipped in the package, not the user's own

    def apply_to(self, base: BlendConfig) -> BlendConfig:
        """``base`` (the user's policy fields) with the calibrated fields."""
        return base.with_overrides(**self.config)

    @property
    def source(self) -> str:
        return f"calibrated (shipped): {self.path}" if self.shipped else f"calibrated: {self.path}"


class CorruptCalibration(ValueError):
    pass


def parse_document(document: Any, fingerprint: str, where: str, *, shipped: bool = False) -> CalibratedSetting:
    """The chosen setting of a calibration document; :class:`CorruptCalibration` says what is wrong."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CorruptCalibration(f"{where} is not a calibration result (no \"format\": {FORMAT!r})")
    if document.get("version") != VERSION:
        raise CorruptCalibration(f"{where} has version {document.get('version')!r}; this package reads {VERSION}")
    if document.get("fingerprint") != fingerprint:
        raise CorruptCalibration(f"{where} was measured on another model (fingerprint "
                                 f"{str(document.get('fingerprint'))[:12]}, this model is {fingerprint[:12]})")
    chosen = document.get("chosen")
    if not isinstance(chosen, dict) or not isinstance(chosen.get("config"), dict):
        raise CorruptCalibration(f"{where} has no \"chosen\" setting")
    config = chosen["config"]
    unknown = sorted(set(config) - set(CALIBRATED_FIELDS))
    if unknown:
        raise CorruptCalibration(f"{where}: the chosen setting holds fields a calibration does not set: {unknown}")
    try:
        resolved = BlendConfig(**config)
    except ConfigError as exc:
        raise CorruptCalibration(f"{where}: the chosen setting is not a valid BlendConfig ({exc})") from None
    conditioned = chosen.get("condition_chunks")
    if not isinstance(conditioned, bool):
        raise CorruptCalibration(f"{where}: chosen.condition_chunks must be true or false")
    return CalibratedSetting(
        path=Path(where), fingerprint=fingerprint, model=str(document.get("model")), config=dict(config),
        condition_chunks=conditioned, name=describe_config(resolved, conditioned),
        target_met=bool(document.get("target_met")), document=document, shipped=shipped,
    )


# path -> ((mtime_ns, size), setting or None): the engine asks on every blend; a file is read once per change.
_READ: dict[Path, tuple[tuple[int, int], CalibratedSetting | None]] = {}


def load_calibration(fingerprint: str, directory: str | os.PathLike[str] | None = None) -> CalibratedSetting | None:
    """The calibrated setting of the model ``fingerprint``: the user's (in ``directory``, see
    :func:`calibration_dir`), else the one shipped for it (:data:`SHIPPED_DIR`), else ``None``. A file
    that is corrupt or another model's is said once per version of the file, as a warning, and skipped."""
    mine = _read_calibration(calibration_path(fingerprint, directory), fingerprint)
    return mine if mine is not None else _read_calibration(SHIPPED_DIR / f"{fingerprint}.json", fingerprint,
                                                           shipped=True)


def _read_calibration(path: Path, fingerprint: str, *, shipped: bool = False) -> CalibratedSetting | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    stamp = (stat.st_mtime_ns, stat.st_size)
    known = _READ.get(path)
    if known is not None and known[0] == stamp:
        return known[1]
    setting: CalibratedSetting | None
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        setting = parse_document(document, fingerprint, str(path), shipped=shipped)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, CorruptCalibration) as exc:
        logger.warning("ignoring the calibration result %s: %s; the setting shipped for this model or the "
                       "built-in one is used. Run `cacheblend-rag calibrate` again to replace it", path, exc)
        setting = None
    _READ[path] = (stamp, setting)
    return setting


def write_json_atomically(path: Path, document: dict[str, Any]) -> Path:
    """Write ``document`` so that a reader (or a stop midway) sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(document, out, indent=2)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save_calibration(document: dict[str, Any], directory: str | os.PathLike[str] | None = None) -> Path:
    """Write a calibration document, checked as :func:`load_calibration` will read it, to its model's
    file in ``directory`` (:func:`calibration_dir`)."""
    fingerprint = str(document.get("fingerprint"))
    target = calibration_path(fingerprint, directory)
    parse_document(document, fingerprint, str(target))
    return write_json_atomically(target, document)
