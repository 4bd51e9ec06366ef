"""Turning a flat prompt string into blend segments. Shared by the LlamaIndex and LangChain integrations.

Frameworks hand the LLM one rendered string. The retriever hook has told us which
chunk texts that string will contain; we find them verbatim, and everything else
(template text, glue between chunks, the question, chunks that were changed on the
way) becomes fresh text. Each piece is tokenized on its own and the ids are
concatenated, so a chunk's tokens are exactly those its cached KV was computed for.

Chunk text is a retrieved document: special-token strings in it (``<|im_end|>``, ``<|endoftext|>``) are
tokenized as the plain text they spell unless ``special_tokens="control"`` says the documents are trusted
(:func:`~cacheblend_rag.reuse.text.document_ids`); the template and question around them are tokenized as
the tokenizer does, control tokens and all. Full prefill of a prompt takes the same ids
(:func:`prompt_ids`), so ratio 1.0 stays exactly full prefill.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from cacheblend_rag.kv.segments import FreshSegment, Segment, StoredSegment
from cacheblend_rag.reuse.text import checked_text, document_ids


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
    # A chunk's text computed fresh (one that ends the prompt): still a document, still tokenized as one.
    document: bool = False

    @property
    def is_document(self) -> bool:
        return self.is_chunk or self.document


@dataclass
class SplitPrompt:
    pieces: list[PromptPiece]
    found: list[str]  # known chunk texts found verbatim, in prompt order
    missing: list[str]  # known chunk texts that the prompt does not contain verbatim

    @property
    def has_chunks(self) -> bool:
        return any(p.is_chunk for p in self.pieces)


def split_prompt(prompt: str, chunk_texts: Iterable[str], document_texts: Iterable[str] = ()) -> SplitPrompt:
    """Locate each known chunk text in ``prompt``; longer chunks win where texts overlap.
    ``document_texts`` (a document's title, say) are found where no chunk is and stay fresh text, tokenized
    as documents are (:attr:`PromptPiece.document`)."""
    taken: list[tuple[int, int]] = []
    found_spans: list[tuple[int, int, str, bool]] = []
    missing: list[str] = []
    for texts, is_chunk in ((chunk_texts, True), (document_texts, False)):
        for text in sorted({c for c in texts if c and c.strip()}, key=len, reverse=True):
            start, hit = 0, False
            while True:
                i = prompt.find(text, start)
                if i < 0:
                    break
                j = i + len(text)
                if all(j <= a or i >= b for a, b in taken):
                    taken.append((i, j))
                    found_spans.append((i, j, text, is_chunk))
                    hit = True
                start = i + 1
            if not hit and is_chunk:
                missing.append(text)
    found_spans.sort()
    pieces: list[PromptPiece] = []
    cursor = 0
    for i, j, text, is_chunk in found_spans:
        if i > cursor:
            pieces.append(PromptPiece(prompt[cursor:i], False))
        pieces.append(PromptPiece(text, is_chunk, document=not is_chunk))
        cursor = j
    if cursor < len(prompt):
        pieces.append(PromptPiece(prompt[cursor:], False))
    # A blend must end with fresh tokens: a chunk at the very end is computed fresh.
    if pieces and pieces[-1].is_chunk:
        pieces[-1] = PromptPiece(pieces[-1].text, False, document=True)
        found_spans.pop()
    return SplitPrompt(pieces=pieces, found=[c for _, _, c, is_chunk in found_spans if is_chunk], missing=missing)


def to_segments(
    split: SplitPrompt, tokenize: Callable[[str], list[int]], prefix_ids: Sequence[int] = (),
    tokenize_document: Callable[[str], list[int]] | None = None,
) -> list[Segment]:
    """Chunks become :class:`StoredSegment` (looked up in the store), the rest :class:`FreshSegment`.
    ``tokenize_document`` tokenizes the chunks' text (:attr:`PromptPiece.is_document`); ``None``: ``tokenize``."""
    segments: list[Segment] = []
    for piece in split.pieces:
        ids = (tokenize_document or tokenize)(piece.text) if piece.is_document else tokenize(piece.text)
        if not ids:
            continue
        segments.append(StoredSegment(ids, prefix_ids) if piece.is_chunk else FreshSegment(ids))
    return segments


def to_segments_in_context(split: SplitPrompt, tokenizer: Any, prefix_ids: Sequence[int] = (), *,
                           special_tokens: str = "text") -> list[Segment]:
    """Like :func:`to_segments`, but with the token ids the whole prompt tokenizes to, when possible.

    Tokenized piece by piece, the glue around chunks can come out differently from the same
    text inside the whole prompt (``"\\n\\n"`` alone is one token in many BPE vocabularies,
    while before a word it splits in two). When the whole prompt's tokens fall apart at
    every chunk edge and each chunk's tokens equal its own tokenization (which its cached
    KV was computed for), those whole-prompt ids are used, so a blend sees exactly the ids
    that full prefill of the prompt sees. Otherwise this is :func:`to_segments`.

    ``special_tokens``: how special-token strings in the chunks are tokenized (see the module). With
    ``"text"``, a chunk that holds one keeps the whole prompt's ids around it where its edges fall on
    token boundaries (its ids alone, the tokenizer's way, equal the prompt's there), its own text ids inside.
    """

    def tokenize(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def tokenize_document(text: str) -> list[int]:
        return list(document_ids(tokenizer, text, special_tokens))

    def fallback() -> list[Segment]:
        return to_segments(split, tokenize, prefix_ids, tokenize_document)

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
            if offsets[token][1] > end and piece.is_document:
                return fallback()  # a token reaches past the chunk's end
            taken.append(ids[token])
            token += 1
        piece_tokens.append(taken)
        cursor = end
    if token != len(ids):
        return fallback()
    # Each chunk's own tokens, in one batch call (a chat's prompt holds every turn's chunks).
    chunk_texts = [piece.text for piece in split.pieces if piece.is_document]
    own = iter(document_ids(tokenizer, chunk_texts, special_tokens) if chunk_texts else [])
    segments: list[Segment] = []
    for piece, piece_ids in zip(split.pieces, piece_tokens):
        text_ids = list(next(own)) if piece.is_document else piece_ids
        if piece_ids != text_ids:
            # Where the text spells a special token the prompt's ids hold as one, its edges are token boundaries
            # if its ids alone, the tokenizer's way, equal the prompt's: its text ids then stand in for them.
            alone = tokenize(piece.text) if special_tokens == "text" else text_ids
            if piece_ids == alone:
                piece_ids = text_ids
            elif piece.is_chunk or alone != text_ids:
                return fallback()
            # else fresh document text spelling no special token: the prompt's ids, as any fresh text's
        if piece_ids:
            segments.append(StoredSegment(piece_ids, prefix_ids) if piece.is_chunk else FreshSegment(piece_ids))
    return segments


def _is_unicode(text: str) -> bool:
    try:
        checked_text(text)
    except ValueError:  # checked_text's BlendInputError (cacheblend_rag.errors is above this layer)
        return False
    return True


def spelling_special_tokens(texts: Iterable[str], tokenizer: Any) -> list[str]:
    """Those of ``texts`` whose ids as document text differ from the tokenizer's own: the ones that spell a
    special token (``<|im_end|>``), which :func:`split_prompt` must find to tokenize them as documents."""
    # A text holding a lone surrogate cannot be in a prompt that tokenizes (checked_text refuses the prompt),
    # so there is nothing to find; the tokenizer would raise a bare TypeError on it (a title the template
    # left out of the prompt was a server's 500).
    texts = [t for t in texts if t and t.strip() and _is_unicode(t)]
    if not texts:
        return []
    as_text, as_control = document_ids(tokenizer, texts, "text"), document_ids(tokenizer, texts, "control")
    return [t for t, a, b in zip(texts, as_text, as_control) if list(a) != list(b)]


def prompt_ids(prompt: str, chunk_texts: Iterable[str], tokenizer: Any, special_tokens: str = "text",
               document_texts: Iterable[str] = ()) -> list[int]:
    """The token ids of ``prompt`` that a blend and full prefill of it both take: :func:`to_segments_in_context`
    of the prompt split at ``chunk_texts`` (and ``document_texts``), joined (each document's text tokenized as
    ``special_tokens`` says)."""
    split = split_prompt(prompt, chunk_texts, document_texts)
    segments = to_segments_in_context(split, tokenizer, special_tokens=special_tokens)
    return [t for s in segments for t in s.token_ids]
