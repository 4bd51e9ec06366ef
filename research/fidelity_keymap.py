"""A learned map from a chunk's stale keys to full prefill's (issue 29's research).

The oracles (``fidelity_oracle.py``) put the 1.5B model's loss in the late layers' stale keys, per token:
exact keys recover 74% of full reuse's KL, the best per-chunk shift 54%. Nothing a blend computes predicts
a stale token's own late-layer key error. This asks whether a map fitted *offline*, on full prefills of
other prompts, does: per layer and KV head, ``full_key - stale_key = W @ features + b`` (keys before RoPE),
least squares with a ridge, where the features are what a blend holds for every cached token: its stale key,
and (``+dev``) its key's change at CacheBlend's check layer, where every token is recomputed.

``collect``: per question, the pairs from the research loop's caches (``fidelity_explore.py``'s references
and float32 chunk store), saved as safetensors. ``fit``: leave one question out, the share of the held-out
stale keys' squared error each map explains, per layer, beside the per-chunk mean's (the ``k_shift`` oracle).

    python research/fidelity_keymap.py collect --cache results/fidelity_cache --out results/keymap
    python research/fidelity_keymap.py fit results/keymap --save results/keymap/fits
    python research/fidelity_explore.py run --methods "kv_deviation@0.15;keymap=key" ...  # from research/

What it found (research/quality_notebook.md, "A learned key map"): held out, the maps explain 36-47% of the stale
keys' squared error (a constant per layer and head 36%, the per-chunk mean as an oracle 59%), and in a blend they
make the answer worse (question 5: KL 0.389 -> 1.14 with the key map). Not adopted.
"""

from __future__ import annotations

import argparse
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cacheblend_rag.engine.blend_run import BlendRun
from fidelity_oracle import attribute_replaced, chunk_means  # noqa: E402  (research/ on sys.path)

FEATURES = ("key", "key+dev", "dev", "bias")
CHECK_LAYER = 1  # CacheBlend's, where a blend computes every token: the ``dev`` feature's layer
KEYMAP_OPTIONS = ("keymap", "keymap_scale", "keymap_dir")  # the research loop's ;keymap=KIND[;keymap_scale=S]


def collect(args: argparse.Namespace) -> None:
    from cacheblend_rag.bench.prompt import build_prompt, load_musique
    from cacheblend_rag.bench.references import ReferenceCache
    from cacheblend_rag.engine.blend import CacheBlendEngine
    from cacheblend_rag.store.chunk_cache import ChunkCache
    from cacheblend_rag.store.backends.disk import DiskKVStore

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    engine = CacheBlendEngine.from_pretrained(args.model, device="cpu", dtype="float32")
    a = engine.adapter
    references = ReferenceCache(Path(args.cache) / "references")
    store = ChunkCache(engine, DiskKVStore(Path(args.cache) / "chunks"), storage_dtype="float32")
    examples = load_musique(args.data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kv_shape = (engine.num_layers, a.num_kv_heads, a.head_dim)
    for q in (int(x) for x in args.questions.split(",")):
        prompt = build_prompt(engine.tokenizer, examples[q], passages=10, max_passage_tokens=args.max_passage_tokens)
        ref = references.get(engine.fingerprint, prompt.input_ids, max_new_tokens=16, teacher_tokens=16,
                             need_kv=True, kv_shape=kv_shape)
        chunks = [store.load(c, ()) for c in prompt.chunk_ids]
        if ref is None or any(c is None for c in chunks):
            print(f"q{q}: reference or chunks not cached; run fidelity_explore.py on it first")
            continue
        start = len(prompt.lead_ids)
        n = sum(len(c) for c in chunks)
        positions = torch.arange(start, start + n)
        cos, sin = a.rope_cos_sin(chunks[0].keys[0].unsqueeze(0), positions.unsqueeze(0))
        stale = torch.stack([torch.cat([c.keys[l].float() for c in chunks], dim=1) for l in range(engine.num_layers)])
        full = torch.stack([a.apply_rope(ref.kv[l][0][:, start:start + n].unsqueeze(0).float(), cos, -sin)[0]
                            for l in range(engine.num_layers)])
        chunk_of = torch.cat([torch.full((len(c),), i) for i, c in enumerate(chunks)])
        offset = torch.cat([torch.arange(len(c)) for c in chunks])
        save_file({"stale": stale.contiguous(), "full": full.contiguous(), "chunk_of": chunk_of, "offset": offset},
                  str(out / f"q{q}.safetensors"))
        print(f"q{q}: {n} chunk tokens", flush=True)


def features(stale: torch.Tensor, dev: torch.Tensor, offset: torch.Tensor, kind: str) -> torch.Tensor:
    """``[heads, tokens, f]``: what a blend holds for each stale token of one layer (its stale key ``stale``,
    its key's change at the check layer ``dev``, both ``[heads, tokens, d]`` before RoPE, as ``kind`` names
    them), whether it is its chunk's first token (a sink when the chunk is computed alone), and a constant."""
    names = kind.split("+")
    parts = [x for name, x in (("key", stale), ("dev", dev)) if name in names]
    heads, n = stale.shape[0], stale.shape[1]
    first = (offset == 0).float().view(1, n, 1).expand(heads, n, 1)
    parts += [first, torch.ones(heads, n, 1)]
    return torch.cat(parts, dim=-1).double()


def fit(args: argparse.Namespace) -> None:
    files = sorted(Path(args.folder).glob("q*.safetensors"), key=lambda p: int(p.stem[1:]))
    data = [load_file(str(f)) for f in files]
    layers = data[0]["stale"].shape[0]
    kinds = args.kinds.split(",")
    print(f"{len(data)} questions; held-out share of the stale keys' squared error explained (leave one out), "
          f"ridge {args.ridge}")
    print("| layer | chunk mean (oracle) | " + " | ".join(kinds) + " |\n|" + "---|" * (len(kinds) + 2))
    totals = {k: [0.0, 0.0] for k in ["mean", *kinds]}
    maps: dict[tuple[str, int], list[torch.Tensor]] = {}  # (kind, held-out question): each layer's map
    for layer in range(layers):
        errors = [d["full"][layer].double() - d["stale"][layer].double() for d in data]
        # a chunk's first tokens are a sink when it is computed alone and every selector recomputes them
        keep = [d["offset"] >= args.skip_first for d in data]
        row = {}
        left = sum(float((e - chunk_means(e, d["chunk_of"].long(), int(d["chunk_of"].max()) + 1))[:, k].pow(2).sum())
                   for e, d, k in zip(errors, data, keep))
        total = sum(float(e[:, k].pow(2).sum()) for e, k in zip(errors, keep))
        row["mean"] = (left, total)
        for kind in kinds:
            xs = [features(d["stale"][layer], d["full"][CHECK_LAYER] - d["stale"][CHECK_LAYER], d["offset"],
                           kind)[:, k] for d, k in zip(data, keep)]
            es = [e[:, k] for e, k in zip(errors, keep)]
            gram = [x.transpose(1, 2) @ x for x in xs]
            cross = [x.transpose(1, 2) @ e for x, e in zip(xs, es)]
            g_all, c_all = sum(gram), sum(cross)
            left = 0.0
            for i, (x, e) in enumerate(zip(xs, es)):
                g, c = g_all - gram[i], c_all - cross[i]
                eye = torch.eye(g.shape[-1], dtype=g.dtype) * args.ridge * g.diagonal(dim1=1, dim2=2).mean(-1).view(-1, 1, 1)
                w = torch.linalg.solve(g + eye, c)
                maps.setdefault((kind, int(files[i].stem[1:])), []).append(w.float())
                left += float((e - x @ w).pow(2).sum())
            row[kind] = (left, total)
        for k, (l, t) in row.items():
            totals[k][0] += l
            totals[k][1] += t
        print(f"| {layer} | " + " | ".join(f"{1 - row[k][0] / row[k][1]:.2f}" for k in ["mean", *kinds]) + " |",
              flush=True)
    print("| all | " + " | ".join(f"{1 - l / t:.2f}" for l, t in totals.values()) + " |")
    if args.save:
        Path(args.save).mkdir(parents=True, exist_ok=True)
        for (kind, q), ws in maps.items():
            save_file({"weights": torch.stack(ws).contiguous()}, str(Path(args.save) / f"{kind}_q{q}.safetensors"))
        print(f"maps fitted without each question written to {args.save}/KIND_qN.safetensors")


# ------------------------------------------------------------------------------------- in a blend
def keymap_blend(weights: torch.Tensor, kind: str, scale: float = 1.0) -> AbstractContextManager[None]:
    """Every blend inside moves its stale chunk keys by ``scale`` times the map's prediction (``weights``
    ``[layers, kv_heads, features, head_dim]``, fitted by :func:`fit`), in every layer after the check layer.
    The ``dev`` feature is the check layer's fresh key minus the stored one, which the blend computes for
    every token anyway."""
    original_patch, original_check = BlendRun._patched_layer, BlendRun._choose_at_check_layer

    def unrotated(run: BlendRun, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return run.a.apply_rope(keys[:, :, pos].float(), run.cos[:, pos].float(), -run.sin[:, pos].float())

    def chunk_tokens(run: BlendRun) -> tuple[torch.Tensor, torch.Tensor]:
        cached_pos = run.layout.cached_pos
        index = torch.cat([torch.arange(s, e) for s, e in run.layout.chunk_spans])
        offset = torch.cat([torch.arange(e - s) for s, e in run.layout.chunk_spans])
        return cached_pos[index], offset

    def check(self: BlendRun, layer: int, k: torch.Tensor, v: torch.Tensor):
        key_layer, value_layer = original_check(self, layer, k, v)
        pos, _ = chunk_tokens(self)
        index = torch.searchsorted(self.layout.cached_pos, pos)
        self._keymap_dev = unrotated(self, key_layer, pos)[0] - self.merged.cached(layer)[0][:, index].float()
        return key_layer, value_layer

    def patched(self: BlendRun, layer: int, k: torch.Tensor, v: torch.Tensor):
        key_layer, value_layer = original_patch(self, layer, k, v)
        if not hasattr(self, "_keymap_dev") or layer <= self.check_layer:
            return key_layer, value_layer
        pos, offset = chunk_tokens(self)
        stale = ~torch.isin(pos, self.active) & (offset > 0)  # the fit left chunks' first tokens out
        x = features(unrotated(self, key_layer, pos)[0], self._keymap_dev, offset, kind)
        shift = (x.float() @ weights[layer]).unsqueeze(0)
        rotated = self.a.apply_rope(shift, self.cos[:, pos].float(), self.sin[:, pos].float())
        key_layer[:, :, pos[stale]] += (scale * rotated[:, :, stale]).to(key_layer.dtype)
        return key_layer, value_layer

    stack = ExitStack()
    stack.enter_context(attribute_replaced(BlendRun, "_choose_at_check_layer", check))
    stack.enter_context(attribute_replaced(BlendRun, "_patched_layer", patched))
    return stack


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--model", default="qwen2.5-coder-1.5b")
    c.add_argument("--data", default="../shared/data/musique_dev.json")
    c.add_argument("--questions", default="5,8,11,13,14,17,20,29,30,31,38,48,49")
    c.add_argument("--max-passage-tokens", type=int, default=100)
    c.add_argument("--cache", default="results/fidelity_cache")
    c.add_argument("--out", default="results/keymap")
    c.add_argument("--threads", type=int, default=2)
    f = sub.add_parser("fit")
    f.add_argument("folder")
    f.add_argument("--kinds", default=",".join(FEATURES))
    f.add_argument("--ridge", type=float, default=1e-2)
    f.add_argument("--save", help="write each held-out question's maps here, for the research loop's ;keymap=")
    f.add_argument("--skip-first", type=int, default=1, help="leave out each chunk's first N tokens")
    args = parser.parse_args(argv)
    collect(args) if args.command == "collect" else fit(args)


if __name__ == "__main__":
    main()
