"""The engine on real weights: SmolLM2-135M-Instruct, the embedded default."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag import BlendConfig, CachedSegment, FreshSegment

pytestmark = pytest.mark.slow

PASSAGES = [
    "The Eiffel Tower is a wrought-iron lattice tower in Paris, France. It was completed in 1889 and designed by "
    "the engineering company of Gustave Eiffel.\n\n",
    "Mount Kilimanjaro is a dormant volcano in Tanzania. It is the highest mountain in Africa, about 5,895 metres "
    "above sea level.\n\n",
    "The Great Barrier Reef lies off the coast of Queensland, Australia. It is the world's largest coral reef "
    "system, made of over 2,900 individual reefs.\n\n",
]
QUESTION = "Question: In which country is Mount Kilimanjaro? Answer in a few words."


def _prompt(engine):
    system = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Answer from the passages."}, {"role": "user", "content": "Passages:\n"}],
        tokenize=False,
    )
    head, _, _ = system.rpartition("<|im_end|>")
    prefix = engine.tokenize(head)
    chunk_ids = [engine.tokenize(p) for p in PASSAGES]
    suffix = engine.tokenize(QUESTION + "<|im_end|>\n<|im_start|>assistant\n")
    chunks = engine.prefill_chunks(chunk_ids)
    segments = [FreshSegment(prefix), *map(CachedSegment, chunks), FreshSegment(suffix)]
    return segments, prefix + [t for c in chunk_ids for t in c] + suffix


def test_ratio_one_equals_full_prefill_on_smollm2(smollm2_engine):
    engine = smollm2_engine
    segments, ids = _prompt(engine)
    blended = engine.blend(segments, config=BlendConfig(recompute_ratio=1.0))
    full = engine.full_prefill(ids)
    torch.testing.assert_close(blended.logits, full.logits, atol=2e-3, rtol=1e-3)
    out = engine.generate(segments, config=BlendConfig(recompute_ratio=1.0), max_new_tokens=12)
    reference = engine.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    expected = engine.tokenizer.decode(reference[0, len(ids):], skip_special_tokens=True)
    assert out.text == expected
    assert out.text.strip()


def test_partial_blend_on_smollm2_is_close_and_reuses(smollm2_engine):
    engine = smollm2_engine
    segments, ids = _prompt(engine)
    full = torch.log_softmax(engine.full_prefill(ids).logits.float(), -1)
    kl = {}
    for ratio in (0.0, 0.15, 1.0):
        result = engine.blend(segments, config=BlendConfig(recompute_ratio=ratio))
        approx = torch.log_softmax(result.logits.float(), -1)
        kl[ratio] = float(torch.sum(full.exp() * (full - approx)))
        if 0 < ratio < 1:
            assert result.stats.reused_tokens > 0.8 * result.stats.cached_tokens
    assert kl[1.0] < 1e-4
    assert kl[0.15] < kl[0.0] + 1e-6
