"""What a turn of a conversation should cost: the bound on its fresh tokens, and its per-turn record.

Turn 2 onward of a chat repeats everything of turn 1 (system prompt, earlier messages, the
previous answer); only the new message and the chat template's glue around it are new text.
Retrieved chunks are cached KV whichever turn brings them, and the separators a RAG template
puts between chunks are glue too. Tests, ``benchmarks/chat_newcomer.py`` and
``benchmarks/bench_chat.py`` hold each turn's ``fresh_tokens`` against :func:`fresh_bound`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from cacheblend_rag.reuse.prompt import split_prompt

# Token counts every per-turn record carries, as the stats of a response name them.
TOKEN_STATS = ("exact_tokens", "reused_tokens", "recomputed_tokens", "fresh_tokens")


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def turn_glue_tokens(tokenizer: Any) -> int:
    """Tokens the chat template adds when a conversation goes on by one user message: the end of the
    previous answer's turn, the user turn's opening and closing, the assistant's opening.

    Measured on a rendered conversation rather than read from the template, so any template
    counts right; the contents are single words, which no template or BPE merges with its markers.
    """
    if not getattr(tokenizer, "chat_template", None):
        # The plain transcript the integrations render for base models: "\nuser: M\nassistant:".
        return _count(tokenizer, "\nuser: ") + _count(tokenizer, "\nassistant:")
    system = {"role": "system", "content": "Be brief."}
    first = tokenizer.apply_chat_template([system, {"role": "user", "content": "Hello"}],
                                          tokenize=False, add_generation_prompt=True)
    second = tokenizer.apply_chat_template(
        [system, {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Yes"},
         {"role": "user", "content": "Why"}], tokenize=False, add_generation_prompt=True)
    return _count(tokenizer, second) - _count(tokenizer, first) - _count(tokenizer, "Yes") - _count(tokenizer, "Why")


def chunk_separator_tokens(tokenizer: Any, prompt: str, chunks: Iterable[str]) -> int:
    """Tokens of the text between two consecutive chunks found in ``prompt`` (a RAG template's
    ``"\\n\\n"`` joins): glue that changes with each retrieval, so it is fresh in every turn."""
    pieces = split_prompt(prompt, chunks).pieces
    chunk_at = [i for i, piece in enumerate(pieces) if piece.is_chunk]
    between = range(chunk_at[0] + 1, chunk_at[-1]) if chunk_at else range(0)
    return sum(_count(tokenizer, pieces[i].text) for i in between if not pieces[i].is_chunk)


def fresh_bound(tokenizer: Any, new_message: str, *, prompt: str = "", chunks: Iterable[str] = (),
                partial_block: int = 0) -> int:
    """The most fresh tokens a turn after the first should have: the new message, the template's
    glue around it and, in a RAG prompt, the separators between its chunks. ``partial_block``
    allows that many more, for a prefix cache that keeps whole blocks only
    (``PrefixCache(partial_blocks=False)``, vLLM's granularity): up to ``block_size - 1`` tokens of
    the previous turn's end are then computed again. The default cache keeps the partial block too,
    so 0, the issue's bound as written, applies."""
    return (_count(tokenizer, new_message) + turn_glue_tokens(tokenizer)
            + chunk_separator_tokens(tokenizer, prompt, chunks) + partial_block)


def answer_allowance(tokenizer: Any, generated_ids: Sequence[int], history_text: str,
                     finish_reason: str | None = None) -> int:
    """Tokens of the previous answer that no cache can hold: all of them when the history holds the
    answer as other tokens than the model generated (LlamaIndex strips a streamed answer before it
    keeps it; a random test model's broken UTF-8 does not tokenize back), else its last token when
    the answer ran out of tokens (``finish_reason`` "length": that token was sampled, never fed to
    the model, so it has no K/V). 0 otherwise."""
    history_ids = tokenizer(history_text, add_special_tokens=False)["input_ids"] if history_text else []
    if list(history_ids) != list(generated_ids):
        return len(history_ids)
    return 1 if finish_reason == "length" and history_ids else 0


def partial_block_allowance(service: Any) -> int:
    """What :func:`fresh_bound`'s ``partial_block`` allows for ``service``'s prefix cache (a
    :class:`~cacheblend_rag.serving.BlendService`): ``block_size - 1`` for one that keeps whole
    blocks only, 0 for one that keeps partial blocks (the default) or none."""
    cache = getattr(service, "prefix_cache", None)
    if cache is None or not cache.enabled or getattr(cache, "partial_blocks", False):
        return 0
    return cache.block_size - 1


def turn_record(stats: Mapping[str, Any], tokenizer: Any, new_message: str, *, turn: int,
                prompt: str = "", chunks: Iterable[str] = (), partial_block: int = 0,
                previous_answer: int = 0) -> dict[str, Any]:
    """One row of a per-turn table: the response's token counts, the new message's, the bound as the
    issue writes it and with the allowances (``partial_block``, ``previous_answer``:
    :func:`answer_allowance` of the turn before) more, and whether the turn meets each (turn 1 has
    no earlier turn to reuse, so no bound)."""
    chunks = list(chunks)
    row: dict[str, Any] = {"turn": turn, "prompt_tokens": stats.get("prompt_tokens", stats.get("total_tokens"))}
    row.update({name: int(stats.get(name) or 0) for name in TOKEN_STATS})
    row["new_message_tokens"] = _count(tokenizer, new_message)
    row["mode"] = stats.get("mode")
    if turn > 1:
        row["fresh_bound"] = fresh_bound(tokenizer, new_message, prompt=prompt, chunks=chunks)
        row["meets_bound"] = row["fresh_tokens"] <= row["fresh_bound"]
        row["partial_block_allowance"] = partial_block
        row["previous_answer_allowance"] = previous_answer
        row["meets_bound_with_allowances"] = row["fresh_tokens"] <= row["fresh_bound"] + partial_block + previous_answer
    return row


__all__ = ["TOKEN_STATS", "answer_allowance", "chunk_separator_tokens", "fresh_bound", "partial_block_allowance",
           "turn_glue_tokens", "turn_record"]
