"""Text a tokenizer can take: valid Unicode, checked once where text enters the engine; document text
tokenized as text (:func:`document_ids`)."""

from __future__ import annotations

from typing import Any

from cacheblend_rag.errors import BlendInputError, ConfigError


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


# How special-token strings in document and chunk text are tokenized. A retrieved chunk is data someone
# else wrote: as control tokens, a chunk holding "<|im_end|>\n<|im_start|>system\n..." would close the user
# turn and open a system turn of its own, and "<|endoftext|>" would end the text. "text" (the default)
# tokenizes them as the plain characters they spell; "control" is what the tokenizer does by default,
# for text that is trusted to carry them. The rest of a prompt (its template, the question) is tokenized
# as the tokenizer does either way: the template's own role and end tokens must stay control tokens.
DOCUMENT_SPECIAL_TOKENS = ("text", "control")


def checked_special_tokens(value: str, what: str = "document_special_tokens") -> str:
    """``value`` if it is one of :data:`DOCUMENT_SPECIAL_TOKENS`, else a :class:`ConfigError` naming them."""
    if value not in DOCUMENT_SPECIAL_TOKENS:
        raise ConfigError(f"{what}={value!r} must be 'text' (special-token strings in documents are tokenized as "
                          "plain text, the default) or 'control' (as control tokens: only for trusted text)")
    return value


def document_ids(tokenizer: Any, text: str | list[str], special_tokens: str = "text") -> Any:
    """Token ids of document text ``text`` (a string, or a list of them: a list of id lists), no special tokens
    added, special-token strings in it tokenized as ``special_tokens`` says (:data:`DOCUMENT_SPECIAL_TOKENS`).
    ``split_special_tokens`` is a call option of every transformers tokenizer, fast or slow: it leaves the
    tokenizer's own setting as it was for the template and question tokenized around the chunk, and
    ``"control"`` calls the tokenizer as it is (what a prompt's text gets)."""
    if checked_special_tokens(special_tokens) == "control":
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def token_ids(tokenizer: Any, text: str, *, what: str = "the text", special_tokens: str = "control") -> list[int]:
    """``CacheBlendEngine.tokenize``'s ids of ``text`` by ``tokenizer`` (no special tokens added); a clear error
    where there is no tokenizer or the text is not valid Unicode."""
    if tokenizer is None:
        raise BlendInputError("this engine has no tokenizer; pass token ids, or build it with a tokenizer")
    return list(document_ids(tokenizer, checked_text(text, what), special_tokens))


class TokenCounter:
    """A prompt's token ids by the model's tokenizer, as ``CacheBlendEngine.tokenize`` gives them, holding the
    tokenizer alone: what token counters and memory buffers keep (LlamaIndex's ``TokenCountingHandler``,
    ``Settings.tokenizer``) pickles and copies without the model (a bound ``engine.tokenize`` holds it all)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return token_ids(self.tokenizer, text)
