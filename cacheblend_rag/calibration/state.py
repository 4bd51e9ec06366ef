"""A calibration's measurements so far, in a JSON state file written as each is made (atomically: a stop
leaves a valid file), so that a rerun with ``resume`` makes only the missing ones
(:mod:`cacheblend_rag.calibration.measure`)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from cacheblend_rag.bench.prompt import BenchPrompt
from cacheblend_rag.calibration.lookup import LEGACY_DEVICE, VERSION, calibration_path, write_json_atomically

logger = logging.getLogger(__name__)

STATE_FORMAT = "cacheblend-rag-calibration-state"


def prompt_key(prompt: BenchPrompt, teacher_tokens: int) -> str:
    blob = json.dumps([prompt.lead_ids, prompt.chunk_ids, prompt.tail_ids, prompt.stand_in_ids, teacher_tokens])
    return hashlib.sha256(blob.encode()).hexdigest()


def default_state_path(fingerprint: str, directory: str | os.PathLike[str] | None = None,
                       device: str = LEGACY_DEVICE) -> Path:
    """``<calibration folder>/<fingerprint>[.<device>].state.json``: beside the result, one per device type, since
    measured TTFTs of one device type are no cost on another."""
    result = calibration_path(fingerprint, directory, device)
    return result.with_name(result.name[: -len(".json")] + ".state.json")


class CalibrationState:
    """Measurements so far, per prompt key: full prefill's teacher tokens and TTFT, and per setting
    (``Candidate.key``, or ``full_reuse``) its KL, top-1 agreement, whether its greedy answer is full
    prefill's, cost and stats. ``path=None`` keeps it in memory."""

    def __init__(self, path: str | os.PathLike[str] | None, fingerprint: str, *, resume: bool) -> None:
        self.path = Path(path) if path is not None else None
        self.fingerprint = fingerprint
        self.prompts: dict[str, dict[str, Any]] = {}
        if resume and self.path is not None and self.path.exists():
            self.prompts = self._read(self.path)

    def _read(self, path: Path) -> dict[str, dict[str, Any]]:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            logger.warning("calibration state %s cannot be read (%s): ignored, everything is measured again", path, exc)
            return {}
        if not isinstance(document, dict) or document.get("format") != STATE_FORMAT or \
                not isinstance(document.get("prompts"), dict):
            logger.warning("calibration state %s is not a calibration state file: ignored, everything is measured "
                           "again", path)
            return {}
        if document.get("fingerprint") != self.fingerprint:
            logger.warning("calibration state %s was measured on another model (fingerprint %s, this model is %s): "
                           "ignored, everything is measured again", path, str(document.get("fingerprint"))[:12],
                           self.fingerprint[:12])
            return {}
        kept: dict[str, dict[str, Any]] = {}
        dropped = older = 0
        for key, entry in document["prompts"].items():
            reference = entry.get("reference") if isinstance(entry, dict) else None
            if not _valid_reference(reference) or not isinstance(entry.get("methods"), dict):
                dropped += 1
                continue
            methods = {k: m for k, m in entry["methods"].items() if _valid_measurement(m)}
            # A state saved before answers were measured: its KLs are sound, but they come with no top-1 or
            # identical-answer reading, which teacher forcing gives at once when the setting is measured again.
            older += sum(1 for m in entry["methods"].values() if _valid_measurement(m, answers=False)) - len(methods)
            dropped += len(entry["methods"]) - len(methods)
            kept[key] = {"reference": reference, "methods": methods}
        if dropped > older:
            logger.warning("calibration state %s: %d malformed entries ignored (measured again)", path, dropped - older)
        if older:
            logger.warning("calibration state %s: %d entries were saved before answers were measured (top-1 "
                           "agreement, identical answers); they are measured again", path, older)
        return kept

    def reference(self, key: str) -> dict[str, Any] | None:
        return self.prompts.get(key, {}).get("reference")

    def measured(self, key: str, method: str) -> dict[str, Any] | None:
        return self.prompts.get(key, {}).get("methods", {}).get(method)

    def set_reference(self, key: str, reference: dict[str, Any]) -> None:
        old = self.reference(key)
        if old is not None and old["tokens"] != reference["tokens"]:
            # Another answer is another teacher: the KLs measured along the old one no longer compare.
            logger.warning("full prefill answers prompt %s differently than when its measurements were saved; they "
                           "are measured again", key[:12])
            self.prompts[key] = {"reference": reference, "methods": {}}
        else:
            self.prompts.setdefault(key, {"reference": reference, "methods": {}})["reference"] = reference
        self.save()

    def record(self, key: str, method: str, measurement: dict[str, Any]) -> None:
        self.prompts[key]["methods"][method] = measurement
        self.save()

    def save(self) -> None:
        if self.path is not None:
            write_json_atomically(self.path, {"format": STATE_FORMAT, "version": VERSION,
                                              "fingerprint": self.fingerprint, "prompts": self.prompts})


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _valid_reference(reference: Any) -> bool:
    return isinstance(reference, dict) and isinstance(reference.get("tokens"), list) and \
        all(isinstance(t, int) for t in reference["tokens"]) and _number(reference.get("ttft_s"))


def _valid_measurement(measurement: Any, *, answers: bool = True) -> bool:
    """A measurement as :meth:`Calibrator._measure` makes it; ``answers=False``: as one made before answers were
    measured (no ``top1``, ``identical``)."""
    if not (isinstance(measurement, dict) and all(_number(measurement.get(k)) for k in ("kl", "work", "ttft_s"))
            and measurement["kl"] >= 0):
        return False
    return not answers or (_number(measurement.get("top1")) and 0 <= measurement["top1"] <= 1
                           and isinstance(measurement.get("identical"), bool))
