"""The chunk texts prompts will contain, in their one normal form (:func:`cacheblend_rag.prompting.chunk_text`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable

from cacheblend_rag.prompting import chunk_texts


class AnnouncedChunks:
    """Chunk texts that upcoming prompts are expected to contain: a bounded LRU.

    Every prompt is searched for all remembered texts (a chunk announced for one
    query can be reused by the next), while :meth:`latest` holds the texts of the
    most recent announcement, so a prompt can report which of them it lacks.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._texts: OrderedDict[str, None] = OrderedDict()
        self._latest: tuple[str, ...] = ()
        self._lock = threading.Lock()

    def announce(self, texts: Iterable[str]) -> list[str]:
        """Remember ``texts`` (in :func:`chunk_text` form, empty ones dropped) and return them in order."""
        kept = chunk_texts(texts)
        with self._lock:
            for text in kept:
                self._texts[text] = None
                self._texts.move_to_end(text)
            while len(self._texts) > self.capacity:
                self._texts.popitem(last=False)
            self._latest = tuple(kept)
        return kept

    def known(self) -> list[str]:
        """Every remembered text, least recently announced first."""
        with self._lock:
            return list(self._texts)

    def latest(self) -> tuple[str, ...]:
        with self._lock:
            return self._latest

    def clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self._latest = ()

    def __len__(self) -> int:
        return len(self._texts)
