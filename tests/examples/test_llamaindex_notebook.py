"""The LlamaIndex example notebook: it matches its .py twin, and it runs end to end (slow)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NOTEBOOK = EXAMPLES / "llamaindex_faiss_rag.ipynb"
SCRIPT = EXAMPLES / "llamaindex_faiss_rag.py"


def cells_from_percent_script(text: str) -> list[tuple[str, str]]:
    """(cell type, source) pairs of a script in the ``# %%`` / ``# %% [markdown]`` format."""
    cells: list[tuple[str, str]] = []
    for block in re.split(r"^# %%", text, flags=re.MULTILINE)[1:]:
        header, _, body = block.partition("\n")
        if header.strip() == "[markdown]":
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in body.strip().splitlines()]
            cells.append(("markdown", "\n".join(lines)))
        else:
            cells.append(("code", body.strip()))
    return cells


def notebook_from_script(script: Path) -> nbformat.NotebookNode:
    notebook = nbformat.v4.new_notebook()
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, source in cells_from_percent_script(script.read_text()):
        make = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        notebook.cells.append(make(source))
    return notebook


def test_notebook_matches_its_script():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    in_notebook = [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]
    assert in_notebook == cells_from_percent_script(SCRIPT.read_text()), (
        "examples/llamaindex_faiss_rag.ipynb and .py differ; regenerate the notebook with "
        "`python tests/examples/test_llamaindex_notebook.py`"
    )


@pytest.mark.slow
def test_notebook_runs(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("CACHEBLEND_EXAMPLE_SMALL", "1")
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))  # it imports examples/demo.py; the kernel inherits this
    monkeypatch.setenv("CACHEBLEND_EXAMPLE_OUTPUT", str(tmp_path))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    assert (tmp_path / "llamaindex_ttft.png").is_file()
    printed = "".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "median TTFT over" in printed and "by origin of their K/V" in printed


if __name__ == "__main__":
    # Regenerate the notebook from the script (outputs are not stored).
    nbformat.write(notebook_from_script(SCRIPT), NOTEBOOK)
    print(f"wrote {NOTEBOOK}")
