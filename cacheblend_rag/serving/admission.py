"""How much KV memory the running requests of one scheduler may hold, and who may start.

A running request holds the K/V of its prompt and of the answer it may still write: ``(prompt
tokens + max_new_tokens) x`` the model's KV bytes per token (:func:`kv_bytes_per_token`). Sixteen
long prompts at once can need more than the machine has; the scheduler therefore keeps a budget
(``SchedulerConfig.kv_budget_bytes``, else :func:`default_kv_budget`) and a :class:`KVLedger` of
what its running requests reserved:

* a request is sized on the scheduler's worker as soon as it is queued (its prompt tokenized);
  one whose need is larger than the whole budget could never start and is refused at once with
  :class:`KVBudgetError`, which names its need, the budget and how to change either;
* the request at the head of the queue starts when its need fits beside what the running ones
  reserved, else it waits, and so does everything behind it (first come, first served: a large
  request is never passed over by a stream of small ones, at the price of idle room while it
  waits);
* its reservation is freed when it finishes, fails or is cancelled.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ByteSize

from cacheblend_rag.errors import CacheBlendError
from cacheblend_rag.models.shapes import LayerShapes

logger = logging.getLogger(__name__)

# Shares of the memory free when the scheduler starts (the weights are loaded by then, so it is
# already net of them) that the running requests' KV may take by default. On a CPU the rest is
# left to the blend's working tensors, the chunk, prefix and segment caches and the rest of the
# host; on a GPU the blend's activations and the allocator's slack need less.
CPU_SHARE = 0.5
CUDA_SHARE = 0.8

RAISE_BUDGET = ("raise the budget with kv_budget_bytes=... on the LLM or chat model "
                "(SchedulerConfig(kv_budget_bytes=...) for serving.scheduler_for)")


class KVBudgetError(CacheBlendError, RuntimeError):
    """A request needs more KV memory than the scheduler's whole budget: it could never start."""


def readable(size: int) -> str:
    return ByteSize(size).human_readable(separator=" ")


def kv_bytes_per_token(engine: Any) -> int:
    """Bytes of K/V one token takes in ``engine``'s dtype: 2 (K and V) x layers x KV heads x head dim
    x the dtype's size."""
    # Read from the config, not the layer-wise adapter, so that an engine serving by full prefill is sized too.
    return LayerShapes.of(engine.model.config).kv_bytes_per_token(engine.dtype.itemsize)


def available_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: free GPU memory for CUDA, else the host's available
    memory (psutil where installed, else /proc/meminfo, else the free pages ``os.sysconf`` reports)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def default_kv_budget(engine: Any) -> tuple[int, str]:
    """The budget a scheduler of ``engine`` takes when none is set, and how it was sized: a share of
    the memory free on its device now (:data:`CPU_SHARE`, :data:`CUDA_SHARE`), and never less than
    one request filling the model's context window, so that every prompt the model can take can run
    (alone, when memory is short)."""
    device = engine.device
    share = CUDA_SHARE if device.type == "cuda" else CPU_SHARE
    free = available_memory(device)
    one_window = engine.context_window * kv_bytes_per_token(engine)
    budget = max(int(free * share), one_window)
    where = "GPU memory" if device.type == "cuda" else "host memory"
    how = (f"{share:.0%} of the {readable(free)} of {where} free when the scheduler started" if budget > one_window
           else f"one request filling the {engine.context_window}-token context window ({where} free: {readable(free)})")
    return budget, how


@dataclass
class KVLedger:
    """What the running requests of one scheduler reserved against its budget (the scheduler's lock
    guards it)."""

    bytes_per_token: int
    budget: int
    budget_source: str
    reserved: int = 0

    def need(self, tokens: int) -> int:
        return max(0, int(tokens)) * self.bytes_per_token

    def fits_now(self, need: int) -> bool:
        return self.reserved + need <= self.budget

    def refusal(self, need: int, model: str) -> KVBudgetError:
        """Why a request of ``need`` bytes can never start, and what to change."""
        tokens = need // self.bytes_per_token if self.bytes_per_token else 0
        return KVBudgetError(
            f"this request needs {readable(need)} of KV memory ({tokens} tokens of prompt and max_new_tokens at "
            f"{self.bytes_per_token:,} bytes a token of {model}), more than the scheduler's whole KV budget of "
            f"{readable(self.budget)} ({self.budget_source}), so it could never start: {RAISE_BUDGET}, or lower "
            "the need with fewer or shorter retrieved chunks, a shorter prompt, or a smaller max_new_tokens "
            "(max_tokens in LangChain)")


def ledger_for(engine: Any, kv_budget_bytes: int | None) -> KVLedger:
    """A ledger for ``engine`` with ``kv_budget_bytes`` as its budget (``None``: :func:`default_kv_budget`)."""
    per_token = kv_bytes_per_token(engine)
    if kv_budget_bytes is not None:
        return KVLedger(per_token, kv_budget_bytes, "kv_budget_bytes as set")
    budget, how = default_kv_budget(engine)
    logger.info("KV budget of %s's scheduler: %s (%s)", engine.model_name, readable(budget), how)
    return KVLedger(per_token, budget, how)
