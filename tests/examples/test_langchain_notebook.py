"""The LangChain example notebook: in step with its script twin, and executed end to end (slow).

``examples/langchain_faiss_rag.py`` is the source, in the "percent" cell format. After
editing it, rebuild the notebook with::

    .venv/bin/python tests/examples/test_langchain_notebook.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPT = EXAMPLES / "langchain_faiss_rag.py"
NOTEBOOK = EXAMPLES / "langchain_faiss_rag.ipynb"
_MARKER = re.compile(r"^# %%(?: \[(markdown)\])?\s*$")


def script_cells(path: Path = SCRIPT) -> list[tuple[str, str]]:
    """``(cell_type, source)`` of each ``# %%`` cell; markdown cells lose their ``# `` prefix."""
    cells: list[tuple[str, list[str]]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        match = _MARKER.match(line)
        if match:
            cells.append(("markdown" if match.group(1) else "code", []))
        elif cells:
            cells[-1][1].append(line)
    result = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [re.sub(r"^# ?", "", line) for line in lines]
        result.append((kind, "\n".join(lines).strip("\n")))
    return result


def build_notebook() -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["language_info"] = {"name": "python"}
    for kind, source in script_cells():
        cell = nbformat.v4.new_markdown_cell(source) if kind == "markdown" else nbformat.v4.new_code_cell(source)
        notebook.cells.append(cell)
    return notebook


def test_notebook_matches_its_script() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert [(c.cell_type, c.source) for c in notebook.cells] == script_cells(), (
        "examples/langchain_faiss_rag.ipynb is out of date; rebuild it with "
        "`.venv/bin/python tests/examples/test_langchain_notebook.py`"
    )


@pytest.mark.slow
def test_notebook_runs(tmp_path, monkeypatch) -> None:
    from nbclient import NotebookClient

    monkeypatch.setenv("CACHEBLEND_EXAMPLE_SMALL", "1")  # the kernel inherits this environment
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    printed = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "mean TTFT: CacheBlend" in printed
    # Where reused tokens came from, per question and in the summary, not one "reused" share.
    by_origin = [line for line in printed.splitlines() if "by origin of their K/V" in line]
    assert len(by_origin) == 3  # two questions (the quick run) and the summary
    for source in ("chunk store", "prefix cache", "earlier spans", "chunks computed on a miss", "fresh"):
        assert all(source in line for line in by_origin), source
    assert "mean share of prompt tokens reused" not in printed


if __name__ == "__main__":
    nbformat.write(build_notebook(), NOTEBOOK)
    print(f"wrote {NOTEBOOK.relative_to(Path.cwd()) if NOTEBOOK.is_relative_to(Path.cwd()) else NOTEBOOK}", file=sys.stderr)
