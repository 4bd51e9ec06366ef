"""A store URL's password is no part of what LlamaIndex shows or keeps: repr, ``metadata``, ``to_dict``,
``to_json``, callback and instrumentation payloads, an ingestion step's cache key; ``from_dict`` of a
``to_dict`` takes it from ``$CACHEBLEND_STORE_PASSWORD``."""

from __future__ import annotations

import logging

import pytest
from llama_index.core.callbacks import CallbackManager, LlamaDebugHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.llms import ChatMessage

from cacheblend_rag.store.testing import record_store_opens
from cacheblend_rag.testing import tiny_engine
from llama_index.llms.cacheblend import CacheBlendLLM

SECRET = "hunter2-s3cr3t"
STORE = f"secretdb://user:{SECRET}@kv.internal:6379/0"
MASKED = "secretdb://user:***@kv.internal:6379/0"


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The specs a ``secretdb://`` store was opened with (a memory store: no server needed)."""
    return record_store_opens(monkeypatch)


class Events(BaseEventHandler):
    """Every instrumentation event, as text."""

    text: str = ""

    @classmethod
    def class_name(cls) -> str:
        return "Events"

    def handle(self, event, **kwargs) -> None:
        self.text += event.model_dump_json()


def test_nothing_llama_index_shows_holds_the_password(opened, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    debug, events = LlamaDebugHandler(), Events()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(events)
    try:
        llm = CacheBlendLLM(engine=tiny_engine("llama"), store_path=STORE, max_new_tokens=3,
                            callback_manager=CallbackManager([debug]))
        llm.complete("Hello")
        llm.chat([ChatMessage(role="user", content="Hi")])
    finally:
        dispatcher.event_handlers.remove(events)
    assert opened == [STORE] and llm.store_path == MASKED and llm.to_dict()["store_path"] == MASKED
    assert "CacheBlendLLM" in events.text  # the payloads were seen (LlamaIndex sends metadata: no store at all)
    shown = [repr(llm), str(llm), str(llm.to_dict()), llm.to_json(), llm.model_dump_json(), str(llm.metadata),
             repr(debug.get_events()), events.text, caplog.text]
    for text in shown:
        assert SECRET not in text


def test_from_dict_takes_the_password_from_the_environment(opened, monkeypatch) -> None:
    engine = tiny_engine("llama")
    data = CacheBlendLLM(engine=engine, store_path=STORE).to_dict()
    with pytest.raises(ValueError, match=r"in place of its password.*\$CACHEBLEND_STORE_PASSWORD"):
        CacheBlendLLM.from_dict(data, engine=engine)
    monkeypatch.setenv("CACHEBLEND_STORE_PASSWORD", SECRET)
    opened.clear()
    loaded = CacheBlendLLM.from_dict(data, engine=engine)
    assert opened == [STORE] and loaded.store_path == MASKED


def test_an_ingestion_steps_cache_key_names_the_store_without_it(opened) -> None:
    precompute = pytest.importorskip("llama_index.postprocessor.cacheblend").CacheBlendKVPrecompute
    step = precompute(llm=CacheBlendLLM(engine=tiny_engine("llama"), store_path=STORE))
    assert MASKED in step.target and SECRET not in step.to_json()
