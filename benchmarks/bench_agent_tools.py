"""A two-tool agent task in the model's own tool format, in both integrations (issue 56): how often out of
``--runs`` the calls parse, the tool results come back and the final answer is right (prints JSON; ``--out``
writes it).

The task: "how warm is it in <city>, in Fahrenheit?". The tools are ``get_weather(city)``, which answers a
fixed Celsius temperature per city, and ``convert_temperature(celsius)``, which answers the Fahrenheit value,
so the answer needs both, one after the other. Run ``i`` asks about city ``i`` of :data:`CITIES` in wording
``i`` of :data:`WORDINGS` (both cycle); decoding is greedy (``--temperature 0``, the default), or sampled with
seed ``i`` when ``--temperature`` is above 0.

- LangChain: ``ChatCacheBlend.bind_tools`` and a hand loop (call, run each tool, ``ToolMessage`` with its
  ``tool_call_id``, call again) of at most ``--max-steps`` model calls.
- LlamaIndex: ``FunctionAgent`` over ``CacheBlendLLM`` (parallel calls allowed).

Both share one engine. A run succeeds when ``get_weather`` was called for the city, ``convert_temperature``
with that city's Celsius value, and the final answer holds the Fahrenheit value (to 0.1, or rounded to a
whole degree); a failure says which of these went wrong. ``tool_format`` says which format the chat template
gave (``hermes`` for Qwen2.5's ``<tool_call>``), ``our_system_turn`` whether the prompt used our fallback.

    .venv/bin/python benchmarks/bench_agent_tools.py --runs 10 --out docs/data/agent_tools_1p5b.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

CITIES = {"Paris": 18.0, "Oslo": 4.0, "Cairo": 31.0, "Lima": 22.0, "Tokyo": 26.0}
WORDINGS = [
    "How warm is it in {city} right now, in degrees Fahrenheit?",
    "What is the current temperature in {city} in Fahrenheit?",
    "I need the temperature of {city} in °F. Use the tools.",
    "Tell me how hot {city} is today, converted to Fahrenheit.",
]
# An agent's usual system prompt: what the tools are for and in which order (the tools' own list and call
# format come from the chat template).
SYSTEM = ("You are a weather assistant. To answer in Fahrenheit, first call get_weather for the city (it gives "
          "Celsius), then call convert_temperature with that Celsius value, then answer with the result. "
          "Never guess a temperature.")


def get_weather(city: str) -> str:
    """Get the current temperature of a city, in degrees Celsius."""
    if city.strip().title() not in CITIES:
        return f"No weather data for {city}."
    return f"{CITIES[city.strip().title()]:g} degrees Celsius in {city.strip().title()}"


def convert_temperature(celsius: float) -> str:
    """Convert a temperature from degrees Celsius to degrees Fahrenheit."""
    return f"{float(celsius) * 9 / 5 + 32:.1f}"


def question(run: int) -> tuple[str, str, float]:
    """Run ``run``'s question, its city and the Fahrenheit value the answer must hold."""
    city = list(CITIES)[run % len(CITIES)]
    return WORDINGS[run % len(WORDINGS)].format(city=city), city, CITIES[city] * 9 / 5 + 32


def judge(calls: list[tuple[str, dict[str, Any]]], answer: str, city: str, fahrenheit: float) -> str | None:
    """Why the run failed (``None``: it succeeded)."""
    if not any(name == "get_weather" and str(args.get("city", "")).strip().lower() == city.lower() for name, args in calls):
        return f"no get_weather call for {city}; calls: {calls}"
    celsius = CITIES[city]
    if not any(name == "convert_temperature" and _number(args.get("celsius")) == celsius for name, args in calls):
        return f"no convert_temperature call with {celsius:g}; calls: {calls}"
    numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", answer)]
    if not any(abs(n - fahrenheit) < 0.051 or n == round(fahrenheit) for n in numbers):
        return f"the answer does not hold {fahrenheit:.1f}: {answer!r}"
    return None


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def run_langchain(llm: Any, run: int, max_steps: int) -> dict[str, Any]:
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool

    tools = {t.name: t for t in (tool(get_weather), tool(convert_temperature))}
    bound = llm.bind_tools(list(tools.values()))
    text, city, fahrenheit = question(run)
    messages: list[Any] = [SystemMessage(SYSTEM), HumanMessage(text)]
    calls: list[tuple[str, dict[str, Any]]] = []
    answer = ""
    for _ in range(max_steps):
        message = bound.invoke(messages)
        messages.append(message)
        if message.response_metadata.get("cacheblend", {}).get("malformed_tool_call"):
            return {"calls": calls, "failure": f"malformed call: {message.response_metadata['cacheblend']['malformed_tool_call']}"}
        if not message.tool_calls:
            answer = message.content
            break
        for call in message.tool_calls:
            calls.append((call["name"], call["args"]))
            messages.append(tools[call["name"]].invoke(call))  # a ToolMessage answering call["id"]
    else:
        return {"calls": calls, "failure": f"no answer within {max_steps} model calls"}
    return {"calls": calls, "answer": answer, "failure": judge(calls, answer, city, fahrenheit)}


def run_llama_index(llm: Any, run: int, max_steps: int) -> dict[str, Any]:
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.tools import FunctionTool

    tools = [FunctionTool.from_defaults(get_weather), FunctionTool.from_defaults(convert_temperature)]
    agent = FunctionAgent(tools=tools, llm=llm, system_prompt=SYSTEM, allow_parallel_tool_calls=True)
    text, city, fahrenheit = question(run)

    async def ask() -> Any:
        return await agent.run(user_msg=text, max_iterations=max_steps)

    try:
        result = asyncio.run(ask())
    except Exception as error:  # noqa: BLE001 - a failed run is a result here
        return {"calls": [], "failure": f"{type(error).__name__}: {error}"}
    calls = [(c.tool_name, dict(c.tool_kwargs)) for c in result.tool_calls]
    answer = str(result.response.content or "")
    return {"calls": calls, "answer": answer, "failure": judge(calls, answer, city, fahrenheit)}


def measure(name: str, runner: Callable[[Any, int, int], dict[str, Any]], llm: Any, args: argparse.Namespace,
            prompt_of: Callable[[], str]) -> dict[str, Any]:
    outcomes, failures = [], []
    for run in range(args.runs):
        if args.temperature > 0:
            torch.manual_seed(run)
        started = time.perf_counter()
        outcome = runner(llm, run, args.max_steps)
        outcome.update(run=run, question=question(run)[0], seconds=round(time.perf_counter() - started, 2))
        outcomes.append(outcome)
        if outcome["failure"]:
            failures.append({"run": run, "reason": outcome["failure"]})
        print(f"[{name}] run {run}: {'ok' if not outcome['failure'] else outcome['failure']}", file=sys.stderr)
    prompt = prompt_of() or ""
    return {"runs": args.runs, "successes": args.runs - len(failures), "failures": failures,
            "our_system_turn": "You can use these tools:" in prompt, "outcomes": outcomes}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="catalog name, model folder or .gguf")
    parser.add_argument("--runs", type=int, default=10, help="runs per framework (city and wording vary)")
    parser.add_argument("--max-steps", type=int, default=5, help="most model calls per run")
    parser.add_argument("--max-tokens", type=int, default=160, help="most tokens per model call")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; above 0: sampled, seed = run")
    parser.add_argument("--dtype", default=None, help="model dtype (default: the loader's choice)")
    parser.add_argument("--frameworks", default="langchain,llama_index", help="comma-separated")
    parser.add_argument("--out", default=None, help="write the JSON here too (docs/data/agent_tools_1p5b.json)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM

    from cacheblend_rag.bench.report import git_info, machine_info
    from cacheblend_rag.serving.tool_formats import tool_format

    sampling = {"temperature": args.temperature}
    chat = ChatCacheBlend(model=args.model, dtype=args.dtype, max_tokens=args.max_tokens, **sampling)
    llm = CacheBlendLLM(model=args.model, dtype=args.dtype, max_new_tokens=args.max_tokens, **sampling)
    engine = chat.get_engine()
    wanted = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    results: dict[str, Any] = {}
    if "langchain" in wanted:
        results["langchain"] = measure("langchain", run_langchain, chat, args, lambda: _first_prompt(chat))
    if "llama_index" in wanted:
        results["llama_index"] = measure("llama_index", run_llama_index, llm, args, lambda: llm.last_prompt)
    document = {
        "benchmark": "agent_tools",
        "model": args.model,
        "tool_format": tool_format(engine.tokenizer).name,
        "varied": "city and question wording per run" + (f"; sampled at temperature {args.temperature}, seed = run"
                                                         if args.temperature > 0 else "; greedy decoding"),
        "settings": {k: getattr(args, k) for k in ("runs", "max_steps", "max_tokens", "temperature", "dtype")},
        "results": results,
        "machine": machine_info(engine.device),
        "git": git_info(),
    }
    text = json.dumps(document, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


def _first_prompt(chat: Any) -> str:
    """The prompt of the task's first model call as ChatCacheBlend renders it (it keeps no last prompt)."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_cacheblend._messages import render_prompt

    from cacheblend_rag.serving.tools import tool_functions

    functions = tool_functions([convert_to_openai_tool(tool(get_weather))])
    return render_prompt(chat.get_engine().tokenizer, [SystemMessage(SYSTEM), HumanMessage(question(0)[0])], None,
                         functions)


if __name__ == "__main__":
    raise SystemExit(main())
