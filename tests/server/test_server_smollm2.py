"""On the real SmolLM2-135M-Instruct (the default model): ``cacheblend-rag serve`` with no model argument reuses
the documents of a second request, and at temperature 0 answers as the in-process path does."""

from __future__ import annotations

import openai
import pytest

from serve_process import ServeProcess

pytest.importorskip("uvicorn")

QUESTIONS = ("Which town is the ferry to the mainland from?", "What colour is the lighthouse?")


def _documents() -> list[dict[str, str]]:
    from cacheblend_rag.data import load_demo_corpus

    return [{"title": d.title, "text": d.text} for d in load_demo_corpus()[:3]]


def _in_process_answers(documents: list[dict[str, str]]) -> list[str]:
    """The same requests, in the same order, through ``run_turn`` on settings of the same model and store kind."""
    from cacheblend_rag.serving import CacheBlendSettings
    from cacheblend_rag.serving.chat_turn import ChatTurn, TextDelta, run_turn

    settings = CacheBlendSettings(store_path="memory")
    answers = []
    for question in QUESTIONS:
        turn = ChatTurn(generation=settings.generation_config_with(16, [], {"temperature": 0}),
                        messages=[{"role": "user", "content": question}], documents=documents)
        answers.append("".join(e.text for e in run_turn(settings, turn) if isinstance(e, TextDelta)))
    return answers


@pytest.mark.slow
def test_the_default_model_reuses_documents_and_answers_as_in_process(tmp_path):
    documents = _documents()
    server = ServeProcess(["--port", "0", "--store", "memory"], tmp_path / "serve.log")
    try:
        assert server.name == "SmolLM2-135M-Instruct"
        server.wait_healthy(timeout=300)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        replies = [client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": q}],
                                                  max_tokens=16, temperature=0, extra_body={"documents": documents})
                   for q in QUESTIONS]
        assert server.terminate() == 0
    finally:
        server.stop()
    assert replies[0].model_extra["cacheblend"]["cache_misses"] == len(documents)
    assert replies[1].usage.prompt_tokens_details.cached_tokens > 0
    served = [r.choices[0].message.content for r in replies]
    assert served == _in_process_answers(documents)
