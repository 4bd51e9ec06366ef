"""cacheblend_rag.reuse.prompt.to_segments_in_context, which ChatCacheBlend uses to turn prompts into segments."""

from __future__ import annotations

from cacheblend_rag.kv.segments import FreshSegment, StoredSegment
from cacheblend_rag.reuse.prompt import split_prompt, to_segments, to_segments_in_context
from cacheblend_rag.testing import tiny_tokenizer

CHUNKS = ["Paris is the capital of France.", "The Amazon river flows through Brazil."]


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_aligned_prompt_keeps_the_whole_prompt_ids() -> None:
    tokenizer = tiny_tokenizer()
    prompt = "<|im_start|>system\nContext:\n" + "\n\n".join(CHUNKS) + "<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n"
    segments = to_segments_in_context(split_prompt(prompt, CHUNKS), tokenizer, prefix_ids=(1,))
    assert [t for s in segments for t in s.token_ids] == _ids(tokenizer, prompt)
    stored = [s for s in segments if isinstance(s, StoredSegment)]
    assert [list(s.token_ids) for s in stored] == [_ids(tokenizer, c) for c in CHUNKS]
    assert all(s.prefix_ids == (1,) for s in stored) and isinstance(segments[-1], FreshSegment)


def test_chunk_tokenized_differently_in_context_falls_back_to_pieces() -> None:
    tokenizer = tiny_tokenizer()
    prompt = "Context: " + CHUNKS[0] + " Question?"  # the space before the chunk joins its first word
    split = split_prompt(prompt, CHUNKS)
    assert _ids(tokenizer, prompt) != [t for s in to_segments(split, lambda t: _ids(tokenizer, t)) for t in s.token_ids]
    assert to_segments_in_context(split, tokenizer) == to_segments(split, lambda t: _ids(tokenizer, t))


def test_prompt_without_chunks_is_one_fresh_segment() -> None:
    tokenizer = tiny_tokenizer()
    segments = to_segments_in_context(split_prompt("Hello there", CHUNKS), tokenizer)
    assert segments == [FreshSegment(_ids(tokenizer, "Hello there"))]
