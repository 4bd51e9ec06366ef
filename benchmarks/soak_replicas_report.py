"""The replica soak's verdict (imported by ``soak_replicas.py``): each failure classified, the killed replica's id,
each replica's RSS growth idle to idle, the invariants and the PNG timeline."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import soak_report

REDIS_FAULTS = ("redis_sigstop", "redis_restart", "flushall")
DETECT_GRACE_S = 15.0  # requests sent this soon after the kill may be routed to the dead replica
REDIS_GRACE_S = 10.0  # after a Redis fault clears, the replicas' clients reconnect within this


def classify(records: list[dict[str, Any]], kill: dict[str, Any], phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each failed request: in flight on the killed replica at the kill, sent to it before Ray saw it gone, a clear
    error during a Redis fault, or unexplained (a lost answer)."""
    at, killed = kill.get("killed_at_s"), kill.get("killed_replica_id")
    redis = [(p["began"], p["cleared"] + REDIS_GRACE_S) for p in phases if p["name"] in REDIS_FAULTS]
    counts, unexplained = Counter(), []
    for r in (r for r in records if r["outcome"] == "error"):
        done = r["submitted"] + (r["latency"] or 0.0)
        if r["error_code"] == "replica_failed" and at is not None and r["replica"] in (None, killed):
            if r["submitted"] <= at <= done:
                counts["in_flight_at_kill"] += 1
                continue
            if at < r["submitted"] <= at + DETECT_GRACE_S:
                counts["sent_to_it_before_ray_saw_it_gone"] += 1
                continue
        if r["clear"] and any(a <= done and r["submitted"] <= b for a, b in redis):
            counts["clear_during_redis_fault"] += 1
            continue
        unexplained.append({k: r[k] for k in ("client", "mode", "submitted", "latency", "replica", "error")})
    return {**{k: counts[k] for k in ("in_flight_at_kill", "sent_to_it_before_ray_saw_it_gone",
                                      "clear_during_redis_fault")}, "unexplained": unexplained}


def replica_ids(records: list[dict[str, Any]], kill: dict[str, Any], ids_before: set[str]) -> dict[str, Any]:
    """The killed replica's id: the one seen before the kill that answers nothing sent after it (+ the grace),
    checked against the replica header of the streams that failed with replica_failed."""
    if not kill:
        return {}
    after = {r["replica"] for r in records if r["outcome"] == "answer"
             and r["submitted"] > kill["killed_at_s"] + DETECT_GRACE_S}
    gone = sorted(ids_before - after)
    in_streams = sorted({r["replica"] for r in records if r["error_code"] == "replica_failed" and r["replica"]})
    new = sorted(after - ids_before)
    return {"killed_replica_id": gone[0] if len(gone) == 1 else None, "ids_before_kill": sorted(ids_before),
            "ids_gone_after_kill": gone, "ids_in_failed_streams": in_streams,
            "survivor_ids": sorted(ids_before & after), "replacement_id": new[0] if len(new) == 1 else None}


def replacements(samples: list[dict[str, Any]], kill: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """The engine processes that appeared after the kill: Ray's attempts at a replacement (one that fails to start,
    say while Redis is stopped, is followed by another); the replacement is the one alive at the end."""
    if not kill:
        return {}
    before = {p for s in samples if s["t"] < kill["killed_at_s"] for p in s["engines"]}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for s in samples:
        for pid in set(s["engines"]) - before:
            first.setdefault(pid, s["t"])
            last[pid] = s["t"]
    attempts = [{"pid": int(p), "first_seen_s": first[p], "last_seen_s": last[p],
                 "alive_at_end": p in end["rss_bytes"]} for p in sorted(first, key=first.get)]
    alive = [a for a in attempts if a["alive_at_end"]]
    return {"replacement_attempts": attempts, "replacement_pid": alive[0]["pid"] if len(alive) == 1 else None,
            "replacement_process_at_s": alive[0]["first_seen_s"] if len(alive) == 1 else None,
            "original_pids": sorted(int(p) for p in before)}


def replica_rss(lulls: dict[str, Any], samples: list[dict[str, Any]], kill: dict[str, Any]) -> list[dict[str, Any]]:
    """Growth of each engine process idle to idle: an original from the warm-up's lull, the replacement from the
    lull after its own warm-up, both to the end's; the killed one and failed starts have no end (left out)."""
    survivors = [p for p in kill.get("original_pids", ()) if p != kill.get("victim_pid")]
    rows = []
    for pid in sorted({pid for s in samples for pid in s["engines"]}, key=int):
        role = {kill.get("victim_pid"): "killed", kill.get("replacement_pid"): "replacement"}.get(int(pid)) or (
            "original" if int(pid) in kill.get("original_pids", (int(pid),)) else "failed start")
        rid = {"killed": kill.get("killed_replica_id"), "replacement": kill.get("replacement_id")}.get(role)
        if role == "original" and len(survivors) == 1 and len(kill.get("survivor_ids", ())) == 1:
            rid = kill["survivor_ids"][0]
        busy = [s["engines"][pid] for s in samples if pid in s["engines"]]
        row = {"pid": int(pid), "replica": rid, "role": role, "growth": None,
               "rss_busy_range_mb": [round(min(busy) / 2**20, 1), round(max(busy) / 2**20, 1)]}
        base, end = lulls.get("replacement" if role == "replacement" else "warmup"), lulls.get("end")
        if role in ("killed", "failed start"):
            row["note"] = f"{role}: no end reading"
        elif not base or not end or pid not in base["rss_bytes"] or pid not in end["rss_bytes"]:
            row["note"] = (f"left out: its warm-up ({kill.get('replacement_warmup_answers_needed')} answers and the "
                           f"run's warm-up time) had not ended before the end ({kill.get('replacement_answers')} "
                           "answers)" if role == "replacement" else "missing from a lull")
        else:
            b, e = base["rss_bytes"][pid], end["rss_bytes"][pid]
            row.update(baseline=base["what"], rss_baseline_mb=round(b / 2**20, 1), rss_end_mb=round(e / 2**20, 1),
                       growth=round(e / b - 1, 4))
        rows.append(row)
    return rows


def tiers(answered: list[dict[str, Any]]) -> dict[str, int]:
    return {t: sum(int((r["chunk_tiers"] or {}).get(t, 0)) for r in answered) for t in ("memory", "store", "computed")}


def invariants(report: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    totals, failures, kill = report["totals"], report["failures"], report["replica_kill"]
    rss = report["rss"]["replicas"]
    measured = [r for r in rss if r["growth"] is not None]
    unmeasured = [r for r in rss if r["growth"] is None and r["role"] == "original"]
    bound = soak_report.RSS_GROWTH_LIMIT
    return {
        "no hangs": (totals["hangs"] == 0, f"{totals['hangs']} requests past the "
                                           f"{report['settings']['deadline_s']:.0f} s deadline or never answered"),
        "no answer lost but the killed replica's": (
            not failures["unexplained"],
            f"{totals['errors']} failed: {failures['in_flight_at_kill']} in flight on the killed replica, "
            f"{failures['sent_to_it_before_ray_saw_it_gone']} sent to it before Ray saw it gone, "
            f"{failures['clear_during_redis_fault']} clear during a Redis fault, "
            f"{len(failures['unexplained'])} unexplained"),
        "every error clear": (totals["clear_errors"] == totals["errors"],
                              f"{totals['errors'] - totals['clear_errors']} of {totals['errors']} errors unclear"),
        f"RSS of each replica flat (< {bound:.0%} idle to idle)": (
            bool(measured) and not unmeasured and all(r["growth"] < bound for r in measured),
            "; ".join(f"{r['role']} {r['pid']}: " + (f"{r['growth']:+.1%} ({r['rss_baseline_mb']} -> "
                                                     f"{r['rss_end_mb']} MB)" if r["growth"] is not None
                                                     else r.get("note", "")) for r in rss)),
        "the killed replica replaced": (
            kill.get("replacement_pid") is not None and not report["fault_injection_errors"],
            f"killed pid {kill.get('victim_pid')} ({kill.get('killed_replica_id')}) at {kill.get('killed_at_s')} s; "
            f"{len(kill.get('replacement_attempts', ()))} processes started after it; the replacement, pid "
            f"{kill.get('replacement_pid')}, at {kill.get('replacement_process_at_s')} s, serving at "
            f"{kill.get('replacement_serving_at_s')} s; injection errors: {report['fault_injection_errors']}"),
    }


def plot(report: dict[str, Any], records: list[dict[str, Any]], path: Path) -> None:
    """Answers and failures per second, TTFT per request and each engine process's RSS, fault spans shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, ttft, rss) = plt.subplots(3, 1, figsize=(13, 9), dpi=110, sharex=True)
    end = report["settings"]["minutes"] * 60
    edges = [i * 5.0 for i in range(int(end // 5) + 2)]
    for outcome, color in (("answer", "tab:blue"), ("error", "tab:red"), ("cancelled", "tab:gray")):
        done = [r["submitted"] + r["latency"] for r in records if r["outcome"] == outcome and r["latency"]]
        rate.hist(done, bins=edges, weights=[0.2] * len(done), histtype="step", color=color, label=outcome)
        rows = [r for r in records if r["outcome"] == outcome and r["ttft"] is not None]
        ttft.scatter([r["submitted"] for r in rows], [r["ttft"] for r in rows], s=8, color=color, label=outcome)
    rate.set(ylabel="finished per s (5-s bins)")
    ttft.set(ylabel="TTFT (s)", yscale="log")
    samples = report["samples"]
    for pid in sorted({p for s in samples for p in s["engines"]}, key=int):
        rows = [s for s in samples if pid in s["engines"]]
        role = next((r["role"] for r in report["rss"]["replicas"] if str(r["pid"]) == pid), "?")
        rss.plot([s["t"] for s in rows], [s["engines"][pid] / 2**20 for s in rows], label=f"pid {pid} ({role})")
    for reading in report["rss"]["lulls"].values():
        if reading:
            rss.axvline(reading["t"], color="tab:green", linestyle=":", linewidth=1)
    rss.set(ylabel="RSS (MB); lulls dotted", xlabel="seconds since the soak began")
    kill = report["replica_kill"]
    for at, label in ((kill.get("killed_at_s"), "kill"), (kill.get("replacement_serving_at_s"), "replacement serving")):
        if at is not None:
            for ax in (rate, ttft, rss):
                ax.axvline(at, color="black", linestyle="--", linewidth=1)
            ttft.annotate(label, (at, 0.02), xycoords=("data", "axes fraction"), fontsize=7, rotation=90)
    for ax in (rate, ttft, rss):
        for phase in report["phases"][1:]:
            ax.axvspan(phase["start_s"], max(phase["cleared_s"], phase["start_s"] + 0.5), color="tab:red", alpha=0.15)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    for phase in report["phases"][1:]:
        rate.annotate(phase["phase"], (phase["start_s"], 1), xycoords=("data", "axes fraction"), fontsize=7,
                      rotation=90, va="top")
    settings = report["settings"]
    fig.suptitle(f"soak through serve --ray (2 replicas of {settings['model']}): {settings['minutes']} min, seed "
                 f"{settings['seed']}, {report['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
