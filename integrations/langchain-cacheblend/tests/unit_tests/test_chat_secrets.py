"""A store URL's password is no part of what LangChain shows or keeps: repr, dumps, identifying and
invocation params, traced runs, cache keys; ``loads`` brings it back from its secrets map or
``$CACHEBLEND_STORE_PASSWORD``, and the object still reaches its store with it."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from langchain_core.caches import InMemoryCache
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.load import dumpd, dumps, loads
from langchain_core.tracers.run_collector import RunCollectorCallbackHandler

from cacheblend_rag.store.testing import record_store_opens
from cacheblend_rag.testing import tiny_engine
from langchain_cacheblend import ChatCacheBlend

SECRET = "hunter2-s3cr3t"
STORE = f"secretdb://:{SECRET}@kv.internal:6379/0"
PLACEHOLDER = {"lc": 1, "type": "secret", "id": ["CACHEBLEND_STORE_PASSWORD"]}


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The specs a ``secretdb://`` store was opened with (a memory store: no server needed)."""
    return record_store_opens(monkeypatch)


class Seen(BaseCallbackHandler):
    """Everything a callback handler is handed, as text."""

    def __init__(self) -> None:
        self.text = ""

    def on_chat_model_start(self, serialized: dict, messages: list, **kwargs: Any) -> None:
        self.text += repr(serialized) + repr(kwargs)

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.text += repr(response) + repr(kwargs)


def test_nothing_langchain_shows_holds_the_password(opened, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    llm = ChatCacheBlend(engine=tiny_engine("llama"), store_path=STORE, max_tokens=3, cache=InMemoryCache())
    assert opened == [STORE] and llm.store_path == "secretdb://:***@kv.internal:6379/0"
    seen, runs = Seen(), RunCollectorCallbackHandler()
    llm.invoke("Hello", config={"callbacks": [seen, runs]})
    assert "secretdb://:***@kv.internal" in seen.text  # the store is named, its password is not
    shown = [repr(llm), str(llm), dumps(llm), str(dumpd(llm)), str(llm._identifying_params), str(llm.model_dump()),
             llm.model_dump_json(), str(llm._get_ls_params()), str(llm._get_invocation_params()), seen.text,
             *(run.model_dump_json() for run in runs.traced_runs), str(list(llm.cache._cache)), caplog.text]
    for text in shown:
        assert SECRET not in text
    assert dumpd(llm)["kwargs"]["store_password"] == PLACEHOLDER


def test_loads_brings_the_password_back(opened, monkeypatch) -> None:
    engine = tiny_engine("llama")
    text = dumps(ChatCacheBlend(engine=engine, store_path=STORE, max_tokens=3))
    opened.clear()
    # engine= is not serialized (a model is hundreds of MB): the loaded object finds it through the registry.
    kwargs = {"valid_namespaces": ["langchain_cacheblend"], "allowed_objects": [ChatCacheBlend]}
    loaded = loads(text, secrets_map={"CACHEBLEND_STORE_PASSWORD": SECRET}, **kwargs)
    assert opened == [STORE] and loaded.store_password.get_secret_value() == SECRET
    assert loaded.invoke("Hello").content is not None
    with pytest.raises(ValueError, match=r"in place of its password.*\$CACHEBLEND_STORE_PASSWORD") as refused:
        loads(text, **kwargs)  # neither the map nor the variable has it: said, not a failed login later
    assert SECRET not in str(refused.value)
    monkeypatch.setenv("CACHEBLEND_STORE_PASSWORD", SECRET)
    opened.clear()
    assert loads(text, **kwargs).store_path == "secretdb://:***@kv.internal:6379/0" and opened == [STORE]
