"""LangChain's own standard test suites for chat models (unit and integration), run against ChatCacheBlend
on the tiny random Llama: the "integration" suite talks to a real, local model, fast enough for every run.

Capabilities ChatCacheBlend does not have are declared through the suites' properties, so the
matching tests skip with LangChain's own reasons: text-only inputs, no per-call model switching, no
VCR cassettes (there are no HTTP calls to record), no environment-variable setup.

Tool calling, structured output and JSON mode are there, and their tests run against SmolLM2-135M
(``TestChatCacheBlendSmolLM2``, slow): they check what a call says (``magic_function(3)`` must call
it with ``{"input": 3}``), which a random tiny model cannot know. One is expected to fail there, for
the model's sake (``test_agent_loop``: a call left to the model's choice, which a 135M model
without tool training does not make). The tiny model's class declares
them absent so its fast run keeps to what any model can pass.
"""

from __future__ import annotations

from typing import Any

import pytest

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


class _WithToolsAndStructuredOutput:
    """Declared where the suite's checks can pass: LangChain's unit suite (no model output is judged)
    and the integration suite on SmolLM2 (a model that understands a request)."""

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True


class TestChatCacheBlendUnit(_WithToolsAndStructuredOutput, _CacheBlendSuiteSettings, ChatModelUnitTests):

    @pytest.mark.xfail(strict=True, reason=(
        "langchain-core's load(allowed_objects='all') admits only the classes of its own registry "
        "(langchain_core.load.mapping), which a package outside langchain's repository cannot join; "
        "ChatCacheBlend loads when allowed by name (test_serdes_with_the_class_allowed_by_name)"))
    def test_serdes(self, model: ChatCacheBlend, snapshot: Any) -> None:
        super().test_serdes(model, snapshot)

    def test_serdes_with_the_class_allowed_by_name(self, model: ChatCacheBlend, snapshot: Any) -> None:
        """The suite's own check, with ``allowed_objects=[ChatCacheBlend]`` instead of ``"all"``."""
        from langchain_core.load import dumpd, load

        serialized = dumpd(model)
        assert serialized == snapshot(name="serialized")
        loaded = load(serialized, valid_namespaces=["langchain_cacheblend"], allowed_objects=[ChatCacheBlend])
        assert model.model_dump() == loaded.model_dump()


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


@pytest.mark.slow
class TestChatCacheBlendSmolLM2(_WithToolsAndStructuredOutput, _CacheBlendSuiteSettings, ChatModelIntegrationTests):
    """The whole integration suite on the embedded SmolLM2-135M-Instruct, tools and structured output included."""

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # The suite's prompts are shorter than the engine's min_blend_tokens: blend them anyway.
        return {"max_tokens": 56, "min_blend_tokens": 0}

    @property
    def supports_json_mode(self) -> bool:
        return True

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        return TestChatCacheBlendIntegration.invoke_with_cache_read_input(self, stream=stream)

    @pytest.mark.xfail(reason="the model's choice, not the package's: with tool_choice left to the model, "
                       "SmolLM2-135M (no tool calling in its training or chat template) answers the weather "
                       "question in text; calls it is asked for are made and parsed (test_tool_calling*)",
                       strict=False)
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)
