"""docs/usage.md's two agent patterns (issue 71: LangGraph's ``create_react_agent`` and LlamaIndex's
``FunctionAgent``), run word for word but for the model, which is the tiny random Llama: a random model's
calls and answers are its own, so this checks that each pattern runs and ends (no error, no endless loop,
something printed), not what it answers; bench_agents measures that on the real model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
HEADING = "### Agents that answer"


def agent_snippets() -> list[str]:
    text = USAGE.read_text(encoding="utf-8")
    section = text[text.index(HEADING):]
    section = section[: section.index("\n## ")]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_section_shows_both_patterns_on_the_quality_model():
    snippets = agent_snippets()
    assert [("create_react_agent" in s, "FunctionAgent" in s) for s in snippets] == [(True, False), (False, True)]
    assert all('model="qwen2.5-coder-1.5b"' in s for s in snippets)


@pytest.mark.parametrize("index", [0, 1], ids=["langgraph_create_react_agent", "llamaindex_function_agent"])
def test_each_pattern_runs_and_ends(index, capsys):
    pytest.importorskip("langgraph.prebuilt")
    snippet = agent_snippets()[index].replace('model="qwen2.5-coder-1.5b"', 'model="tiny-llama"')
    exec(compile(snippet, f"{USAGE}#agents-{index}", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip()
