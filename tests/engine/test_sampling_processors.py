"""The sampler runs on transformers' logits processors and warpers (issue 56, item 8): on fixed logits they
keep, penalise and draw what the hand-written transforms they replaced did; the request builds them once;
no_repeat_ngram_size, do_sample and eos_token_id work as model.generate's."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import FreshSegment, GenerationConfig
from cacheblend_rag.engine.sampling import TokenSampler
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.testing import tiny_engine


# ------------------------------------------------------------------ the transforms the sampler had (oracle)
def _old_penalised(logits: torch.Tensor, seen: set[int], penalty: float) -> torch.Tensor:
    mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
    mask[torch.tensor([t for t in sorted(seen) if t < logits.shape[-1]], dtype=torch.long)] = True
    return torch.where(mask, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def _old_kept(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= top_p
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return scores


def _logits(seed: int, size: int = 2048, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(size, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_the_repetition_penalty_is_the_one_the_sampler_applied(dtype, penalty):
    prompt = [5, 9, 9, 200, 311, 5000]  # 5000: past the output rows (an added token), never penalised
    # max_new_tokens=2: the answer outgrows the ids' buffer, which grows
    sampler = TokenSampler(GenerationConfig(max_new_tokens=2, repetition_penalty=penalty).resolved(), prompt)
    sampler._build(torch.device("cpu"))
    for seed in range(5):
        logits = _logits(seed, dtype=dtype)
        generated = [7, 42, 1000, 3, 1999, 7][: 2 * seed]
        ids = sampler._input_ids(generated, logits.device)
        got = sampler.processors[0](ids, logits.unsqueeze(0))[0]
        assert torch.equal(got, _old_penalised(logits, {*prompt, *generated}, penalty))


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (0, 0.5), (40, 1.0), (40, 0.8), (3, 0.99)])
def test_top_k_and_top_p_keep_the_tokens_the_sampler_kept(top_k, top_p):
    # float32 logits without ties: where two scores tie at the top-p boundary, which one stays is the
    # sort's choice (transformers sorts ascending, the sampler sorted descending)
    cfg = GenerationConfig(temperature=0.8, top_k=top_k, top_p=top_p).resolved()
    sampler = TokenSampler(cfg)
    for seed in range(20):
        logits = _logits(seed)
        sampler._build(logits.device)
        scores = logits.float().unsqueeze(0)
        for warper in sampler.warpers:
            scores = warper(None, scores)
        want = _old_kept(logits.float() / 0.8, top_k, top_p)
        assert torch.equal(torch.isfinite(scores[0]), torch.isfinite(want))
        assert torch.allclose(scores[0][torch.isfinite(want)], want[torch.isfinite(want)])


def test_min_p_draws_what_the_sampler_drew():
    """The sampler zeroed the probabilities below min_p times the top one; MinPLogitsWarper removes those tokens
    before the softmax. Same tokens kept, the same draw for the same noise."""
    cfg = GenerationConfig(temperature=1.5, min_p=0.1, seed=6).resolved()
    for seed in range(20):
        logits = _logits(seed)
        sampler = TokenSampler(cfg)
        noise = torch.empty(logits.numel()).exponential_(1, generator=torch.Generator().manual_seed(6))
        probs = (logits.float() / 1.5).softmax(-1)
        probs = probs.masked_fill(probs < 0.1 * probs.max(), 0.0)
        assert int(sampler.sample(logits)) == int(torch.argmax(probs / noise))


@pytest.mark.parametrize("options", [
    {"temperature": 0.0, "repetition_penalty": 1.5},
    {"temperature": 0.0, "min_new_tokens": 10},
    {"temperature": 1.2, "top_k": 40, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.3, "seed": 7},
])
def test_a_seed_gives_the_same_tokens_every_time(options):
    def run() -> list[int]:
        sampler = TokenSampler(GenerationConfig(**options).resolved(), [5, 9, 200], eos=[2])
        generated: list[int] = []
        for step in range(30):
            generated.append(int(sampler.sample(_logits(100 + step), generated)))
        return generated

    assert run() == run()


def test_the_processors_are_built_once_a_request(monkeypatch):
    engine = tiny_engine("llama", num_hidden_layers=2)
    builds = []
    real = TokenSampler._build
    monkeypatch.setattr(TokenSampler, "_build", lambda self, device: builds.append(1) or real(self, device))
    result = engine.generate([FreshSegment(engine.tokenize("Paris is the capital of"))], max_new_tokens=12,
                             min_new_tokens=12, temperature=0.9, top_k=20, top_p=0.9, repetition_penalty=1.2,
                             no_repeat_ngram_size=3, seed=1)
    assert len(result.token_ids) == 12 and builds == [1]


def test_min_new_tokens_hold_ends_with_the_answer_long_enough():
    sampler = TokenSampler(GenerationConfig(max_new_tokens=8, min_new_tokens=3).resolved(), [4, 4], eos=[2])
    logits = torch.zeros(16)
    logits[2] = 5.0  # end of sequence would win
    assert [int(sampler.sample(logits, [9] * n)) for n in range(5)] == [0, 0, 0, 2, 2]
    assert len(sampler.processors) == 0  # dropped once the answer was long enough


def test_no_repeat_ngram_size_never_repeats_an_ngram():
    sampler = TokenSampler(GenerationConfig(no_repeat_ngram_size=2).resolved(), [1, 2, 3])
    generated: list[int] = []
    for step in range(40):
        logits = -torch.arange(64.0) / 64
        logits[step % 2] = 3.0  # 0, 1, 0, 1... would repeat at once
        generated.append(int(sampler.sample(logits, generated)))
    ids = [1, 2, 3, *generated]
    bigrams = list(zip(ids, ids[1:]))
    assert len(bigrams) == len(set(bigrams))


def test_eos_token_id_replaces_the_models_end_tokens():
    engine = tiny_engine("llama", num_hidden_layers=2)
    segments = [FreshSegment(engine.tokenize("Paris is the capital of"))]
    free = engine.generate(segments, max_new_tokens=6)
    ended = engine.generate(segments, max_new_tokens=6, eos_token_id=[free.token_ids[2]])
    assert ended.token_ids == free.token_ids[:2] and ended.finish_reason == "eos"


def test_do_sample_is_model_generates():
    engine = tiny_engine("llama", num_hidden_layers=2)
    segments = [FreshSegment(engine.tokenize("Paris is the capital of"))]
    greedy = engine.generate(segments, max_new_tokens=8)
    assert engine.generate(segments, max_new_tokens=8, do_sample=False, temperature=1.5).token_ids == greedy.token_ids
    sampled = {tuple(engine.generate(segments, max_new_tokens=8, do_sample=True, seed=s).token_ids) for s in range(4)}
    assert len(sampled) > 1  # the model's config is greedy; do_sample=True samples at temperature 1.0
    assert GenerationConfig(do_sample=True).resolved(None).temperature == 1.0
    with pytest.raises(ConfigError, match="do_sample=True with temperature=0"):
        GenerationConfig(do_sample=True, temperature=0)
    with pytest.raises(ConfigError, match="eos_token_id=.* must be a token id"):
        GenerationConfig(eos_token_id=[])


@pytest.mark.parametrize("options", [
    {"no_repeat_ngram_size": 3, "min_new_tokens": 30},
    {"temperature": 0.8, "top_k": 30, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2,
     "no_repeat_ngram_size": 2, "seed": 3},
])
def test_the_processors_read_nothing_back(options):
    from bench_support.host_syncs import count_host_syncs

    sampler = TokenSampler(GenerationConfig(max_new_tokens=40, **options).resolved(), [5, 9, 200], eos=[2])
    generated = [int(sampler.sample(_logits(0), []))]
    syncs = count_host_syncs(lambda: sampler.sample(_logits(1), generated))
    assert syncs.count == 0, syncs.by_site()
