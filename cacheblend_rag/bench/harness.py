"""The MuSiQue benchmark: every method on every question, then per-method summaries.

:func:`run_benchmark` runs one :class:`~cacheblend_rag.bench.config.BenchConfig` end to end and
returns the result document. Its parts: the settings (:mod:`cacheblend_rag.bench.config`), the
per-question execution (:mod:`cacheblend_rag.bench.runner`), what is measured
(:mod:`cacheblend_rag.bench.outcomes`) and the per-method summaries (:mod:`cacheblend_rag.bench.summary`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable

from cacheblend_rag.bench.config import BenchConfig
from cacheblend_rag.bench.outcomes import ExampleOutcome, outcome_from_dict
from cacheblend_rag.bench.prompt import load_musique
from cacheblend_rag.bench.runner import BenchmarkRunner
from cacheblend_rag.bench.summary import summarize_methods
from cacheblend_rag.engine.blend import CacheBlendEngine
from cacheblend_rag.errors import ConfigError

logger = logging.getLogger(__name__)


def run_benchmark(config: BenchConfig, engine: CacheBlendEngine | None = None,
                  on_partial: Callable[[dict[str, Any]], None] | None = None,
                  resume: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the benchmark and return the result document (see docs/benchmark_schema.md).

    ``on_partial`` gets the document of what is done so far after each (question, method) pair
    (``partial`` true until every pair is in), so a long run that is stopped keeps what it measured.
    ``resume``: an earlier document of this benchmark (:mod:`cacheblend_rag.bench.resume`); its
    finished pairs are kept if its settings match this run's (a :class:`ConfigError` names the
    first difference otherwise), and only the missing pairs run."""
    from cacheblend_rag.bench.report import build_document, git_info
    from cacheblend_rag.bench.resume import check_resumable, data_digest

    # The commit whose code runs; taken now, as a long run can outlive several commits.
    git = git_info()
    examples = load_musique(config.data, config.n)
    data_sha = data_digest(config.data)
    if engine is None:
        engine = CacheBlendEngine.from_pretrained(config.model, device=config.device)
    runner = BenchmarkRunner(engine, config)
    backend = runner.stores.backend_name
    started = time.time()

    def document(outcomes: list[ExampleOutcome]) -> dict[str, Any]:
        doc = build_document(
            config=config, engine=engine, specs=runner.specs, added=runner.added_specs,
            blend_config=runner.base_blend, store_backend=backend, outcomes=outcomes,
            summaries=summarize_methods(runner.specs, outcomes), elapsed_s=time.time() - started, git=git,
            selection=runner.selection,
        )
        doc["data"]["sha256"] = data_sha
        doc["work"] = dict(runner.work)
        if resume is not None:
            # The runs this document grew from: their pairs were measured by that code, on that day.
            doc["history"] = [*resume.get("history", []), {k: resume.get(k) for k in ("created_utc", "command", "git")}]
        return doc

    previous = None
    if resume is not None:
        check_resumable(resume, document([]), [spec.to_dict() for spec in runner.specs])
        try:
            previous = {int(e["index"]): outcome_from_dict(e) for e in resume["examples"]}
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"--resume: the result's examples do not read back ({type(exc).__name__}: {exc}); "
                              "it is left as it is") from None
        dropped = sorted({name for o in previous.values() for name in o.methods} - {s.name for s in runner.specs})
        if dropped:
            logger.warning("--resume: the result holds methods this run does not ask for, left out of the new "
                           "document (the backup keeps them): %s", ", ".join(dropped))

    def finished(outcomes: list[ExampleOutcome]) -> bool:
        assert runner.selection is not None
        return len(outcomes) == runner.selection["kept"] and all(
            len(o.methods) == len(runner.specs) for o in outcomes)

    def partial(outcomes: list[ExampleOutcome]) -> None:
        if on_partial is None:
            return
        # A resumed run's questions not reached yet are written as they were: a run stopped midway must
        # not leave a file that has lost them (resuming it would measure them all again).
        reached = {o.index for o in outcomes}
        names = {spec.name for spec in runner.specs}
        waiting = [replace(o, methods={name: m for name, m in o.methods.items() if name in names})
                   for index, o in (previous or {}).items() if index not in reached]
        written = sorted([*outcomes, *waiting], key=lambda o: o.index)
        on_partial({**document(written), "partial": not finished(outcomes)})

    outcomes = runner.run(examples, on_example=partial, previous=previous)
    left_out = sorted(set(previous or {}) - {o.index for o in outcomes})
    if left_out:
        logger.warning("--resume: the result holds questions this run does not select (--n, --answerable), left "
                       "out of the new document (the backup keeps them): %s", left_out)
    return {**document(outcomes), "partial": not finished(outcomes)}
