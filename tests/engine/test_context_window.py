"""A prompt close to the model's window: decoding stops with finish reason "length" when the window
is full, rather than feeding the model positions it does not have (issue 24, item 5). Decided: stop,
not refuse up front, as OpenAI-style servers do; the prompt itself beyond the window is refused."""

from __future__ import annotations

import pytest

from cacheblend_rag import BlendInputError
from cacheblend_rag.testing import tiny_engine

WINDOW = 64


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", seed=41, max_position_embeddings=WINDOW)


def _prompt(engine, tokens: int) -> list[int]:
    ids = engine.tokenize("Paris is the capital of France. The quick brown fox jumps over the lazy dog. " * 10)
    return ids[:tokens]


@pytest.mark.parametrize("prompt_tokens", [WINDOW - 4, WINDOW - 1, WINDOW])
def test_decoding_stops_when_the_window_is_full(engine, prompt_tokens):
    out = engine.generate([_prompt(engine, prompt_tokens)], max_new_tokens=50)
    assert out.finish_reason in ("length", "eos")
    # The last token is sampled from the forward at position WINDOW - 1; none is fed beyond it.
    assert prompt_tokens + len(out.token_ids) <= WINDOW + 1
    if out.finish_reason == "length":
        assert prompt_tokens + len(out.token_ids) == WINDOW + 1


def test_the_same_stop_through_the_scheduler(engine):
    from cacheblend_rag.config import GenerationConfig
    from cacheblend_rag.engine.generate import start_decoding
    from cacheblend_rag.serving import RequestScheduler

    segments = [_prompt(engine, WINDOW - 6)]
    alone = engine.generate(segments, max_new_tokens=50)
    scheduler = RequestScheduler(engine)
    try:
        handle = scheduler.submit(
            lambda: start_decoding(engine, segments, GenerationConfig(max_new_tokens=50), None, None), lambda r: r)
        got = handle.result()
    finally:
        scheduler.close()
    assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason


def test_a_prompt_beyond_the_window_is_refused(engine):
    with pytest.raises(BlendInputError, match="context window"):
        engine.generate([_prompt(engine, WINDOW + 1)], max_new_tokens=4)
