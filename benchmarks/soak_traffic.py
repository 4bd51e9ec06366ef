"""The soak's traffic: 16 clients on their own threads, through LangChain and LlamaIndex, sync, async and
streaming, asking RAG questions over the warmed corpus, holding multi-turn chats, asking over passages no
one warmed (misses), cancelling mid-stream or dropping the connection, and one control stream (ratio 1.0
against full prefill). Each client sends at Poisson times (``rate`` requests/s over all clients, times the
burst factor while a burst runs) and records every request. Imported by ``soak.py``."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from cacheblend_rag.errors import CacheBlendError

# (framework, how it calls, what it asks): 16 clients.
CLIENTS: list[tuple[str, str, str]] = [
    *[("langchain", "sync", "rag")] * 3, *[("langchain", "async", "rag")] * 2, ("langchain", "stream", "rag"),
    ("langchain", "stream-cancel", "rag"), ("langchain", "sync", "chat"),
    *[("llamaindex", "sync", "rag")] * 2, ("llamaindex", "async", "rag"), ("llamaindex", "stream", "rag"),
    ("llamaindex", "async-stream-drop", "rag"), ("llamaindex", "sync", "chat"), ("llamaindex", "sync", "miss"),
    ("llamaindex", "sync", "control"),
]
FOLLOW_UPS = ["What else do the passages say about it?", "Which passage says so?"]
# A clear error is one of this package's, with a message that says what happened (not a bare class name).
CLEAR_MESSAGE_CHARS = 20


@dataclass
class Record:
    client: int
    framework: str
    mode: str
    kind: str
    submitted: float  # seconds since the soak began
    passages: int
    ttft: float | None = None
    latency: float | None = None
    outcome: str = "in flight"  # answer, error, cancelled (on purpose), hang
    error: str | None = None
    clear: bool | None = None
    control_equal: bool | None = None
    text: str = ""
    expected: str | None = None  # the control stream's: full prefill's answer
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        row = asdict(self)
        keep = ("cache_hits", "cache_misses", "load_failures", "chunks_found", "prefix_tokens", "segment_tokens",
                "mode", "ttft_s", "prefix_tokens", "exact_tokens", "recomputed_tokens")
        row["stats"] = {k: self.stats[k] for k in keep if k in self.stats}
        return row


def rag_prompt(passages: list[str], question: str) -> str:
    return "Passages:\n" + "".join(passages) + f"\nQuestion: {question}\nAnswer in a few words."


class Traffic:
    """Runs the clients until :meth:`stop`; ``burst`` (a float, 1.0 normally) multiplies the arrival rate."""

    def __init__(self, llms: dict[str, Any], corpus: Any, *, rate: float, seed: int, deadline_s: float,
                 reference: dict[str, tuple[str, int]], started: float) -> None:
        self.llms, self.corpus, self.rate, self.seed = llms, corpus, rate, seed
        self.deadline_s = deadline_s
        self.reference = reference  # control prompt -> (full prefill's answer, its passages)
        self.started = started
        self.burst = 1.0
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._go = threading.Event()  # cleared for a lull: no new arrivals (pause / resume)
        self._go.set()
        self._threads: list[threading.Thread] = []
        self._cold = 0

    def now(self) -> float:
        return time.monotonic() - self.started

    # ------------------------------------------------------------ clients
    def prime(self) -> None:
        """One request per client, all at once, before the clock starts: first calls' allocations (batches of up
        to 16, each framework's code paths) happen here, not in the warm-up the healthy numbers come from."""
        def one(index: int) -> None:
            framework, mode, kind = CLIENTS[index]
            rng = random.Random(-1 - index)
            loop = asyncio.new_event_loop() if "async" in mode else None
            prompt, passages, turns = self._prompt(rng, "rag" if kind == "miss" else kind, [])
            try:
                self._run(Record(index, framework, mode, kind, 0.0, passages), loop, prompt, turns, framework, mode,
                          kind)
            finally:
                if loop is not None:
                    loop.close()

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(CLIENTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.deadline_s)

    def start(self) -> None:
        for index, (framework, mode, kind) in enumerate(CLIENTS):
            thread = threading.Thread(target=self._client, args=(index, framework, mode, kind),
                                      name=f"soak-client-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def pause(self) -> None:
        """No new arrivals until :meth:`resume`; requests in flight finish. The lull in which the soak reads RSS
        with nothing running, at the warm-up's end."""
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def stop(self, grace_s: float) -> list[Record]:
        """Stop sending; wait up to ``grace_s`` for requests in flight. One still running then is a hang."""
        self._stop.set()
        end = time.monotonic() + grace_s
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))
        with self._lock:
            for record in self.records:
                if record.outcome == "in flight":
                    record.outcome, record.error = "hang", f"no answer within {grace_s:.0f} s of the soak's end"
            return list(self.records)

    def _client(self, index: int, framework: str, mode: str, kind: str) -> None:
        rng = random.Random(self.seed * 1000 + index)
        loop = asyncio.new_event_loop() if "async" in mode else None
        history: list[tuple[str, str, int]] = []  # a chat's turns: (question, answer, passages in the first)
        next_at = self.now()
        try:
            while not self._stop.is_set():
                next_at += rng.expovariate(self.rate / len(CLIENTS) * self.burst)
                if self._stop.wait(max(0.0, next_at - self.now())):
                    return
                if not self._go.is_set():  # a lull: this arrival is not sent, and the schedule restarts after it
                    while not self._go.wait(0.1):
                        if self._stop.is_set():
                            return
                    next_at = self.now()
                    continue
                next_at = max(next_at, self.now() - 1.0)  # a client behind its schedule does not catch up in a rush
                prompt, passages, turns = self._prompt(rng, kind, history)
                record = Record(index, framework, mode, kind, round(self.now(), 3), passages)
                with self._lock:
                    self.records.append(record)
                self._run(record, loop, prompt, turns, framework, mode, kind)
                if kind == "chat":  # three turns, then a new conversation; one that failed starts again
                    answered = record.outcome == "answer" and len(history) < 2
                    history = [*history, (turns[-1], record.text, passages)] if answered else []
        finally:
            if loop is not None:
                loop.close()

    def _prompt(self, rng: random.Random, kind: str, history: list[tuple[str, str, int]]
                ) -> tuple[str, int, list[str]]:
        """The request's prompt, how many stored passages it holds, and its turns (a chat's history and question)."""
        corpus = self.corpus
        if kind == "miss":
            with self._lock:
                at, self._cold = self._cold, self._cold + 2
            passages = [corpus.cold[(at + i) % len(corpus.cold)] for i in range(2)]
            return rag_prompt(passages, rng.choice(corpus.questions)), 2, []
        if kind == "control":
            prompt = rng.choice(sorted(self.reference))
            return prompt, self.reference[prompt][1], []
        if kind == "chat" and history:
            turns = [t for question, answer, _ in history for t in (question, answer)]
            return turns[0], history[0][2], [*turns, rng.choice(FOLLOW_UPS)]
        q = rng.randrange(len(corpus.questions))
        group = corpus.warm[q]
        passages = rng.sample(group, k=min(len(group), rng.choice([2, 3])))
        first = rag_prompt(passages, corpus.questions[q])
        return first, len(passages), [first]

    # ------------------------------------------------------------ one request
    def _run(self, record: Record, loop: Any, prompt: str, turns: list[str], framework: str, mode: str,
             kind: str) -> None:
        begun = time.monotonic()
        llm = self.llms["control" if kind == "control" else framework]
        try:
            if loop is not None:
                coroutine = (_ask_async_langchain if framework == "langchain" else _ask_async_llamaindex)(
                    llm, turns or [prompt], mode, begun)
                ttft, text, stats, cancelled = loop.run_until_complete(
                    asyncio.wait_for(coroutine, self.deadline_s))
            else:
                ask: Callable = _ask_langchain if framework == "langchain" else _ask_llamaindex
                ttft, text, stats, cancelled = ask(llm, turns or [prompt], mode, begun)
        except asyncio.TimeoutError:
            self._finish(record, begun, "hang", error=f"no answer within the {self.deadline_s:.0f} s deadline")
            return
        except Exception as exc:  # what a client sees: the soak counts it and checks that it is clear
            clear = isinstance(exc, CacheBlendError) and len(str(exc)) >= CLEAR_MESSAGE_CHARS
            self._finish(record, begun, "error", error=f"{type(exc).__name__}: {exc}"[:400], clear=clear)
            return
        record.stats = dict(stats or {})
        record.text = text
        # A call that returns whole shows no first token: the engine's own time from submission to it.
        whole = mode in ("sync", "async") and "ttft_s" in record.stats
        record.ttft = round(record.stats["ttft_s"] if whole else ttft, 4)
        if kind == "control":
            record.expected = self.reference[prompt][0]
            record.control_equal = text == record.expected
        outcome = "cancelled" if cancelled else "answer"
        self._finish(record, begun, outcome)

    def _finish(self, record: Record, begun: float, outcome: str, *, error: str | None = None,
                clear: bool | None = None) -> None:
        latency = time.monotonic() - begun
        if outcome != "error" and latency > self.deadline_s:
            outcome, error = "hang", f"answered after {latency:.1f} s, past the {self.deadline_s:.0f} s deadline"
        with self._lock:
            record.latency, record.outcome, record.error, record.clear = round(latency, 4), outcome, error, clear


# ---------------------------------------------------------------- the frameworks' calls
# Each returns (time to first text, text, stats, cancelled on purpose).
def _langchain_messages(turns: list[str]) -> list[Any]:
    from langchain_core.messages import AIMessage, HumanMessage

    return [(HumanMessage if i % 2 == 0 else AIMessage)(t) for i, t in enumerate(turns)]


def _llamaindex_messages(turns: list[str]) -> list[Any]:
    from llama_index.core.llms import ChatMessage

    return [ChatMessage(role="user" if i % 2 == 0 else "assistant", content=t) for i, t in enumerate(turns)]


def _ask_langchain(llm: Any, turns: list[str], mode: str, begun: float) -> tuple[float, str, dict, bool]:
    messages = _langchain_messages(turns)
    if mode == "sync":
        message = llm.invoke(messages)
        return time.monotonic() - begun, message.content, message.response_metadata.get("cacheblend", {}), False
    ttft, total = None, None
    for chunk in llm.stream(messages):
        ttft = ttft if ttft is not None else time.monotonic() - begun
        total = chunk if total is None else total + chunk
        if mode == "stream-cancel" and chunk.content:
            break  # the client closes the stream after its first text: the request is cancelled
    stats = total.response_metadata.get("cacheblend", {}) if total is not None else {}
    return ttft or time.monotonic() - begun, total.content if total else "", stats, mode == "stream-cancel"


def _ask_llamaindex(llm: Any, turns: list[str], mode: str, begun: float) -> tuple[float, str, dict, bool]:
    if len(turns) > 1:
        response = llm.chat(_llamaindex_messages(turns))
        return time.monotonic() - begun, response.message.content or "", dict(response.additional_kwargs), False
    if mode == "sync":
        response = llm.complete(turns[0])
        return time.monotonic() - begun, response.text, dict(response.additional_kwargs), False
    ttft, last = None, None
    for last in llm.stream_complete(turns[0]):  # noqa: B007 (the last chunk is read after the loop)
        ttft = ttft if ttft is not None else time.monotonic() - begun
    return ttft or time.monotonic() - begun, last.text if last else "", dict(last.additional_kwargs) if last else {}, False


async def _ask_async_langchain(llm: Any, turns: list[str], mode: str, begun: float) -> tuple[float, str, dict, bool]:
    message = await llm.ainvoke(_langchain_messages(turns))
    return time.monotonic() - begun, message.content, message.response_metadata.get("cacheblend", {}), False


async def _ask_async_llamaindex(llm: Any, turns: list[str], mode: str, begun: float
                                ) -> tuple[float, str, dict, bool]:
    if mode == "async":
        response = await llm.acomplete(turns[0])
        return time.monotonic() - begun, response.text, dict(response.additional_kwargs), False
    stream = await llm.astream_complete(turns[0])
    ttft, text = None, ""
    async for response in stream:
        ttft = time.monotonic() - begun
        text = response.text
        break  # the client goes away after its first text: the stream is closed under the request
    await stream.aclose()
    return ttft or time.monotonic() - begun, text, {}, True
