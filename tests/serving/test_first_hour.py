"""What a new user meets in the first hour (issue 25): a mistyped store URL, a tokenizer from an
unreachable hub, ``device_map="auto"``. Each setting either means what it says or is an error saying
what to write instead."""

from __future__ import annotations

import logging
import time

import pytest
from langchain_cacheblend import ChatCacheBlend
from llama_index.llms.cacheblend import CacheBlendLLM
from pydantic import ValidationError

from cacheblend_rag.errors import ModelLoadError
from cacheblend_rag.models.loader import load_model, resolve_device
from cacheblend_rag.testing import save_tiny_model

CLASSES = [CacheBlendLLM, ChatCacheBlend]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.mark.parametrize("cls", CLASSES)
def test_a_mistyped_redis_url_is_refused_not_made_a_folder(cls, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValidationError, match=r"malformed redis URL: write redis://localhost:6379"):
        cls(model="tiny-llama", store_path="redis:/localhost:6379")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def unreachable_hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    return constants


def test_a_tokenizer_from_an_unreachable_hub_fails_fast_under_its_own_name(model_folder, unreachable_hub):
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"could not load tokenizer 'no-such-org/no-such-tokenizer'.*"
                                             r"cannot be reached.*leave tokenizer_name unset") as caught:
        load_model(model_folder, tokenizer="no-such-org/no-such-tokenizer")
    assert time.monotonic() - started < 10
    assert str(model_folder) not in str(caught.value)
    unreachable_hub.HF_HUB_OFFLINE = True
    with pytest.raises(ModelLoadError, match=r"tokenizer 'no-such-org/no-such-tokenizer'.*HF_HUB_OFFLINE is set"):
        load_model(model_folder, tokenizer="no-such-org/no-such-tokenizer")


@pytest.mark.parametrize("cls", CLASSES)
def test_tokenizer_name_is_named_in_the_integrations_error(cls, model_folder, unreachable_hub):
    with pytest.raises(ModelLoadError, match=r"could not load tokenizer 'no-such-org/tok'.*cannot be reached"):
        cls(model=str(model_folder), tokenizer_name="no-such-org/tok")


def test_a_local_tokenizer_folder_that_is_not_one_is_named(model_folder, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"could not load tokenizer .*empty.*\(tokenizer_name\)"):
        load_model(model_folder, tokenizer=tmp_path / "empty")


@pytest.mark.parametrize("cls", CLASSES)
def test_device_map_auto_says_which_device_it_maps_to(cls, model_folder, caplog):
    with caplog.at_level(logging.INFO, logger="cacheblend_rag.serving.settings"):
        llm = cls(model=str(model_folder), device_map="auto")
    here = str(resolve_device(None))
    assert llm.device == here
    assert any(f"device_map='auto' maps to device={here!r}" in r.getMessage() or
               f"device_map='auto' runs the whole model on {here}" in r.getMessage() for r in caplog.records)
