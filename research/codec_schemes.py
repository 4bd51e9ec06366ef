"""Which 4-bit and 8-bit grouping to store chunk KV in: measured, not assumed (prints JSON).

On ``--n`` MuSiQue questions (10 passages of ``--max-passage-tokens``), each chunk's KV is round-
tripped through a scheme in memory and blended at ratio 0 (full reuse: nothing hides the codec's
error) and at 0.15 (the default selection), against full prefill's next-token distribution:

* ``kivi`` (what the store uses): keys per channel over groups of tokens, values per token over
  groups of channels;
* ``per_token``: keys and values both per token over groups of channels (the usual choice for
  activations);
* ``per_channel``: both per channel over groups of tokens.

Also the relative reconstruction error of K and V (Frobenius norm of the error over the norm).

    .venv/bin/python research/codec_schemes.py --n 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from cacheblend_rag import BlendConfig, CacheBlendEngine, FreshSegment
from cacheblend_rag.kv.segments import ChunkKV
from cacheblend_rag.store.format.codec import DEFAULT_GROUP, Int4, Int8, PackedLayer

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"


def _round_trip(codec, keys: torch.Tensor, values: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V after storing in ``codec`` with ``scheme``'s grouping: the store's codec applied to
    the tensors as they are (kivi), to keys transposed like values (per_token), or to values
    transposed like keys (per_channel)."""
    def through(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        packed = PackedLayer(codec, tuple(k.shape), codec.pack(k, v))
        return codec.expand(packed, torch.float32)

    if scheme == "kivi":
        return through(keys, values)
    if scheme == "per_token":  # keys quantized as the store quantizes values
        _, k = through(values, keys)
        _, v = through(keys, values)
        return k, v
    # per_channel: values quantized as the store quantizes keys
    k, _ = through(keys, values)
    v, _ = through(values, keys)
    return k, v


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--max-passage-tokens", type=int, default=100)
    args = p.parse_args(argv)
    engine = CacheBlendEngine.from_pretrained(min_blend_tokens=0)
    examples = json.loads(args.data.read_text())[: args.n]
    codecs = {"int8": Int8(DEFAULT_GROUP), "int4": Int4(DEFAULT_GROUP)}
    schemes = ("kivi", "per_token", "per_channel")
    kl: dict[str, list[float]] = {}
    error: dict[str, list[float]] = {}
    for example in tqdm(examples, desc="questions"):
        head = engine.tokenize("<|im_start|>system\nAnswer from the passages.<|im_end|>\n<|im_start|>user\n")
        chunk_ids = [engine.tokenize(f"{c['title']}\n{c['text']}\n")[: args.max_passage_tokens] for c in example["ctxs"]]
        tail = engine.tokenize(f"Question: {example['question']}<|im_end|>\n<|im_start|>assistant\n")
        reference = engine.full_prefill(head + [t for c in chunk_ids for t in c] + tail).logits.float().log_softmax(-1)
        chunks = engine.prefill_chunks(chunk_ids)
        for codec_name, codec in codecs.items():
            for scheme in schemes:
                stored = []
                for chunk in chunks:
                    pairs = [_round_trip(codec, k, v, scheme) for k, v in zip(chunk.keys, chunk.values)]
                    for (k, v), (k0, v0) in zip(pairs, zip(chunk.keys, chunk.values)):
                        error.setdefault(f"{codec_name}/{scheme}/K", []).append(float((k - k0).norm() / k0.norm()))
                        error.setdefault(f"{codec_name}/{scheme}/V", []).append(float((v - v0).norm() / v0.norm()))
                    stored.append(ChunkKV(chunk.token_ids, [k for k, _ in pairs], [v for _, v in pairs],
                                          chunk.prefix_ids, chunk.model_fingerprint))
                for ratio in (0.0, 0.15):
                    logits = engine.blend([FreshSegment(head), *stored, FreshSegment(tail)],
                                          config=BlendConfig(recompute_ratio=ratio, min_blend_tokens=0)).logits
                    got = logits.float().log_softmax(-1)
                    kl.setdefault(f"{codec_name}/{scheme}@{ratio:g}", []).append(
                        float((reference.exp() * (reference - got)).sum()))
        for ratio in (0.0, 0.15):
            logits = engine.blend([FreshSegment(head), *chunks, FreshSegment(tail)],
                                  config=BlendConfig(recompute_ratio=ratio, min_blend_tokens=0)).logits
            kl.setdefault(f"float32@{ratio:g}", []).append(
                float((reference.exp() * (reference - logits.float().log_softmax(-1))).sum()))
    print(json.dumps({
        "benchmark": "codec_schemes", "model": engine.model_name, "questions": len(examples),
        "group": DEFAULT_GROUP, "note": "KL of the next token against full prefill, chunks computed alone",
        "kl_mean": {k: round(statistics.mean(v), 4) for k, v in kl.items()},
        "relative_error_mean": {k: round(statistics.mean(v), 4) for k, v in error.items()},
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
