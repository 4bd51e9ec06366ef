"""Text a tokenizer can take: valid Unicode, checked once where text enters the engine."""

from __future__ import annotations

from cacheblend_rag.errors import BlendInputError


def checked_text(text: str, what: str = "the text") -> str:
    """``text``, unless it holds a lone surrogate (``"\\ud800"``, say: what a bad decode or a JSON
    ``\\ud800`` escape leaves), which no tokenizer can encode; the error names its position."""
    if not isinstance(text, str):
        raise BlendInputError(f"{what} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = text[exc.start]
        raise BlendInputError(
            f"{what} holds a lone surrogate U+{ord(char):04X} at character {exc.start} (of {len(text)}), which is "
            "not valid Unicode and cannot be tokenized; remove it, or decode the bytes it came from with "
            "errors='replace'"
        ) from None
    return text
