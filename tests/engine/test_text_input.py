"""Text that is not valid Unicode (a lone surrogate, as a bad decode or a JSON escape leaves) is a
BlendInputError naming where it is, in tokenize, warm and the integrations' generate path, not
the tokenizer's raw TypeError."""

from __future__ import annotations

import pytest

from cacheblend_rag import BlendInputError
from cacheblend_rag.reuse.prompt import split_prompt, to_segments_in_context
from cacheblend_rag.store import ChunkCache


@pytest.fixture(scope="module")
def engine():
    from cacheblend_rag.testing import tiny_engine

    return tiny_engine()


def test_tokenize_names_the_position_of_a_lone_surrogate(engine):
    with pytest.raises(BlendInputError, match=r"U\+D800 at character 6"):
        engine.tokenize("Paris \ud800 is")


def test_warm_names_the_chunk_and_position(engine):
    cache = ChunkCache(engine)
    with pytest.raises(BlendInputError, match=r"chunk 1 holds a lone surrogate U\+DFFF at character 2"):
        cache.warm(["fine text", "ok\udfff"])


def test_a_prompt_with_a_surrogate_is_refused_with_its_position(engine):
    split = split_prompt("Context: Paris.\nQuestion: \ud800?", ["Paris."])
    with pytest.raises(BlendInputError, match="the prompt holds a lone surrogate U\\+D800 at character 26"):
        to_segments_in_context(split, engine.tokenizer)
