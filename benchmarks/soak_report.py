"""The soak's measurements and verdict: the process sampled every second, the report per phase, the
invariants the exit code stands for, the PNG timeline and the Markdown table of docs/operations.md.
Imported by ``soak.py``."""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

from cacheblend_rag.serving.memory_trim import release_free_memory

RECOVERY_WITHIN_S = 5.0  # p99 back within RECOVERY_MARGIN of healthy this soon after a fault clears
RECOVERY_MARGIN = 1.2
RSS_GROWTH_LIMIT = 0.05
FLAT_SLACK = 2  # open files and threads may differ from the warm-up's by this many at the end
WINDOW_STEP_S = 0.5
# Recovery is judged on the warmed traffic: a "miss" request computes its passages by design (p50 0.40 s
# against 0.20 s for the rest in the ten-minute soak, above the healthy p99 of 0.31 s), is ~9% of
# requests and 0-2 of a recovery window's ~5, so its presence, not the fault, decided the verdict.
# Its TTFT stays in every phase's p50/p99.
NOT_IN_RECOVERY = frozenset({"miss"})
# Healthy traffic: the warm-up's last two thirds and every stretch from this long after a fault cleared to the
# next fault. The warm-up alone is lighter than the steady state that follows (three ten-minute runs: p90
# 0.21-0.25 s there against 0.26-0.49 s 20 s and more after each fault, requests in flight 0.30 against
# 0.25-0.61), so 55-67% of all 10-s windows after it missed its p99 by 20%, far from any fault too. Pooled,
# ~300 requests make the healthy p99 a p99 (the warm-up's 57 made it about their second largest), and a
# recovery longer than this is still seen: it is judged before this point, in its own window.
SETTLED_AFTER_S = 20.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class Sampler:
    """RSS, open file descriptors, threads, the scheduler's queue and the store's counters, every second."""

    def __init__(self, now: Callable[[], float], scheduler: Any, counters: Callable[[], dict[str, int]],
                 extra: Callable[[], dict[str, Any]] = dict) -> None:
        self.now, self.scheduler, self.counters, self.extra = now, scheduler, counters, extra
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        try:
            import psutil

            self._process = psutil.Process()
        except ImportError:  # /proc/self says the same, on Linux
            self._process = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _process_numbers(self) -> tuple[int, int, int]:
        if self._process is not None:
            return self._process.memory_info().rss, self._process.num_fds(), self._process.num_threads()
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(status["VmRSS"].split()[0]) * 1024, len(os.listdir("/proc/self/fd")), int(status["Threads"])

    @staticmethod
    def _rss_kinds() -> dict[str, int]:
        """Anonymous memory (the heap: what a leak grows) apart from file pages (SQLite's mmap of the disk
        tier's index, the model's weights) and shared memory, where /proc says so."""
        try:
            status = Path("/proc/self/status").read_text().splitlines()
        except OSError:
            return {}
        fields = {"RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes", "RssShmem": "rss_shmem_bytes"}
        return {fields[k]: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in status if ":" in line)
                if k in fields}

    @staticmethod
    def fd_kinds() -> dict[str, int]:
        """Open descriptors by what they are (socket, pipe, a store file by its suffix...): where a leak is."""
        kinds: dict[str, int] = {}
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            return kinds
        for name in names:
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue
            kind = target.split(":", 1)[0] if ":" in target and not target.startswith("/") else \
                (Path(target).suffix or Path(target).name)
            kinds[kind] = kinds.get(kind, 0) + 1
        return kinds

    @staticmethod
    def rss_by_mapping() -> dict[str, int]:
        """Resident bytes per mapping name ([heap], anonymous, a file), from /proc/self/smaps: taken at the
        warm-up's end and at the end, their difference says what grew."""
        out: dict[str, int] = {}
        name = "?"
        try:
            lines = Path("/proc/self/smaps").read_text().splitlines()
        except OSError:
            return out
        for line in lines:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else "[anonymous]"
            elif head and head[0] == "Rss:":
                out[name] = out.get(name, 0) + int(head[1]) * 1024
        return out

    def sample(self) -> dict[str, Any]:
        rss, fds, threads = self._process_numbers()
        queue = self.scheduler.stats()  # read defensively: which fields it has depends on the version
        row = {"t": round(self.now(), 2), "rss_bytes": rss, "fds": fds, "threads": threads,
               "running": queue.get("running"), "queued": queue.get("queued", queue.get("waiting")),
               "kv_reserved_bytes": queue.get("kv_reserved_bytes"), "refused": queue.get("refused",
                                                                                         queue.get("rejected")),
               "python_objects": len(gc.get_objects()), **self._rss_kinds(), **self.extra(),
               "fd_kinds": self.fd_kinds(),
               **{f"store_{k}": v for k, v in self.counters().items()}}
        self.samples.append(row)
        return row

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.sample()

    def settled(self, timeout_s: float) -> dict[str, Any]:
        """RSS with no request running or queued, after the freed heap went back to the system (as the scheduler
        does when it goes idle): the process's own memory without the requests' activations and K/V. Read the
        same way in a lull at the warm-up's end and after the traffic stops, the two tell a leak from the swing
        RSS makes with the requests in flight (1.27-1.47 GB on SmolLM2 in float32 on a 2-core EPYC, up to six
        blends at once; a reading at a burst's peak failed a two-minute run at +8.8%)."""
        began = time.monotonic()
        idle = False
        while not idle and time.monotonic() - began < timeout_s:
            queue = self.scheduler.stats()
            idle = not queue.get("running") and not queue.get("queued", queue.get("waiting"))
            if not idle:
                time.sleep(0.05)
        trimmed = release_free_memory()
        readings = []
        for _ in range(3):
            time.sleep(0.1)
            readings.append(self._process_numbers()[0])
        return {"t": round(self.now(), 2), "rss_bytes": int(statistics.median(readings)), "idle": idle,
                "waited_s": round(time.monotonic() - began, 2), "trimmed": trimmed}


def _ttfts(records: list[dict[str, Any]]) -> list[float]:
    return [r["ttft"] for r in records if r["ttft"] is not None and r["outcome"] in ("answer", "cancelled")]


def recovery_s(records: list[dict[str, Any]], cleared: float, ends: float, healthy_p99: float) -> float | None:
    """Seconds from ``cleared`` to the first moment from which the requests sent in the next window (5-10 s, at
    most to ``ends``; 3 requests at least) have a TTFT p99 within
    RECOVERY_MARGIN of ``healthy_p99``. ``None``: not within the phase."""
    window = max(5.0, min(10.0, (ends - cleared) / 2))
    at = cleared
    while at + window <= ends + 1e-9:
        inside = _ttfts([r for r in records if at <= r["submitted"] < at + window])
        if len(inside) >= 3 and percentile(inside, 99) <= RECOVERY_MARGIN * healthy_p99:
            return round(at - cleared, 2)
        at += WINDOW_STEP_S
    return None


def _counter_at(samples: list[dict[str, Any]], t: float, name: str) -> int:
    before = [s for s in samples if s["t"] <= t]
    return (before[-1] if before else samples[0]).get(f"store_{name}", 0) if samples else 0


def warmup_p99(records: list[dict[str, Any]], warmup_end: float) -> float | None:
    """The warmed traffic's TTFT p99 over the warm-up's last two thirds alone (reported beside the healthy p99)."""
    return percentile(_ttfts([r for r in records if r["kind"] not in NOT_IN_RECOVERY
                              and warmup_end / 3 <= r["submitted"] < warmup_end]), 99)


def phase_rows(records: list[dict[str, Any]], phases: list[dict[str, Any]], samples: list[dict[str, Any]],
               warmup_end: float, end: float) -> tuple[list[dict[str, Any]], float | None]:
    """One row per phase (the warm-up, then each fault from its start to the next one's), and the healthy p99
    (the warmed traffic, every kind but NOT_IN_RECOVERY, in the settled stretches: SETTLED_AFTER_S) against
    which recovery is judged."""
    warmed = [r for r in records if r["kind"] not in NOT_IN_RECOVERY]
    settled = [(warmup_end / 3, warmup_end)] + [(p["cleared"] + SETTLED_AFTER_S, p["ends"]) for p in phases
                                                 if p["cleared"] is not None]
    healthy_p99 = percentile(_ttfts([r for r in warmed if any(a <= r["submitted"] < b for a, b in settled)]), 99)
    spans = [("warm-up", "healthy traffic before any fault", 0.0, None, warmup_end)]
    for phase in phases:
        spans.append((phase["name"], phase["label"], phase["began"], phase["cleared"], phase["ends"]))
    rows = []
    for name, label, start, cleared, stop in spans:
        inside = [r for r in records if start <= r["submitted"] < stop]
        ttfts = _ttfts(inside)
        done = [r for r in inside if r["outcome"] == "answer"]
        in_window = [s for s in samples if start <= s["t"] < stop]
        row = {
            "phase": name, "what": label, "start_s": start, "cleared_s": cleared, "ends_s": stop,
            "requests": len(inside), "answers": len(done),
            "cancelled_on_purpose": sum(r["outcome"] == "cancelled" for r in inside),
            "errors": sum(r["outcome"] == "error" for r in inside),
            "clear_errors": sum(r["outcome"] == "error" and bool(r["clear"]) for r in inside),
            "hangs": sum(r["outcome"] == "hang" for r in inside),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "hits": sum(r["stats"].get("cache_hits", 0) for r in done),
            "misses": sum(r["stats"].get("cache_misses", 0) for r in done),
            "load_failures": sum(r["stats"].get("load_failures", 0) for r in done),
            "corrupt": _counter_at(samples, stop, "corrupt") - _counter_at(samples, start, "corrupt"),
            "control_compared": sum(r["control_equal"] is not None for r in inside),
            "control_equal": sum(bool(r["control_equal"]) for r in inside),
            "rss_max_mb": round(max(s["rss_bytes"] for s in in_window) / 2**20, 1) if in_window else None,
            "fds_max": max((s["fds"] for s in in_window), default=None),
            "threads_max": max((s["threads"] for s in in_window), default=None),
        }
        if cleared is not None and healthy_p99 is not None:
            row["recovery_s"] = recovery_s(warmed, cleared, stop, healthy_p99)
        rows.append(row)
    return rows, healthy_p99


def resource_verdict(samples: list[dict[str, Any]], warmup_end: float, end: float,
                     settled: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    """RSS growth idle to idle (``settled``: :meth:`Sampler.settled` in the warm-up's lull and after the traffic
    stopped), what RSS did with the requests running (the medians of the warm-up's last 3 s and the soak's last
    5 s, the range after the warm-up), and open files and threads at the same two medians."""
    def median_of(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(s[key] for s in rows)

    base = [s for s in samples if warmup_end - 3 <= s["t"] <= warmup_end] or samples[:1]
    last = [s for s in samples if s["t"] >= end - 5] or samples[-1:]
    after = [s for s in samples if s["t"] > warmup_end] or samples
    busy0, busy1 = median_of(base, "rss_bytes"), median_of(last, "rss_bytes")
    idle0, idle1 = settled[0]["rss_bytes"], settled[1]["rss_bytes"]
    busy_range = [round(min(s["rss_bytes"] for s in after) / 2**20, 1),
                  round(max(s["rss_bytes"] for s in after) / 2**20, 1)]
    return {"rss_warmup_mb": round(idle0 / 2**20, 1), "rss_end_mb": round(idle1 / 2**20, 1),
            "rss_growth": round(idle1 / idle0 - 1, 4),
            "rss_settled": {"warmup": settled[0], "end": settled[1]},
            "rss_busy_warmup_mb": round(busy0 / 2**20, 1), "rss_busy_end_mb": round(busy1 / 2**20, 1),
            "rss_busy_growth": round(busy1 / busy0 - 1, 4), "rss_range_after_warmup_mb": busy_range,
            "rss_max_after_warmup_mb": busy_range[1],
            "fds_warmup": median_of(base, "fds"), "fds_end": median_of(last, "fds"),
            "fds_max": max(s["fds"] for s in after),
            "threads_warmup": median_of(base, "threads"), "threads_end": median_of(last, "threads"),
            "threads_max": max(s["threads"] for s in after)}


def invariants(report: dict[str, Any], *, timing: bool) -> dict[str, tuple[bool, str]]:
    """Each invariant: (holds, what was measured). The exit code is non-zero when one does not hold."""
    totals, resources, identity = report["totals"], report["resources"], report["identity"]
    entries = report["healthy_entries"]
    checks = {
        "no hangs": (totals["hangs"] == 0, f"{totals['hangs']} requests past the {report['settings']['deadline_s']} "
                                           "s deadline or never answered"),
        "control answers equal full prefill": (
            totals["control_compared"] > 0 and totals["control_equal"] == totals["control_compared"],
            f"{totals['control_equal']}/{totals['control_compared']} equal at ratio 1.0"),
        "every error clear": (totals["clear_errors"] == totals["errors"],
                              f"{totals['errors'] - totals['clear_errors']} of {totals['errors']} errors unclear"),
        "no healthy entry lost": (not entries["lost"], f"{len(entries['lost'])} lost of {entries['before']}"),
        "counter identity": (identity["holds"], identity["summary"]),
        "RSS growth after warm-up < 5%": (resources["rss_growth"] < RSS_GROWTH_LIMIT,
                                          f"{resources['rss_growth']:+.1%} idle to idle "
                                          f"({resources['rss_warmup_mb']} -> {resources['rss_end_mb']} MB; "
                                          f"{resources['rss_busy_growth']:+.1%} busy, range "
                                          f"{resources['rss_range_after_warmup_mb']} MB)"),
        "open files flat": (resources["fds_end"] - resources["fds_warmup"] <= FLAT_SLACK,
                            f"{resources['fds_warmup']} -> {resources['fds_end']} (max {resources['fds_max']})"),
        "threads flat": (resources["threads_end"] - resources["threads_warmup"] <= FLAT_SLACK,
                         f"{resources['threads_warmup']} -> {resources['threads_end']} "
                         f"(max {resources['threads_max']})"),
    }
    if timing:
        slow = {r["phase"]: r.get("recovery_s") for r in report["phases"][1:]
                if r.get("recovery_s") is None or r["recovery_s"] > RECOVERY_WITHIN_S}
        checks[f"p99 back within 20% within {RECOVERY_WITHIN_S:.0f} s of each fault"] = (
            not slow and report["healthy_ttft_p99_s"] is not None,
            "all recovered" if not slow else f"not recovered in time: {slow} (None: not within the phase)")
    return checks


def plot(report: dict[str, Any], records: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(13, 9), dpi=110, sharex=True)
    colors = {"answer": "tab:blue", "cancelled": "tab:gray", "error": "tab:red", "hang": "black"}
    for outcome, color in colors.items():
        rows = [r for r in records if r["outcome"] == outcome and r["ttft"] is not None]
        top.scatter([r["submitted"] for r in rows], [r["ttft"] for r in rows], s=8, color=color, label=outcome)
    if report["healthy_ttft_p99_s"]:
        top.axhline(RECOVERY_MARGIN * report["healthy_ttft_p99_s"], color="tab:green", linestyle="--",
                    label="1.2 x healthy p99")
    top.set(ylabel="TTFT (s)", yscale="log", title="requests (by when sent)")
    t = [s["t"] for s in samples]
    for name, color in (("hits", "tab:green"), ("misses", "tab:orange"), ("load_failures", "tab:red"),
                        ("corrupt", "tab:purple")):
        middle.plot(t, [s.get(f"store_{name}", 0) for s in samples], color=color, label=name)
    middle.set(ylabel="store counters (cumulative)")
    bottom.plot(t, [s["rss_bytes"] / 2**20 for s in samples], color="tab:blue", label="RSS (MB)")
    twin = bottom.twinx()
    twin.plot(t, [s["fds"] for s in samples], color="tab:orange", label="open fds")
    twin.plot(t, [s["threads"] for s in samples], color="tab:green", label="threads")
    bottom.set(ylabel="RSS (MB)", xlabel="seconds since the soak began")
    twin.set_ylabel("fds, threads")
    for ax in (top, middle, bottom):
        for phase in report["phases"][1:]:
            ax.axvspan(phase["start_s"], max(phase["cleared_s"], phase["start_s"] + 0.5), color="tab:red", alpha=0.15)
        ax.grid(True, alpha=0.3)
    for phase in report["phases"][1:]:
        top.annotate(phase["phase"], (phase["start_s"], 1), xycoords=("data", "axes fraction"), fontsize=7,
                     rotation=90, va="top")
    top.legend(fontsize=7, loc="upper right")
    middle.legend(fontsize=7, loc="upper left")
    bottom.legend(fontsize=7, loc="upper left")
    twin.legend(fontsize=7, loc="upper right")
    settings = report["settings"]
    fig.suptitle(f"soak: {settings['minutes']} min, seed {settings['seed']}, {report['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def table(report: dict[str, Any]) -> str:
    """What each phase cost, as Markdown (docs/operations.md, "Soak")."""
    def num(value: Any, digits: int = 2) -> str:
        return "-" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))

    lines = ["| phase | requests | answers | errors (clear) | hangs | TTFT p50 / p99 (s) | back within 20% (s) "
             "| hits / misses / load failures | corrupt |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["phases"]:
        lines.append(f"| {r['what']} | {r['requests']} | {r['answers']} | {r['errors']} ({r['clear_errors']}) | "
                     f"{r['hangs']} | {num(r['ttft_p50_s'])} / {num(r['ttft_p99_s'])} | {num(r.get('recovery_s'))} | "
                     f"{r['hits']} / {r['misses']} / {r['load_failures']} | {r['corrupt']} |")
    settings = report["settings"]
    lines.append(f"\n{settings['minutes']} min, seed {settings['seed']}, {report['machine']['cpu']}; invariants: "
                 + ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, (ok, _) in report["invariants"].items()))
    return "\n".join(lines)


def wait_until(deadline: float, now: Callable[[], float]) -> None:
    while now() < deadline:
        time.sleep(min(0.5, deadline - now()))
