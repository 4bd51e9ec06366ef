"""The chat scripts of issue 31 on tiny engines: benchmarks/bench_chat.py's document and targets block,
benchmarks/chat_newcomer.py's per-turn table and target (also on SmolLM2, slow), and the bound on a
later turn's fresh tokens they use (bench_support.conversation)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from bench_support.conversation import chunk_separator_tokens, fresh_bound, turn_glue_tokens
from cacheblend_rag.testing import tiny_tokenizer

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


# ------------------------------------------------------------------ the bound
def test_turn_glue_is_what_the_template_adds_around_one_more_message():
    tokenizer = tiny_tokenizer()
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    # ChatML: the previous answer's end, the user turn around the message, the assistant's opening.
    glue = (count("<|im_end|>\n") + count("<|im_start|>user\n") + count("<|im_end|>\n")
            + count("<|im_start|>assistant\n"))
    assert turn_glue_tokens(tokenizer) == glue
    assert fresh_bound(tokenizer, "Why") == glue + count("Why")
    assert fresh_bound(tokenizer, "Why", partial_block=15) == glue + count("Why") + 15


def test_chunk_separators_count_only_between_found_chunks():
    tokenizer = tiny_tokenizer()
    chunks = ["Paris is the capital of France.", "The Amazon river flows through Brazil."]
    prompt = f"Context:\n{chunks[0]}\n\n{chunks[1]}\n\nQuestion: where?"
    count = len(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    assert chunk_separator_tokens(tokenizer, prompt, chunks) == count
    assert chunk_separator_tokens(tokenizer, prompt, chunks[:1]) == 0


# ------------------------------------------------------------------ bench_chat
def test_bench_chat_reports_every_method_per_turn_and_the_targets(chat_musique, tmp_path, monkeypatch, capsys):
    bench = script("bench_chat")
    monkeypatch.setattr(bench, "SYSTEM_PROMPT", "Answer from the passages in a few words.")
    plot = tmp_path / "chat.png"
    assert bench.main(["--model", "tiny-llama", "--data", str(chat_musique), "--conversations", "1", "--turns", "4",
                       "--passages", "2", "--max-passage-tokens", "12", "--max-new-tokens", "4",
                       "--teacher-tokens", "3", "--no-progress", "--plot", str(plot)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [r["turn"] for r in document["turns"]] == [1, 2, 3, 4]
    names = {m.name for m in bench.METHODS}
    for row in document["turns"]:
        assert set(row["methods"]) == names
        assert all(m["ttft_s"] > 0 and m["kl"] >= 0 for m in row["methods"].values())
        assert row["methods"]["full_prefill"]["kl"] == pytest.approx(0.0, abs=1e-6)
        assert set(row["speedup"]) >= {"prefix+blending_vs_blending", "prefix+blending_vs_full_prefill"}
    # One history for all methods: the prompts of a turn are the same for every method.
    first = document["conversations"][0]
    for row in first:
        prompts = {m["reused_tokens"] + m["recomputed_tokens"] + m["fresh_tokens"] for m in row["methods"].values()}
        assert len(prompts) == 1
    targets = document["targets"]
    assert targets["evaluated"] and targets["turn"] == 4
    assert {"vs_blending", "vs_full_prefill", "kl_no_worse_than_blending"} <= set(targets)
    assert isinstance(targets["all_met"], bool)
    assert plot.stat().st_size > 0


def test_bench_chat_refuses_a_conversation_past_the_context(chat_musique, monkeypatch):
    bench = script("bench_chat")
    monkeypatch.setattr(bench, "SYSTEM_PROMPT", "word " * 5000)
    with pytest.raises(Exception, match="context"):
        bench.main(["--model", "tiny-llama", "--data", str(chat_musique), "--conversations", "1", "--turns", "2",
                    "--passages", "1", "--max-new-tokens", "2", "--teacher-tokens", "1", "--no-progress"])


# ------------------------------------------------------------------ the newcomer
def newcomer(model: str, embedding: str, tmp_path: Path, capsys, max_new_tokens: int) -> dict:
    chat = script("chat_newcomer")
    plot = tmp_path / "newcomer.png"
    # The history follows the chunks in this chat engine's prompt: only the segment cache (on by
    # default) reuses it.
    assert chat.main(["--model", model, "--embedding", embedding, "--max-new-tokens", str(max_new_tokens),
                      "--no-progress", "--plot", str(plot)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert plot.stat().st_size > 0
    rows = document["turns"]
    assert [r["turn"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["chunks_found"] == 4 and row["new_message_tokens"] > 0
        assert row["reused_tokens"] + row["recomputed_tokens"] + row["fresh_tokens"] == row["prompt_tokens"]
        assert row.get("partial_block_allowance", 0) == 0  # the prefix cache keeps partial blocks
    return document


def test_newcomer_scenario_on_a_tiny_model(tmp_path, capsys):
    document = newcomer("tiny-llama", "hash", tmp_path, capsys, 6)
    assert document["targets"]["with_allowances"]["met"], document["turns"]


@pytest.mark.slow
def test_newcomer_scenario_on_smollm2(tmp_path, capsys):
    """The issue's scenario as written: SmolLM2, all-MiniLM-L6-v2, FAISS top 4, a 300-token system prompt."""
    document = newcomer("SmolLM2-135M-Instruct", "minilm", tmp_path, capsys, 24)
    assert 250 <= document["system_prompt_tokens"] <= 350
    assert document["targets"]["with_allowances"]["met"], document["turns"]
