"""One engine per model, device and dtype, however they are spelt: the registry keys on what the
arguments resolve to (cacheblend_rag.serving.engine_key), so that spellings of one model never load it twice."""

from __future__ import annotations

import pytest
from langchain_cacheblend import ChatCacheBlend
from llama_index.llms.cacheblend import CacheBlendLLM

from cacheblend_rag.models.loader import DEFAULT_MODEL_NAME
from cacheblend_rag.serving import shared_engine
from cacheblend_rag.serving.engine_key import engine_key
from cacheblend_rag.testing import save_tiny_model


def key(model: str, device=None, dtype=None, tokenizer=None, **options):
    return engine_key(model, device, dtype, tokenizer, options)


def test_device_none_and_auto_are_the_device_they_pick(monkeypatch) -> None:
    monkeypatch.setenv("CACHEBLEND_DTYPE", "float32")
    here = "cuda:0" if __import__("torch").cuda.is_available() else "cpu"
    assert key(DEFAULT_MODEL_NAME) == key(DEFAULT_MODEL_NAME, device="auto") == key(DEFAULT_MODEL_NAME, device=here)
    assert key(DEFAULT_MODEL_NAME).device == here


def test_dtype_unset_is_the_one_the_loader_picks(monkeypatch) -> None:
    monkeypatch.setenv("CACHEBLEND_DTYPE", "float32")
    assert key(DEFAULT_MODEL_NAME, device="cpu") == key(DEFAULT_MODEL_NAME, device="cpu", dtype="float32") \
        == key(DEFAULT_MODEL_NAME, device="cpu", dtype="fp32")
    monkeypatch.setenv("CACHEBLEND_DTYPE", "bfloat16")
    assert key(DEFAULT_MODEL_NAME, device="cpu") == key(DEFAULT_MODEL_NAME, device="cpu", dtype="bfloat16")
    assert key(DEFAULT_MODEL_NAME, device="cpu") != key(DEFAULT_MODEL_NAME, device="cpu", dtype="float32")


def test_names_paths_and_options_resolve_to_their_weights(tmp_path, monkeypatch) -> None:
    from cacheblend_rag.models import catalog
    from cacheblend_rag.models.loader import cache_root, default_gguf_path

    assert key(DEFAULT_MODEL_NAME).source == key(str(default_gguf_path())).source
    entry = next(iter(catalog.CATALOG.values()))
    assert key(entry.name.upper()).source == key(str(catalog.fetched_path(entry, cache_root()))).source
    folder = save_tiny_model(tmp_path / "fine-tune")
    monkeypatch.chdir(tmp_path)
    assert key("fine-tune").source == key(str(folder)).source == f"folder:{folder.resolve()}"
    assert key("someone/model").source == "hub:someone/model"
    assert key("tiny-llama").source == "tiny:llama" and key("tiny-llama", device="cpu") == key("tiny-llama")
    assert key("fine-tune", revision="main") != key("fine-tune")


def test_spellings_of_a_folder_model_share_one_engine(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CACHEBLEND_DTYPE", "float32")
    folder = save_tiny_model(tmp_path / "own-model")
    monkeypatch.chdir(tmp_path)
    engine = shared_engine(str(folder))
    assert shared_engine("own-model", device="cpu", dtype="float32") is engine
    assert shared_engine(str(folder) + "/", device="auto", dtype="fp32") is engine


@pytest.mark.slow
def test_the_three_spellings_of_the_default_model_share_one_engine(monkeypatch) -> None:
    """The issue's three: keyed as written they loaded three SmolLM2s (on a GPU with a 7B model, out of memory)."""
    monkeypatch.setenv("CACHEBLEND_DTYPE", "float32")
    first = ChatCacheBlend()
    on_cpu = ChatCacheBlend(device="cpu")
    spelt_out = ChatCacheBlend(model="SmolLM2-135M-Instruct", dtype="float32")
    assert first.engine is on_cpu.engine is spelt_out.engine
    # Settings that leave the weights alone never load another, in either framework.
    other_settings = ChatCacheBlend(recompute_ratio=0.3, temperature=0.7, seed=1, max_tokens=5)
    assert other_settings.engine is first.engine
    assert CacheBlendLLM(device="auto", max_new_tokens=5).engine is first.engine


def test_a_released_engine_is_forgotten_stopped_and_freed() -> None:
    """release_engine: the next shared_engine loads anew, the scheduler's worker stops, model objects on it
    say so, and once they are gone nothing holds the engine (the registry's slot held it for good before)."""
    import gc
    import weakref

    from cacheblend_rag.serving import release_engine, scheduler_for

    llm = ChatCacheBlend(model="tiny-qwen2", max_tokens=2)
    engine = llm.get_engine()
    assert engine is shared_engine("tiny-qwen2")
    llm.invoke("hello")
    scheduler = scheduler_for(engine)
    assert release_engine(engine) and not release_engine(engine)
    assert scheduler.closed and (scheduler._thread is None or not scheduler._thread.is_alive())
    with pytest.raises(RuntimeError, match="scheduler is closed"):
        llm.invoke("hello")
    fresh = shared_engine("tiny-qwen2")
    assert fresh is not engine
    gone = weakref.ref(engine)
    del llm, engine, scheduler
    gc.collect()
    assert gone() is None
    assert release_engine(fresh)
