"""Settings for every test run in this repository: tests/ and each integration package's tests/.

`make test` runs the suite on two pytest-xdist workers, one per core of a 2-core machine (see
docs/testing.md). Under xdist each worker does its math on one torch thread, and so do the processes
its tests start (notebook kernels, the fault trial, the README's virtualenv): two workers on two cores,
not four threads or more fighting for them. The longest tests are sent to the workers first, so that
they run beside the rest of the suite instead of after it. Run in one process (no ``-n``), none of
that scheduling applies.

Models load in float32 on the CPU here (``$CACHEBLEND_DTYPE``), whatever the CPU: on one with a fast
bfloat16 path the package's own default is bfloat16 (``cacheblend_rag.models.dtype_choice``), and the
tests' tolerances and expected answers were set in float32, so a run must not depend on the machine's
flags. The auto choice has its own tests (tests/models/test_dtype_choice.py, the probe stubbed both
ways); set ``CACHEBLEND_DTYPE=auto`` to run everything in the machine's own default.
"""

from __future__ import annotations

import os

os.environ.setdefault("CACHEBLEND_DTYPE", "float32")  # inherited by the processes tests start (notebooks, venvs)

# The longest tests, longest first (a node id or its beginning). Their files go first: each worker is
# handed the next file when it is free, so that the longest ones start at once, on different workers,
# and the many short files fill in around them.
LONGEST_FIRST = (
    "tests/models/test_quality_model.py",  # only where the quality model is fetched; it skips at once elsewhere
    "tests/test_readme_install.py::test_the_readme_installs_in_a_fresh_virtualenv",
    "tests/bench/test_fault_trial.py::",
    "tests/bench/test_smollm2_bench.py::",
    "tests/examples/test_llamaindex_notebook.py::test_notebook_runs",
    "tests/examples/test_langchain_notebook.py::test_notebook_runs",
    "tests/bench/test_gpu_check.py::test_every_step_runs_on_tiny_models_on_the_cpu",
    "tests/server/test_server_smollm2.py::",  # a SmolLM2 server in a subprocess and the same turns in process
    "integrations/langchain-cacheblend/tests/integration_tests/test_standard.py::TestChatCacheBlendSmolLM2",
)


# Files that must not run beside each other: each group is one unit of work, run by one worker, file
# after file. (pytest-xdist 3.8's own `xdist_group` mark does nothing under pytest 9.2: it renames a node
# id attribute pytest no longer reads.)
GROUPS = {
    # Both stop a Redis (SIGSTOP) and hold a request's time against a bound.
    "redis-timing": ("tests/bench/test_fault_trial.py", "tests/store_redis/test_hung_server.py"),
}


def pytest_xdist_make_scheduler(config, log):
    """Hand out whole files (or a group of files): a module's fixtures (a SmolLM2 prompt set, a loaded
    LLM and its answer) are computed by one worker, once, not by both."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((name for name, files in GROUPS.items() if path in files), path)

    return FileScheduling(config, log)


def _xdist_worker() -> bool:
    return bool(os.environ.get("PYTEST_XDIST_WORKER"))


def pytest_configure(config) -> None:
    # pytest-xdist's --loadscope-reorder (on by default) queues files by their number of tests, most first,
    # which put the one-test files (the fault trial, the notebooks, the quality model) last, and a notebook
    # then ran alone at the end of the run; the collection order (LONGEST_FIRST) is the order wanted.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if _xdist_worker():
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[name] = "1"  # inherited by the processes tests start
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items) -> None:
    if not _xdist_worker():
        return

    def rank(item) -> int:
        return next((i for i, start in enumerate(LONGEST_FIRST) if item.nodeid.startswith(start)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: every worker collects the same order, as xdist requires
