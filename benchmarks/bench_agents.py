"""Agents that answer (issue 71): one agent task on one model, five ways, so that what this package changes
is told apart from what the model can do (prints JSON; ``--out`` writes it, ``--resume`` keeps finished runs).

The task, one run per MuSiQue question whose gold answer is written in its own passages (``--runs`` of them,
in file order): the question (after a system turn saying what the tools are for with ``--system task``);
two tools, ``search_passages`` (the question's own ten passages ranked by word overlap with the query, top
``--k``) and ``calculate`` (an arithmetic expression, a tool the task does not need); ``auto`` tool choice;
greedy decoding; at most ``--max-steps`` model calls of at most ``--max-tokens`` tokens. The issue's four ways
and a fifth that tells parsing apart from rendering, taking turns per question (their order rotates):

* ``reference``: plain transformers, no blending: ``generate`` on the engine's own model, the prompt from the
  model's chat template with the tools passed as JSON schemas, the calls parsed in the template's own
  format (Qwen2.5's ``<tool_call>{json}</tool_call>``: hermes), tool turns appended as the template expects;
* ``reference_our_parser``: the same, the calls read as this package reads them (also in ```` ```json ````
  blocks or as a bare JSON call, which Qwen2.5-Coder writes instead of ``<tool_call>`` blocks);
* ``blending_off``: ``ChatCacheBlend(reuse_chunk_kv=False)`` with ``bind_tools`` and a plain
  ``create_retriever_tool``, in a hand loop (call, run the tools, ``ToolMessage``, call again);
* ``blended``: the same loop, the shipped default: ``cacheblend_retriever_tool``, the passages' K/V
  precomputed (untimed) as an ingestion pipeline would have done;
* ``function_agent``: LlamaIndex's ``FunctionAgent`` on ``CacheBlendLLM`` with LlamaIndex's
  ``cacheblend_retriever_tool``, ``early_stopping_method="generate"`` (out of iterations, it answers).

Per way: the share of runs that call ``search_passages``, that end with a non-empty answer, and whose answer
holds a gold answer (SQuAD normalization: lower case, no punctuation or articles); the answering call's TTFT
(the last model call's, the one that answered: transformers' first streamed token, the response's own
``ttft_s`` in the package). All five share one loaded model.

    .venv/bin/python benchmarks/bench_agents.py --model qwen2.5-coder-1.5b --runs 10 \\
        --resume results/agents_qwen.jsonl --out docs/data/agents_qwen1p5b.json
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agentic_rag import OverlapRetriever, corpus  # noqa: E402

from cacheblend_rag.bench.metrics import normalize_answer  # noqa: E402
from cacheblend_rag.bench.prompt import MusiqueExample, load_musique  # noqa: E402
from cacheblend_rag.bench.report import git_info, machine_info, print_report  # noqa: E402

DEFAULT_DATA = "../shared/data/musique_dev.json"
WAYS = ("reference", "reference_our_parser", "blending_off", "blended", "function_agent")
TOOL = "search_passages"
TOOL_DESCRIPTION = "Search the passages; returns the passages most related to the query."
SYSTEM = (f"You answer questions from passages. Call the {TOOL} tool to find the passages you need (as often as "
          "the question needs), then answer the question in at most five words, from the passages only.")
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: the expression, for example "(3 + 4) * 2".
    """
    operations = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
                  ast.USub: operator.neg}

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in operations:
            return operations[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in operations:
            return operations[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        return f"{value(ast.parse(str(expression), mode='eval').body):g}"
    except (SyntaxError, ValueError, ZeroDivisionError) as error:
        return f"cannot evaluate {expression!r}: {error}"


def answerable(examples: list[MusiqueExample]) -> list[MusiqueExample]:
    """The questions with a gold answer written in their own passages (normalized)."""
    def written(example: MusiqueExample) -> bool:
        text = normalize_answer(" ".join(f"{title} {body}" for title, body in example.passages))
        return any(normalize_answer(gold) and f" {normalize_answer(gold)} " in f" {text} " for gold in example.answers)
    return [e for e in examples if written(e)]


def holds_gold(answer: str, golds: list[str]) -> bool:
    text = f" {normalize_answer(answer)} "
    return any(normalize_answer(gold) and f" {normalize_answer(gold)} " in text for gold in golds)


class FirstToken:
    """A transformers streamer that notes when the first generated token arrives (``put`` gets the prompt first)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_reference(engine: Any, example: MusiqueExample, retriever: OverlapRetriever, args: argparse.Namespace,
                  our_parser: bool = False) -> dict[str, Any]:
    """Plain transformers: the chat template as shipped with the tools, ``generate``, calls read in the
    template's own format (``<tool_call>`` blocks) or, ``our_parser``, as this package reads them (also in
    ```json blocks, or a bare JSON call: what Qwen2.5-Coder writes)."""
    from cacheblend_rag.serving.tool_formats import HERMES
    from cacheblend_rag.serving.tools import tool_functions

    from langchain_core.utils.function_calling import convert_to_openai_tool

    def search_passages(query: str) -> str:
        """Search the passages; returns the passages most related to the query.

        Args:
            query: what to search for.
        """
        return "\n\n".join(d.page_content for d in retriever.invoke(query))

    tools = {"search_passages": search_passages, "calculate": calculate}
    schemas = [convert_to_openai_tool(f) for f in tools.values()]
    tokenizer, model = engine.tokenizer, engine.model
    messages = [*_system_turn(args), {"role": "user", "content": example.question}]
    calls: list[tuple[str, dict[str, Any]]] = []
    for _ in range(args.max_steps):
        ids = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"].to(model.device)
        streamer, started = FirstToken(), time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                                 do_sample=False, streamer=streamer, pad_token_id=tokenizer.eos_token_id)
        ttft = (streamer.first or time.perf_counter()) - started
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        found = []
        if our_parser:
            found = [(c.name, dict(c.arguments)) for c in HERMES.parse(text, tool_functions(schemas)).calls]
        for body in ([] if our_parser else _TOOL_CALL.findall(text)):
            try:
                call = json.loads(body)
                found.append((str(call["name"]), dict(call.get("arguments") or {})))
            except (ValueError, KeyError, TypeError):
                continue
        if not found:
            return {"calls": calls, "answer": text.strip(), "ttft_s": ttft, "untagged_call": _looks_like_call(text)}
        messages.append({"role": "assistant", "content": "" if our_parser else _TOOL_CALL.sub("", text).strip(),
                         "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in found]})
        for name, arguments in found:
            calls.append((name, arguments))
            try:
                result = tools[name](**arguments) if name in tools else f"no tool named {name}"
            except TypeError as error:
                result = f"bad arguments: {error}"
            messages.append({"role": "tool", "name": name, "content": result})
    return {"calls": calls, "answer": "", "ttft_s": None, "failure": f"no answer within {args.max_steps} calls"}


def _system_turn(args: argparse.Namespace) -> list[dict[str, str]]:
    """``--system task``: the task's system turn; ``template``: none, so the chat template writes its own."""
    return [{"role": "system", "content": SYSTEM}] if args.system == "task" else []


def _looks_like_call(text: str) -> bool:
    """Whether an answer the native parser read as text is a call in another form: a JSON object with a
    "name" (bare or in a ```json fence), or one in doubled braces (copied from Qwen2.5's template)."""
    body = re.sub(r"^```(?:json)?|```$", "", text.strip()).strip()
    if body.startswith("{{") and '"name"' in body:
        return True
    try:
        return isinstance(value := json.loads(body), dict) and "name" in value
    except ValueError:
        return False


def run_langchain(llm: Any, retriever_tool: Any, example: MusiqueExample, args: argparse.Namespace) -> dict[str, Any]:
    """``bind_tools`` and a hand loop, as langchain-core's docs write one."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_core.tools import tool

    tools = {t.name: t for t in (retriever_tool, tool(calculate))}
    bound = llm.bind_tools(list(tools.values()))
    messages: list[Any] = [SystemMessage(t["content"]) for t in _system_turn(args)] + [HumanMessage(example.question)]
    calls: list[tuple[str, dict[str, Any]]] = []
    for _ in range(args.max_steps):
        message = bound.invoke(messages)
        messages.append(message)
        stats = message.response_metadata.get("cacheblend", {})
        if not message.tool_calls:
            return {"calls": calls, "answer": str(message.content).strip(), "ttft_s": stats.get("ttft_s"),
                    "mode": stats.get("mode"), "reused_tokens": stats.get("reused_tokens"),
                    "fallback_reason": stats.get("fallback_reason")}
        for call in message.tool_calls:
            calls.append((call["name"], dict(call["args"])))
            messages.append(tools[call["name"]].invoke(call) if call["name"] in tools else
                            _unknown_tool(call))
    return {"calls": calls, "answer": "", "ttft_s": None, "failure": f"no answer within {args.max_steps} calls"}


def _unknown_tool(call: dict[str, Any]) -> Any:
    from langchain_core.messages import ToolMessage

    return ToolMessage(f"no tool named {call['name']}", tool_call_id=call["id"])


def run_function_agent(llm: Any, retriever: OverlapRetriever, example: MusiqueExample, args: argparse.Namespace
                       ) -> dict[str, Any]:
    """LlamaIndex's ``FunctionAgent`` with the blended retriever tool and ``calculate``."""
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.core.tools import FunctionTool
    from llama_index.postprocessor.cacheblend import cacheblend_retriever_tool

    nodes = {d.page_content: TextNode(text=d.page_content) for d in retriever.documents}

    class Overlap(BaseRetriever):
        """The LangChain ways' ranking (``OverlapRetriever``), as LlamaIndex nodes."""

        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return [NodeWithScore(node=nodes[d.page_content]) for d in retriever.invoke(query_bundle.query_str)]

    tools = [cacheblend_retriever_tool(Overlap(), llm, name=TOOL, description=TOOL_DESCRIPTION),
             FunctionTool.from_defaults(calculate)]
    # "generate": out of iterations, the agent answers from what it has instead of raising (docs/usage.md's pattern)
    agent = FunctionAgent(tools=tools, llm=llm, system_prompt=SYSTEM if args.system == "task" else None,
                          early_stopping_method="generate")

    async def ask() -> Any:  # agent.run gives a handler to await, not a coroutine
        return await agent.run(user_msg=example.question, max_iterations=args.max_steps)

    try:
        result = asyncio.run(ask())
    except Exception as error:  # noqa: BLE001 - a failed run is a result here
        return {"calls": [], "answer": "", "ttft_s": None, "failure": f"{type(error).__name__}: {error}"}
    stats = llm.last_stats or {}
    return {"calls": [(c.tool_name, dict(c.tool_kwargs)) for c in result.tool_calls],
            "answer": str(result.response.content or "").strip(), "ttft_s": stats.get("ttft_s"),
            "mode": stats.get("mode"), "reused_tokens": stats.get("reused_tokens"),
            "fallback_reason": stats.get("fallback_reason")}


def summarize(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    runs = len(outcomes)
    ttfts = [o["ttft_s"] for o in outcomes if o.get("ttft_s") is not None]
    share = (lambda test: round(sum(map(test, outcomes)) / runs, 3)) if runs else (lambda test: None)
    return {
        "runs": runs,
        "called_the_tool": share(lambda o: any(name == TOOL for name, _ in o["calls"])),
        "answered": share(lambda o: bool(o["answer"])),
        "answer_holds_gold": share(lambda o: o["holds_gold"]),
        "untagged_calls": share(lambda o: bool(o.get("untagged_call"))),
        "answering_ttft_s_p50": round(statistics.median(ttfts), 3) if ttfts else None,
        "answering_ttft_s_mean": round(statistics.fmean(ttfts), 3) if ttfts else None,
        "seconds_per_run": round(statistics.fmean(o["seconds"] for o in outcomes), 1) if runs else None,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="catalog name, model folder or .gguf")
    parser.add_argument("--data", default=DEFAULT_DATA, help="MuSiQue-format JSON")
    parser.add_argument("--runs", type=int, default=10, help="questions (one run each, per way)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument("--k", type=int, default=3, help="passages search_passages returns")
    parser.add_argument("--passage-tokens", type=int, default=None,
                        help="each passage cut to this many tokens (default: whole, so the gold stays in it)")
    parser.add_argument("--max-steps", type=int, default=4, help="most model calls per run")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens per model call")
    parser.add_argument("--system", choices=("template", "task"), default="template",
                        help="template: no system turn (the chat template's own); task: SYSTEM, the task's")
    parser.add_argument("--dtype", default=None, help="model dtype (default: the loader's choice for this device)")
    parser.add_argument("--resume", default=None, help="JSONL of finished runs: kept, and not run again")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = sorted(set(ways) - set(WAYS))
    if unknown:
        raise SystemExit(f"--ways: unknown {unknown}; choose among {', '.join(WAYS)}")
    from langchain_cacheblend import ChatCacheBlend, cacheblend_retriever_tool
    from langchain_core.tools import create_retriever_tool
    from llama_index.llms.cacheblend import CacheBlendLLM

    from cacheblend_rag.serving import shared_engine

    examples = answerable(load_musique(args.data))[: args.runs]
    engine = shared_engine(args.model, dtype=args.dtype)
    chats = {"blending_off": ChatCacheBlend(engine=engine, reuse_chunk_kv=False, temperature=0.0,
                                            max_tokens=args.max_tokens),
             "blended": ChatCacheBlend(engine=engine, temperature=0.0, max_tokens=args.max_tokens)}
    llama = CacheBlendLLM(engine=engine, temperature=0.0, max_new_tokens=args.max_tokens)
    done: dict[tuple[str, int], dict[str, Any]] = {}
    resume = Path(args.resume) if args.resume else None
    if resume and resume.exists():
        for line in resume.read_text().splitlines():
            row = json.loads(line)
            done[(row["way"], row["question"])] = row
    todo = [(i, ways[(i + j) % len(ways)]) for i in range(len(examples)) for j in range(len(ways))]
    for i, way in tqdm(todo, desc="agent runs", file=sys.stderr):
        if (way, i) in done:
            continue
        example = examples[i]
        retriever = OverlapRetriever(documents=corpus(engine, example, args.passage_tokens), k=args.k)
        if way == "blended":  # precomputed, untimed, as an ingestion pipeline would have
            chats["blended"].warm([d.page_content for d in retriever.documents], announce=False, show_progress=False)
        if way == "function_agent":
            llama.warm([d.page_content for d in retriever.documents], announce=False, show_progress=False)
        started = time.perf_counter()
        runners: dict[str, Callable[[], dict[str, Any]]] = {
            "reference": lambda: run_reference(engine, example, retriever, args),
            "reference_our_parser": lambda: run_reference(engine, example, retriever, args, our_parser=True),
            "blending_off": lambda: run_langchain(chats["blending_off"], create_retriever_tool(
                retriever, TOOL, TOOL_DESCRIPTION), example, args),
            "blended": lambda: run_langchain(chats["blended"], cacheblend_retriever_tool(
                retriever, chats["blended"], TOOL, TOOL_DESCRIPTION), example, args),
            "function_agent": lambda: run_function_agent(llama, retriever, example, args),
        }
        outcome = runners[way]()
        outcome.update(way=way, question=i, text=example.question, golds=example.answers,
                       holds_gold=holds_gold(outcome["answer"], example.answers),
                       seconds=round(time.perf_counter() - started, 2))
        done[(way, i)] = outcome
        if resume:
            resume.parent.mkdir(parents=True, exist_ok=True)
            with resume.open("a") as f:
                f.write(json.dumps(outcome, default=str) + "\n")
        print(f"[{way}] q{i}: calls={[n for n, _ in outcome['calls']]} answer={outcome['answer'][:60]!r} "
              f"gold={outcome['holds_gold']}" + (f" failure={outcome['failure']}" if outcome.get("failure") else ""),
              file=sys.stderr)
    results = {way: {**summarize([done[(way, i)] for i in range(len(examples)) if (way, i) in done]),
                     "outcomes": [done[(way, i)] for i in range(len(examples)) if (way, i) in done]}
               for way in ways}
    document = {
        "benchmark": "agents",
        "model": args.model,
        "dtype": str(engine.dtype),
        "questions": f"the first {len(examples)} MuSiQue questions of {args.data} whose gold answer is written in "
                     "their own passages",
        "settings": {k: getattr(args, k)
                     for k in ("runs", "k", "passage_tokens", "max_steps", "max_tokens", "system", "dtype")},
        "table": {way: {k: v for k, v in r.items() if k != "outcomes"} for way, r in results.items()},
        "results": results,
        "machine": machine_info(engine.device),
        "git": git_info(),
    }
    print_report(document, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
