"""LangChain's own standard test suites for chat models (unit and integration), run against ChatCacheBlend
on the tiny random Llama: the "integration" suite talks to a real, local model, fast enough for every run.

Capabilities ChatCacheBlend does not have are declared through the suites' properties,
so the matching tests skip with LangChain's own reasons: no tool calling, no structured
output or JSON mode, text-only inputs, no per-call model switching, no VCR cassettes
(there are no HTTP calls to record), no environment-variable setup and no LangChain
serialisation (``is_lc_serializable`` stays False, as for most partner chat models).
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_cacheblend import ChatCacheBlend

# A chunk that the cache-read test warms and then finds in its prompt.
_CHUNK = "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris."


class _CacheBlendSuiteSettings:
    @property
    def chat_model_class(self) -> type[ChatCacheBlend]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # The tiny random Llama of cacheblend_rag.testing: milliseconds per call, no download.
        return {"model": "tiny-llama"}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}


class TestChatCacheBlendUnit(_CacheBlendSuiteSettings, ChatModelUnitTests):
    pass


class TestChatCacheBlendIntegration(_CacheBlendSuiteSettings, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Short answers keep the suite fast; the unit suite sets max_tokens itself.
        return {**super().chat_model_params, "max_tokens": 16}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatCacheBlend(**self.chat_model_params)
        llm.warm([_CHUNK], show_progress=False)
        messages = [SystemMessage(f"Context:\n{_CHUNK}\n"), HumanMessage("Who won two Nobel prizes?")]
        if stream:
            full = None
            for chunk in llm.stream(messages):
                full = chunk if full is None else full + chunk
            message = full
        else:
            message = llm.invoke(messages)
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0
        return message
