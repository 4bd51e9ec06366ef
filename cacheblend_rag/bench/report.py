"""The result document (JSON, schema in docs/benchmark_schema.md) and its markdown table."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from cacheblend_rag.bench.methods import MethodSpec
from cacheblend_rag.models.dtype_choice import cpu_model_name

SCHEMA_VERSION = 1
_REPO_ROOT = Path(__file__).resolve().parents[2]


def git_info(root: Path = _REPO_ROOT) -> dict[str, Any]:
    """Commit and whether the working tree had changes; ``None`` values outside a git checkout."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def machine_info(device: torch.device) -> dict[str, Any]:
    import transformers

    import cacheblend_rag

    try:
        usable_cores = len(os.sched_getaffinity(0))
    except AttributeError:
        usable_cores = os.cpu_count()
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cacheblend_rag": cacheblend_rag.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def build_document(
    *,
    config: Any,
    engine: Any,
    specs: Sequence[MethodSpec],
    added: Sequence[MethodSpec],
    blend_config: Any,
    store_backend: str,
    outcomes: Sequence[Any],
    summaries: list[dict[str, Any]],
    elapsed_s: float,
    git: dict[str, Any] | None = None,
    selection: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``git``: :func:`git_info` taken when the run started (the code it ran); now, if not given.
    ``selection``: which questions ran, ``{answerable, kept, of}``."""
    prompt_tokens = [o.prompt_tokens for o in outcomes]
    chunk_tokens = [t for o in outcomes for t in o.chunk_tokens]
    added_names = {s.name for s in added}
    for summary in summaries:
        summary["added_as_reference"] = summary["name"] in added_names
    return {
        "schema_version": SCHEMA_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv) if sys.argv else None,
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
        "git": git if git is not None else git_info(),
        "machine": machine_info(engine.device),
        "model": {
            "name": engine.model_name,
            "fingerprint": engine.fingerprint,
            "num_layers": engine.num_layers,
            "dtype": str(engine.dtype).replace("torch.", ""),
        },
        "blend_config": blend_config.to_dict(),
        "store": {"kind": config.store, "backend": store_backend, "storage_dtype": config.storage_dtype,
                  # A persistent store (--store disk:PATH) that later runs read chunks back from.
                  "path": getattr(config, "store_path", None)},
        "data": {
            "path": str(config.data),
            "examples": len(outcomes),
            "selection": selection or {"answerable": False, "kept": len(outcomes), "of": len(outcomes)},
            "passages": config.passages,
            "max_passage_tokens": config.max_passage_tokens,
            "prompt_tokens": _spread(prompt_tokens),
            "chunk_tokens": _spread(chunk_tokens),
        },
        "elapsed_s": elapsed_s,
        "methods": summaries,
        "examples": [asdict(o) for o in outcomes],
    }


def _spread(values: Sequence[int]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def print_report(document: dict[str, Any], out: str | Path | None = None) -> None:
    """A benchmark's JSON report on stdout, and into ``out`` (whole or not at all) where given."""
    print(json.dumps(document, indent=2))
    if out:
        write_json(document, out)


def write_json(document: dict[str, Any], path: str | Path) -> Path:
    """Write ``document`` whole or not at all: a run killed mid-write leaves the previous version,
    which ``--resume`` can read."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(document: dict[str, Any]) -> str:
    """One row per method: speed (warm TTFT, speedup, cold TTFT, decode, throughput), then quality."""
    columns = [
        "method", "TTFT median (s)", "TTFT p90 (s)", "speedup", "cold TTFT (s)", "precompute ms/chunk",
        "decode tok/s", "req/s",
        "F1", "EM", "ΔF1 vs full [95% CI]", "KL", "top-1", "recovery", "same answer as full", "worse than full reuse",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---"] * len(columns)) + "|"]
    n = document["data"]["examples"]
    for m in document["methods"]:
        q = m["quality"]
        speedup, rec, worse = m["ttft_speedup"], q["recovery"], q["worse_than_full_reuse"]
        cells = [
            method_cell(m),
            _fmt(m["ttft_s"]["median"], ".3f"),
            _fmt(m["ttft_s"]["p90"], ".3f"),
            "–" if speedup is None else f"{speedup:.2f}x",
            _fmt(m["cold_ttft_s"], ".3f"),
            _fmt((m["precompute"] or {}).get("ms_per_chunk"), ".0f"),
            _fmt(m["decode_tokens_per_s"], ".1f"),
            _fmt(m["throughput_rps"], ".3f"),
            _fmt(q["f1"], ".3f"),
            _fmt(q["gold_em"], ".3f"),
            f1_delta_cell(q),
            _fmt(q["kl"], ".4f"),
            _fmt(q["top1"], ".3f"),
            "–" if rec is None else f"{100 * rec:.0f}%",
            _fmt(q["exact_match"], ".2f"),
            "–" if worse is None else f"{worse}/{n}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def method_cell(method: dict[str, Any]) -> str:
    """The method's name; ``default`` with the setting it resolved to and where that came from."""
    if not method.get("setting"):
        return method["name"]
    return f"{method['name']} = {method['setting']} ({str(method.get('source')).split(':')[0]})"


def f1_delta_cell(quality: dict[str, Any]) -> str:
    """``+0.012 [-0.030, +0.061]``: the mean paired F1 difference to full prefill and its bootstrap interval."""
    delta, interval = quality.get("f1_delta"), quality.get("f1_delta_ci95")
    if delta is None:
        return "–"
    return f"{delta:+.3f}" + ("" if interval is None else f" [{interval[0]:+.3f}, {interval[1]:+.3f}]")


def recovery_cell(quality: dict[str, Any]) -> str:
    """``45% [30%, 58%]``: recovery of full reuse's KL and its bootstrap interval (older results have none)."""
    rec, interval = quality.get("recovery"), quality.get("recovery_ci95")
    if rec is None:
        return "–"
    return f"{100 * rec:.0f}%" + ("" if interval is None else f" [{100 * interval[0]:.0f}%, {100 * interval[1]:.0f}%]")


def answer_table(document: dict[str, Any]) -> str:
    """The paper's table: answers against gold beside fidelity to full prefill and TTFT speedup."""
    columns = ["method", "F1", "EM", "ΔF1 vs full prefill [95% CI]", "KL", "top-1", "recovery [95% CI]",
               "TTFT speedup"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(["---"] * len(columns)) + "|"]
    for m in document["methods"]:
        q = m["quality"]
        lines.append("| " + " | ".join([
            method_cell(m), _fmt(q["f1"], ".3f"), _fmt(q["gold_em"], ".3f"), f1_delta_cell(q), _fmt(q["kl"], ".4f"),
            _fmt(q["top1"], ".3f"), recovery_cell(q),
            "–" if m["ttft_speedup"] is None else f"{m['ttft_speedup']:.2f}x",
        ]) + " |")
    return "\n".join(lines)


def describe_run(document: dict[str, Any]) -> str:
    """A one-paragraph caption: data, model, machine."""
    d, mach, model = document["data"], document["machine"], document["model"]
    tokens = d["prompt_tokens"]["mean"]
    selection = d.get("selection") or {}
    return (
        ("PARTIAL RUN: " if document.get("partial") else "")
        + f"{d['examples']} MuSiQue questions"
        + (f" (--answerable: kept {selection['kept']} of {selection['of']}, gold answer in the prompt)"
           if selection.get("answerable") else "")
        + f", {d['passages']} passages each"
        + (f" (truncated to {d['max_passage_tokens']} tokens)" if d["max_passage_tokens"] else "")
        + (f", {tokens:.0f} prompt tokens on average" if tokens else "")
        + f"; {model['name']} ({model['dtype']}), store {document['store']['kind']}"
        + f"; {mach['cpu']}, {mach['usable_cores']} cores, torch {mach['torch']}, transformers {mach['transformers']}"
        + (f"; commit {document['git']['commit'][:10]}" if document["git"]["commit"] else "")
        + _untimed_note(document)
    )


def _untimed_note(document: dict[str, Any]) -> str:
    """Said in the caption: a speedup column of dashes is not a failure to compute one."""
    full = next((m for m in document["methods"] if m["kind"] == "full_prefill"), None)
    if full is None or full.get("ttft_measured", full["examples"]) >= full["examples"]:
        return ""
    return (f". Full prefill's TTFT was measured on {full['ttft_measured']} of {full['examples']} questions (the "
            "others' references came from the reference cache): speedups are over those questions only, "
            "'–' if none; --time-full-prefill times it")


def strategy_grid_table(document: dict[str, Any], reference_family: str = "cacheblend", focus: float = 0.15) -> str:
    """The quality grid, one row per method family (strategy, with or without prefix conditioning):
    recovery, gold F1 and examples worse than full reuse at every ratio; KL, top-1 and TTFT
    relative to ``reference_family`` (plain CacheBlend) at the ``focus`` ratio."""
    n = document["data"]["examples"]
    ratios = sorted({m["ratio"] for m in document["methods"] if m["kind"] == "blend"})
    families: dict[str, dict[float, dict[str, Any]]] = {}
    for m in document["methods"]:
        if m["kind"] in ("blend", "full_reuse"):
            families.setdefault(m["family"], {})[m["ratio"] or 0.0] = m
    reference = families.get(reference_family, {}).get(focus)

    def at(family: dict[float, dict[str, Any]], ratio: float) -> dict[str, Any] | None:
        return family.get(ratio) or family.get(0.0)  # full reuse has one entry, at ratio 0

    def joined(family: dict[float, dict[str, Any]], show: Any) -> str:
        return " / ".join("–" if (m := at(family, r)) is None else show(m["quality"]) for r in ratios)

    ratio_names = " / ".join(f"{r:g}" for r in ratios)
    header = ["method", f"recovery @ {ratio_names}", f"gold F1 @ {ratio_names}", f"worse than full reuse @ {ratio_names}",
              f"KL @{focus:g}", f"top-1 @{focus:g}", f"TTFT @{focus:g} (s)", f"TTFT vs {reference_family} @{focus:g}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for name, family in families.items():
        m = at(family, focus)
        ttft = None if m is None else m["ttft_s"]["median"]
        reference_ttft = None if reference is None else reference["ttft_s"]["median"]
        relative = None if ttft is None or not reference_ttft else ttft / reference_ttft
        lines.append("| " + " | ".join([
            name,
            joined(family, lambda q: "–" if q["recovery"] is None else f"{100 * q['recovery']:.0f}%"),
            joined(family, lambda q: _fmt(q["f1"], ".3f")),
            joined(family, lambda q: "–" if q["worse_than_full_reuse"] is None else f"{q['worse_than_full_reuse']}/{n}"),
            _fmt(None if m is None else m["quality"]["kl"], ".4f"),
            _fmt(None if m is None else m["quality"]["top1"], ".3f"),
            _fmt(ttft, ".3f"),
            _fmt(relative, ".2f"),
        ]) + " |")
    return "\n".join(lines)


def diagnostics_table(document: dict[str, Any]) -> str:
    """One row per method with diagnostics (means over questions): KL at the first and the last
    teacher-forced position, the stale tokens' K/V distance to full prefill at the last layer, and
    the question's attention on stale entries averaged over layers. ``""`` without diagnostics."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for example in document["examples"]:
        for name, outcome in example["methods"].items():
            if outcome.get("diagnostics"):
                rows.setdefault(name, []).append(outcome["diagnostics"])
    if not rows:
        return ""

    def mean(values: list[float | None]) -> float | None:
        kept = [v for v in values if v is not None]
        return sum(kept) / len(kept) if kept else None

    header = ["method", "questions", "KL first position", "KL last position", "stale tokens",
              "stale K dist, last layer", "stale V dist, last layer", "attention on stale (mean over layers)",
              "attention on recomputed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    order = [m["name"] for m in document["methods"] if m["name"] in rows]
    for name in order:
        found = rows[name]
        kv = [d for d in found if "kv_distance" in d]
        lines.append("| " + " | ".join([
            name, str(len(found)),
            _fmt(mean([d["kl_by_position"][0] for d in found if d["kl_by_position"]]), ".4f"),
            _fmt(mean([d["kl_by_position"][-1] for d in found if d["kl_by_position"]]), ".4f"),
            _fmt(mean([d["tokens"]["stale"] for d in kv]), ".0f"),
            _fmt(mean([d["kv_distance"]["stale"]["k"][-1] for d in kv]), ".3f"),
            _fmt(mean([d["kv_distance"]["stale"]["v"][-1] for d in kv]), ".3f"),
            _fmt(mean([mean(d["attention_share"]["stale"]) for d in kv]), ".3f"),
            _fmt(mean([mean(d["attention_share"]["recomputed"]) for d in kv]), ".3f"),
        ]) + " |")
    return "\n".join(lines)
