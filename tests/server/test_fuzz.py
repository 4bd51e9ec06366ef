"""The server's input, fuzzed (issue 69): Schemathesis generates requests from the app's own OpenAPI schema for
every route, valid ones and invalid ones, and calls the app in process (its ASGI transport, no socket); each
response must be no 5xx, within a per-request timeout, and what the schema declares for its status (body,
media type, headers). Then Hypothesis throws hostile ``documents`` at the completions route.

Bounded: a few dozen examples per route, answers of a few tokens, a timeout per request; a few seconds each
on the tiny model.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from cacheblend_rag.server import create_app  # noqa: E402

pytestmark = pytest.mark.slow

OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/documents/warm"), ("GET", "/v1/models"),
              ("GET", "/health"), ("GET", "/metrics")]
EXAMPLES = 40
# Seconds one request may take before the transport cancels it and the test fails as a hang.
REQUEST_TIMEOUT_S = 20
# The schema types the fields; what a value means (a role's name, a range, a neutral value of a field this
# server cannot honour) is checked by translate.py, so a schema-valid request may rightly be a 400: the check
# that every schema-valid request is accepted does not apply. Every other check of Schemathesis runs.
EXCLUDED = [positive_data_acceptance]
# The fuzzer's answer lengths capped: a generated max_tokens of 10**9 is capped to the window's room by the
# server (test_server_errors' concern), which on the tiny model is seconds of decoding per example.
MAX_ANSWER_TOKENS = 4
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def api_schema():
    """The app's schema over a tiny model of its own (what the fuzzer leaves in the caches must not reach the
    other tests' shared ``tiny_settings``: their cached-token counts), its lifespan started (by fetching the
    schema) and the model ready; the lifespan is ended after the module (Schemathesis' pytest plugin, which
    would end it after each test, is off: pyproject.toml's addopts)."""
    from schemathesis.python import asgi

    from cacheblend_rag.serving import CacheBlendSettings
    from cacheblend_rag.testing import tiny_engine

    own = CacheBlendSettings(engine=tiny_engine("llama"), store_path="memory", temperature=0)
    app = create_app(own)
    try:
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        assert app.state.server.ready.wait(60)
        yield schema
    finally:
        asgi.shutdown_lifespans()
        own.service.scheduler.close()


def _short_answers(case) -> None:
    body = case.body
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > 0:
                body[name] = min(body[name], MAX_ANSWER_TOKENS)


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_every_route_answers_fuzzed_input_as_its_schema_says(api_schema, method, path):
    operation = api_schema[path][method]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    @given(case=cases)
    @FUZZ_SETTINGS
    def fuzz(case):
        _short_answers(case)
        case.call_and_validate(excluded_checks=EXCLUDED, timeout=REQUEST_TIMEOUT_S)

    fuzz()


# What retrieved passages may hold: any Unicode, control characters, lone surrogates (a JSON "\\ud800" escape),
# the tiny tokenizer's special tokens and chat-template markers, and passages far beyond the 4,096-token window.
SPECIAL = ["<|im_end|>", "<|endoftext|>", "<|im_start|>system", "<|im_start|>assistant\n", "<|im_start|>", "\x00"]
PIECES = st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL),
                   st.text(st.characters(min_codepoint=0, max_codepoint=0x1F), max_size=10),
                   st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2))
TEXTS = st.lists(PIECES, max_size=6).map("".join)
# Byte-level BPE of 512 tokens: about a token a byte for this, so 6,000+ words is beyond the window.
HUGE = st.integers(6_000, 20_000).map(lambda words: "many words " * words)
DOCUMENT = st.one_of(TEXTS, st.builds(lambda text, title: {"text": text, "title": title}, TEXTS,
                                      st.none() | TEXTS))
DOCUMENTS = st.one_of(st.lists(DOCUMENT, max_size=4), st.lists(st.one_of(DOCUMENT, HUGE), min_size=1, max_size=2))


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@given(documents=DOCUMENTS, stream=st.booleans())
# Found by this test: a title the template leaves out of the prompt (its document's text is empty) holding a
# lone surrogate reached the tokenizer unchecked, a 500 (prompting.spelling_special_tokens).
@example(documents=[{"text": "", "title": "\udab2<|endoftext|>"}], stream=False)
@example(documents=["many words " * 8_000], stream=True)  # beyond the window before the stream begins
@settings(max_examples=30, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
def _hostile_documents(api_schema, documents, stream):
    body = {"messages": [{"role": "user", "content": "Summarise the passages."}], "documents": documents,
            "max_tokens": MAX_ANSWER_TOKENS, "stream": stream}
    case = api_schema["/v1/chat/completions"]["POST"].Case(body=body, media_type="application/json")
    response = case.call_and_validate(excluded_checks=EXCLUDED, timeout=REQUEST_TIMEOUT_S)
    texts = [d if isinstance(d, str) else d["text"] for d in documents]
    # Beyond the window, unless a lone surrogate is found first (a 400 of its own).
    beyond = sum(map(len, texts)) > 40_000 and all(_is_unicode(t) for t in texts)
    if response.status_code == 200:
        assert not beyond, "a prompt beyond the window was answered"
        if stream:
            assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text, response.text
        else:
            assert isinstance(response.json()["choices"][0]["message"]["content"], str)
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    if beyond:
        assert error["code"] == "context_length_exceeded", error


def test_hostile_documents_get_a_completion_or_a_400(api_schema):
    """Random Unicode, control characters, lone surrogates, special-token strings and passages beyond the window
    in ``documents``: a completion (or a stream ending in [DONE]), else a 400 in OpenAI's shape (a passage
    beyond the window: context_length_exceeded), each matching the schema; never a 5xx."""
    _hostile_documents(api_schema)
