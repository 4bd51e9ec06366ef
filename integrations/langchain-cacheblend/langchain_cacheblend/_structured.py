"""``with_structured_output`` by a JSON schema (``method="json_schema"`` or ``"json_mode"``): decoding
constrained to the schema (``response_format``), the answer parsed into it."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from pydantic import BaseModel


def json_structured_output(
    llm: BaseChatModel, schema: dict | type | None, method: str, include_raw: bool, kwargs: dict[str, Any]
) -> Runnable[LanguageModelInput, dict | BaseModel]:
    """``llm`` bound to answer in ``schema`` (any JSON object when it is ``None`` and ``method`` is
    ``"json_mode"``) and the parser of that answer; with ``include_raw``, the message beside it."""
    if method not in ("json_schema", "json_mode"):
        raise ValueError(f"method={method!r}; choose 'function_calling', 'json_schema' or 'json_mode'")
    kwargs.pop("strict", None)
    if kwargs:
        raise ValueError(f"with_structured_output got unsupported arguments {sorted(kwargs)}")
    if schema is None and method == "json_schema":
        raise ValueError("method='json_schema' needs a schema (or use method='json_mode' for any JSON object)")
    is_pydantic = isinstance(schema, type) and issubclass(schema, BaseModel)
    response_format = convert_to_json_schema(schema) if schema is not None else {"type": "json_object"}
    bound = llm.bind(response_format=response_format,
                  ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
    parser: Runnable = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    fallback = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([fallback], exception_key="parsing_error")
