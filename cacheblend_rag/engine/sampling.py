"""The next token from a request's logits, with transformers' logits processors and warpers.

:class:`TokenSampler` applies what ``model.generate`` would, in its order, built once per request:
``MinNewTokensLengthLogitsProcessor``, ``RepetitionPenaltyLogitsProcessor`` and
``NoRepeatNGramLogitsProcessor`` to the logits as they are; then greedy, or in float32
``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper`` and
a draw. Two parts are ours, where transformers has nothing that fits:

- The JSON constraint (:class:`~cacheblend_rag.engine.constraints.JsonConstraint`), and with it the
  hold on end-of-sequence below ``min_new_tokens``: a complete JSON answer allows only
  end-of-sequence, which must then win (transformers' processor would leave no token possible).
- The draw. ``torch.multinomial`` checks its input on the host, a sync per token; the draw here is
  the same exponential race (``argmax(probs / noise)``) written out, so nothing is read back but the id.

All of it runs where the logits are: nothing of the vocabulary's size crosses to the host.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cacheblend_rag.config import GenerationConfig


class TokenSampler:
    """The next token from logits, as ``model.generate`` would pick it: repetition penalty over the
    prompt and the answer so far, no repeated n-grams, then greedy, or temperature with top-k, top-p
    and min-p, seeded for reproducibility. A :class:`~cacheblend_rag.engine.constraints.JsonConstraint`
    first removes every token that would break the answer's JSON, and ``eos`` ids are removed until the
    answer holds ``cfg.min_new_tokens`` tokens. ``cfg`` must be :meth:`GenerationConfig.resolved`.

    The processors are built at the first call, where the logits' device and vocabulary are known, and
    kept for the request. They read the prompt and the answer so far as ``input_ids``, which live in a
    buffer on the device with room for the answer: a step writes its one new id.

    The draw is torch's own for one sample (``multinomial`` draws exponential noise ``q`` of the
    vocabulary's size and takes ``argmax(probs / q)``), written out so that it makes no host sync. On a
    CPU it draws the same noise from the same seeded generator as ``multinomial`` would, so a seed gives
    the same tokens; on a GPU the noise comes from a generator on the GPU seeded alike: a seed still
    gives the same tokens every time there, not the ones the host's generator would have drawn."""

    def __init__(self, cfg: GenerationConfig, prompt_ids: Sequence[int] = (), constraint: Any = None,
                 eos: Iterable[int] = ()) -> None:
        self.cfg = cfg
        self.constraint = constraint
        self.eos = sorted(eos) if cfg.min_new_tokens else []
        self.prompt_ids = list(prompt_ids)
        self.seed = cfg.seed if cfg.seed is not None else int(time.time_ns() % (2**63))
        self._generators: dict[torch.device, torch.Generator] = {}
        self._eos_index: torch.Tensor | None = None
        self._device: torch.device | None = None
        self.processors = LogitsProcessorList()  # on the logits as they are (built at the first call)
        self.warpers = LogitsProcessorList()  # on float32 scores, when sampling
        self._ids: torch.Tensor | None = None  # [1, room]: the prompt, then the answer's ids so far
        self._filled = 0
        self._reads_ids = False  # whether a processor reads the ids (else only their count)
        self._holding = bool(self.eos) and constraint is None  # MinNewTokensLengthLogitsProcessor in the list

    @property
    def generator(self) -> torch.Generator | None:
        """The host's generator (``None`` when greedy)."""
        return None if self.cfg.greedy else self._generator(torch.device("cpu"))

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
            self._generators[device].manual_seed(self.seed)
        return self._generators[device]

    def _build(self, device: torch.device) -> None:
        """The request's processors and warpers, as ``model.generate`` would make them for ``cfg``."""
        cfg = self.cfg
        self._device = device
        processors: list[LogitsProcessor] = []
        if self._holding:  # with a constraint, the hold is ours (see _hold_eos)
            processors.append(MinNewTokensLengthLogitsProcessor(len(self.prompt_ids), cfg.min_new_tokens, self.eos,
                                                                device=str(device)))
        if cfg.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(float(cfg.repetition_penalty)))
        if cfg.no_repeat_ngram_size:
            processors.append(NoRepeatNGramLogitsProcessor(cfg.no_repeat_ngram_size))
        self.processors = LogitsProcessorList(processors)
        self._reads_ids = any(not isinstance(p, MinNewTokensLengthLogitsProcessor) for p in processors)
        warpers: list[LogitsProcessor] = []
        if not cfg.greedy:
            if cfg.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(float(cfg.temperature)))
            if cfg.top_k > 0:
                warpers.append(TopKLogitsWarper(cfg.top_k))
            if cfg.top_p < 1.0:
                warpers.append(TopPLogitsWarper(float(cfg.top_p)))
            if cfg.min_p > 0.0:
                warpers.append(MinPLogitsWarper(float(cfg.min_p)))
        self.warpers = LogitsProcessorList(warpers)
        self._ids, self._filled = None, 0

    def _input_ids(self, generated: Sequence[int], device: torch.device) -> torch.Tensor:
        """The prompt and ``generated`` as ``[1, n]`` ids on ``device``: a view of a buffer that grows by
        the ids not yet written (one a step); where no processor reads them, a view of one zero as long."""
        total = len(self.prompt_ids) + len(generated)
        if not self._reads_ids:  # MinNewTokensLengthLogitsProcessor counts them: no write, no copy
            if self._ids is None:
                self._ids = torch.zeros((1, 1), dtype=torch.long, device=device)
            return self._ids.expand(1, total)
        if self._ids is None or self._ids.shape[1] < total:
            planned = len(self.prompt_ids) + self.cfg.max_new_tokens  # more only where a caller decodes past it
            room = max(total, planned, 2 * self._ids.shape[1] if self._ids is not None else 0)
            ids = torch.zeros((1, room), dtype=torch.long, device=device)
            ids[0, : len(self.prompt_ids)] = torch.tensor(self.prompt_ids, dtype=torch.long, device=device)
            self._ids, self._filled = ids, len(self.prompt_ids)
        for position in range(self._filled, total):  # a scalar write: no read back from the device
            self._ids[0, position] = generated[position - len(self.prompt_ids)]
        self._filled = total
        return self._ids[:, :total]

    def __call__(self, logits: torch.Tensor, generated: Sequence[int] = ()) -> int:
        return int(self.sample(logits, generated))

    def sample(self, logits: torch.Tensor, generated: Sequence[int] = ()) -> torch.Tensor:
        """The next token's id, a 0-d ``long`` tensor on ``logits``' device (read it back when needed)."""
        if self._device != logits.device:
            self._build(logits.device)
        if self.constraint is not None:
            logits = self._hold_eos(self.constraint.mask(logits, generated), generated)
        if self._holding and len(generated) >= self.cfg.min_new_tokens:
            self._stop_holding_eos()
        # Processors take a batch, [1, vocab]; argmax over it is the index in the one row.
        scores = logits.unsqueeze(0) if self.processors or self.warpers else logits
        if self.processors:
            ids = self._input_ids(generated, logits.device)
            # Called one by one: LogitsProcessorList.__call__ inspects each processor's signature every step.
            for processor in self.processors:
                scores = processor(ids, scores)
        if self.cfg.greedy:
            return torch.argmax(scores)
        scores = scores.float()
        for warper in self.warpers:  # none of them reads the ids
            scores = warper(None, scores)  # type: ignore[arg-type]
        # The noise of a [1, vocab] tensor is the same draws as of [vocab]: the same tokens for a seed.
        probs = scores.softmax(-1)
        noise = torch.empty_like(probs).exponential_(1, generator=self._generator(probs.device))
        return torch.argmax(probs / noise)

    def _stop_holding_eos(self) -> None:
        """Drop MinNewTokensLengthLogitsProcessor once the answer is long enough: it would still copy the
        logits and build its mask every step."""
        self._holding = False
        self.processors = LogitsProcessorList(p for p in self.processors
                                              if not isinstance(p, MinNewTokensLengthLogitsProcessor))
        if not self._reads_ids:
            self._ids = None

    def _hold_eos(self, logits: torch.Tensor, generated: Sequence[int]) -> torch.Tensor:
        """End-of-sequence removed below ``min_new_tokens``, unless the JSON constraint allows nothing else (a
        finished JSON answer: it ends, min_new_tokens or not). Ours, not MinNewTokensLengthLogitsProcessor:
        that one would leave no token possible there."""
        if not self.eos or len(generated) >= self.cfg.min_new_tokens:
            return logits
        if self._eos_index is None or self._eos_index.device != logits.device:
            self._eos_index = torch.tensor(self.eos, device=logits.device)
        held = logits.index_fill(-1, self._eos_index, float("-inf"))
        return torch.where(torch.isfinite(held).any(), held, logits)  # decided on the device: no sync


__all__ = ["TokenSampler"]
