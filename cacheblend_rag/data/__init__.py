"""Data shipped with the package: a small fictional corpus for demos and examples.

The demo corpus is written for this project (no download, no licence questions):
twenty short encyclopedia-style articles about invented places, people and things,
so a small model cannot answer from memory and must read the retrieved text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = ["DemoDocument", "DemoQuestion", "demo_corpus_dir", "load_demo_corpus", "load_demo_questions"]


@dataclass(frozen=True)
class DemoDocument:
    doc_id: str  # file name, e.g. "01_isle_of_varrow.md"
    title: str
    text: str  # the article body, without its "# Title" line


@dataclass(frozen=True)
class DemoQuestion:
    question: str
    answer: str  # a short phrase the correct answer contains
    source: str  # doc_id of the article holding the answer


def demo_corpus_dir() -> Path:
    """Folder of the demo articles (one Markdown file each)."""
    return Path(str(resources.files(__package__).joinpath("demo_corpus")))


def load_demo_corpus() -> list[DemoDocument]:
    """The demo articles, sorted by file name."""
    documents = []
    for path in sorted(demo_corpus_dir().glob("*.md")):
        lines = path.read_text(encoding="utf-8").strip().splitlines()
        title = lines[0].lstrip("# ").strip()
        body = "\n".join(lines[1:]).strip()
        documents.append(DemoDocument(doc_id=path.name, title=title, text=body))
    return documents


def load_demo_questions() -> list[DemoQuestion]:
    """Questions over the demo corpus with a short expected answer each."""
    raw = resources.files(__package__).joinpath("demo_questions.json").read_text(encoding="utf-8")
    return [DemoQuestion(**item) for item in json.loads(raw)]
