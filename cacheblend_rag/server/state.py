"""The model a server serves, loaded in the background, and the tokenizer its request threads count with.

The socket is up before the model is: :meth:`ServerState.start_loading` loads it (or takes the settings it
was given) on a thread of its own and runs one one-token request through the engine's scheduler, and only
then is the state ``ready`` (``GET /health`` 200). A failed load leaves it ``failed`` and calls the
``on_failure`` hook (the CLI stops the server and exits 1).

Request threads count a prompt's tokens before it is submitted (the window check, the default
``max_tokens``) on a copy of the engine's tokenizer, under a lock: the engine's own is the scheduler
worker's alone (a fast tokenizer is not safe to call from two threads at once).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

from cacheblend_rag.engine import gate
from cacheblend_rag.reuse.text import checked_text
from cacheblend_rag.reuse.prompt import prompt_ids, spelling_special_tokens
from cacheblend_rag.server.options import ServerConfig
from cacheblend_rag.serving.chat_turn import ChatTurn, run_turn
from cacheblend_rag.serving.settings import CacheBlendSettings
from cacheblend_rag.store.urls import redact

logger = logging.getLogger(__name__)

LOADING, WARMING, READY, FAILED = "loading", "warming up", "ready", "failed"


class ServerState:
    """The served settings once loaded, the server's status and its own tokenizer."""

    def __init__(self, source: Union[CacheBlendSettings, ServerConfig], config: ServerConfig,
                 on_failure: Optional[Callable[[BaseException], None]] = None) -> None:
        self.config = config
        self._source = source
        self.on_failure = on_failure
        self.status = LOADING
        self.error: Optional[BaseException] = None
        self.settings: Optional[CacheBlendSettings] = None
        # Settings it loads itself are its own: it closes their scheduler at the end (unless told not to).
        self.owns_settings = not isinstance(source, CacheBlendSettings) and config.close_on_shutdown
        self.created = int(time.time())
        self.ready = threading.Event()
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    @property
    def name(self) -> str:
        return self.config.name

    # ------------------------------------------------------------------ loading
    def start_loading(self) -> None:
        self._thread = threading.Thread(target=self._load, name="cacheblend-server-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            source = self._source
            settings = source if isinstance(source, CacheBlendSettings) else source.load()
            self._tokenizer = _copied(settings.service.engine.tokenizer)
            self.settings = settings
            self.status = WARMING
            if self.config.warmup:
                self._warm_up(settings)
            self.status = READY
            self.ready.set()
            logger.info("serving %s (context window %d)", self.name, self.context_window)
        except BaseException as exc:  # reported by /health and the CLI's exit code
            logger.error("the model could not be loaded: %s: %s", type(exc).__name__, redact(exc))
            self.error, self.status = exc, FAILED
            if self.on_failure is not None:
                self.on_failure(exc)

    @staticmethod
    def _warm_up(settings: CacheBlendSettings) -> None:
        """One one-token request by full prefill (nothing cached): the model, the scheduler and the sampler
        all work before the first client's request. Then the correctness gate, which the first blend would
        otherwise pay (1 s on SmolLM2 here, more on larger models): its outcome is logged, a failure is the
        blends' to report (an error, or full prefill where the setting falls back)."""
        turn = ChatTurn(generation=settings.generation_config_with(1, None, {}),
                        messages=[{"role": "user", "content": "Hello"}], reuse=False)
        for _ in run_turn(settings, turn):
            pass
        engine, config = settings.service.engine, settings.blend_config
        if config.gate and engine.adapter is not None and gate.pending(engine):
            started = time.perf_counter()
            try:  # on the scheduler's worker, as every other use of the model; remembered as a blend's gate would be
                ok, err = settings.service.scheduler.call(lambda: gate.remember(engine, engine.run_gate(config)))
            except Exception as exc:  # noqa: BLE001 - the first blend runs it again and reports it to its request
                logger.warning("correctness gate could not run in the warm-up (%s: %s); the first blend runs it",
                               type(exc).__name__, exc)
                return
            logger.info("correctness gate: blending at ratio 1.0 %s full prefill (relative error %.2g) in %.1f s",
                        "matches" if ok else "DIFFERS FROM", err, time.perf_counter() - started)

    def wait_loaded(self, timeout: Optional[float] = None) -> bool:
        """Wait for the load thread (at shutdown: the scheduler is closed only once it exists)."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.settings is not None

    def close(self) -> None:
        """Close the scheduler, cancelling what still runs, if this server loaded the settings itself."""
        if self.owns_settings and self.settings is not None:
            self.settings.service.scheduler.close()

    # ------------------------------------------------------------------ what requests read
    @property
    def context_window(self) -> int:
        assert self.settings is not None
        return self.settings.service.engine.context_window

    def body_limit(self) -> Optional[int]:
        """Bytes a request body may hold; ``None`` before the model is loaded (requests then get 503)."""
        return self.config.body_limit(self.context_window) if self.settings is not None else None

    def count_tokens(self, text: str, documents: Sequence[str] = (), titles: Sequence[str] = ()) -> int:
        """Tokens of ``text`` as the engine tokenizes a prompt (no special tokens added, the ``documents`` and
        their ``titles`` found in it tokenized as the service tokenizes documents), on this server's copy."""
        checked_text(text, "the prompt")
        special = self.settings.service.document_special_tokens if self.settings is not None else "text"
        with self._tokenizer_lock:
            titles = spelling_special_tokens(titles, self._tokenizer) if special == "text" else []
            return len(prompt_ids(text, documents, self._tokenizer, special, titles))


def _copied(tokenizer: Any) -> Any:
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is loaded again from its files
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer.name_or_path)


__all__ = ["FAILED", "LOADING", "READY", "ServerState", "WARMING"]
