"""Where each span of a prompt's K/V comes from: the one call (:meth:`PromptReuse.plan`) a request makes, and
what it keeps for the next (:meth:`PromptReuse.keep`).

The retrieval side has told which chunk texts prompts will contain (:mod:`~cacheblend_rag.reuse.announced`); the
plan finds them verbatim in the prompt (:mod:`~cacheblend_rag.reuse.prompt`) and turns the prompt into segments:
chunks looked up in the chunk cache, everything else fresh, with the ids the whole prompt tokenizes to
(:mod:`~cacheblend_rag.reuse.text`). It then takes the longest opening of the prompt whose K/V an earlier request
left in the prefix cache (:mod:`~cacheblend_rag.reuse.prefix_cache`) as a prefix reused as is, and spans after the
chunks an earlier request computed from the segment cache (:mod:`~cacheblend_rag.reuse.segment_cache`) as cached
segments. After the request it leaves this request's K/V (prompt and answer) in the prefix cache for the next: the
exact part as exact blocks, what the blend computed past it as approximate ones, and its spans after the chunks in
the segment cache.

Approximate blocks are an earlier blend's K/V, so they are only served to a request that accepts a
blend's approximation anyway: recompute ratio below 1.0 and at least one announced chunk found in the
prompt (one it would blend). A request at ratio 1.0, one that finds no chunk (full prefill) and one
with reuse off gets exact blocks only, so its answer is what it is without the cache. That is what a
chat needs: turn ``N`` opens with turn ``N-1``'s whole prompt and answer, reused as is, outside the
recompute budget (``BlendConfig.approximate_prefix_recompute_ratio`` > 0 recomputes a share of it for the
turn's question), and the new message is blended. The blend configuration is not part of the
blocks' keys: a conversation's turns use one.

A request's cache salt (``salt``, a tenant's ``cache_salt``) scopes what it shares: its prefix-cache blocks are
chained from it and its segment-cache spans kept under it, so requests with different salts share no K/V of their
prompts or answers. Everything here runs on the engine's scheduler worker (the tokenizer and caches are its).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine import CacheBlendEngine
from cacheblend_rag.engine.decode import Decoding
from cacheblend_rag.engine.layout import unrotated_keys
from cacheblend_rag.kv.segments import CachedSegment, FreshSegment, PrefixSegment, Segment, StoredSegment
from cacheblend_rag.reuse.announced import AnnouncedChunks
from cacheblend_rag.reuse.prefix_cache import PrefixCache
from cacheblend_rag.reuse.prompt import prompt_ids, spelling_special_tokens, split_prompt, to_segments_in_context
from cacheblend_rag.reuse.segment_cache import SegmentCache
from cacheblend_rag.reuse.text import checked_special_tokens
from cacheblend_rag.store import ChunkCache

logger = logging.getLogger(__name__)

@dataclass
class PreparedPrompt:
    """A prompt as segments, with what was found of the announced chunks."""

    segments: list[Segment]
    chunks_found: int
    chunks_missing: int  # texts of the latest announcement the prompt lacks verbatim
    reason: str | None  # why no chunk KV is reused, when none is
    prefix_tokens: int = 0  # tokens the prefix cache held (the first segment, then a PrefixSegment)
    approximate_prefix_tokens: int = 0  # of them, those from approximate blocks (an earlier blend's K/V)
    segment_tokens: int = 0  # tokens of spans after the chunks whose K/V an earlier request left
    segment_hits: int = 0  # such spans (cached segments, but not chunks: not counted as cache hits)
    # [start, end) of the fresh spans after the first chunk, as the prompt split them: kept for the next
    spans: list[tuple[int, int]] = field(default_factory=list)
    salt: str = ""  # the request's cache salt: its K/V is kept under it

    def sources(self) -> list[tuple[int, int, str]]:
        """``[start, end)`` of each segment of the prompt with where its K/V comes from: ``"prefix cache"``
        (``"prefix cache (approximate)"`` where it holds an earlier blend's K/V), ``"chunk"`` (the chunk store, or
        computed for it and stored), ``"segment cache"`` (a span an earlier request computed) or ``"computed"``."""
        out, offset = [], 0
        for s in self.segments:
            n = len(s.token_ids)
            if isinstance(s, PrefixSegment):
                kind = "prefix cache (approximate)" if s.approximate_tokens else "prefix cache"
            elif isinstance(s, StoredSegment) or (isinstance(s, CachedSegment) and not s.chunk.approximate):
                kind = "chunk"
            elif isinstance(s, CachedSegment):
                kind = "segment cache"
            else:
                kind = "computed"
            out.append((offset, offset + n, kind))
            offset += n
        return out


# A prompt this long that speaks of its context (LlamaIndex's "Context information is below.", LangChain's
# "pieces of retrieved context") and reuses nothing with no chunk ever announced is a RAG prompt whose
# retriever was not wrapped: worth a warning. Any other prompt without retrieval (structured output, a chat
# engine's own calls, an agent's turn before its retriever tool ran) is right as a full prefill: no warning.
LONG_PROMPT_TOKENS = 200
RAG_PROMPT = re.compile(r"\bcontext\b", re.IGNORECASE)


def _escaped(text: str) -> str:
    return text.encode("unicode_escape").decode("ascii", "replace").replace("'", "\\'")


def _normalized(text: str) -> str:
    return " ".join(text.split()).casefold()


class PromptReuse:
    """The K/V reuse of one engine's prompts: its chunk cache (and the prefix chunks are computed behind), the chunk
    texts announced to one integration object, and the engine's prefix and segment caches (``None`` when off, or
    when the engine cannot blend)."""

    def __init__(self, engine: CacheBlendEngine, chunk_cache: ChunkCache, announced: AnnouncedChunks,
                 prefix_cache: PrefixCache | None = None, segment_cache: SegmentCache | None = None, *,
                 document_special_tokens: str = "text") -> None:
        self.engine = engine
        self.chunk_cache = chunk_cache  # its conditioning prefix is what stored chunks were computed behind
        self.announced = announced
        self.prefix_cache = prefix_cache if engine.adapter is not None else None
        self.segment_cache = segment_cache if engine.adapter is not None else None
        self.document_special_tokens = checked_special_tokens(document_special_tokens)
        self._warned: set[str] = set()

    @property
    def keeps(self) -> bool:
        """Whether a request's K/V is kept for later ones (a prefix or segment cache is on)."""
        return self.prefix_cache is not None or self.segment_cache is not None

    def plan(self, prompt: str, *, reuse: bool = True, blend: BlendConfig | None = None,
             chunks: Sequence[str] | None = None, salt: str = "", document_texts: Sequence[str] = ()
             ) -> PreparedPrompt:
        """``prompt`` as segments: announced chunk texts found verbatim become stored chunks (computed
        behind the cache's prefix), everything else fresh text, with the ids the whole prompt
        tokenizes to where the tokenizer allows (so ratio 1.0 reproduces the plain model).

        ``blend``: the request's configuration. The prefix cache's approximate blocks are taken only
        when it is given, its ``recompute_ratio`` is below 1.0 and the prompt holds a chunk (see the
        module); without it, exact blocks only.

        ``chunks``: the chunk texts to look for (a request's own documents, in :func:`chunk_text` form);
        ``None``: the announced ones. ``salt``: the request's cache salt, whose prefix-cache blocks are
        chained from it and whose segment-cache spans are its own. ``document_texts``: other text of the
        documents (their titles), fresh but tokenized as documents are where it spells a special token."""
        known = self.known(chunks)
        if not reuse:  # the chunks' spans are still documents: their text is tokenized as a blend's would be
            return PreparedPrompt([FreshSegment(self.prompt_ids(prompt, known, document_texts))], 0, 0,
                                  "chunk KV reuse is off (reuse_chunk_kv=False)")
        latest = self.announced.latest() if chunks is None else tuple(chunks)
        split = split_prompt(prompt, known, self._spelling_special_tokens(document_texts))
        segments = to_segments_in_context(split, self.engine.tokenizer, self.chunk_cache.prefix_ids,
                                          special_tokens=self.document_special_tokens)
        found = set(split.found)
        if split.found:
            reason = None
        elif chunks is not None and not chunks:  # a request that brings its own documents brought none
            reason = ("the request brought no documents: send the retrieved chunks as `documents` (each one chunk) "
                      "to reuse their K/V")
        else:
            reason = self._no_reuse(prompt, sum(len(s.token_ids) for s in segments), known, latest)
        approximate = bool(split.found) and blend is not None and blend.recompute_ratio < 1.0
        spans = self._spans_after_chunks(segments)
        # Once per request: checking the weights' stamp walks every parameter, and a chat's prompt
        # has a span after every chunk of every turn.
        fingerprint = self.engine.fingerprint
        segments = self._with_cached_prefix(segments, spans, fingerprint, approximate=approximate, salt=salt)
        segments, reused = self._with_cached_spans(segments, spans, fingerprint, salt)
        prefix = segments[0] if segments and isinstance(segments[0], PrefixSegment) else None
        return PreparedPrompt(
            segments=segments,
            chunks_found=len(split.found),
            # Chunks of the latest announcement that this prompt lacks verbatim (changed by a template,
            # truncated, or, in refine mode, simply handled by another call).
            chunks_missing=sum(1 for text in latest if text not in found),
            reason=reason,
            prefix_tokens=0 if prefix is None else len(prefix),
            approximate_prefix_tokens=0 if prefix is None else prefix.approximate_tokens,
            segment_tokens=reused, spans=spans, salt=salt,
            segment_hits=sum(1 for s in segments if isinstance(s, CachedSegment) and s.chunk.approximate),
        )

    def known(self, chunks: Sequence[str] | None) -> list[str]:
        """The chunk texts a prompt is searched for: ``chunks``, else the announced ones."""
        return self.announced.known() if chunks is None else list(chunks)

    def prompt_ids(self, prompt: str, known: Sequence[str], document_texts: Sequence[str] = ()) -> list[int]:
        """``prompt``'s token ids with the ``known`` chunk texts in it tokenized as documents (full prefill's)."""
        return prompt_ids(prompt, known, self.engine.tokenizer, self.document_special_tokens,
                          self._spelling_special_tokens(document_texts))

    def _spelling_special_tokens(self, texts: Sequence[str]) -> list[str]:
        """Those of ``texts`` that tokenizing as documents changes: only they are split out of the fresh text
        (a title as common as "Paris" would otherwise cut the prompt's ids wherever the word stands)."""
        if self.document_special_tokens == "control" or not texts:
            return []
        return spelling_special_tokens(texts, self.engine.tokenizer)

    def _with_cached_prefix(self, segments: list[Segment], spans: list[tuple[int, int]], fingerprint: str, *,
                            approximate: bool = False, salt: str = "") -> list[Segment]:
        """``segments`` opened by the longest prefix of their token ids the prefix cache holds (exact
        blocks only unless ``approximate``). The ids are the ones the blend sees (the whole prompt's
        where the tokenizer allows), so block boundaries are token boundaries of this prompt. A chunk
        the prefix ends inside keeps its tail as fresh tokens: its stored K/V is the whole chunk's, at
        its own start.

        An approximate prefix is cut back (no further than its exact part) to the start of a chunk it
        would end inside, and to the start of a span after the chunks (``spans``) it would end inside
        where the segment cache holds more of that span: the chunks of two turns often open alike (a
        title, a template's "Source:"), and another conversation's blocks can reach into this one's
        history; a few approximate tokens are not worth computing the rest of the chunk or span fresh."""
        cache = self.prefix_cache
        if cache is None or not cache.enabled or not segments:
            return segments
        ids = [t for s in segments for t in s.token_ids]
        hit = cache.match(ids, fingerprint, approximate=approximate, salt=salt)
        if hit is None:
            return segments
        if hit.approximate_tokens:
            hit = hit.cut(self._approximate_end(len(hit), hit.exact_tokens, segments, spans, ids, fingerprint, salt))
        m, rest, offset = len(hit.token_ids), [], 0
        for s in segments:
            end = offset + len(s.token_ids)
            if offset >= m:
                rest.append(s)
            elif end > m:
                rest.append(FreshSegment(s.token_ids[m - offset:]))
            offset = end
        return [hit, *rest] if m else segments

    def _approximate_end(self, m: int, exact: int, segments: list[Segment], spans: list[tuple[int, int]],
                         ids: list[int], fingerprint: str, salt: str = "") -> int:
        """Where an approximate prefix of ``m`` tokens (``exact`` of them exact) should end (see above)."""
        offset = 0
        for s in segments:
            end = offset + len(s.token_ids)
            if offset < m < end and isinstance(s, (StoredSegment, CachedSegment)):
                return max(offset, exact)
            offset = end
        if self.segment_cache is not None:
            for a, b in spans:
                if exact <= a < m < b:
                    limit = b - a - 1 if b == len(ids) else b - a
                    if self.segment_cache.reach(ids[a:b], fingerprint, max_tokens=limit, salt=salt) > m - a:
                        return a
        return m

    def _spans_after_chunks(self, segments: list[Segment]) -> list[tuple[int, int]]:
        """[start, end) of the fresh spans after the first chunk of the prompt as it was split, before
        any cache replaced part of it (so even where this request takes them from the prefix cache, a
        chat's history reused as approximate blocks): the spans the segment cache is asked for, and
        keeps after the request."""
        if self.segment_cache is None:
            return []
        spans: list[tuple[int, int]] = []
        offset, after_chunk = 0, False
        for s in segments:
            n = len(s.token_ids)
            if isinstance(s, (StoredSegment, CachedSegment)):
                after_chunk = True
            elif isinstance(s, FreshSegment) and after_chunk:
                spans.append((offset, offset + n))
            offset += n
        return spans

    def _with_cached_spans(self, segments: list[Segment], spans: list[tuple[int, int]],
                           fingerprint: str, salt: str = "") -> tuple[list[Segment], int]:
        """Fresh segments that are whole ``spans`` and open with a span an earlier request of ``salt`` computed
        become that span's cached segment and a fresh rest (the last keeps at least its last token
        fresh). Returns the segments and the tokens reused."""
        cache = self.segment_cache
        starts = {start for start, _ in spans}
        out: list[Segment] = []
        reused = offset = 0
        for index, s in enumerate(segments):
            n = len(s.token_ids)
            if cache is not None and isinstance(s, FreshSegment) and offset in starts:
                last = index == len(segments) - 1
                hit = cache.match(s.token_ids, fingerprint, max_tokens=n - 1 if last else n, salt=salt)
                if hit is not None:
                    out.append(CachedSegment(hit))
                    if len(hit) < n:
                        out.append(FreshSegment(s.token_ids[len(hit):]))
                    reused += len(hit)
                    offset += n
                    continue
            out.append(s)
            offset += n
        return out, reused

    def keep(self, decoding: Decoding, prepared: PreparedPrompt) -> None:
        """After a request, on the worker: its K/V into the prefix cache, prompt and answer (the next turn
        of a chat opens with both): the exact part as exact blocks, the rest, when the prompt was not
        all exact, as approximate blocks; and its spans after the chunks into the segment cache."""
        prefix_cache = self.prefix_cache if self.prefix_cache is not None and self.prefix_cache.enabled else None
        keep_prefix = prefix_cache is not None
        keep_spans = self.segment_cache is not None and bool(prepared.spans)
        if not (keep_prefix or keep_spans):
            return  # no cache to keep it in: not even the weights' stamp is read
        try:
            ids, keys, values = decoding.held_kv()
            if not ids:
                return
            fingerprint = self.engine.fingerprint
            if prefix_cache is not None:
                exact = decoding.stats.exact_kv_tokens
                if exact < decoding.prompt_tokens:
                    # Past the exact part the K/V attended to blended K/V: not what full prefill computes.
                    prefix_cache.insert(ids[:exact], keys, values, fingerprint, salt=prepared.salt)
                    prefix_cache.insert(ids, keys, values, fingerprint, salt=prepared.salt, approximate=True)
                else:
                    prefix_cache.insert(ids, keys, values, fingerprint, salt=prepared.salt)
            if keep_spans:
                self._keep_spans(ids, keys, values, prepared, decoding.prompt_tokens, fingerprint)
        except Exception:  # keeping K/V is an optimisation: it never fails the request
            logger.exception("could not keep this request's K/V for later requests")

    def _keep_spans(self, ids: list[int], keys: list[Any], values: list[Any], prepared: PreparedPrompt,
                    prompt_tokens: int, fingerprint: str) -> None:
        a = self.engine.adapter
        assert a is not None and self.segment_cache is not None
        for start, end in prepared.spans:
            if end == prompt_tokens:
                end = len(ids)  # the span that ends the prompt continues with the answer
            self.segment_cache.remember(ids[start:end], unrotated_keys(a, keys, start, end),
                                        [v[0, :, start:end] for v in values], fingerprint, salt=prepared.salt)

    def _no_reuse(self, prompt: str, tokens: int, known: Sequence[str], latest: Sequence[str]) -> str:
        """Why a prompt reuses no chunk KV: the latest retrieval found nothing, nothing was ever announced
        (warned once only where the prompt reads as a RAG prompt), or the prompt holds the announced chunks
        changed, escaped or cut (each warned once: the user can change it)."""
        if not latest and self.announced.announcements():
            return ("the latest retrieval brought no chunks (its retriever returned nothing), so there is nothing "
                    "to reuse: a full prefill")
        if not known:
            cause = "none-announced"
            quiet = tokens < LONG_PROMPT_TOKENS or not RAG_PROMPT.search(prompt)
            fix = ("add CacheBlendNodePostprocessor(llm=llm) to the query engine (LlamaIndex) or wrap the retriever in "
                   "CacheBlendRetriever (LangChain); an agent's retriever tool: build it with cacheblend_retriever_tool "
                   "(either framework)")
            reason = (f"no chunk text was announced to this model, yet the prompt reads as a RAG prompt (it speaks of "
                      f"its context), so its retrieved text is computed fresh: {fix}" if not quiet else
                      f"no chunk text was announced to this model: a full prefill, right for a call without retrieval "
                      f"(structured output, a plain chat, an agent's turn before its retriever tool ran); to reuse "
                      f"retrieved chunks, {fix}")
        elif any(_escaped(text) in prompt for text in latest if _escaped(text) != text):
            cause, quiet = "escaped", False
            reason = ("the prompt holds the announced chunks escaped, as a Python list's repr (LlamaIndex's "
                      "response_mode='simple_summarize' renders them so), and escaped text has other KV: use "
                      "response_mode='compact' (the default), 'refine' or 'tree_summarize'")
        elif any(_normalized(text) in _normalized(prompt) for text in latest):
            cause, quiet = "changed", False
            reason = ("the prompt holds the announced chunks with their text changed (whitespace, case, or a "
                      "template rewriting them), so their KV is computed fresh")
        elif any(len(text) > 80 and text[: len(text) // 2] in prompt for text in latest):
            cause, quiet = "cut", False
            reason = ("the prompt holds only part of an announced chunk (compact repacking split it to fit the "
                      "context window, or it was truncated); the part is computed fresh")
        else:
            return "no announced chunk text appears verbatim in the prompt"
        if not quiet and cause not in self._warned:
            self._warned.add(cause)
            logger.warning("chunk KV reuse dropped to zero: %s", reason)
        return reason


__all__ = ["LONG_PROMPT_TOKENS", "PreparedPrompt", "PromptReuse"]
