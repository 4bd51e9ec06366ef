"""Tools in the model's own format: which format a chat template was trained on, how calls of each format
parse (parallel calls included), how a conversation with calls and results renders with their ids, and the
errors for what cannot be rendered or parsed."""

from __future__ import annotations

import pytest

from cacheblend_rag.errors import BlendInputError, ConfigError
from cacheblend_rag.serving.tool_chat import assistant_turn, render_chat, tool_turn
from cacheblend_rag.serving.tool_formats import CACHEBLEND, HERMES, LLAMA3_JSON, tool_format
from cacheblend_rag.serving.tool_stream import ToolCallStream
from cacheblend_rag.serving.tools import constrained, tool_functions
from cacheblend_rag.config import GenerationConfig
from cacheblend_rag.testing import tiny_tokenizer
from cacheblend_rag.testing_tools import LLAMA31_TOOLS_TEMPLATE, QWEN25_TOOLS_TEMPLATE

FUNCTIONS = tool_functions([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "to_fahrenheit", "description": "Celsius to Fahrenheit.", "parameters": {
        "type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]}}},
])
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN_CALL_2 = '<tool_call>\n{"name": "to_fahrenheit", "arguments": {"celsius": 20}}\n</tool_call>'


def tokenizer_with(template: str):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def qwen():
    return tokenizer_with(QWEN25_TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def llama():
    return tokenizer_with(LLAMA31_TOOLS_TEMPLATE)


def test_the_format_comes_from_the_template(qwen, llama):
    assert tool_format(qwen) is HERMES and tool_format(llama) is LLAMA3_JSON
    assert tool_format(tiny_tokenizer()) is CACHEBLEND  # a ChatML template that cannot list tools
    # Naming <tool_call> is not enough: the template must really render the tools it is given.
    assert tool_format(tokenizer_with("{{ '<tool_call>' }}{% for m in messages %}{{ m.content }}{% endfor %}")) is CACHEBLEND


@pytest.mark.slow
def test_the_smollm2_template_falls_back_to_our_system_turn(smollm2_engine):
    tokenizer = smollm2_engine.tokenizer
    assert tool_format(tokenizer) is CACHEBLEND
    prompt = render_chat(tokenizer, [{"role": "user", "content": "Weather in Paris?"}], FUNCTIONS)
    assert "You can use these tools:" in prompt and '"name": "get_weather"' in prompt


def test_hermes_calls_parse_with_text_before_and_in_parallel():
    parsed = HERMES.parse(f"Let me look.\n{QWEN_CALL}\n{QWEN_CALL_2}", FUNCTIONS)
    assert parsed.content == "Let me look.\n" and parsed.malformed is None
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", {"city": "Paris"}),
                                                              ("to_fahrenheit", {"celsius": 20})]
    assert len({c.id for c in parsed.calls}) == 2
    # A last block cut before its closing tag, and a bare JSON call, still parse.
    assert HERMES.parse(QWEN_CALL.removesuffix("\n</tool_call>"), FUNCTIONS).calls[0].arguments == {"city": "Paris"}
    assert HERMES.parse('{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}', FUNCTIONS).calls[0].arguments == {"city": "Rome"}


@pytest.mark.parametrize("text, reason", [
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \n</tool_call>", "not JSON"),
    ("<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>", "'launch', which is no bound tool"),
    ("<tool_call>\n</tool_call>", "holds no call"),
])
def test_a_malformed_hermes_call_is_text_with_the_reason(text, reason):
    parsed = HERMES.parse(text, FUNCTIONS)
    assert parsed.calls == [] and parsed.content == text and reason in parsed.malformed


@pytest.mark.parametrize("text", [
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "to_fahrenheit", "parameters": {"celsius": 20}}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}}\n{"name": "to_fahrenheit", "parameters": {"celsius": 20}}',
])
def test_llama3_calls_parse_after_the_python_tag_and_separated(text):
    calls = LLAMA3_JSON.parse(text, FUNCTIONS).calls
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}), ("to_fahrenheit", {"celsius": 20})]


def test_plain_text_is_no_call_and_no_malformed_call():
    for fmt in (HERMES, LLAMA3_JSON, CACHEBLEND):
        parsed = fmt.parse("It is sunny in Paris.", FUNCTIONS)
        assert parsed.calls == [] and parsed.malformed is None and parsed.content == "It is sunny in Paris."


CONVERSATION = [
    {"role": "user", "content": "How warm is Paris in Fahrenheit?"},
    assistant_turn("", [("call_w1", "get_weather", {"city": "Paris"}), ("call_f2", "to_fahrenheit", '{"celsius": 20}')]),
    tool_turn("20 C, sunny", "call_w1"),
    tool_turn("68.0", "call_f2"),
]


def test_a_round_trip_renders_through_the_template_with_ids(qwen, llama):
    prompt = render_chat(qwen, CONVERSATION, FUNCTIONS)
    assert "# Tools" in prompt and '"name": "to_fahrenheit"' in prompt  # tools in Qwen's own section
    assert f"{QWEN_CALL}\n{QWEN_CALL_2}" in prompt  # JSON-text arguments written as an object
    assert "<tool_response>\n20 C, sunny\n</tool_response>\n<tool_response>\n68.0\n</tool_response>" in prompt
    assert "You can use these tools" not in prompt
    # Llama 3 takes one call per message; its results carry their ids (this template writes them).
    prompt = render_chat(llama, CONVERSATION, FUNCTIONS)
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in prompt
    assert "[call_w1] 20 C, sunny" in prompt and "[call_f2] 68.0" in prompt


def test_tool_results_get_the_name_of_the_call_they_answer():
    seen = {}

    class Recording:
        chat_template = QWEN25_TOOLS_TEMPLATE

        def apply_chat_template(self, turns, **kwargs):
            seen["turns"] = turns
            return "<tool_call>" + "".join(t["function"]["name"] for t in kwargs.get("tools") or [])

    render_chat(Recording(), CONVERSATION, FUNCTIONS)
    tool_turns = [t for t in seen["turns"] if t["role"] == "tool"]
    assert [(t["tool_call_id"], t["name"]) for t in tool_turns] == [("call_w1", "get_weather"), ("call_f2", "to_fahrenheit")]
    assert seen["turns"][1]["tool_calls"][0] == {"id": "call_w1", "type": "function",
                                                  "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def test_a_required_call_opens_in_the_prompt_and_is_held_to_the_format_keys(qwen, llama):
    assert render_chat(qwen, CONVERSATION[:1], FUNCTIONS, required=True).endswith("<|im_start|>assistant\n<tool_call>\n")
    assert render_chat(llama, CONVERSATION[:1], FUNCTIONS, required=True).endswith("<|end_header_id|>\n\n")
    schema = constrained(GenerationConfig(), FUNCTIONS[:1], True, arguments_key=LLAMA3_JSON.arguments_key).json_schema
    assert '"parameters": {"type": "object"' in schema and '"arguments"' not in schema


def test_what_cannot_be_rendered_is_an_error_naming_it(llama):
    with pytest.raises(ConfigError, match=r"parameters schema of tool 'bad' is not JSON"):
        tool_functions([{"type": "function", "function": {"name": "bad", "parameters": {"default": object()}}}])
    # Llama 3's template lists tools in the first user message, and raises without one.
    with pytest.raises(ConfigError, match=r"cannot render tools \['get_weather', 'to_fahrenheit'\].*first user message"):
        render_chat(llama, [{"role": "system", "content": "Be brief."}], FUNCTIONS)


def feed_all(stream: ToolCallStream, deltas: list[str]) -> list[str]:
    return [stream.feed(d) for d in deltas]


def test_hermes_text_streams_until_a_call_opens():
    stream = ToolCallStream(FUNCTIONS, HERMES)
    shown = feed_all(stream, ["Let", " me look.", "\n<tool", "_call>\n{\"name\": \"get_weather\", ",
                              "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"])
    assert shown == ["Let", " me look.", "", "", ""]
    rest, call = stream.finish()
    assert rest == "" and call.name == "get_weather" and [c.name for c in stream.calls] == ["get_weather"]


def test_hermes_text_that_only_looked_like_an_opening_is_released():
    stream = ToolCallStream(FUNCTIONS, HERMES)
    assert feed_all(stream, ["Use <", "b>bold</b>"]) == ["Use", " <b>bold</b>"]
    assert stream.finish() == ("", None) and stream.stats() == {}


def test_parallel_calls_off_keeps_the_first_and_says_so():
    stream = ToolCallStream(FUNCTIONS, HERMES, parallel=False)
    feed_all(stream, [QWEN_CALL, "\n", QWEN_CALL_2])
    rest, call = stream.finish()
    assert call.name == "get_weather" and len(stream.calls) == 1 and stream.stats() == {"dropped_tool_calls": 1}


def test_a_required_call_continues_the_opening_and_a_non_call_is_an_error():
    stream = ToolCallStream(FUNCTIONS, HERMES, opened=True, required=True)
    assert feed_all(stream, ['{"name": "to_fahrenheit", ', '"arguments": {"celsius": 3}}']) == ["", ""]
    assert stream.finish()[1].arguments == {"celsius": 3}
    stream = ToolCallStream(FUNCTIONS, HERMES, opened=True, required=True)
    stream.feed('{"name": "to_fahrenheit", "arguments": {"celsius": ')
    with pytest.raises(BlendInputError, match=r"was required.*celsius.*raise max_tokens"):
        stream.finish()


def test_a_malformed_call_in_auto_mode_is_text_and_flagged():
    stream = ToolCallStream(FUNCTIONS, HERMES)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city"}}\n</tool_call>'
    assert feed_all(stream, [text]) == [""]
    rest, call = stream.finish()
    assert call is None and rest == text and "not JSON" in stream.stats()["malformed_tool_call"]


def test_llama3_answers_are_calls_only_from_their_start():
    stream = ToolCallStream(FUNCTIONS, LLAMA3_JSON)
    assert feed_all(stream, ["<|python", "_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}"]) == ["", ""]
    assert stream.finish()[1].arguments == {"city": "Oslo"}
    stream = ToolCallStream(FUNCTIONS, LLAMA3_JSON)
    assert feed_all(stream, ["It is", " {warm}"]) == ["It is", " {warm}"]
    assert stream.finish() == ("", None)


def test_hermes_reads_calls_in_json_code_blocks_and_leaves_other_json_as_text():
    fenced = '```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo"}\n}\n```'
    parsed = HERMES.parse(fenced, FUNCTIONS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", {"city": "Oslo"})]
    answer = '```json\n{"temperature": 4}\n```'
    assert HERMES.parse(answer, FUNCTIONS) == HERMES.parse(answer, FUNCTIONS).__class__(answer)
    stream = ToolCallStream(FUNCTIONS, HERMES)
    assert feed_all(stream, ["``", "`json\n{", '"name": "get_weather", "arguments": {"city": "Oslo"}}\n```']) == ["", "", ""]
    assert stream.finish()[1].arguments == {"city": "Oslo"}
    stream = ToolCallStream(FUNCTIONS, HERMES)
    assert feed_all(stream, ["``", "`python\nprint(1)"]) == ["", "```python\nprint(1)"]
