"""Every relative link and image of the repository's pages points at a file that is there, and a link into a page
at a heading that page has (GitHub's anchors).

The pages: README.md, docs/*.md, the integration packages' READMEs, research/README.md with the notebook it indexes,
and benchmarks/README.md. Links in code (fenced blocks, inline code) are text, not links, and web addresses are not
followed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("integrations/*/README.md"),
                ROOT / "research" / "README.md", ROOT / "research" / "quality_notebook.md",
                ROOT / "benchmarks" / "README.md"})

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"(`+).+?\1", re.S)
# [text](target) and ![alt](target); the text may hold brackets one level deep ([a [b] c](x)).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def links(text: str) -> list[str]:
    """The link targets of markdown ``text``, outside code."""
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, markup and punctuation dropped (letters, digits, ``_`` and ``-``
    kept), lower case, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``'s headings; a repeated heading's get ``-1``, ``-2``... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("/"):
            continue  # a web address (https:, mailto:), not a file of the repository
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {_shown(linked)}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading #{anchor} in {_shown(linked)}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there:\n  " + "\n  ".join(broken)


def test_the_checker_finds_links_and_anchors_as_github_does(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Quality at 0.05 / 0.15: `profile_tokens` (issue 31's)\n## Notes\n## Notes\n"
        "[ok](page.md#quality-at-005--015-profile_tokens-issue-31s) [again](#notes-1) ![img](missing.png)\n"
        "[bad anchor](#nowhere) [a [nested] text](page.md) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n[web](https://example.com/x.md)\n",
        encoding="utf-8")
    assert links(page.read_text()) == ["page.md#quality-at-005--015-profile_tokens-issue-31s", "#notes-1",
                                       "missing.png", "#nowhere", "page.md", "https://example.com/x.md"]
    assert anchors(page) == {"quality-at-005--015-profile_tokens-issue-31s", "notes", "notes-1"}
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.png", "#nowhere"]


def linked_files() -> set[Path]:
    """Every file of the repository some page links (anchors dropped)."""
    found = set()
    for page in PAGES:
        for target in links(page.read_text(encoding="utf-8")):
            path = target.partition("#")[0]
            if path and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", path):
                found.add((page.parent / path).resolve())
    return found


def test_docs_holds_only_what_a_page_links():
    """docs/ is pages and what they show or cite (figures, docs/data/ rows): a file no page links belongs in
    research/ or nowhere."""
    linked = linked_files()
    unlinked = [_shown(path) for path in sorted((ROOT / "docs").rglob("*"))
                if path.is_file() and "__pycache__" not in path.parts and path.resolve() not in linked]
    assert not unlinked, "files in docs/ that no page links (link them from the page that uses them, or move " \
                         "them to research/):\n  " + "\n  ".join(unlinked)
