"""ToolCallStream: which text of an answer with tools bound can be shown as it comes (the decision both
integrations stream by; their streams are tested in test_tool_streaming.py)."""

from __future__ import annotations

import pytest

from cacheblend_rag.serving.tool_stream import ToolCallStream, could_start_call
from cacheblend_rag.serving.tools import tool_functions

CALL = ["{\"", "name", "\": \"", "set_mode", "\", \"arguments\": {\"mode\": \"", "safe", "\"}}"]
FUNCTIONS = tool_functions([{"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {"mode": {"enum": ["fast", "safe"]}}}}}])


def test_text_is_shown_from_the_first_delta_that_rules_a_call_out():
    stream = ToolCallStream(FUNCTIONS)
    assert [stream.feed(d) for d in ["\n", " Once", " upon"]] == ["", "\n Once", " upon"]
    assert stream.finish() == ("", None)


@pytest.mark.parametrize("text, could", [("", True), ("  ", True), ("{", True), ("{ \"na", True),
                                         ("{Hello", False), ("Hi {", False), ("{}", False)])
def test_could_start_call(text, could):
    assert could_start_call(text) is could


def test_a_call_is_held_and_read_whole_at_the_end():
    stream = ToolCallStream(FUNCTIONS)
    assert all(stream.feed(d) == "" for d in CALL)
    rest, call = stream.finish()
    assert rest == "" and call.name == "set_mode" and call.arguments == {"mode": "safe"}


def test_held_json_that_is_no_call_is_shown_at_the_end():
    stream = ToolCallStream(FUNCTIONS)
    assert stream.feed('{"answer": 42}') == ""
    assert stream.finish() == ('{"answer": 42}', None)
