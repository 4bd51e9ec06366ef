"""LangChain's own standard test suites for chat models (unit and integration), run against ChatCacheBlend
on the tiny random Llama: the "integration" suite talks to a real, local model, fast enough for every run.

Capabilities ChatCacheBlend does not have are declared through the suites' properties, so the
matching tests skip with LangChain's own reasons: text-only inputs, no per-call model switching, no
VCR cassettes (there are no HTTP calls to record), no environment-variable setup.

``TestChatCacheBlendRemote`` runs the integration suite, with the same settings and expected failures, against
``ChatCacheBlend(base_url=...)``: a real ``cacheblend-rag serve`` of the tiny random Qwen2 in a subprocess.

Tool calling, structured output and JSON mode are declared everywhere. Decoding is constrained to a
valid call (or the schema's JSON), so even the random tiny model makes calls that parse, and the suite's
tool and structured-output tests run on it; the four that check what a call says (``magic_function(3)``
must be called with ``{"input": 3}``, a company name copied from the message) or that the model chooses to
call are marked expected to fail there, each with its reason, and run against SmolLM2-135M
(``TestChatCacheBlendSmolLM2``, slow, with a first answer and structured output: the suite's tests that need
real weights, not the whole suite again). One is expected to fail there, for the model's sake
(``test_agent_loop``: a call left to the model's choice, which a 135M model without tool training does not
make).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_cacheblend import ChatCacheBlend

# A chunk that the cache-read test warms and then finds in its prompt.
_CHUNK = "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris."
_RANDOM_ARGUMENTS = ("it checks the call's arguments (magic_function(3) called with {'input': 3}), which a random "
                     "model cannot know: its call parses (constrained decoding) with arguments of its own; "
                     "TestChatCacheBlendSmolLM2 runs it")


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
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

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
        # Short answers keep the suite fast, long enough for the suite's calls in the tiny model's tokens (its
        # small vocabulary spells a tool's name in many); the unit suite sets max_tokens itself.
        return {**super().chat_model_params, "max_tokens": 64}

    # What a call says, and whether the model calls at all, is the model's doing: a random model's call
    # parses (constrained decoding) but says nothing in particular. TestChatCacheBlendSmolLM2 runs these.
    @pytest.mark.xfail(reason=_RANDOM_ARGUMENTS, strict=False)
    def test_tool_calling(self, model: Any) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason=_RANDOM_ARGUMENTS, strict=False)
    async def test_tool_calling_async(self, model: Any) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason="it checks that the call's customer_name holds the company name written in the "
                       "message ('你好啊集团'), which a random model cannot copy (nor spell its call in 64 of "
                       "the tiny tokenizer's tokens); TestChatCacheBlendSmolLM2 runs it", strict=False)
    def test_unicode_tool_call_integration(self, model: Any, *args: Any, **kwargs: Any) -> None:
        super().test_unicode_tool_call_integration(model, *args, **kwargs)

    @pytest.mark.xfail(reason="with tool_choice left to the model, it checks that the model chooses to call the "
                       "weather tool, which a random model does not; TestChatCacheBlendSmolLM2 runs it",
                       strict=False)
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)

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


class TestChatCacheBlendRemote(TestChatCacheBlendIntegration):
    """The same suite, settings and expected failures against ``ChatCacheBlend(base_url=...)``: a real
    ``cacheblend-rag serve`` of the tiny random Qwen2 (tests/conftest.py), once for this module."""

    base_url: ClassVar[str] = ""
    api_key: ClassVar[str] = ""

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def _served(cls, cacheblend_server: Any) -> None:
        cls.base_url, cls.api_key = cacheblend_server.base_url, cacheblend_server.api_key

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # The model is the server's; the one argument that moves an app there, and its key.
        return {"base_url": self.base_url, "api_key": self.api_key, "max_tokens": 64}


@pytest.mark.slow
class TestChatCacheBlendSmolLM2(_CacheBlendSuiteSettings, ChatModelIntegrationTests):
    """The integration suite's tests that need real weights, on the embedded SmolLM2-135M-Instruct: the four the
    random model is expected to fail (what a call says, whether the model calls), a first answer, and structured
    output with a real 49k-token vocabulary. The rest of the suite checks the protocol, which
    ``TestChatCacheBlendIntegration`` does on the tiny model with the same code; running it all again here cost
    ~250 CPU-s of SmolLM2 decoding a run (issue 70's suite budget). The conftest deselects the others."""

    runs_only: ClassVar[frozenset[str]] = frozenset({
        "test_invoke", "test_tool_calling", "test_tool_calling_async", "test_unicode_tool_call_integration",
        "test_agent_loop", "test_structured_output",
    })

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # The suite's prompts are shorter than the engine's min_blend_tokens: blend them anyway.
        return {"max_tokens": 56, "min_blend_tokens": 0}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        return TestChatCacheBlendIntegration.invoke_with_cache_read_input(self, stream=stream)

    @pytest.mark.xfail(reason="the model's choice, not the package's: with tool_choice left to the model, "
                       "SmolLM2-135M (no tool calling in its training or chat template) answers the weather "
                       "question in text; calls it is asked for are made and parsed (test_tool_calling*)",
                       strict=False)
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)
