"""The compute dtype a model loads in when none is given, and why.

On a GPU the default is bfloat16 (float16 where the GPU has no bfloat16). On a CPU it used to be
float32 everywhere, but a CPU with AMX or AVX-512 BF16 runs a bfloat16 prefill several times faster
(docs/performance.md), at a first-token KL against float32 near 0.001. So on a CPU the default is
*auto*: the CPU's flags say whether a fast bfloat16 path can exist, and a short probe (one matmul of
the model's width, timed in both dtypes) says whether torch takes it here. bfloat16 is picked only
when it is clearly faster (:data:`MIN_BF16_SPEEDUP`); else float32. The probe's result is kept per
CPU model, torch version and width in a small JSON file in the cache root, so it runs once per
machine and width.

An explicit ``dtype`` always wins; ``$CACHEBLEND_DTYPE`` sets the default for every load that gives
none (``auto``, ``float32``, ``bfloat16``, ``float16``).
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import logging
import os
import platform
import timeit
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from cacheblend_rag.errors import ModelLoadError
from cacheblend_rag.models.json_file import write_json_atomically

logger = logging.getLogger(__name__)

DTYPE_ENV = "CACHEBLEND_DTYPE"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                                  "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
# bfloat16 must beat float32 by this much: below it the probe's noise could decide, and float32 is exact
# where bfloat16 rounds; at or above it the measured prefill gain was 3.6-4x (issue 55, an AMX Xeon).
MIN_BF16_SPEEDUP = 1.3
# CPU flags (/proc/cpuinfo) under which torch's oneDNN has bfloat16 matmul kernels: x86's AMX and
# AVX-512 BF16, Arm's BF16 extension. Without one of them torch emulates bfloat16, slower than float32.
FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
PROBE_FILE = "dtype_probe.json"  # in the loader's cache root
PROBE_FORMAT = "cacheblend-rag-dtype-probe"
PROBE_VERSION = 1
PROBE_ROWS = 256  # a prefill's worth of rows: at 256, AMX's gain on a 576-wide matmul was 4.8x, at 32 only 2x


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model loads in, and why (``reason`` is what stats and ``model info`` show)."""

    dtype: torch.dtype
    reason: str


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: torch.dtype | str, what: str = "dtype") -> torch.dtype | None:
    """``value`` as a torch dtype, or ``None`` for ``"auto"``; anything else is an error naming the choices."""
    if isinstance(value, torch.dtype):
        return value
    name = str(value).strip().lower().removeprefix("torch.")
    if name == "auto":
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"{what}={value!r} is not supported; choose 'auto' or one of {sorted(DTYPES)}") from None


def choose_dtype(dtype: torch.dtype | str | None, device: torch.device,
                 width: int | Callable[[], int | None] | None = None, probe_file: Path | None = None) -> DtypeChoice:
    """The dtype to load in: ``dtype`` if given, else ``$CACHEBLEND_DTYPE`` if set, else the device's
    default (``dtype="auto"`` asks for the device's default, whatever the variable says): bfloat16 on a GPU that has it (float16 on one that has not), on a CPU the
    auto choice over a matmul of ``width`` (a callable is asked only if the probe must run; the result
    is kept in ``probe_file``, the loader's ``<cache root>/dtype_probe.json``), and float32 elsewhere (MPS)."""
    if dtype is not None:
        chosen = parse_dtype(dtype)
        if chosen is not None:
            return DtypeChoice(chosen, f"explicit: {dtype_name(chosen)}")
    else:
        forced = os.environ.get(DTYPE_ENV, "").strip()
        if forced:
            chosen = parse_dtype(forced, what=f"${DTYPE_ENV}")
            if chosen is not None:
                return DtypeChoice(chosen, f"{DTYPE_ENV}={forced}")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: bfloat16, the GPU's default")
        return DtypeChoice(torch.float16, "auto: float16, this GPU has no bfloat16")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: float32 on {device.type}")
    return cpu_auto_dtype(width, probe_file)


def cpu_auto_dtype(width: int | Callable[[], int | None] | None, probe_file: Path | None = None) -> DtypeChoice:
    """bfloat16 where this CPU runs a matmul of ``width`` at least :data:`MIN_BF16_SPEEDUP` times faster in
    it than in float32 (measured once per machine), else float32."""
    cpu = cpu_model_name()
    flags = cpu_flags()
    fast = [f for f in FAST_BF16_FLAGS if f in flags] if flags is not None else None
    if fast == []:  # the flags were read and name no bfloat16 unit: no need to measure
        return DtypeChoice(torch.float32, f"auto: float32, no fast bfloat16 path on {cpu} (no "
                                          f"{'/'.join(FAST_BF16_FLAGS[:2])})")
    hidden = width() if callable(width) else width
    if not hidden:
        return DtypeChoice(torch.float32, "auto: float32, the model's width is unknown so bfloat16 was not measured")
    speedup = cached_probe(cpu, int(hidden), probe_file)
    flagged = f" ({', '.join(fast)})" if fast else ""
    if speedup >= MIN_BF16_SPEEDUP:
        return DtypeChoice(torch.bfloat16, f"auto: bfloat16, {speedup:.1f}x faster matmul than float32 on "
                                           f"{cpu}{flagged}")
    return DtypeChoice(torch.float32, f"auto: float32, bfloat16 matmul only {speedup:.2f}x as fast on {cpu}"
                                      f"{flagged} (under {MIN_BF16_SPEEDUP}x)")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says."""
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "an unknown CPU"


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``), or ``None`` where they cannot be read."""
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def probe_key(cpu: str, width: int) -> str:
    return f"{cpu} | torch {torch.__version__} | width {width}"


def cached_probe(cpu: str, width: int, path: Path | None) -> float:
    """bfloat16's matmul speedup over float32 at ``width`` on this machine: from the probe file ``path`` if
    it holds this CPU, torch and width, else measured now (a few to tens of milliseconds) and added to it
    (``None``: measured, not kept). The file is JSON, read as data only; an unreadable or malformed one is
    ignored and rewritten."""
    key = probe_key(cpu, width)
    if path is None:
        float32_s, bfloat16_s = probe_matmul(width)
        return float32_s / bfloat16_s
    entries = _read_probe_file(path)
    known = entries.get(key)
    if isinstance(known, dict) and isinstance(known.get("speedup"), (int, float)) and known["speedup"] > 0:
        return float(known["speedup"])
    float32_s, bfloat16_s = probe_matmul(width)
    speedup = float32_s / bfloat16_s
    entries[key] = {"speedup": round(speedup, 3), "float32_ms": round(float32_s * 1e3, 3),
                    "bfloat16_ms": round(bfloat16_s * 1e3, 3), "threads": torch.get_num_threads(),
                    "measured_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        write_json_atomically(path, {"format": PROBE_FORMAT, "version": PROBE_VERSION, "entries": entries}, indent=1)
    except OSError as exc:  # a read-only cache costs a probe per load, nothing more
        logger.info("could not keep the dtype probe in %s (%s); it will run again on the next load", path, exc)
    return speedup


def _read_probe_file(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        logger.warning("ignoring the dtype probe file %s (%s); measuring again and rewriting it", path, exc)
        return {}
    if (not isinstance(document, dict) or document.get("format") != PROBE_FORMAT
            or document.get("version") != PROBE_VERSION or not isinstance(document.get("entries"), dict)):
        logger.warning("ignoring the dtype probe file %s (not a version %d probe file); measuring again and "
                       "rewriting it", path, PROBE_VERSION)
        return {}
    return dict(document["entries"])


def probe_matmul(width: int, rows: int = PROBE_ROWS, repeats: int = 3) -> tuple[float, float]:
    """The best of ``repeats`` timings, in seconds, of ``[rows x width] @ [width x 4*width]`` (a prefill's
    MLP up-projection) in float32 and in bfloat16, each after one untimed call that pays the kernel setup
    (``timeit.repeat``: garbage collection is off while it times)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, width, generator=generator)
    b = torch.randn(width, 4 * width, generator=generator)
    best = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            x, y = a.to(dtype), b.to(dtype)
            torch.matmul(x, y)
            times = timeit.repeat(functools.partial(torch.matmul, x, y), repeat=repeats, number=1)
            best.append(max(min(times), 1e-9))
    return best[0], best[1]
