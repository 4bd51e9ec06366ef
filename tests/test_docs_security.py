"""docs/operations.md's "Security" section (issue 69, item 8) says what users of one engine share and how to
scope it, what a store key protects, what is in a store on disk and the server's --api-key; and every test file
it cites for a claim exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _security_section() -> str:
    text = (REPO / "docs" / "operations.md").read_text()
    begun = text.index("\n## Security")
    return text[begun:text.index("\n## ", begun + 1)]


def test_the_security_section_covers_what_issue_69_asks():
    section = _security_section()
    for topic in ("--api-key", "cache_salt", "chunk_sharing", "per_salt", "document_special_tokens",
                  "store_password", "What a store key protects", "What is in a store on disk", "0o700",
                  "foreign_key_entries", "write_backs_dropped", "require_store_key"):
        assert topic in section, topic


def test_every_test_the_section_cites_exists():
    cited = re.findall(r"`(tests/[\w/]+\.py)`", _security_section())
    assert cited and all((REPO / path).is_file() for path in cited), cited
