"""Prompt K/V reuse in one room (issue 72, item 2): one call per request learns, for each span of the prompt, where
its K/V comes from, and the request's K/V is kept for the next by the same object."""

from __future__ import annotations

import pytest

from cacheblend_rag import BlendConfig, GenerationConfig
from cacheblend_rag.serving import AnnouncedChunks, BlendService, PrefixCache, PromptReuse
from cacheblend_rag.store import ChunkCache
from cacheblend_rag.testing import tiny_engine

CHUNK = "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris."
GREEDY = GenerationConfig(max_new_tokens=4, temperature=0.0)
BLEND = BlendConfig(recompute_ratio=0.15, min_blend_tokens=0)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama")


def prompt_of(engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer from the context."},
         {"role": "user", "content": f"Context:\n{CHUNK}\n\nQuestion: {question}"}], tokenize=False,
        add_generation_prompt=True)


def test_each_span_says_where_its_kv_comes_from_and_a_request_plans_once(engine, monkeypatch):
    service = BlendService(engine, ChunkCache(engine), AnnouncedChunks(8), PrefixCache(1 << 24))
    assert isinstance(service.reuse, PromptReuse)
    service.announce([CHUNK])
    plans = []
    plan = service.reuse.plan
    monkeypatch.setattr(service.reuse, "plan", lambda *a, **k: plans.append(1) or plan(*a, **k))

    first = service.generate(prompt_of(engine, "Who won two prizes?"), GREEDY, BLEND)
    assert len(plans) == 1
    sources = first.prompt.sources()
    assert [kind for _, _, kind in sources] == ["computed", "chunk", "computed"]
    assert sources[0][0] == 0 and sources[-1][1] == sum(len(s.token_ids) for s in first.prompt.segments)
    assert all(a[1] == b[0] for a, b in zip(sources, sources[1:]))  # spans follow one another

    # The next request opens with what the first left: its opening from the prefix cache.
    second = service.generate(prompt_of(engine, "Where was she?"), GREEDY, BLEND)
    assert len(plans) == 2
    assert second.prompt.sources()[0][2].startswith("prefix cache")
    assert second.prompt.sources()[0][1] == second.prompt.prefix_tokens > 0
