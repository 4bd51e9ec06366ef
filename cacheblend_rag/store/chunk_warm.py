"""Precomputing chunk KV into the store ahead of requests.

:class:`ChunkWarming`, a base of :class:`~cacheblend_rag.store.chunk_cache.ChunkCache`, holds
:meth:`~ChunkWarming.warm` and :meth:`~ChunkWarming.warm_steps` (one batch per step, so a server's
scheduler can run a large warm between decode steps); :class:`WarmSummary` is what they return and
:func:`with_progress` steps through them behind a progress bar. Serving a blend is in
:mod:`~cacheblend_rag.store.chunk_cache`, an entry's reads and writes in :mod:`~cacheblend_rag.store.chunk_io`.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generator, Iterable, Sequence

from tqdm.auto import tqdm


@dataclass
class WarmSummary:
    new: int = 0  # chunks computed and written by this call
    present: int = 0  # chunks already in the store (or written meanwhile by another process)
    bytes_written: int = 0
    failed: int = 0  # chunks computed but not written because the store failed
    computed: list[tuple[int, ...]] = field(default_factory=list)  # token ids of the chunks counted in ``new``


def with_progress(
    steps: Generator[tuple[int, int], None, WarmSummary], show_progress: bool
) -> Generator[None, None, WarmSummary]:
    """:meth:`ChunkCache.warm_steps` with a progress bar, step for step."""
    with tqdm(desc="precompute chunk KV", unit="chunk", disable=not show_progress) as bar:
        while True:
            try:
                todo, done = next(steps)
            except StopIteration as finished:
                return finished.value
            bar.total = todo
            bar.update(done - bar.n)
            yield


class ChunkWarming:
    """:meth:`warm` and :meth:`warm_steps` of a :class:`~cacheblend_rag.store.chunk_cache.ChunkCache`, a base of it.

    The cache sets the attributes below; :class:`~cacheblend_rag.store.chunk_io.ChunkStoreIO` provides
    ``contains``, ``key_for`` and ``_write_logged``.
    """

    engine: Any
    prefix_ids: tuple[int, ...]
    batch_size: int
    _writer: ThreadPoolExecutor

    # ------------------------------------------------------------ precompute
    def _ids(self, item: str | Sequence[int], what: str = "the chunk", special_tokens: str = "text") -> tuple[int, ...]:
        if isinstance(item, str):
            return tuple(self.engine.tokenize(item, what=what, special_tokens=special_tokens))
        return tuple(int(t) for t in item)

    def warm(
        self, items: Iterable[str | Sequence[int]], *, show_progress: bool = False,
        prefix_ids: Sequence[int] | None = None, lossless: bool = False, special_tokens: str = "text",
    ) -> WarmSummary:
        """Make sure every chunk (text or token ids) is stored, computing the missing ones in batches,
        behind ``prefix_ids`` (default: this cache's conditioning prefix; ``()`` for a chunk that
        opens prompts, such as a system prompt).

        ``special_tokens``: how special-token strings in a chunk's text are tokenized: ``"text"`` (the
        default) as the plain text they spell, ``"control"`` as control tokens, for trusted text
        (:func:`~cacheblend_rag.reuse.text.document_ids`). Prompts must find the chunk under the same
        ids: the integrations and the server tokenize chunks the way their ``document_special_tokens`` says.

        A chunk that opens a prompt behind nothing is an exact prefix of the blend (reused as is,
        never recomputed) only if it is stored without loss: warm it with ``lossless=True``, which
        keeps the model's own dtype whatever this cache's codec. Stored at fewer bits it is blended
        like any other chunk."""
        steps = with_progress(self.warm_steps(items, prefix_ids=prefix_ids, lossless=lossless,
                                              special_tokens=special_tokens), show_progress)
        while True:
            try:
                next(steps)
            except StopIteration as finished:
                return finished.value

    def warm_steps(
        self, items: Iterable[str | Sequence[int]], *, prefix_ids: Sequence[int] | None = None,
        lossless: bool = False, special_tokens: str = "text",
    ) -> Generator[tuple[int, int], None, WarmSummary]:
        """:meth:`warm` one batch per step: yields ``(chunks to compute, chunks computed)`` after
        each batch and returns the summary. A server's scheduler runs a step between two decode
        steps, so a large warm never holds the requests that are decoding."""
        prefix = self.prefix_ids if prefix_ids is None else tuple(int(t) for t in prefix_ids)
        summary = WarmSummary()
        fingerprint = self.engine.fingerprint  # once: it checks the weights
        todo: list[tuple[int, ...]] = []
        seen: set[tuple[int, ...]] = set()
        for index, item in enumerate(items):
            ids = self._ids(item, f"chunk {index}", special_tokens)
            if not ids:
                continue
            if ids in seen or self.contains(ids, prefix, fingerprint=fingerprint):
                summary.present += 1
            else:
                todo.append(ids)
            seen.add(ids)
        writes: list[Future] = []
        if todo:
            yield len(todo), 0
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start : start + self.batch_size]
            chunks = self.engine.prefill_chunks(batch, prefix_ids=prefix, batch_size=self.batch_size)
            # Writing batch i overlaps computing batch i+1; wait for i-1 first, to bound memory.
            for ids, future in writes:
                self._tally(summary, ids, future.result())
            writes = [(ids, self._writer.submit(self._write_logged, self.key_for(c.token_ids, c.prefix_ids,
                                                                                 fingerprint=fingerprint), c, lossless))
                      for ids, c in zip(batch, chunks)]
            yield len(todo), start + len(batch)
        for ids, future in writes:
            self._tally(summary, ids, future.result())
        return summary

    @staticmethod
    def _tally(summary: WarmSummary, ids: tuple[int, ...], written: int | None) -> None:
        if written is None:
            summary.failed += 1
        elif written:
            summary.new += 1
            summary.bytes_written += written
            summary.computed.append(ids)
        else:
            summary.present += 1
