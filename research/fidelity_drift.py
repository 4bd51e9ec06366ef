"""How much of a stale chunk's K/V error is a shift its tokens share (issue 29's research; prints a table).

For each question (10 MuSiQue passages of 100 tokens), full prefill's K/V and each passage's K/V computed
alone (or behind the default's conditioning prefix) are compared, layer by layer, keys before RoPE:

- ``rel``: the stale K (or V) error's norm over full prefill's;
- ``shared``: the share of the squared error that each chunk's mean error (per KV head and channel) explains;
- ``from chosen``: the same, for the tokens a 15% CacheBlend selection (V deviation at layer 1) does not
  recompute, when the mean is taken over the tokens it does: what a blend could correct with what it computes.

    python research/fidelity_drift.py --model qwen2.5-coder-1.5b --questions 5,8,11,13 [--out drift.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import DynamicCache

from cacheblend_rag import CacheBlendEngine
from cacheblend_rag.bench.prompt import build_prompt, load_musique

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "musique_dev.json"


def _squares(error: torch.Tensor, chosen: torch.Tensor) -> dict[str, float]:
    """``error`` ``[kv_heads, tokens, dim]``: its squared norm, what is left after the chunk's mean, and the
    same two over the tokens not chosen when the mean is the chosen tokens'."""
    rest = error[:, ~chosen]
    return {"all": float((error ** 2).sum()), "left": float(((error - error.mean(1, keepdim=True)) ** 2).sum()),
            "rest": float((rest ** 2).sum()),
            "rest_left": float(((rest - error[:, chosen].mean(1, keepdim=True)) ** 2).sum())}


def full_prefill_cache(engine: CacheBlendEngine, prompt) -> DynamicCache:
    cache = DynamicCache(config=engine.model.config)
    engine.model(input_ids=torch.tensor([prompt.input_ids]), cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def drift(engine: CacheBlendEngine, prompt, cache: DynamicCache, conditioned: bool,
          ratio: float = 0.15) -> list[dict[str, float]]:
    """Per layer, against full prefill's ``cache`` of ``prompt``."""
    a = engine.adapter
    chunks = engine.prefill_chunks(prompt.chunk_ids, prefix_ids=prompt.conditioning_prefix(conditioned))
    sums = [{f"{kind}_{part}": 1e-30 for kind in "kv" for part in ("all", "left", "rest", "rest_left", "norm")}
            for _ in range(a.num_layers)]
    start = len(prompt.lead_ids)
    for chunk in chunks:
        span, positions = slice(start, start + len(chunk)), torch.arange(start, start + len(chunk))
        cos, sin = a.rope_cos_sin(chunk.keys[0], positions.unsqueeze(0))
        deviation = (cache.layers[1].values[0, :, span] - chunk.values[1]).norm(dim=-1).sum(0)
        chosen = torch.zeros(len(chunk), dtype=torch.bool)
        chosen[torch.topk(deviation, max(1, round(ratio * len(chunk)))).indices] = True
        for layer in range(a.num_layers):
            full_k = a.apply_rope(cache.layers[layer].keys[:, :, span], cos, -sin)[0]  # back before RoPE
            for kind, full, stale in (("k", full_k, chunk.keys[layer]), ("v", cache.layers[layer].values[0, :, span],
                                                                          chunk.values[layer])):
                for part, value in _squares(full - stale.float(), chosen).items():
                    sums[layer][f"{kind}_{part}"] += value
                sums[layer][f"{kind}_norm"] += float((full ** 2).sum())
        start += len(chunk)
    rows = []
    for s in sums:
        row = {}
        for kind in "kv":
            row[f"{kind}_rel"] = (s[f"{kind}_all"] / s[f"{kind}_norm"]) ** 0.5
            row[f"{kind}_shared"] = 1 - s[f"{kind}_left"] / s[f"{kind}_all"]
            row[f"{kind}_from_chosen"] = 1 - s[f"{kind}_rest_left"] / s[f"{kind}_rest"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a catalog name or path (default: the embedded SmolLM2)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--questions", default="5,8,11,13")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    engine = CacheBlendEngine.from_pretrained(args.model, device="cpu", dtype="float32")
    examples = load_musique(args.data)
    rows = []
    for q in (int(x) for x in args.questions.split(",")):
        prompt = build_prompt(engine.tokenizer, examples[q], passages=10, max_passage_tokens=100)
        cache = full_prefill_cache(engine, prompt)  # one full prefill serves both chunk versions
        for conditioned in (False, True):
            rows += [{"q": q, "conditioned": conditioned, "layer": layer, **r}
                     for layer, r in enumerate(drift(engine, prompt, cache, conditioned))]
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    columns = [f"{kind}_{part}" for kind in "kv" for part in ("rel", "shared", "from_chosen")]
    for conditioned in (False, True):
        print(f"\nchunks {'behind the conditioning prefix' if conditioned else 'alone'} (mean over questions)")
        print("| layer | " + " | ".join(columns) + " |\n|" + "---|" * (len(columns) + 1))
        for layer in range(engine.num_layers):
            picked = [r for r in rows if r["conditioned"] == conditioned and r["layer"] == layer]
            print(f"| {layer} | " + " | ".join(f"{statistics.mean(r[c] for r in picked):.3f}" for c in columns) + " |")


if __name__ == "__main__":
    main()
