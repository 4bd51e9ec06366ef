"""Integration objects pickle without their model (a few KB, not 514 MB) and attach to it again on first
use: in this process the same engine and chunk cache, in another one the engine loaded there once through
the registry (cacheblend_rag.serving.pickling). An engine the caller built cannot travel: using such an
object elsewhere is an error that says what to do."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from langchain_cacheblend import ChatCacheBlend
from langchain_core.load import dumpd, load
from llama_index.core import Document
from llama_index.core.ingestion import IngestionPipeline
from llama_index.llms.cacheblend import CacheBlendLLM
from llama_index.postprocessor.cacheblend import CacheBlendKVPrecompute, CacheBlendNodePostprocessor

from cacheblend_rag.testing import tiny_engine

PROMPT = "Context: Paris is the capital of France.\nQuestion: what is the capital of France? Answer:"
SMALL = 1 << 20


def answer(llm) -> str:
    if isinstance(llm, ChatCacheBlend):
        return llm.invoke(PROMPT).content
    return llm.complete(PROMPT, formatted=True).text


def in_another_process(tmp_path: Path, cases: dict[str, tuple[bytes, str]]) -> dict[str, dict]:
    """Run each case's ``code`` in one fresh Python (~13 s of imports a fresh interpreter, paid once for all
    cases) that has unpickled the case's bytes as ``llm``; the code sets ``result``. Each case's answer by name."""
    script = "import json, pickle, sys\nresults = {}\n"
    for name, (pickled, code) in cases.items():
        (tmp_path / f"{name}.pkl").write_bytes(pickled)
        script += f"llm = pickle.loads(open({str(tmp_path / (name + '.pkl'))!r}, 'rb').read())\nresult = {{}}\n"
        script += textwrap.dedent(code) + f"\nresults[{name!r}] = result\n"
    script += "open(sys.argv[1], 'w').write(json.dumps(results))\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())


@pytest.mark.parametrize("cls", [CacheBlendLLM, ChatCacheBlend])
def test_a_pickle_is_small_and_its_copy_answers_the_same(cls) -> None:
    llm = cls(model="tiny-llama", temperature=0, recompute_ratio=0.3, **{cls._max_tokens_field: 6})
    pickled = pickle.dumps(llm)
    assert len(pickled) < SMALL
    again = pickle.loads(pickled)
    assert not again.engine_attached  # attached on first use, not by unpickling
    assert (again.recompute_ratio, again.model_fields_set) == (llm.recompute_ratio, llm.model_fields_set)
    assert answer(again) == answer(llm)
    assert again.engine is llm.engine and again.chunk_cache is llm.chunk_cache
    assert again.config_source == llm.config_source
    assert len(pickle.dumps(pickle.loads(pickled))) < SMALL  # pickled again before any use


@pytest.mark.parametrize("cls", [CacheBlendLLM, ChatCacheBlend])
def test_a_deep_copy_shares_the_model_and_answers_the_same(cls) -> None:
    """copy.deepcopy and model_copy(deep=True) used to fail on the engine's locks; a copy now shares the model."""
    import copy

    llm = cls(model="tiny-llama", temperature=0, recompute_ratio=0.3, **{cls._max_tokens_field: 6})
    for again in (copy.deepcopy(llm), llm.model_copy(deep=True)):
        assert again is not llm and again.recompute_ratio == llm.recompute_ratio
        assert answer(again) == answer(llm)
        assert again.engine is llm.engine and again.chunk_cache is llm.chunk_cache


@dataclass
class Elsewhere:
    """Three objects pickled here and used in one other process, and what each did there."""

    callers_engine: CacheBlendLLM  # built on an engine of the caller's
    by_name: ChatCacheBlend  # built by model name, with a store path
    results: dict[str, dict]


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> Elsewhere:
    from cacheblend_rag.serving import chunk_cache_for, shared_engine

    tmp_path = tmp_path_factory.mktemp("pickling")
    callers_engine = CacheBlendLLM(engine=tiny_engine("llama", seed=3), temperature=0, max_new_tokens=4)
    by_name = ChatCacheBlend(model="tiny-llama", temperature=0, max_tokens=6, store_path=str(tmp_path / "store"))
    engine = shared_engine("tiny-llama")
    callers_cache = CacheBlendLLM(engine=engine, chunk_cache=chunk_cache_for(engine, str(tmp_path / "elsewhere")))
    results = in_another_process(tmp_path, {
        "callers_engine": (pickle.dumps(callers_engine), """
            from cacheblend_rag.errors import ConfigError
            from cacheblend_rag.testing import tiny_engine
            try:
                llm.complete("Hello")
            except ConfigError as exc:
                result["error"] = str(exc)
            result["attached"] = llm.engine_attached
            llm.attach_engine(tiny_engine("llama", seed=3))
            result["text"] = llm.complete("Hello").text
        """),
        "by_name": (pickle.dumps(by_name), f"""
            from langchain_cacheblend import ChatCacheBlend
            result["text"] = llm.invoke({PROMPT!r}).content
            result["shared"] = ChatCacheBlend(model="tiny-llama", device="cpu").engine is llm.engine
        """),
        "callers_cache": (pickle.dumps(callers_cache), """
            try:
                llm.complete("Hello")
            except Exception as exc:
                result["error"] = str(exc)
        """),
    })
    return Elsewhere(callers_engine, by_name, results)


def test_an_engine_of_the_callers_comes_back_in_this_process_only(elsewhere) -> None:
    llm = elsewhere.callers_engine
    assert pickle.loads(pickle.dumps(llm)).engine is llm.engine
    result = elsewhere.results["callers_engine"]
    assert "unpickled without its model" in result["error"] and ".attach_engine(engine)" in result["error"]
    assert "build the CacheBlendLLM where it is used" in result["error"] and result["attached"] is False
    assert result["text"] == llm.complete("Hello").text


def test_another_process_loads_the_model_once_through_the_registry(elsewhere) -> None:
    assert elsewhere.results["by_name"] == {"text": answer(elsewhere.by_name), "shared": True}


def test_a_chunk_cache_of_the_callers_cannot_travel(elsewhere) -> None:
    result = elsewhere.results["callers_cache"]
    assert "without its chunk cache" in result["error"] and "store_path=" in result["error"]


def test_langchain_serialization_is_unaffected() -> None:
    llm = ChatCacheBlend(model="tiny-llama", recompute_ratio=0.3, max_tokens=5)
    for source in (llm, pickle.loads(pickle.dumps(llm))):
        again = load(dumpd(source), valid_namespaces=["langchain_cacheblend"], allowed_objects=[ChatCacheBlend])
        assert (again.recompute_ratio, again.max_tokens, again.engine) == (0.3, 5, llm.engine)


def test_an_ingestion_pipeline_precomputes_in_two_worker_processes(tmp_path) -> None:
    store = str(tmp_path / "store")
    llm = CacheBlendLLM(model="tiny-llama", store_path=store)
    transform = CacheBlendKVPrecompute(llm=llm)
    assert len(pickle.dumps(transform)) < SMALL and len(pickle.dumps(CacheBlendNodePostprocessor(llm=llm))) < SMALL
    assert pickle.loads(pickle.dumps(transform)).target == transform.target
    documents = [Document(text=f"Fact {i}: the river number {i} flows into sea {i % 3}.") for i in range(8)]
    nodes = IngestionPipeline(transformations=[transform]).run(documents=documents, num_workers=2)
    assert len(nodes) == 8
    # The workers stored every node's KV; here each one is a store hit.
    summary = llm.precompute([n.get_content(metadata_mode="llm") for n in nodes])
    assert (summary.new, summary.present) == (0, 8)


@pytest.mark.slow
def test_the_default_llm_pickles_small_and_answers_the_same(tmp_path) -> None:
    """The issue's 514 MB: pickle.dumps(CacheBlendLLM()) held SmolLM2's weights."""
    llm = CacheBlendLLM(max_new_tokens=8, temperature=0)
    pickled = pickle.dumps(llm)
    assert len(pickled) < SMALL
    assert answer(pickle.loads(pickled)) == answer(llm)
    result = in_another_process(tmp_path, {"default": (pickled, f"""
        result["text"] = llm.complete({PROMPT!r}, formatted=True).text
    """)})["default"]
    assert result["text"] == answer(llm)
