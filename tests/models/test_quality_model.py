"""The quality model (Qwen2.5-Coder-1.5B-Instruct) loaded by name: the engine runs it, and blending at
ratio 1 is its full prefill. Skips, saying how to fetch it, where it is not fetched (`make test` never needs it)."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.calibration.lookup import CALIBRATION_DIR_ENV
from cacheblend_rag.kv.segments import CachedSegment, FreshSegment
from cacheblend_rag.models import catalog
from cacheblend_rag.models.loader import cache_root

NAME = "qwen2.5-coder-1.5b"
PASSAGES = [
    "The Corvane Observatory stands on a basalt ridge above the town of Mirrowby.\n\n",
    "Its great refractor was ground by Orla Fenwick in 1887 from glass cast at Saltcombe.\n\n",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    if not catalog.fetched_path(catalog.CATALOG[NAME], cache_root()).is_file():
        pytest.skip(f"the quality model {NAME} is not fetched here; run `make quality-model` to test it")
    from cacheblend_rag import CacheBlendEngine

    return CacheBlendEngine.from_pretrained(NAME, device="cpu", min_blend_tokens=0)


def test_loads_by_name_and_ratio_one_equals_full_prefill(engine):
    assert engine.model_name == NAME and engine.model.config.model_type == "qwen2"
    lead = engine.tokenize("Read the passages, then answer.\n")
    question = engine.tokenize("Who ground the refractor of the Corvane Observatory?")
    chunk_ids = [engine.tokenize(p) for p in PASSAGES]
    chunks = engine.prefill_chunks(chunk_ids)
    segments = [FreshSegment(lead), *(CachedSegment(c) for c in chunks), FreshSegment(question)]
    # gate=False: the gate blends a probe at ratio 1.0 against full prefill, which is what this test checks in full.
    blended = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0, gate=False))
    full = engine.full_prefill(lead + [t for c in chunk_ids for t in c] + question)
    assert blended.input_ids == full.input_ids
    assert blended.stats.recomputed_tokens == blended.stats.cached_tokens
    torch.testing.assert_close(blended.logits, full.logits, atol=2e-3, rtol=1e-3)
    assert int(blended.logits.argmax()) == int(full.logits.argmax())
    for layer in (0, engine.num_layers - 1):
        torch.testing.assert_close(blended.cache.layers[layer].keys, full.cache.layers[layer].keys, atol=2e-3, rtol=1e-3)


def test_the_setting_shipped_for_it_is_its_default(engine, tmp_path, monkeypatch):
    monkeypatch.setenv(CALIBRATION_DIR_ENV, str(tmp_path))  # where no calibration of the user's is
    assert engine.config_source.startswith("calibrated (shipped): ")
    config = engine.default_config()
    assert (config.selection, config.recompute_ratio, config.shift_probe_stride, config.shift_window) == \
        ("query_profiled", 0.2, 10, 100)
    assert not engine.calibration().condition_chunks  # chunks computed alone: better than conditioned on it
