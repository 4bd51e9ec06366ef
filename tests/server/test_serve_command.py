"""``cacheblend-rag serve`` as a user starts it: a subprocess on a free port that prints its URL, says 503 then
200 on /health, answers with its API key, lets a running request finish on SIGTERM and exits 0."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from serve_process import ServeProcess

pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    process = ServeProcess(["--model", "tiny-llama", "--port", "0", "--store", "memory"], log,
                           env={"CACHEBLEND_API_KEY": "k3y"})
    yield process
    process.stop()


def test_it_prints_its_url_and_is_healthy_once_loaded(serve):
    assert serve.name == "tiny-llama"
    seen = serve.wait_healthy()
    assert seen[-1] == 200 and set(seen) <= {503, 200}  # 503 while the model loads, if the poll came early


def test_it_answers_with_its_key_and_refuses_without(serve):
    serve.wait_healthy()
    refused = httpx.post(f"{serve.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 401
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="k3y", max_retries=0)
    reply = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2)
    assert reply.usage.completion_tokens <= 2


def test_sigterm_lets_a_running_request_finish_then_exits_0(serve):
    serve.wait_healthy()
    events: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                "max_tokens": 120, "min_tokens": 120}
        with httpx.stream("POST", f"{serve.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer k3y"}) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    assert serve.terminate() == 0, serve.log.read_text()
    reader.join(60)
    assert events[-1] == "data: [DONE]"
    finish = [json.loads(e[6:]) for e in events[:-1] if '"finish_reason": "length"' in e]
    assert finish, "the request was cut off instead of finishing"
