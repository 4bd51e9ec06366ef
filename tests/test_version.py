"""``cacheblend_rag.__version__`` is the installed package's version, which pyproject.toml sets once."""

from __future__ import annotations

import tomllib
from pathlib import Path

import cacheblend_rag


def test_the_version_is_pyproject_s():
    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]
    assert cacheblend_rag.__version__ == declared
