"""Turning a flat prompt string into blend segments. Shared by the LlamaIndex and LangChain integrations.

Frameworks hand the LLM one rendered string. The retriever hook has told us which
chunk texts that string will contain; we find them verbatim, and everything else
(template text, glue between chunks, the question, chunks that were changed on the
way) becomes fresh text. Each piece is tokenized on its own and the ids are
concatenated, so a chunk's tokens are exactly those its cached KV was computed for.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from cacheblend_rag.engine.segments import FreshSegment, Segment, StoredSegment
from cacheblend_rag.engine.text import checked_text


def chunk_text(text: str) -> str:
    """The form a chunk's text is announced, looked up and stored in: stripped of surrounding
    whitespace. Some framework components strip chunk text before joining it into a prompt
    (LlamaIndex's compact mode and chat engines) and others do not; a stripped text is found
    verbatim in both, and the whitespace around it becomes fresh glue. The CLI's ``warm``
    stores chunks in this form too, so a warm job and the integrations agree on every key."""
    return text.strip()


def chunk_texts(texts: Iterable[str]) -> list[str]:
    """:func:`chunk_text` of each text, dropping the ones left empty, in order."""
    return [kept for kept in (chunk_text(t) for t in texts if t) if kept]


# Chunks are precomputed behind a conditioning prefix: the prompt's constant lead (system turn and
# template text before the first chunk) followed by this invented passage. In a real prompt most
# chunks follow another passage; computed behind the lead alone, every chunk is computed as if it
# came first, and the attention it would pay earlier passages lands on the lead instead. The
# stand-in gives it somewhere to go. On MuSiQue this roughly halved full reuse's error and lifted
# CacheBlend's recovery by a further 5-10 points (research/quality_notebook.md). The text is ours, written for
# this purpose: plain encyclopedic prose, like the passages a RAG prompt carries.
STAND_IN_PASSAGE = (
    "Harrow Vale\n\nHarrow Vale is a small market town in the north of the county, on the east bank of the "
    "River Lune. It was first recorded in 1086 and received its charter in 1254. The town grew around its wool "
    "trade, and its stone bridge, built in 1672, is a listed structure. At the 2011 census it had a population "
    "of 4,310. The local football club, Harrow Vale Athletic, was founded in 1889.\n\n"
)


def conditioning_prefix(lead_ids: Sequence[int], tokenize: Callable[[str], list[int]]) -> list[int]:
    """The prefix chunks are precomputed behind: ``lead_ids`` and the stand-in passage."""
    return [*lead_ids, *tokenize(STAND_IN_PASSAGE)]


def template_lead(tokenizer: Any) -> str:
    """The chat template's text before the first user message's content (its default system turn
    and the user turn's opening), or ``""`` for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    marker = "\u2063cacheblend-user-content\u2063"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
    return rendered.split(marker, 1)[0] if marker in rendered else ""


_DEFAULT_PREFIXES: "weakref.WeakKeyDictionary[Any, tuple[int, ...]]" = weakref.WeakKeyDictionary()


def default_conditioning_prefix(tokenizer: Any) -> list[int]:
    """What the integrations precompute chunks behind by default: the template lead and the stand-in.
    Remembered per tokenizer: integrations ask on every request."""
    try:
        return list(_DEFAULT_PREFIXES[tokenizer])
    except (KeyError, TypeError):
        pass

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    prefix = conditioning_prefix(tokenize(template_lead(tokenizer)), tokenize)
    try:
        _DEFAULT_PREFIXES[tokenizer] = tuple(prefix)
    except TypeError:
        pass  # not weakly referenceable: computed again next time
    return prefix


@dataclass(frozen=True)
class PromptPiece:
    text: str
    is_chunk: bool


@dataclass
class SplitPrompt:
    pieces: list[PromptPiece]
    found: list[str]  # known chunk texts found verbatim, in prompt order
    missing: list[str]  # known chunk texts that the prompt does not contain verbatim

    @property
    def has_chunks(self) -> bool:
        return any(p.is_chunk for p in self.pieces)


def split_prompt(prompt: str, chunk_texts: Iterable[str]) -> SplitPrompt:
    """Locate each known chunk text in ``prompt``; longer chunks win where texts overlap."""
    known = sorted({c for c in chunk_texts if c and c.strip()}, key=len, reverse=True)
    taken: list[tuple[int, int]] = []
    found_spans: list[tuple[int, int, str]] = []
    missing: list[str] = []
    for chunk in known:
        start, hit = 0, False
        while True:
            i = prompt.find(chunk, start)
            if i < 0:
                break
            j = i + len(chunk)
            if all(j <= a or i >= b for a, b in taken):
                taken.append((i, j))
                found_spans.append((i, j, chunk))
                hit = True
            start = i + 1
        if not hit:
            missing.append(chunk)
    found_spans.sort()
    pieces: list[PromptPiece] = []
    cursor = 0
    for i, j, chunk in found_spans:
        if i > cursor:
            pieces.append(PromptPiece(prompt[cursor:i], False))
        pieces.append(PromptPiece(chunk, True))
        cursor = j
    if cursor < len(prompt):
        pieces.append(PromptPiece(prompt[cursor:], False))
    # A blend must end with fresh tokens: a chunk at the very end is computed fresh.
    if pieces and pieces[-1].is_chunk:
        pieces[-1] = PromptPiece(pieces[-1].text, False)
        found_spans.pop()
    return SplitPrompt(pieces=pieces, found=[c for _, _, c in found_spans], missing=missing)


def to_segments(
    split: SplitPrompt, tokenize: Callable[[str], list[int]], prefix_ids: Sequence[int] = ()
) -> list[Segment]:
    """Chunks become :class:`StoredSegment` (looked up in the store), the rest :class:`FreshSegment`."""
    segments: list[Segment] = []
    for piece in split.pieces:
        ids = tokenize(piece.text)
        if not ids:
            continue
        segments.append(StoredSegment(ids, prefix_ids) if piece.is_chunk else FreshSegment(ids))
    return segments


def to_segments_in_context(split: SplitPrompt, tokenizer: Any, prefix_ids: Sequence[int] = ()) -> list[Segment]:
    """Like :func:`to_segments`, but with the token ids the whole prompt tokenizes to, when possible.

    Tokenized piece by piece, the glue around chunks can come out differently from the same
    text inside the whole prompt (``"\\n\\n"`` alone is one token in many BPE vocabularies,
    while before a word it splits in two). When the whole prompt's tokens fall apart at
    every chunk edge and each chunk's tokens equal its own tokenization (which its cached
    KV was computed for), those whole-prompt ids are used, so a blend sees exactly the ids
    that full prefill of the prompt sees. Otherwise this is :func:`to_segments`.
    """

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def fallback() -> list[Segment]:
        return to_segments(split, tokenize, prefix_ids)

    # A lone surrogate: an error naming where it is in the prompt, not the tokenizer's TypeError.
    prompt = checked_text("".join(p.text for p in split.pieces), "the prompt")
    if not split.has_chunks or not getattr(tokenizer, "is_fast", False):
        return fallback()
    encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), list(encoded["offset_mapping"])
    starts = [start for start, _ in offsets]
    if starts != sorted(starts):
        return fallback()
    piece_tokens: list[list[int]] = []
    cursor, token = 0, 0
    for piece in split.pieces:
        end = cursor + len(piece.text)
        taken = []
        while token < len(ids) and offsets[token][0] < end:
            if offsets[token][1] > end and piece.is_chunk:
                return fallback()  # a token reaches past the chunk's end
            taken.append(ids[token])
            token += 1
        piece_tokens.append(taken)
        cursor = end
    if token != len(ids):
        return fallback()
    # Each chunk's own tokens, in one batch call (a chat's prompt holds every turn's chunks).
    chunk_texts = [piece.text for piece in split.pieces if piece.is_chunk]
    own = iter(tokenizer(chunk_texts, add_special_tokens=False)["input_ids"])
    segments: list[Segment] = []
    for piece, piece_ids in zip(split.pieces, piece_tokens):
        if piece.is_chunk and piece_ids != list(next(own)):
            return fallback()
        if piece_ids:
            segments.append(StoredSegment(piece_ids, prefix_ids) if piece.is_chunk else FreshSegment(piece_ids))
    return segments
