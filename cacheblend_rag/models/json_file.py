"""A JSON file written whole or not at all: the package's small state files (the dtype probe, calibrations and their
run state) are read by other processes and by a run resumed after a stop."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomically(path: Path, document: dict[str, Any], *, indent: int = 2) -> Path:
    """Write ``document`` so that a reader (or a stop midway) sees the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(document, out, indent=indent)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
