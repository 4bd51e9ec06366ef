"""Tiny, randomly initialised models and an offline tokenizer, for fast exact tests.

They are part of the package so that users' own tests (and the integration
tests) can exercise a full pipeline in well under a second, with no download.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_config(arch: str = "llama", **overrides: Any):
    """A small config of ``arch`` (llama, mistral, qwen2, qwen3); ``overrides`` change any field."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"arch={arch!r}; choose one of {sorted(classes)}")
    fields = dict(_TINY, vocab_size=overrides.pop("vocab_size", 512), tie_word_embeddings=False)
    if arch == "qwen3":
        fields["head_dim"] = 16
    if arch == "mistral":
        fields["sliding_window"] = None
    fields.update(overrides)
    return classes[arch](**fields)


def tiny_model(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A randomly initialised causal LM of ``arch``, deterministic for a given seed. The weights are
    drawn in float32 and then converted, so a ``dtype`` model holds the float32 model's weights rounded."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger random weights than the default init, so that attention is far from uniform
    # and blending mistakes show up in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model.to(dtype).eval()


_TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Question: What is the capital of France? Answer: Paris. Context information is below.",
    "Given the context information and not prior knowledge, answer the query.",
    "Marie Curie was a physicist and chemist who won two Nobel prizes in Warsaw and Paris.",
    "The Amazon river flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "0123456789 ,.;:!?'\"()[]{}-_/\\ file_path: doc.txt title: Passages:",
]


def tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained in milliseconds on a fixed text, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_engine(
    arch: str = "llama", *, config: Any = None, seed: int = 0, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", **overrides: Any,
):
    """A :class:`~cacheblend_rag.engine.CacheBlendEngine` over a tiny model (in ``dtype``, on ``device``)
    with :func:`tiny_tokenizer`."""
    from cacheblend_rag.engine import CacheBlendEngine

    tokenizer = tiny_tokenizer()
    model = tiny_model(arch, seed=seed, dtype=dtype, vocab_size=len(tokenizer), **overrides).to(device)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # Test prompts are a few dozen tokens: they must blend, not fall back to full prefill.
    return CacheBlendEngine(model, tokenizer, config=config, model_name=f"tiny-{arch}", min_blend_tokens=0)


def save_tiny_model(folder: str | Path, arch: str = "llama") -> Path:
    """A tiny model and its tokenizer saved as a model folder, as a user's own fine-tune would be:
    what ``model=``, ``warm --model`` and ``load_model`` take."""
    folder = Path(folder)
    tokenizer = tiny_tokenizer()
    model = tiny_model(arch, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ChatML, with Qwen3's switch: enable_thinking=False writes an empty thinking block after the opening.
THINKING_TEMPLATE = CHAT_TEMPLATE + (
    "{% if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
)


def tiny_thinking_engine():
    """A tiny Qwen3 whose chat template honours ``enable_thinking``, as Qwen3's does: for the integrations'
    thinking tests (``chat_template_kwargs``, reasoning kept apart from the answer)."""
    engine = tiny_engine("qwen3")
    engine.tokenizer.chat_template = THINKING_TEMPLATE
    return engine


class ScriptedStream:
    """A served stream whose text deltas are ``pieces`` instead of the model's (a tiny model's text is
    random): the request itself still runs, so ``result()`` and the stats are its own."""

    def __init__(self, stream: Any, pieces: list[str]) -> None:
        self._stream = stream
        self._pieces = list(pieces)

    def __iter__(self) -> Iterator[str]:
        for _ in self._stream:  # the model's own deltas, decoded and dropped
            pass
        yield from self._pieces

    def result(self) -> Any:
        return self._stream.result()

    def close(self) -> None:
        self._stream.close()


def script_answers(llm: Any, monkeypatch: Any, *answers: list[str]) -> None:
    """Make ``llm`` (either integration's) answer its next calls with ``answers``, in order, delta by delta,
    through :class:`ScriptedStream`: for tests of what the integrations make of an answer's text as it
    streams (thinking, tool calls). ``monkeypatch``: pytest's, which undoes it after the test."""
    real_stream, queue = llm.service.stream, list(answers)
    monkeypatch.setattr(llm.service, "stream", lambda *a, **k: ScriptedStream(real_stream(*a, **k), queue.pop(0)))
