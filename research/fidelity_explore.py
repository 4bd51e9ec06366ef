"""Fidelity experiments on the 1.5B quality model (issue 29): blends against cached full-prefill references,
and the report of what they did.

``run``: per question, full prefill's greedy answer, its teacher-forced logits and its per-layer K/V are
computed once and kept (the harness's reference cache, ``--reference-cache``); chunk KV (plain, or
computed behind a prefix: the stand-in conditioning ``+prefix``, the prompt's real lead ``+lead``, its
first token ``+sink``, FusionRAG's corpus neighbours ``+nb1``-``+nb3``) is kept in a disk chunk store at float32. Both check what they read (a damaged
entry is reported and computed again) and never unpickle. A method then costs only its blend and its teacher forcing. Results append to a JSONL, one line a
(question, method); a rerun skips what is there, so a stopped run resumes. What `cacheblend-rag bench
--reference-cache --store disk:PATH --resume` does for the package's methods, with the chunk
variants and per-layer stale-K/V distances this research needed.

``report``: the table of research/quality_notebook.md ("Where fidelity goes at 1.5B") from the JSONL: KL per
question and method, recovery of full reuse's KL, questions worse than full reuse; and the speed-fidelity plot,
each method's recovery against its TTFT speedup at 3,043 tokens, estimated as its work bound
(:mod:`cacheblend_rag.calibration.bound`) times the share of its bound that the engine reached when measured
(research/quality_notebook.md, "Speed at 3,000 tokens on the 1.5B model").

    python research/fidelity_explore.py run --methods "kv_deviation@0.15,query_profiled+prefix@0.15"
    python research/fidelity_explore.py report research/data/fidelity_1p5b.jsonl \\
        --plot research/figures/fidelity_1p5b_speed.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file

from cacheblend_rag.calibration.bound import LayerShapes, work_bound
from cacheblend_rag.bench.metrics import recovery, token_kl, top1_agreement
from cacheblend_rag.models import catalog
from cacheblend_rag.models.loader import cache_root, converted_gguf_folder
from cacheblend_rag.bench.prompt import build_prompt, load_musique
from cacheblend_rag.bench.references import Reference, ReferenceCache
from cacheblend_rag.bench.requests import FullPrefillRequest, run_request, teacher_forced_logits
from cacheblend_rag.store.chunk_cache import ChunkCache
from cacheblend_rag.store.backends.disk import DiskKVStore
from cacheblend_rag.engine.generate import eos_token_ids
from cacheblend_rag.config import BlendConfig
from cacheblend_rag.engine.blend import CacheBlendEngine
from cacheblend_rag.kv.segments import CachedSegment, ChunkKV, FreshSegment
from cacheblend_rag.engine.selection import (ProfileRequest, SelectionContext, SelectionNeeds, SelectionStrategy,
                                             register_strategy, top_indices)

from fidelity_ape import ApeSetting, ape_blend, ape_teacher_forcing  # noqa: E402  (research/ on sys.path)
from fidelity_keymap import KEYMAP_OPTIONS, keymap_blend  # noqa: E402
from fidelity_neighbors import NeighbourIndex  # noqa: E402
from fidelity_tail import TAIL_OPTIONS, chunk_hidden_states, tail_blend  # noqa: E402
from fidelity_oracle import (ORACLE_OPTIONS, OracleSetting, affine_key_correction, chunk_lead_tokens,  # noqa: E402
                             corrected_profile, key_correction_layers, local_key_correction, oracle_blend,
                             conditioned_shape, local_shift, pooled_offset_shift, positional_shift, probes_offset,
                             probe_truth_shift, residual_deviation, robust_shift_estimate, similar_shift,
                             sloped_shift)

APE_OPTIONS = ("ape_T", "ape_S", "ape_M")  # ApeSetting's temperature, lse_scale and mass, in that order
NEIGHBOUR_VARIANTS = ("nb1", "nb2", "nb3")  # FusionRAG-style: behind the lead and the n most similar passages
ANSWERABLE_100 = [5, 8, 11, 13, 14, 17, 20, 29, 30, 31, 38, 48, 49]


# -------------------------------------------------------------- an idea tested here: offline sensitivity
# A chunk token whose K/V moves a lot when its chunk is computed behind other text is one whose K/V
# depends on context; measured offline, from the two versions the store can keep of every chunk
# (alone, and behind the stand-in conditioning prefix), layer by layer. ``sensitivity`` recomputes the
# most sensitive tokens (no check layer evidence); ``sensitive_read`` weighs that by the question's
# attention from the profile pass. The scores of the prompt being blended are set before each blend.
SENSITIVITY: dict[str, torch.Tensor] = {}


def _scores(ctx: SelectionContext) -> torch.Tensor:
    s = SENSITIVITY["scores"]
    if ctx.num_cached > s.numel():  # the lead is a cached segment too, and exact
        s = torch.cat([torch.zeros(ctx.num_cached - s.numel()), s])
    return s.to(ctx.cached_v.device)


@register_strategy
@dataclass(frozen=True)
class OfflineSensitivity(SelectionStrategy):
    name: ClassVar[str] = "sensitivity"

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(check_layer=0)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return top_indices(_scores(ctx), ctx.budget)


@register_strategy
@dataclass(frozen=True)
class SensitiveRead(SelectionStrategy):
    name: ClassVar[str] = "sensitive_read"

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(check_layer=0, profile=ProfileRequest(None, 16))

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return top_indices(ctx.question_attention().float() * _scores(ctx).sqrt(), ctx.budget)


# ------------------------------------------- an oracle selector: what a perfect deviation predictor would pick
# The tokens whose stored V is furthest from full prefill's, summed over every layer (each layer's distance
# divided by its mean V norm): CacheBlend's aim (recompute the most deviating tokens) with the deviation known
# everywhere instead of estimated at one early layer. It reads full prefill's K/V, so it only says how much
# the choice of tokens can still give at a budget.
@register_strategy
@dataclass(frozen=True)
class OracleDeviation(SelectionStrategy):
    name: ClassVar[str] = "oracle_dev"

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(check_layer=1)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        s = SENSITIVITY["oracle"]
        if ctx.num_cached > s.numel():
            s = torch.cat([torch.zeros(ctx.num_cached - s.numel()), s])
        return top_indices(s.to(ctx.cached_v.device), ctx.budget)


def oracle_scores(chunks: list[ChunkKV], reference_kv, first: int) -> torch.Tensor:
    """Per chunk token (the chunks back to back from prompt position ``first``): its stored V's squared
    distance to full prefill's, each layer's divided by that layer's mean, summed over layers."""
    n = sum(len(c.token_ids) for c in chunks)
    total = torch.zeros(n)
    for layer, (_, ref_v) in enumerate(reference_kv):
        stored = torch.cat([c.values[layer].float() for c in chunks], dim=1)
        d = (stored - ref_v[:, first:first + n].float()).pow(2).sum(dim=(0, 2))
        total += d / d.mean()
    return total


def sensitivity_scores(plain: list[ChunkKV], conditioned: list[ChunkKV]) -> torch.Tensor:
    """Per chunk token: the squared V distance between its two versions, each layer's divided by that
    layer's mean V norm so that no layer dominates, summed over layers."""
    per_chunk = []
    for a, b in zip(plain, conditioned):
        total = torch.zeros(len(a.token_ids))
        for va, vb in zip(a.values, b.values):
            d = (va.float() - vb.float()).pow(2).sum(dim=(0, 2))
            total += d / vb.float().pow(2).sum(dim=(0, 2)).mean()
        per_chunk.append(total)
    return torch.cat(per_chunk)


# ------------------------------------------------ an idea tested here: whole chunks, the ones the question reads
# At 1.5B nearly every stale token's middle-layer K/V depends on the other passages, and recomputing a
# scattered 15% leaves its neighbours stale. So spend the budget on whole chunks instead: those the
# question pays the most attention in the profile pass (each chunk's first token left out of its score:
# a chunk computed alone makes it a sink), the leftover on single tokens. ``chunk_focus``: the leftover by
# the question's attention; ``chunk_focus_dev``: by V deviation at the check layer (CacheBlend's evidence);
# ``chunk_last``: the chunks nearest the question instead of the most read.
def _chunk_order(ctx: SelectionContext, by: str) -> list[tuple[int, int]]:
    spans = list(ctx.chunk_spans)
    if by == "last":
        return spans[::-1]
    attention = ctx.question_attention().float()
    return sorted(spans, key=lambda s: -float(attention[s[0] + 1:s[1]].sum()))


def _whole_chunks_then(ctx: SelectionContext, order: str, rest: torch.Tensor) -> torch.Tensor:
    chosen: list[int] = []
    for start, end in _chunk_order(ctx, order):
        if len(chosen) + end - start > ctx.budget:
            break
        chosen.extend(range(start, end))
    taken = torch.tensor(chosen, dtype=torch.long)
    rest = rest.clone().float()
    rest[taken] = -math.inf
    extra = top_indices(rest, ctx.budget - len(chosen))
    return torch.sort(torch.cat([taken.to(extra.device), extra])).values


@register_strategy
@dataclass(frozen=True)
class ChunkFocus(SelectionStrategy):
    name: ClassVar[str] = "chunk_focus"

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(check_layer=0, profile=ProfileRequest(None, 16))

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return _whole_chunks_then(ctx, "attention", ctx.question_attention())


@register_strategy
@dataclass(frozen=True)
class ChunkFocusDeviation(SelectionStrategy):
    name: ClassVar[str] = "chunk_focus_dev"

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(check_layer=1, profile=ProfileRequest(None, 16))

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return _whole_chunks_then(ctx, "attention", ctx.deviation_scores("value"))


@register_strategy
@dataclass(frozen=True)
class ChunkLast(SelectionStrategy):
    name: ClassVar[str] = "chunk_last"

    @property
    def needs(self) -> SelectionNeeds:
        return SelectionNeeds(check_layer=1)

    def select(self, ctx: SelectionContext) -> torch.Tensor:
        return _whole_chunks_then(ctx, "last", ctx.deviation_scores("value"))


def parse_method(spec: str):
    """name@ratio[,key=value...]: e.g. 'kv_deviation@0.15', 'query_profiled+prefix@0.15', 'kv_deviation@0.15;check_layer=4'."""
    head = spec.split(";")[0]
    prefix = "plain"
    name, _, ratio = head.partition("@")
    for variant in ("prefix", "lead", "sink", *NEIGHBOUR_VARIANTS):
        if name.endswith("+" + variant):
            name, prefix = name[: -len(variant) - 1], variant
    research = APE_OPTIONS + ORACLE_OPTIONS + KEYMAP_OPTIONS + TAIL_OPTIONS  # ape_of(), oracle_of(), the patches
    kw = {k: v for k, v in _options(spec).items() if k not in research}
    if name == "full_reuse":
        cfg = BlendConfig(recompute_ratio=0.0, selection="kv_deviation", **kw)
    else:
        cfg = BlendConfig(selection=name, recompute_ratio=float(ratio), **kw)
    return cfg, prefix


def _options(spec: str) -> dict:
    """A method's ``;key=value`` options, each value read as JSON where it is JSON."""
    options = {}
    for e in spec.split(";")[1:]:
        k, _, v = e.partition("=")
        try:
            v = json.loads(v)
        except Exception:
            pass
        options[k] = v
    return options


def ape_of(spec: str) -> ApeSetting | None:
    """APE's attention from a method's ``;ape_T=...;ape_S=...;ape_M=...`` (each defaults to 1), or None."""
    options = _options(spec)
    if not set(APE_OPTIONS) & set(options):
        return None
    return ApeSetting(*(float(options.get(name, 1.0)) for name in APE_OPTIONS))


def oracle_of(spec: str) -> OracleSetting | None:
    """An oracle correction from a method's ``;oracle=MODE[;oracle_layers=A-B][;oracle_window=N]
    [;oracle_sample=K[/P]]``, or None."""
    options = _options(spec)
    if "oracle" not in options:
        return None
    return OracleSetting.parse(options["oracle"], options.get("oracle_layers"), options.get("oracle_window"),
                               options.get("oracle_sample"))


def stored_chunks(engine: CacheBlendEngine, store: ChunkCache, chunk_ids: list[list[int]],
                  prefix: tuple[int, ...]) -> list[ChunkKV]:
    """Each chunk's KV computed behind ``prefix``, from ``store`` where it is held, else computed and kept."""
    held = [store.load(c, prefix) for c in chunk_ids]
    missing = [i for i, c in enumerate(held) if c is None]
    if missing:
        for i, chunk in zip(missing, engine.prefill_chunks([chunk_ids[i] for i in missing], prefix_ids=prefix)):
            store.put(chunk)
            held[i] = chunk
    return held  # type: ignore[return-value]


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    engine = CacheBlendEngine.from_pretrained(None if args.model == "smollm2" else args.model, device="cpu", dtype="float32")
    fp = engine.fingerprint
    L = engine.num_layers
    # The harness's reference cache (digests checked, a damaged entry discarded and recomputed) and a
    # disk chunk store holding float32 chunk KV (checked the same way), keyed by model, ids and prefix.
    references = ReferenceCache(Path(args.cache) / "references")
    store = ChunkCache(engine, DiskKVStore(Path(args.cache) / "chunks"), storage_dtype="float32")
    kv_shape = (L, engine.adapter.num_kv_heads, engine.adapter.head_dim)
    eos = eos_token_ids(engine)
    examples = load_musique(args.data)
    done = set()
    if os.path.exists(args.out):
        for line in open(args.out):
            r = json.loads(line)
            done.add((r["model"], r["setup"], r["q"], r["method"]))
    setup = f"p{args.passages}_t{args.max_passage_tokens}_teach{args.teacher}"
    methods = [m for m in args.methods.split(",") if m]
    neighbours: NeighbourIndex | None = None
    for q in [int(x) for x in args.questions.split(",")]:
        todo = [m for m in methods if (args.model, setup, q, m) not in done]
        if not todo:
            continue
        prompt = build_prompt(engine.tokenizer, examples[q], passages=args.passages,
                              max_passage_tokens=args.max_passage_tokens)
        ids = prompt.input_ids
        reference = references.get(fp, ids, max_new_tokens=args.teacher, teacher_tokens=args.teacher, need_kv=True,
                                   kv_shape=kv_shape)
        if reference is None:
            t0 = time.time()
            done_run = run_request(engine, FullPrefillRequest(engine, ids), max_new_tokens=args.teacher, eos_ids=eos,
                                   teacher_limit=args.teacher, keep_prompt_kv=True)
            reference = Reference(answer_ids=list(done_run.token_ids), stopped_by=done_run.stopped_by,
                                  text=done_run.text, teacher_ids=done_run.answer_tokens(args.teacher),
                                  teacher_logits=done_run.teacher_logits, kv=done_run.prompt_kv)
            references.put(fp, ids, reference, max_new_tokens=args.teacher, teacher_tokens=args.teacher)
            print(f"q{q}: reference {len(ids)} tokens, {time.time()-t0:.1f}s, answer {reference.text!r}", flush=True)
        ref_tokens, ref_logits, ref_kv = reference.teacher_ids, reference.teacher_logits, reference.kv
        assert ref_kv is not None
        chunks = {}
        prefixes = {"plain": (), "prefix": prompt.conditioning_prefix(True), "lead": tuple(prompt.lead_ids),
                    "sink": tuple(prompt.lead_ids[:1])}
        tails: dict[tuple[str, int], torch.Tensor] = {}  # (conditioning, first layer): the chunks' hidden states
        for cond, prefix in prefixes.items():
            if any(parse_method(m)[1] == cond or (cond in ("plain", "prefix") and (parse_method(m)[0].selection
                   in ("sensitivity", "sensitive_read") or "shift_shape" in _options(m))) for m in todo):
                t0 = time.time()
                chunks[cond] = stored_chunks(engine, store, prompt.chunk_ids, prefix)
                print(f"q{q}: chunks cond={cond} {time.time()-t0:.1f}s", flush=True)
        for cond in NEIGHBOUR_VARIANTS:
            if any(parse_method(m)[1] == cond for m in todo):
                if neighbours is None:
                    neighbours = NeighbourIndex(engine.tokenizer, examples, args.max_passage_tokens)
                t0 = time.time()
                chunks[cond] = [stored_chunks(engine, store, [c], p)[0] for c, p in
                                zip(prompt.chunk_ids, neighbours.prefixes(prompt, int(cond[2:])))]
                print(f"q{q}: chunks cond={cond} {time.time()-t0:.1f}s", flush=True)
        lead = stored_chunks(engine, store, [prompt.lead_ids], ())[0]
        if any(parse_method(m)[0].selection in ("sensitivity", "sensitive_read") for m in todo):
            SENSITIVITY["scores"] = sensitivity_scores(chunks["plain"], chunks["prefix"])
        if any(parse_method(m)[0].selection == "oracle_dev" for m in todo):
            SENSITIVITY["oracle"] = oracle_scores(chunks["plain"], ref_kv, len(prompt.lead_ids))
        for m in todo:
            cfg, cond = parse_method(m)
            segs = [CachedSegment(lead), *(CachedSegment(c) for c in chunks[cond]), FreshSegment(prompt.tail_ids)]
            n_lead = len(prompt.lead_ids)
            cached = torch.arange(n_lead, n_lead + sum(len(c) for c in prompt.chunk_ids))
            ape, oracle = ape_of(m), oracle_of(m)
            t0 = time.time()
            with contextlib.ExitStack() as patches:
                if ape:
                    patches.enter_context(ape_blend(cached, len(ids), ape))
                if oracle:
                    patches.enter_context(oracle_blend(ref_kv, oracle))
                if "keyshift_layers" in _options(m):
                    first, _, last = str(_options(m)["keyshift_layers"]).partition("-")
                    patches.enter_context(key_correction_layers(int(first), int(last or first)))
                if "keyshift_tau" in _options(m):
                    patches.enter_context(local_key_correction(float(_options(m)["keyshift_tau"])))
                if "probe_offset" in _options(m):
                    patches.enter_context(probes_offset(int(_options(m)["probe_offset"])))
                if "shift_estimate" in _options(m):
                    patches.enter_context(robust_shift_estimate(_options(m)["shift_estimate"]))
                if _options(m).get("deviation_residual"):
                    patches.enter_context(residual_deviation())
                if "shift_slope" in _options(m):
                    opts = _options(m)
                    patches.enter_context(sloped_shift(opts["shift_slope"], opts.get("shift_slope_on", "own"),
                                                       opts.get("shift_slope_pool", "probes")))
                if "shift_kernel" in _options(m):
                    opts = _options(m)
                    patches.enter_context(similar_shift(float(opts["shift_kernel"]), opts.get("shift_kernel_on", "key"),
                                                        opts.get("shift_kernel_pool", "probes")))
                if "shift_poskernel" in _options(m):
                    patches.enter_context(positional_shift(float(_options(m)["shift_poskernel"])))
                if "shift_offset_profile" in _options(m):
                    patches.enter_context(pooled_offset_shift(int(_options(m)["shift_offset_profile"])))
                if "shift_shape" in _options(m):
                    patches.enter_context(conditioned_shape(chunks["plain"], chunks["prefix"],
                                                            int(_options(m)["shift_shape"])))
                if "shift_local" in _options(m):
                    patches.enter_context(local_shift(_options(m)["shift_local"]))
                if _options(m).get("shift_truth"):
                    patches.enter_context(probe_truth_shift(ref_kv))
                if "tail_layers" in _options(m):
                    first = L - int(_options(m)["tail_layers"])
                    if (cond, first) not in tails:
                        tails[cond, first] = chunk_hidden_states(engine.adapter, prompt.chunk_ids, prefixes[cond],
                                                                 first)
                    patches.enter_context(tail_blend(tails[cond, first], first, _options(m).get("tail_drift", "none")))
                if _options(m).get("keyshift_fit") == "diag":
                    patches.enter_context(affine_key_correction())
                if "keymap" in _options(m):
                    opts = _options(m)
                    fitted = Path(opts.get("keymap_dir", "../results/keymap/fits")) / f"{opts['keymap']}_q{q}.safetensors"
                    patches.enter_context(keymap_blend(load_file(str(fitted))["weights"], opts["keymap"],
                                                       float(opts.get("keymap_scale", 1.0))))
                if "lead_tokens" in _options(m):
                    patches.enter_context(chunk_lead_tokens(int(_options(m)["lead_tokens"])))
                if "profile_source" in _options(m):
                    first = cfg.with_overrides(recompute_ratio=float(_options(m)["profile_source"]))
                    patches.enter_context(corrected_profile(lambda: engine.blend(segs, config=first).cache,
                                                            _options(m).get("profile_rank", "corrected")))
                res = engine.blend(segs, config=cfg)
            blend_s = time.time() - t0
            # diagnostics: K/V distance of stale (not recomputed) cached tokens, layer by layer
            sel = torch.tensor(res.stats.selected_positions, dtype=torch.long)
            stale_mask = torch.ones(len(ids), dtype=torch.bool)
            stale_mask[:] = False
            stale_mask[cached] = True
            if sel.numel():
                stale_mask[sel] = False
            kd, vd = [], []
            for l in range(L):
                kb, vb = res.cache.layers[l].keys[0], res.cache.layers[l].values[0]
                kr, vr = ref_kv[l]
                s = stale_mask
                kd.append(float((kb[:, s] - kr[:, s]).norm() / kr[:, s].norm()))
                vd.append(float((vb[:, s] - vr[:, s]).norm() / vr[:, s].norm()))
            with ape_teacher_forcing(engine.model, stale_mask, ape) if ape else contextlib.nullcontext():
                logits = teacher_forced_logits(engine, res.logits, res.cache, len(ids), ref_tokens)
            kl = token_kl(ref_logits, logits)
            rec = {"model": args.model, "setup": setup, "q": q, "method": m, "kl": float(kl.mean()),
                   "kl_pos": [round(float(x), 4) for x in kl], "top1": top1_agreement(ref_logits, logits),
                   "recomputed": res.stats.recomputed_tokens, "cached": res.stats.cached_tokens,
                   "blend_s": round(blend_s, 2), "stale_k_dist": [round(x, 4) for x in kd],
                   "stale_v_dist": [round(x, 4) for x in vd],
                   "selected_chunk_starts": int(sum(1 for s in res.stats.selected_positions
                                                    if s in set(n_lead + sum(len(c) for c in prompt.chunk_ids[:i])
                                                                for i in range(len(prompt.chunk_ids)))))}
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"q{q} {m:45s} KL {rec['kl']:.4f} top1 {rec['top1']:.3f} rec {rec['recomputed']} "
                  f"{blend_s:.1f}s", flush=True)



# ------------------------------------------------------------------------------------------- report
# Share of its work bound each kind of blend reached when timed at 3,043 tokens on the 1.5B model,
# chunk KV from the disk store (research/quality_notebook.md, "Speed at 3,000 tokens on the 1.5B model": plain
# CacheBlend 4.74x of 5.30x, the profiled default 4.32x of 6.18x). Full reuse: 26.1x measured.
MEASURED_SHARE_OF_BOUND = {"deviation": 0.89, "profiled": 0.70}
FULL_REUSE_SPEEDUP = 26.1
PROMPT_TOKENS, FRESH_TOKENS = 3043, 43
PROFILED = ("query_profiled", "profiled_deviation", "stale_impact")


def estimated_speedup(method: str, shapes: LayerShapes) -> float:
    """TTFT speedup over full prefill at 3,043 tokens, estimated from the work bound."""
    cfg, _ = parse_method(method)
    if cfg.recompute_ratio == 0:
        return FULL_REUSE_SPEEDUP
    profiled = cfg.selection in PROFILED
    check = 0 if cfg.selection == "query_profiled" else (cfg.check_layer or 1)
    bound = work_bound(shapes, PROMPT_TOKENS, FRESH_TOKENS, cfg.recompute_ratio, check_layer=check,
                       profile_tokens=cfg.profile_tokens)["bound"]
    return bound * MEASURED_SHARE_OF_BOUND["profiled" if profiled else "deviation"]


def measured_rows(paths: list[str], model: str, setup: str) -> list[dict]:
    """The rows of the JSONLs ``run`` wrote, for one model and setup."""
    rows = [json.loads(line) for path in paths for line in open(path, encoding="utf-8") if line.strip()]
    return [r for r in rows if r["setup"] == setup and r["model"] == model]


def summarize(rows: list[dict], questions: list[int] | None = None) -> tuple[list[int], list[dict]]:
    """Per method over the questions every listed method ran: mean KL, recovery, worse than full reuse."""
    by: dict[str, dict[int, dict]] = {}
    for r in rows:
        by.setdefault(r["method"], {})[r["q"]] = r
    reuse = by.get("full_reuse", {})
    qs = sorted(questions or reuse)
    out = []
    for method, per_q in by.items():
        have = [q for q in qs if q in per_q and q in reuse]
        if not have:
            continue
        kl = sum(per_q[q]["kl"] for q in have) / len(have)
        reuse_kl = sum(reuse[q]["kl"] for q in have) / len(have)
        out.append({"method": method, "questions": have, "kl": kl, "recovery": recovery(kl, reuse_kl),
                    "worse": sum(per_q[q]["kl"] > reuse[q]["kl"] for q in have),
                    "per_question": {q: per_q[q]["kl"] for q in have}})
    return qs, out


def report(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    rows = measured_rows([args.results], args.model, args.setup)
    qs, methods = summarize(rows)
    complete = [m for m in methods if len(m["questions"]) == len(qs)]
    folder, _ = converted_gguf_folder(catalog.installed_gguf(catalog.lookup(args.model), cache_root()))
    shapes = LayerShapes.of(AutoConfig.from_pretrained(str(folder)))
    print(f"{args.model}, {args.setup}: {len(qs)} questions ({', '.join(map(str, qs))}); KL per question, "
          "recovery of full reuse's KL, questions worse than full reuse, TTFT speedup at 3,043 tokens "
          "(estimated: work bound x measured share)\n")
    print("| method | " + " | ".join(f"q{q}" for q in qs) + " | KL | recovery | worse | speedup (est.) |")
    print("|---" * (len(qs) + 5) + "|")
    for m in sorted(complete, key=lambda m: -m["recovery"]):
        cells = " | ".join(f"{m['per_question'][q]:.3f}" for q in qs)
        print(f"| {m['method']} | {cells} | {m['kl']:.3f} | {100 * m['recovery']:.0f}% | {m['worse']}/{len(qs)} | "
              f"{estimated_speedup(m['method'], shapes):.2f}x |")
    partial = [m for m in methods if len(m["questions"]) < len(qs)]
    if partial:
        print("\nOn fewer questions (recovery on those only):\n")
        for m in sorted(partial, key=lambda m: m["method"]):
            print(f"- {m['method']}: {len(m['questions'])} questions ({', '.join(map(str, m['questions']))}), "
                  f"recovery {100 * m['recovery']:.0f}%, worse {m['worse']}")
    if args.plot:
        fig, ax = _recovery_axes((9, 5.5))
        for m in complete:
            x, y = estimated_speedup(m["method"], shapes), 100 * m["recovery"]
            ax.scatter(x, y, color="tab:red" if m["worse"] else "tab:blue")
            ax.annotate(f"{_short(m['method'])} ({m['worse']} worse)", (x, y), textcoords="offset points",
                        xytext=(4, 2), fontsize=7)
        ax.axvline(3.5, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT speedup over full prefill at 3,043 tokens (estimated from the work bound)")
        _save_recovery_plot(fig, ax, args.plot, len(qs), f"{args.model}: speed against fidelity (targets: >= 70%, "
                            ">= 3.5x; red: a question worse than full reuse)", legend=False)


def _recovery_axes(size: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size, dpi=120)


def _save_recovery_plot(fig, ax, path: str, n_questions: int, title: str, legend: bool = True) -> None:
    """The plots' shared frame: recovery on the y axis with the issue's 70% line, then the PNG written."""
    ax.axhline(70, color="grey", linestyle="--", linewidth=0.8)
    ax.set_ylabel(f"recovery of full reuse's KL, {n_questions} questions (%)")
    ax.set_title(title, fontsize=9)
    if legend:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    print(f"\nplot written to {path}")


PLACED = re.compile(r"kv_deviation@(?P<ratio>[0-9.]+);shift_probe_stride=(?P<stride>\d+);stale_key_correction=1;"
                    r"stale_value_correction=1(?:;probe_offset=(?P<offset>\d+))?")


def placements(args: argparse.Namespace) -> None:
    """How much the probes' placement alone moves plain CacheBlend + probes: every stride and ratio measured at
    more than one ``probe_offset`` (keys and values moved by their whole mean, no other option), one table row
    per stride and ratio, and a plot of recovery by stride with one point per placement."""
    rows = measured_rows(args.results, args.model, args.setup)
    qs, methods = summarize(rows)
    found: dict[tuple[float, int], dict[int, dict]] = {}
    for m in methods:
        match = PLACED.fullmatch(m["method"])
        if match and len(m["questions"]) == len(qs):
            stride = int(match["stride"])
            offset = int(match["offset"]) if match["offset"] else max(1, stride // 2)
            found.setdefault((float(match["ratio"]), stride), {})[offset] = m
    found = {k: v for k, v in sorted(found.items()) if len(v) > 1}
    print(f"{args.model}, {args.setup}, {len(qs)} questions: recovery (questions worse than full reuse) by the "
          "first probe's offset in each chunk\n")
    print("| ratio | stride | probes a chunk | by offset | mean | spread |")
    print("|---|---|---|---|---|---|")
    for (ratio, stride), by_offset in found.items():
        rec = [100 * m["recovery"] for m in by_offset.values()]
        cells = ", ".join(f"{o}: {100 * m['recovery']:.0f}% ({m['worse']})" for o, m in sorted(by_offset.items()))
        print(f"| {ratio:g} | {stride} | {100 // stride} | {cells} | {sum(rec) / len(rec):.0f}% | "
              f"{max(rec) - min(rec):.0f} points |")
    if args.plot:
        fig, ax = _recovery_axes((7, 4.5))
        colours = {0.15: "tab:orange", 0.2: "tab:blue", 0.3: "tab:green"}
        ratios = sorted({ratio for ratio, _ in found})
        for (ratio, stride), by_offset in found.items():
            ys = [100 * m["recovery"] for m in by_offset.values()]
            x = stride + 0.5 * (ratios.index(ratio) - (len(ratios) - 1) / 2)  # side by side at one stride
            ax.scatter([x] * len(ys), ys, color=colours.get(ratio, "grey"), s=22,
                       label=f"@{ratio:g}" if stride == min(s for r, s in found if r == ratio) else None)
            ax.plot([x, x], [min(ys), max(ys)], color=colours.get(ratio, "grey"), linewidth=1)
        ax.set_xlabel("probe stride (tokens between probes; 100-token chunks)")
        _save_recovery_plot(fig, ax, args.plot, len(qs),
                            f"{args.model}: plain CacheBlend + probes, one point per probe placement")


def windows(args: argparse.Namespace) -> None:
    """How many known errors a window's shift needs: ``--base`` with the window oracle fed the exact errors of the
    stale tokens at every ``oracle_sample``-th offset (about ``window / sample`` a window) or of all of them, beside
    probes at any stride with ``shift_window=W``, shifted by their changes in the blend or by their exact errors
    (``shift_truth``). A table and a plot of recovery against known errors per window."""
    rows = measured_rows(args.results, args.model, args.setup)
    qs, methods = summarize(rows)
    w = args.window
    oracle = re.compile(re.escape(f"{args.base};oracle=kv_shift;oracle_window={w}")
                        + r"(?:;oracle_sample=(\d+)(?:/(\d+))?)?")
    probed = re.compile(r".*;shift_probe_stride=(\d+);stale_key_correction=1;stale_value_correction=1;"
                        + re.escape(f"shift_window={w}") + r"(;shift_truth=1)?")
    series: dict[str, list[tuple[float, dict]]] = {}
    for m in methods:
        if len(m["questions"]) < len(qs):
            continue
        if match := oracle.fullmatch(m["method"]):
            per_window = w / int(match[1]) if match[1] else w * (1 - _ratio(args.base))  # all: the stale ones
            kind = "stale tokens' exact errors (oracle" + (", other offsets)" if match[2] else ")")
            series.setdefault(kind, []).append((per_window, m))
        elif match := probed.fullmatch(m["method"]):
            kind = "probes' exact errors" if match[2] else "probes' changes in the blend"
            series.setdefault(kind, []).append((w / int(match[1]), m))
    print(f"{args.model}, {args.setup}, {len(qs)} questions: one shift per {w}-token window, from how many known "
          "errors\n")
    print("| from | known errors a window | recovery | worse | method |")
    print("|---|---|---|---|---|")
    for kind, points in series.items():
        for x, m in sorted(points, key=lambda p: p[0]):
            print(f"| {kind} | {x:.1f} | {100 * m['recovery']:.0f}% | {m['worse']}/{len(qs)} | {m['method']} |")
    if args.plot:
        fig, ax = _recovery_axes((7, 4.5))
        for index, (kind, points) in enumerate(series.items()):
            points = sorted(points, key=lambda p: p[0])
            ax.plot([x for x, _ in points], [100 * m["recovery"] for _, m in points], marker="o", label=kind,
                    linestyle="none" if "other offsets" in kind else "-")  # several samplings at one x
            for x, m in points:
                if m["worse"]:
                    ax.annotate(f"{m['worse']} worse", (x, 100 * m["recovery"]), textcoords="offset points",
                                xytext=(4, -10 - 8 * index), fontsize=7, color="tab:red")
        ax.set_xlabel(f"known errors per {w}-token window")
        _save_recovery_plot(fig, ax, args.plot, len(qs), f"{args.model}: one shift per {w}-token window, from how "
                            "many errors")


def _ratio(method: str) -> float:
    return float(re.search(r"@([0-9.]+)", method)[1])


def estimates(args: argparse.Namespace) -> None:
    """Other estimates of the stale shifts against the probes' plain mean, at every probe placement measured:
    ``--base`` is the method without an estimate's options, ``--variants`` the options each variant adds (``""``
    is the base itself). Per variant, its recovery (questions worse than full reuse) at each placement that the
    base has too, their mean, and the gain over the base with its paired bootstrap interval: per question, KL
    averaged over the placements, questions resampled 5,000 times (recovery is a ratio of sums, so each resample
    recomputes both)."""
    import numpy as np

    rows = measured_rows(args.results, args.model, args.setup)
    kl: dict[str, dict[int, float]] = {}
    for r in rows:
        kl.setdefault(r["method"], {})[r["q"]] = r["kl"]
    reuse = kl["full_reuse"]
    qs = sorted(reuse)
    offsets = [""] + [f";probe_offset={o}" for o in args.offsets.split(",") if o]
    complete = [o for o in offsets if all(q in kl.get(args.base + o, {}) for q in qs)]
    picks = np.random.default_rng(0).integers(0, len(qs), size=(5000, len(qs)))
    reuse_kl = np.array([reuse[q] for q in qs])
    print(f"{args.model}, {args.setup}, {len(qs)} questions; base {args.base}\n")
    print("| estimate | recovery (worse) by placement | mean | gain over the mean of the probes [95%] |")
    print("|---|---|---|---|")
    for variant in args.variants.split(","):
        placed = [o for o in complete if all(q in kl.get(args.base + variant + o, {}) for q in qs)]
        if not placed:
            continue
        cells, recs = [], []
        for o in placed:
            per_q = kl[args.base + variant + o]
            recs.append(recovery(sum(per_q.values()) / len(qs), sum(reuse.values()) / len(qs)))
            cells.append(f"{o.rpartition('=')[2] or 'engine'}: {100 * recs[-1]:.0f}% "
                         f"({sum(per_q[q] > reuse[q] for q in qs)})")
        mean = np.array([sum(kl[args.base + variant + o][q] for o in placed) / len(placed) for q in qs])
        same = np.array([sum(kl[args.base + o][q] for o in placed) / len(placed) for q in qs])
        gain = (same - mean).sum() / reuse_kl.sum()
        low, high = np.percentile((same - mean)[picks].sum(axis=1) / reuse_kl[picks].sum(axis=1), [2.5, 97.5])
        print(f"| `{variant or '(the mean)'}` | {', '.join(cells)} | {100 * sum(recs) / len(recs):.0f}% | "
              f"{100 * gain:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] points |")


def _short(method: str) -> str:
    """A method's name for a plot label: the long option names abbreviated."""
    for long, short in (("shift_probe_stride=", "probes"), ("stale_key_correction=", "k"),
                        ("stale_value_correction=", "v"), ("shift_window=", "w")):
        method = method.replace(long, short)
    return method


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="blend methods against cached references; append to the JSONL")
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--data", default="../shared/data/musique_dev.json", help="MuSiQue-format JSON")
    p.add_argument("--questions", default=",".join(map(str, ANSWERABLE_100)),
                   help="question indices (default: the 13 answerable at 10 x 100 tokens)")
    p.add_argument("--passages", type=int, default=10)
    p.add_argument("--max-passage-tokens", type=int, default=100)
    p.add_argument("--teacher", type=int, default=16, help="tokens of full prefill's answer teacher-forced")
    p.add_argument("--methods", required=True,
                   help="comma-separated NAME[+prefix|+lead|+sink]@RATIO[;field=value...], or full_reuse[+...]")
    p.add_argument("--cache", default="results/fidelity_cache", help="references and chunk KV (a reference cache and a disk store)")
    p.add_argument("--out", default="results/fidelity_1p5b.jsonl")
    p.add_argument("--threads", type=int, default=1)
    r = sub.add_parser("report", help="the table and the speed-fidelity plot from a JSONL")
    r.add_argument("results", help="the JSONL `run` wrote")
    r.add_argument("--model", default="qwen2.5-coder-1.5b")
    r.add_argument("--setup", default="p10_t100_teach16")
    r.add_argument("--plot", help="write the speed-fidelity PNG here")
    pl = sub.add_parser("placements", help="the probe-placement table and plot from one or more JSONLs")
    pl.add_argument("results", nargs="+", help="JSONLs `run` wrote")
    pl.add_argument("--model", default="qwen2.5-coder-1.5b")
    pl.add_argument("--setup", default="p10_t100_teach16")
    pl.add_argument("--plot", help="write the PNG here")
    es = sub.add_parser("estimates", help="estimates of the stale shifts against the probes' mean, by placement")
    es.add_argument("results", nargs="+", help="JSONLs `run` wrote")
    es.add_argument("--base", default="kv_deviation@0.2;shift_probe_stride=10;stale_key_correction=1;"
                    "stale_value_correction=1", help="the method without an estimate's options")
    es.add_argument("--variants", required=True,
                    help='comma-separated options each variant adds, e.g. ";shift_kernel=10" ("" is the base)')
    es.add_argument("--offsets", default="2,8", help="probe offsets measured besides the engine's")
    es.add_argument("--model", default="qwen2.5-coder-1.5b")
    es.add_argument("--setup", default="p10_t100_teach16")
    wi = sub.add_parser("windows", help="one shift per window, from how many known errors: table and plot")
    wi.add_argument("results", nargs="+", help="JSONLs `run` wrote")
    wi.add_argument("--base", default="query_profiled@0.2;shift_probe_stride=10;stale_key_correction=1;"
                    "stale_value_correction=1;shift_window=100", help="the method the window oracle runs on")
    wi.add_argument("--window", type=int, default=10)
    wi.add_argument("--plot", help="write the PNG here")
    wi.add_argument("--model", default="qwen2.5-coder-1.5b")
    wi.add_argument("--setup", default="p10_t100_teach16")
    args = parser.parse_args(argv)
    {"run": run, "report": report, "placements": placements, "estimates": estimates,
     "windows": windows}[args.command](args)


if __name__ == "__main__":
    main()
