"""Saved calibration results: the blend setting measured best for one model, one JSON file per
model fingerprint (``cacheblend-rag calibrate`` writes them, :mod:`cacheblend_rag.calibration.measure`).

The engine and both integrations look here for their model's fingerprint when the user gave
no blend setting. A file is used only if it is well formed *and* names the same fingerprint
inside it (a file copied or renamed to another model's name is refused); a corrupt file is
reported once and ignored, never used in part. This module imports neither the engine nor the
calibration runner, so both can import it.

The fingerprint holds the compute dtype, so a setting measured in float32 is not the bfloat16
load's by fingerprint. A document also records the dtype it was measured in and the identities of
its weights that hold across dtypes (``"weights"``: the GGUF file, the weights' content rounded to
bfloat16; :func:`~cacheblend_rag.models.fingerprint.weights_identities`). :func:`find_calibration`
takes the exact fingerprint's setting first; failing that, the same weights' setting measured in
another dtype, which it says (the source reads ``calibrated (measured in float32): <file>``, and a
warning is logged once). Documents written before these fields existed still match their exact
fingerprint; one that names the engine's model but cannot be matched to its weights leaves the
built-in setting in force, with a warning and a source that says why.

A document also records the device type it was measured on (``"device"``: ``cpu``, ``cuda``, ``mps``),
because the best setting differs between them: on a GPU a blend's time goes to the host's fixed costs,
not to the arithmetic, so a higher ratio costs little there and keeps more answers. One model has a
file per device type (``<fingerprint>.json`` for a CPU, as always; ``<fingerprint>.cuda.json``), and
:func:`find_calibration` prefers the engine's own device type: its exact fingerprint, then the same
weights in another dtype, and only then a setting measured on another device type, which it says the
same way (``calibrated (measured on cpu in float32): <file>``, a warning once).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.json_file import write_json_atomically  # noqa: F401 (the calibration tools write through it)
from cacheblend_rag.models.loader import cache_root

logger = logging.getLogger(__name__)

CALIBRATION_DIR_ENV = "CACHEBLEND_CALIBRATION_DIR"
# Whether the integrations compute chunk KV behind the prompt's lead when neither the user nor a
# calibration says (measured better than alone, research/quality_notebook.md); the bench's ``default`` method too.
DEFAULT_CONDITION_CHUNKS = True
FORMAT = "cacheblend-rag-calibration"
VERSION = 1  # "device" was added within version 1: a document without it reads as before (LEGACY_DEVICE)
# The device type of a document that records none. Every calibration saved before devices were recorded, the
# shipped ones included, was measured on a CPU, and a CPU's file keeps the name those always had.
LEGACY_DEVICE = "cpu"
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


def calibration_path(fingerprint: str, directory: str | os.PathLike[str] | None = None,
                     device: str = LEGACY_DEVICE) -> Path:
    """Where the calibration of ``fingerprint`` measured on ``device`` (a device type: ``cpu``, ``cuda``) lives:
    ``<fingerprint>.json`` for a CPU (the name every calibration had before devices were recorded), else
    ``<fingerprint>.<device>.json``, so that a model keeps one setting per device type side by side."""
    _check_device(device, "device")
    name = fingerprint if device == LEGACY_DEVICE else f"{fingerprint}.{device}"
    return calibration_dir(directory) / f"{name}.json"


def _check_device(device: Any, where: str) -> None:
    # A device type becomes part of a file name: letters, digits and underscores only (torch's are).
    if not isinstance(device, str) or not device or not all(c.isalnum() or c == "_" for c in device) or \
            device != device.lower():
        raise ConfigError(f"{where}: {device!r} is not a device type; use torch's name for it, e.g. \"cpu\", "
                          "\"cuda\" or \"mps\" (no index: \"cuda\", not \"cuda:0\")")


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
    dtype: str | None = None  # the compute dtype it was measured in (None: a document from before it was recorded)
    identities: tuple[str, ...] = ()  # the weights' identities across dtypes (document["weights"]["identities"])
    shape: dict[str, Any] = field(default_factory=dict)  # architecture, hidden_size, num_hidden_layers
    device: str = LEGACY_DEVICE  # the device type it was measured on ("cpu" for a document that records none)
    # set when used for an engine it was not measured for: "measured in float32", "measured on cpu in float32";
    # the source says so
    measured_note: str | None = None

    def apply_to(self, base: BlendConfig) -> BlendConfig:
        """``base`` (the user's policy fields) with the calibrated fields."""
        return base.with_overrides(**self.config)

    @property
    def source(self) -> str:
        notes = ", ".join(n for n in ("shipped" if self.shipped else None, self.measured_note) if n)
        return f"calibrated ({notes}): {self.path}" if notes else f"calibrated: {self.path}"


class CorruptCalibration(ValueError):
    pass


def parse_document(document: Any, fingerprint: str | None, where: str, *, shipped: bool = False) -> CalibratedSetting:
    """The chosen setting of a calibration document; :class:`CorruptCalibration` says what is wrong.
    ``fingerprint``: the model it must be for (``None``: any, as the document says)."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CorruptCalibration(f"{where} is not a calibration result (no \"format\": {FORMAT!r})")
    if document.get("version") != VERSION:
        raise CorruptCalibration(f"{where} has version {document.get('version')!r}; this package reads {VERSION}")
    if fingerprint is None:
        if not isinstance(document.get("fingerprint"), str):
            raise CorruptCalibration(f"{where} names no model (no \"fingerprint\")")
        fingerprint = document["fingerprint"]
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
    dtype = document.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        raise CorruptCalibration(f"{where}: \"dtype\" must be a dtype's name, e.g. \"float32\"")
    device = document.get("device", LEGACY_DEVICE)
    try:
        _check_device(device, f"{where}: \"device\"")
    except ConfigError as exc:
        raise CorruptCalibration(str(exc)) from None
    weights = document.get("weights", {})
    identities = weights.get("identities", []) if isinstance(weights, dict) else None
    if not isinstance(identities, list) or not all(isinstance(i, str) for i in identities):
        raise CorruptCalibration(f"{where}: \"weights\" must be {{\"identities\": [strings], ...}}")
    return CalibratedSetting(
        path=Path(where), fingerprint=fingerprint, model=str(document.get("model")), config=dict(config),
        condition_chunks=conditioned, name=describe_config(resolved, conditioned),
        target_met=bool(document.get("target_met")), document=document, shipped=shipped, dtype=dtype,
        identities=tuple(identities), shape={k: v for k, v in weights.items() if k != "identities"}, device=device,
    )


# path -> ((mtime_ns, size), setting or None): the engine asks on every blend; a file is read once per change.
_READ: dict[Path, tuple[tuple[int, int], CalibratedSetting | None]] = {}
# folder -> (mtime_ns, its calibration files): listed again only when a file is added, removed or replaced
_LISTED: dict[Path, tuple[int, list[Path]]] = {}
# what find_calibration found for a key and the files it looked at, each with its (mtime_ns, size)
_FOUND: dict[tuple[Any, ...], tuple[tuple[Any, ...], "CalibrationLookup"]] = {}
_WARNED: set[tuple[str, ...]] = set()  # the cross-dtype, cross-device and no-fit warnings already given, once each


def load_calibration(fingerprint: str, directory: str | os.PathLike[str] | None = None,
                     device: str = LEGACY_DEVICE) -> CalibratedSetting | None:
    """The calibrated setting of the model ``fingerprint`` in the file for ``device`` (a device type): the user's
    (in ``directory``, see :func:`calibration_dir`), else the one shipped for it (:data:`SHIPPED_DIR`), else
    ``None``. A file that is corrupt or another model's is said once per version of the file, as a warning, and
    skipped. Exact fingerprints only; :func:`find_calibration` also finds the same weights' in another dtype or
    measured on another device type."""
    mine = _read_calibration(calibration_path(fingerprint, directory, device), fingerprint)
    return mine if mine is not None else _read_calibration(calibration_path(fingerprint, SHIPPED_DIR, device),
                                                           fingerprint, shipped=True)


def _read_calibration(path: Path, fingerprint: str, *, shipped: bool = False) -> CalibratedSetting | None:
    setting = _read_any(path, shipped=shipped)
    if setting is None or setting.fingerprint == fingerprint:
        return setting
    if _once("another model", str(path), fingerprint, str(_READ[path][0])):
        logger.warning("ignoring the calibration result %s: it was measured on another model (fingerprint %s, this "
                       "model is %s); the setting shipped for this model or the built-in one is used. Run "
                       "`cacheblend-rag calibrate` again to replace it", path, setting.fingerprint[:12], fingerprint[:12])
    return None


def _read_any(path: Path, *, shipped: bool = False) -> CalibratedSetting | None:
    """The setting in ``path``, whichever model it is for; ``None`` if missing or corrupt (said once)."""
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
        setting = parse_document(document, None, str(path), shipped=shipped)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, CorruptCalibration) as exc:
        logger.warning("ignoring the calibration result %s: %s; the setting shipped for this model or the "
                       "built-in one is used. Run `cacheblend-rag calibrate` again to replace it", path, exc)
        setting = None
    _READ[path] = (stamp, setting)
    return setting


def _once(*key: str) -> bool:
    if key in _WARNED:
        return False
    _WARNED.add(key)
    return True


@dataclass(frozen=True)
class WeightsKey:
    """What an engine knows of its model, for finding a calibration by more than its fingerprint."""

    fingerprint: str
    dtype: str  # the compute dtype's name, "bfloat16"
    model: str  # the engine's model name
    shape: dict[str, Any]  # :func:`~cacheblend_rag.models.fingerprint.weights_shape`
    source: str | None  # the identity the loader recorded (the GGUF's), which the fingerprint does not hold
    identities: Callable[[], Sequence[str]]  # all of them; asked only when a document of the same shape may match
    device: str = LEGACY_DEVICE  # the engine's device type ("cuda"): its own device type's setting comes first


@dataclass(frozen=True)
class CalibrationLookup:
    """What :func:`find_calibration` found: a setting, or none and (``unusable``) why a calibration that
    names this model could not be used."""

    setting: CalibratedSetting | None
    unusable: str | None = None

    @property
    def source(self) -> str:
        if self.setting is not None:
            return self.setting.source
        return f"built-in ({self.unusable})" if self.unusable else "built-in"


def find_calibration(key: WeightsKey, directory: str | os.PathLike[str] | None = None) -> CalibrationLookup:
    """The calibration for ``key``'s model, in this order (the user's before the shipped, then the newest):

    1. measured on ``key.device``'s device type: its exact fingerprint's, else the same weights' in another dtype;
    2. measured on another device type: the exact fingerprint's, else the same weights' in another dtype.

    A setting not measured for exactly this engine is said by its source (``measured in float32``, ``measured on
    cpu in float32``) and a warning once. Failing all, none, with a warning once and a note if a calibration
    names this model but records no weights identity to match it by."""
    exact = load_calibration(key.fingerprint, directory, key.device)
    if exact is not None and exact.device == key.device:
        return CalibrationLookup(exact)
    folders = [(calibration_dir(directory), False), (SHIPPED_DIR, True)]
    paths = [(path, shipped) for folder, shipped in folders for path in _listing(folder)]
    settings = [(s, shipped) for path, shipped in paths if (s := _read_any(path, shipped=shipped)) is not None]
    memo_key = (key.fingerprint, key.dtype, key.device, key.model, key.source, str(folders[0][0]))
    stamps = tuple((path, _READ[path][0]) for path, _ in paths if path in _READ)
    known = _FOUND.get(memo_key)
    if known is not None and known[0] == stamps:
        return known[1]
    found = _match(key, [s for s, _ in settings])
    _FOUND[memo_key] = (stamps, found)
    return found


def _match(key: WeightsKey, settings: list[CalibratedSetting]) -> CalibrationLookup:
    here = [s for s in settings if s.device == key.device]
    for setting in here:  # a file not named by the fingerprint it holds (the user's before the shipped)
        if setting.fingerprint == key.fingerprint:
            return CalibrationLookup(setting)
    alike = [s for s in settings if s.identities and all(key.shape.get(k, v) == v for k, v in s.shape.items())]
    mine = set(key.identities()) if alike else set()
    same = [s for s in alike if mine & set(s.identities)]
    newest = sorted(same, key=lambda s: (s.shipped, -_created(s), str(s.path)))
    for best in newest:  # the same weights in another dtype, on this device type
        if best.device == key.device:
            return CalibrationLookup(_used_elsewhere(key, best))
    # Another device type's setting: the exact fingerprint's first, then the same weights' in another dtype.
    elsewhere = sorted((s for s in settings if s.device != key.device and s.fingerprint == key.fingerprint),
                       key=lambda s: (s.shipped, -_created(s), str(s.path))) + newest
    if elsewhere:
        return CalibrationLookup(_used_elsewhere(key, elsewhere[0]))
    legacy = [s for s in settings if not s.identities and s.model == key.model]
    if legacy:
        old = legacy[0]
        why = (f"the calibration {old.path} names {key.model} but records no weights identity (it was saved before "
               f"calibrations did), so it cannot be matched to this {key.dtype} load; calibrate again to replace it")
        if _once("no fit", str(old.path), key.fingerprint):
            logger.warning("no calibrated setting fits %s in %s, the built-in one is used: %s", key.model, key.dtype, why)
        return CalibrationLookup(None, unusable=why)
    return CalibrationLookup(None)


def _used_elsewhere(key: WeightsKey, best: CalibratedSetting) -> CalibratedSetting:
    """``best``, measured for the same weights but not for ``key``'s dtype or device type, with the note its source
    carries; the warning that says so, once per file, dtype and device type."""
    exact = best.fingerprint == key.fingerprint
    dtype = "" if exact else (f"in {best.dtype}" if best.dtype and best.dtype != key.dtype else
                              f"in {best.dtype or 'another dtype'} on another conversion of these weights")
    if best.device == key.device:
        note = f"measured {dtype}"
        if _once("other dtype", str(best.path), key.dtype, key.device):
            logger.warning("using the calibrated setting %s (%s) for %s in %s: it was %s, not in %s, where this setting "
                           "has not been measured. Run `cacheblend-rag calibrate --dtype %s` to measure one here",
                           best.path, best.name, key.model, key.dtype, note, key.dtype, key.dtype)
        return replace(best, measured_note=note)
    note = " ".join(("measured on", best.device, dtype or f"in {best.dtype or key.dtype}"))
    if _once("other device", str(best.path), key.dtype, key.device):
        # The best ratio moves with the device: a GPU spends a blend's time on the host's fixed costs, not on the
        # arithmetic a higher ratio adds, so a CPU's setting is likely cheaper and less faithful than a GPU affords.
        logger.warning("using the calibrated setting %s (%s) for %s on %s in %s: it was %s, not on %s, where the "
                       "best setting differs (what a higher ratio costs depends on the device). Run `cacheblend-rag "
                       "calibrate --device %s --dtype %s --cost ttft` on this machine to measure one for it",
                       best.path, best.name, key.model, key.device, key.dtype, note, key.device, key.device, key.dtype)
    return replace(best, measured_note=note)


def _created(setting: CalibratedSetting) -> float:
    try:
        return _dt.datetime.fromisoformat(str(setting.document.get("created_utc"))).timestamp()
    except ValueError:
        return 0.0


def _listing(folder: Path) -> list[Path]:
    """The calibration documents in ``folder`` (not a run's ``.state.json``), listed once per change of it."""
    try:
        mtime = folder.stat().st_mtime_ns
    except OSError:
        return []
    known = _LISTED.get(folder)
    if known is not None and known[0] == mtime:
        return known[1]
    paths = sorted(p for p in folder.glob("*.json") if not p.name.endswith(".state.json"))
    _LISTED[folder] = (mtime, paths)
    return paths


def save_calibration(document: dict[str, Any], directory: str | os.PathLike[str] | None = None) -> Path:
    """Write a calibration document, checked as :func:`load_calibration` will read it, to its model's file for its
    device type in ``directory`` (:func:`calibration_dir`, :func:`calibration_path`)."""
    fingerprint = str(document.get("fingerprint"))
    device = document.get("device", LEGACY_DEVICE)
    _check_device(device, "the calibration's \"device\"")
    target = calibration_path(fingerprint, directory, device)
    parse_document(document, fingerprint, str(target))
    return write_json_atomically(target, document)
