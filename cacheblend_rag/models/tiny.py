"""Tiny, randomly initialised models of each supported architecture and an offline tokenizer.

What the ``tiny-*`` model names load everywhere a model name is taken (the integrations, the command line,
the server): a whole pipeline in well under a second, with no download; their answers are gibberish. The
tests use them (``cacheblend_rag.testing`` re-exports them), and so may users' own tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
        for p in model.parameters():
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


__all__ = ["CHAT_TEMPLATE", "save_tiny_model", "tiny_config", "tiny_model", "tiny_tokenizer"]
