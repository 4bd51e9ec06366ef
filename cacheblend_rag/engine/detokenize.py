"""An answer's text as its tokens arrive, decoding a few tokens per token instead of the whole answer.

Decoding the whole answer at every token costs time that grows with the answer (a tokenizer call over
every token so far, per token). :class:`IncrementalText` decodes a small window instead, as vLLM's
incremental detokenizer and transformers' ``TextStreamer`` do: the tokens after the last point where
the text was complete, with the tokens before that point as context (so a tokenizer that drops a
leading space at the start of a decode drops it from the context too, and the new part keeps it).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

# SentencePiece's byte fallback (Llama 2, Mistral v0.1): a character it has no piece for is spelled as byte
# tokens, and its decoder decodes a run of them together, every byte of the run a replacement character while
# the run is not whole UTF-8 (so a character already complete turns back into replacement characters while
# the next one's bytes are still arriving). Text is final only after a token that is not such a byte.
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class IncrementalText:
    """``tokenizer.decode(tokens, skip_special_tokens=True)`` for a list of tokens that only grows.

    The text is final up to the last token after which it ended on a whole character (no trailing
    replacement character: the bytes of a character split over tokens are all there), that token being
    neither a byte piece nor a special token; later tokens only add to it, decoded with the tokens of the
    stretch before that point as context. Where that does not hold, the whole answer is decoded every
    token, as before: a tokenizer that cleans up tokenization spaces (``" ."`` to ``"."``, across any
    point), or a window whose context decodes differently once more tokens follow (seen, from then on)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.local = not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._special = set(getattr(tokenizer, "all_special_ids", None) or ())
        self.text = ""
        self._final = ""  # the text of tokens[: self._read]
        self._start = 0  # the window's first token: context for the tokens after _read
        self._read = 0
        self._context = ""  # the window's decode of tokens[self._start : self._read]

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _joins_next(self, token: int) -> bool:
        """Whether the text of ``token`` may still change with the tokens after it: a byte piece, or a special
        token (skipped, it leaves the byte pieces on either side one run)."""
        if token in self._special:
            return True
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token) if convert is not None else None
        return isinstance(piece, str) and _BYTE_PIECE.fullmatch(piece) is not None

    def update(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``: those of the previous call with more after them."""
        if not self.local:
            self.text = self._decode(tokens)
            return self.text
        window = self._decode(tokens[self._start :])
        if not window.startswith(self._context):  # the context changed with what followed: not local
            self.local = False
            return self.update(tokens)
        tail = window[len(self._context) :]
        self.text = self._final + tail
        if tail and not tail.endswith("\ufffd") and not self._joins_next(tokens[-1]):
            self._final = self.text
            self._start, self._read = self._read, len(tokens)
            self._context = self._decode(tokens[self._start : self._read])
        return self.text
