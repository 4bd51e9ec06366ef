"""What a user would run instead of this package, for ``benchmarks/bench_peers.py``: each peer set up as
its own docs recommend for RAG, timed to the first greedy token on the harness's MuSiQue prompts.

A peer is started once (:meth:`Peer.start`, untimed: models, caches), prepared once per prompt
(:meth:`Peer.prepare`, untimed: passages warmed, prefix caches filled), then timed
(:meth:`Peer.first_token`) and asked for its greedy answer and first-token logits
(:meth:`Peer.answer`). The peers' own packages (``kvboost``, ``llama-cpp-python``) are imported only
by their peers and installed only by ``make peers``; a peer whose package is missing is skipped
with the install hint, never an error.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch
from transformers import DynamicCache

from cacheblend_rag.bench.methods import parse_methods, resolve_default
from cacheblend_rag.bench.metrics import token_kl
from cacheblend_rag.bench.prompt import BenchPrompt
from cacheblend_rag.bench.requests import BlendRequest, run_request
from cacheblend_rag.bench.stores import ChunkStoreFactory
from cacheblend_rag.engine.blend import CacheBlendEngine
from cacheblend_rag.calibration.lookup import describe_config
from cacheblend_rag.engine.generate import eos_token_ids

PEERS_HINT = "install the peers with `make peers` (kvboost==0.9.0, llama-cpp-python built from source)"


class PeerUnavailable(Exception):
    """The peer cannot run here (no GGUF for the model, ...): it is skipped with this reason."""


# llama.cpp's CPU formats a GGUF can be re-quantized to: llama_cpp's LLAMA_FTYPE_MOSTLY_<name>.
LLAMA_FORMATS = ("Q8_0", "F16", "BF16")


def requantized_gguf(source: Path, fmt: str, folder: Path) -> Path:
    """``source`` re-quantized to ``fmt`` by llama.cpp's own ``llama_model_quantize`` (dequantized, then
    quantized again: the same weights in a format llama.cpp may run faster), made once into ``folder``."""
    if fmt not in LLAMA_FORMATS:
        raise ValueError(f"llama.cpp format {fmt!r}: choose one of {', '.join(LLAMA_FORMATS)}")
    target = folder / f"{source.stem}.{fmt}.gguf"
    if target.exists():
        return target
    import ctypes

    import llama_cpp

    folder.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{fmt}")
    params.allow_requantize = True
    partial = target.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not re-quantize {source} to {fmt}")
    partial.replace(target)  # whole or absent: a stopped run leaves no half-written model behind
    return target


@dataclass
class PeerContext:
    """What every peer shares: the float32 engine (the reference's), how to get the model in another dtype,
    the GGUF llama.cpp reads, the thread count, the answer length and the context the prompts need."""

    engine: CacheBlendEngine
    load: Callable[[str], CacheBlendEngine] | None = None  # dtype -> engine; None: a copy of ``engine``'s model
    gguf: Path | None = None
    threads: int = 1
    max_new_tokens: int = 16
    n_ctx: int = 4096
    _engines: dict[str, CacheBlendEngine] = field(default_factory=dict)

    def engine_for(self, dtype: str) -> CacheBlendEngine:
        if dtype == "float32":
            return self.engine
        if dtype not in self._engines:
            if self.load is not None:
                self._engines[dtype] = self.load(dtype)
            else:  # an injected engine (the tests'): its own weights, rounded
                e = self.engine
                model = copy.deepcopy(e.model).to(getattr(torch, dtype))
                self._engines[dtype] = CacheBlendEngine(model, e.tokenizer, model_name=e.model_name,
                                                        min_blend_tokens=e.min_blend_tokens)
        return self._engines[dtype]


@dataclass
class Timed:
    ttft_s: float
    reused_tokens: int  # prompt tokens whose KV came from a cache, not computed for this request


@dataclass
class Answer:
    text: str | None  # the greedy answer, special tokens dropped
    first_logits: torch.Tensor | None  # [vocab]: None where the peer gives none
    reused_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)


class Peer:
    name: ClassVar[str] = ""
    requires: ClassVar[str | None] = None  # the module it imports; missing: skipped with ``install``
    install: ClassVar[str] = PEERS_HINT
    setup: ClassVar[str] = ""  # how it is set up, in a line
    docs: ClassVar[str] = ""  # the docs or source followed

    def __init__(self, ctx: PeerContext) -> None:
        self.ctx = ctx
        self.info: dict[str, Any] = {}  # what the report says of this peer beside its setup (versions, settings)

    def start(self) -> None:
        pass

    def prepare(self, prompt: BenchPrompt) -> None:
        pass

    def first_token(self, prompt: BenchPrompt) -> Timed:
        raise NotImplementedError

    def answer(self, prompt: BenchPrompt) -> Answer:
        raise NotImplementedError

    def close(self) -> None:
        pass


PEERS: dict[str, type[Peer]] = {}


def register(cls: type[Peer]) -> type[Peer]:
    PEERS[cls.name] = cls
    return cls


def variant(base: type[Peer], name: str, setup: str, **fields: Any) -> type[Peer]:
    """A registered subclass of ``base`` named ``name``, with these class fields (dtype, strategy, method)."""
    return register(type(f"{base.__name__}:{name}", (base,), {"name": name, "setup": setup, **fields}))


def _greedy(logits: torch.Tensor) -> int:
    return int(logits.reshape(-1, logits.shape[-1])[-1].argmax())


# ------------------------------------------------------------------------------------ Hugging Face
class HFFullPrefill(Peer):
    dtype: ClassVar[str] = "float32"
    docs = "transformers: the model's own forward and generate (https://huggingface.co/docs/transformers/llm_tutorial)"

    def start(self) -> None:
        self.model = self.ctx.engine_for(self.dtype).model
        self.tokenizer = self.ctx.engine.tokenizer

    def _ids(self, prompt: BenchPrompt) -> torch.Tensor:
        return torch.tensor([prompt.input_ids], dtype=torch.long, device=self.model.device)

    @torch.inference_mode()
    def first_token(self, prompt: BenchPrompt) -> Timed:
        ids = self._ids(prompt)
        start = time.perf_counter()
        _greedy(self.model(input_ids=ids, logits_to_keep=1).logits)
        return Timed(time.perf_counter() - start, 0)

    @torch.inference_mode()
    def answer(self, prompt: BenchPrompt) -> Answer:
        return self._generate(self._ids(prompt), None, 0)

    def _generate(self, ids: torch.Tensor, cache: DynamicCache | None, reused: int) -> Answer:
        extra = {} if cache is None else {"cache": cache}
        out = self.model.generate(ids, max_new_tokens=self.ctx.max_new_tokens, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, **extra)
        text = self.tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
        return Answer(text, out.logits[0][0].float().cpu(), reused)


class HFPrefixCache(HFFullPrefill):
    """The KV of the prompt's lead (system turn, user header, "Passages:"), the same for every question,
    computed once and deep-copied for each request, as transformers' docs reuse a prompt cache."""

    setup_tail = ": a DynamicCache of the lead every prompt shares, deep-copied per request (timed)"
    docs = ("transformers KV cache docs, 'Re-use Cache to continue generation' "
            "(https://huggingface.co/docs/transformers/kv_cache): prompt_cache = model(**lead, "
            "past_key_values=DynamicCache()).past_key_values; generate(..., past_key_values=copy.deepcopy(prompt_cache))")

    def prepare(self, prompt: BenchPrompt) -> None:
        if getattr(self, "lead", None) != prompt.lead_ids:
            self.lead = list(prompt.lead_ids)
            ids = torch.tensor([self.lead], dtype=torch.long, device=self.model.device)
            with torch.inference_mode():
                self.prompt_cache = self.model(input_ids=ids, cache=DynamicCache(config=self.model.config)).cache

    @torch.inference_mode()
    def first_token(self, prompt: BenchPrompt) -> Timed:
        rest = torch.tensor([prompt.input_ids[len(self.lead):]], dtype=torch.long, device=self.model.device)
        start = time.perf_counter()
        cache = copy.deepcopy(self.prompt_cache)
        _greedy(self.model(input_ids=rest, cache=cache, logits_to_keep=1).logits)
        return Timed(time.perf_counter() - start, len(self.lead))

    @torch.inference_mode()
    def answer(self, prompt: BenchPrompt) -> Answer:
        return self._generate(self._ids(prompt), copy.deepcopy(self.prompt_cache), len(self.lead))


# ------------------------------------------------------------------------------------------- KVBoost
class KVBoost(Peer):
    """KVBoost's InferenceEngine on the float32 model, in the configuration its README benchmarks
    (chunk 128, boundary window 16, overlap 16, 32 sink tokens, ratio 0.15). The lead and every passage
    are warmed alone (``warm(text)``, as its docs say for system prompts and documents), then the whole
    rendered prompt is generated from. ``cacheable_prefix_len=0`` keeps a request from storing its own
    prompt's chunks: a repeat would otherwise find the very prompt cached, which the first asking never does."""

    requires = "kvboost"
    strategy: ClassVar[str] = "cacheblend"
    docs = ("kvboost 0.9.0 README ('How it works', 'RAG', 'Benchmarks': cacheblend, chunk=128, boundary_window=16, "
            "overlap_k=16, sink_tokens=32) and kvboost/engine.py (warm, generate, on_token)")

    def start(self) -> None:
        import importlib.metadata

        from kvboost.engine import InferenceEngine

        self.settings = dict(max_cache_bytes=2 << 30, chunk_size=128, chunk_boundary_window=16, overlap_k=16,
                             sink_tokens=32, recompute_ratio=0.15, recompute_strategy=self.strategy)
        self.info = {"version": importlib.metadata.version("kvboost"), "settings": self.settings}
        self.kv = InferenceEngine(self.ctx.engine.model, self.ctx.engine.tokenizer, device="cpu", **self.settings)

    def prepare(self, prompt: BenchPrompt) -> None:
        self.kv.reset_cache()
        lead = prompt.text[: prompt.text.index(prompt.passage_texts[0])]
        self.warmed = [self.kv.warm(text) for text in (lead, *prompt.passage_texts)]

    def _generate(self, prompt: BenchPrompt, tokens: int) -> tuple[Any, float]:
        first: list[float] = []
        start = time.perf_counter()
        result = self.kv.generate(prompt.text, max_new_tokens=tokens, do_sample=False, cacheable_prefix_len=0,
                                  on_token=lambda _token: first or first.append(time.perf_counter()))
        return result, first[0] - start

    def first_token(self, prompt: BenchPrompt) -> Timed:
        result, ttft = self._generate(prompt, 1)
        return Timed(ttft, int(result.cached_tokens))

    def answer(self, prompt: BenchPrompt) -> Answer:
        result, _ = self._generate(prompt, self.ctx.max_new_tokens)
        logits = None if result.first_token_logits is None else torch.from_numpy(np.asarray(result.first_token_logits))
        ids = self.ctx.engine.tokenizer.encode(prompt.text, add_special_tokens=True)  # what its generate() feeds
        extra = {"kv_reuse_ratio": float(result.kv_reuse_ratio),
                 # its own clock, which starts after chunk lookup and seam repair (the answer's run)
                 "kvboost_reported_ttft_ms": float(result.ttft_ms),
                 "chunks_warmed": sum(w.chunks_stored for w in self.warmed),
                 "warmed_tokens_left_uncached": sum(w.partial_tail_tokens for w in self.warmed),
                 "own_prompt_tokens": len(ids), "prompt_ids_match": ids == prompt.input_ids}
        if ids != prompt.input_ids and logits is not None:  # the rendered text tokenized whole: tokenization aside
            extra["first_token_kl_vs_fp32_full_prefill_of_own_ids"] = float(
                token_kl(self._own_reference(ids)[None], logits.float()[None])[0])
        return Answer(result.output_text, logits, int(result.cached_tokens), extra)

    _references: ClassVar[dict[tuple[int, ...], torch.Tensor]] = {}  # shared by the three modes

    def _own_reference(self, ids: list[int]) -> torch.Tensor:
        if tuple(ids) not in self._references:
            KVBoost._references.clear()  # one prompt at a time
            KVBoost._references[tuple(ids)] = self.ctx.engine.full_prefill(ids).logits.float()
        return self._references[tuple(ids)]


# ----------------------------------------------------------------------------------------- llama.cpp
class LlamaCpp(Peer):
    """llama.cpp through llama-cpp-python on the GGUF file this package's loader converts (its weights in
    their own quantization), the token ids given as they are (the same vocabulary, checked), threads =
    torch's. TTFT: ``create_completion(ids, temperature=0, stream=True)`` to its first chunk, after
    ``reset()`` (else it reuses the previous request's matching prefix, which is the cache peer's job)."""

    name = "llama-cpp"
    requires = "llama_cpp"
    setup = "full prefill: Llama(model_path=<the loader's GGUF>, n_ctx, n_threads=torch's), reset() per request"
    docs = ("llama-cpp-python 0.3.36 README (high-level API: Llama, create_completion) and llama_cpp/llama.py "
            "(reset, eval, generate's prefix match, save_state/load_state)")

    def start(self) -> None:
        if self.ctx.gguf is None:
            raise PeerUnavailable("no GGUF file for this model (pass --gguf)")
        import importlib.metadata

        import llama_cpp

        t = self.ctx.threads
        self.llm = llama_cpp.Llama(model_path=str(self.ctx.gguf), n_ctx=self.ctx.n_ctx, n_threads=t, n_threads_batch=t,
                                   verbose=False)
        vocab = len(self.ctx.engine.tokenizer)
        self.same_vocab = self.llm.n_vocab() == vocab
        self.info = {"version": importlib.metadata.version("llama-cpp-python"), "gguf": str(self.ctx.gguf),
                     "file_type": self.llm.metadata.get("general.file_type"), "n_ctx": self.ctx.n_ctx,
                     "n_batch": self.llm.n_batch, "threads": t, "n_vocab": self.llm.n_vocab(),
                     "vocab_matches_tokenizer": self.same_vocab,
                     "system_info": llama_cpp.llama_print_system_info().decode().strip()}

    def _ready(self, prompt: BenchPrompt) -> int:
        """Untimed, before a request: the state it starts from; returns the tokens it will reuse."""
        self.llm.set_cache(None)
        self.llm.reset()
        return 0

    def first_token(self, prompt: BenchPrompt) -> Timed:
        reused = self._ready(prompt)
        start = time.perf_counter()
        stream = self.llm.create_completion(prompt.input_ids, max_tokens=1, temperature=0.0, stream=True)
        next(iter(stream))
        ttft = time.perf_counter() - start
        for _ in stream:
            pass
        return Timed(ttft, reused)

    def _first_logits(self, prompt: BenchPrompt, reused: int) -> torch.Tensor | None:
        """The logits after the prompt, computed as the request computes them (the first ``reused`` tokens
        from the state it starts from)."""
        import llama_cpp

        self.llm.n_tokens = reused  # eval() drops the rest of the state's KV from here on
        self.llm.eval(prompt.input_ids[reused:])
        row = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        logits = torch.from_numpy(np.ctypeslib.as_array(row, shape=(self.llm.n_vocab(),)).copy())
        return logits if self.same_vocab else None

    def answer(self, prompt: BenchPrompt) -> Answer:
        reused = self._ready(prompt)
        logits = self._first_logits(prompt, reused)
        reused = self._ready(prompt)
        out = self.llm.create_completion(prompt.input_ids, max_tokens=self.ctx.max_new_tokens, temperature=0.0)
        return Answer(out["choices"][0]["text"], logits, reused)


class LlamaCppCache(LlamaCpp):
    """Its prompt cache: a ``LlamaRAMCache`` set on the model holds the state ``create_completion`` saved
    after the previous question (or, before the first, the state of the lead alone); a new question loads
    the state with the longest common prefix and evaluates the rest."""

    name = "llama-cpp-cache"
    setup = ("prompt cache: llm.set_cache(LlamaRAMCache()) holding the state saved after the previous question "
             "(same system turn and header); the request loads it and evaluates the rest")

    def prepare(self, prompt: BenchPrompt) -> None:
        if getattr(self, "saved", None) is None:
            self.llm.set_cache(None)
            self.llm.reset()
            self.llm.eval(prompt.lead_ids)
            self.saved = (tuple(prompt.lead_ids), self.llm.save_state())
        self.seed = self.saved

    def _ready(self, prompt: BenchPrompt) -> int:
        from llama_cpp import Llama, LlamaRAMCache

        self.llm.reset()
        self.cache = LlamaRAMCache(capacity_bytes=2 << 30)
        self.cache[self.seed[0]] = self.seed[1]
        self.llm.set_cache(self.cache)
        common = Llama.longest_token_prefix(self.seed[0], prompt.input_ids)
        return common - 1 if common == len(prompt.input_ids) else common

    def _first_logits(self, prompt: BenchPrompt, reused: int) -> torch.Tensor | None:
        self.llm.load_state(self.seed[1])
        return super()._first_logits(prompt, reused)

    def answer(self, prompt: BenchPrompt) -> Answer:
        answer = super().answer(prompt)
        self.saved = next(reversed(self.cache.cache_state.items()))  # what this completion saved: the next seed
        return answer


# ------------------------------------------------------------------------------------- this package
class Package(Peer):
    """This package as the harness runs it: chunk KV warmed into an in-memory store (the lead stored
    losslessly, an exact prefix), the blend reading it back."""

    method: ClassVar[str] = "default"
    dtype: ClassVar[str] = "float32"
    docs = "README (warm the passages, blend) and cacheblend_rag/bench/harness.py (the same requests)"

    def start(self) -> None:
        self.engine = self.ctx.engine_for(self.dtype)
        self.spec = resolve_default(parse_methods(self.method, [0.15])[0], self.engine)
        self.config = self.spec.blend_config(self.engine.config)
        self.stores = ChunkStoreFactory("memory", self.engine)
        self.eos = eos_token_ids(self.engine)
        self.cache = None
        self.info = {"setting": describe_config(self.config, self.spec.prefix_conditioned),
                     "source": self.spec.source or "user", "dtype": self.dtype}

    def prepare(self, prompt: BenchPrompt) -> None:
        if self.cache is not None:
            self.stores.release(self.cache)
        prefix = prompt.conditioning_prefix(self.spec.prefix_conditioned)
        self.cache = self.stores.open(prefix)
        self.cache.warm(prompt.chunk_ids)
        self.cache.warm([prompt.lead_ids], prefix_ids=(), lossless=True)
        self.request = BlendRequest(self.engine, prompt.stored_segments(prefix), self.config, self.cache)

    def first_token(self, prompt: BenchPrompt) -> Timed:
        start = time.perf_counter()
        out = self.request.prefill()
        _greedy(out.logits)
        return Timed(time.perf_counter() - start, int(out.stats["reused_tokens"]))

    def answer(self, prompt: BenchPrompt) -> Answer:
        run = run_request(self.engine, self.request, max_new_tokens=self.ctx.max_new_tokens, eos_ids=self.eos,
                          teacher_limit=1)
        return Answer(run.text, run.teacher_logits[0], int(run.stats["reused_tokens"]),
                      {"engine_mode": run.stats.get("mode"), "recomputed_tokens": run.stats.get("recomputed_tokens")})

    def close(self) -> None:
        self.stores.close()


for _dtype, _short in (("float32", "fp32"), ("bfloat16", "bf16")):
    variant(HFFullPrefill, f"hf-{_short}", f"full prefill, {_dtype}", dtype=_dtype)
for _dtype, _short in (("float32", "fp32"), ("bfloat16", "bf16")):
    variant(HFPrefixCache, f"hf-prefix-{_short}", f"prefix caching, {_dtype}{HFPrefixCache.setup_tail}", dtype=_dtype)
variant(KVBoost, "kvboost-cacheblend", "recompute_strategy='cacheblend' (its seam repair, ratio 0.15), passages warmed",
        strategy="cacheblend")
variant(KVBoost, "kvboost-selective", "recompute_strategy='selective' (its default: each seam's last tokens), passages "
        "warmed", strategy="selective")
variant(KVBoost, "kvboost-none", "recompute_strategy='none' (cached chunks as they are), passages warmed", strategy="none")
register(LlamaCpp)
register(LlamaCppCache)
variant(Package, "cbr-default", "cacheblend-rag's default setting for the model, float32", method="default")
variant(Package, "cbr-cacheblend@0.15", "plain CacheBlend (kv_deviation) at 0.15, float32", method="cacheblend@0.15")
variant(Package, "cbr-full-reuse", "full reuse (every passage's KV as is), float32", method="full_reuse")
variant(Package, "cbr-default-bf16", "cacheblend-rag's default setting, bfloat16", method="default", dtype="bfloat16")
variant(Package, "cbr-cacheblend@0.15-bf16", "plain CacheBlend (kv_deviation) at 0.15, bfloat16",
        method="cacheblend@0.15", dtype="bfloat16")
