"""APE's attention as the research loop uses it (research/fidelity_ape.py): at temperature and scale 1
it is exact attention, and otherwise it moves mass only between the context keys and the rest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

RESEARCH = str(Path(__file__).resolve().parents[1])
sys.path.insert(0, RESEARCH)
try:
    from fidelity_ape import ApeSetting, ape_attention
finally:
    sys.path.remove(RESEARCH)


def _inputs(rows: int = 5, n: int = 12):
    torch.manual_seed(0)
    q = torch.randn(1, 4, rows, 8)
    k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
    positions = torch.arange(n - rows, n)
    context = torch.zeros(n, dtype=torch.bool)
    context[2:7] = True
    return q, k, v, positions, context


def test_at_temperature_and_scale_one_it_is_exact_causal_attention():
    q, k, v, positions, context = _inputs()
    n = k.shape[2]
    allowed = torch.arange(n)[None, :] <= positions[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3, enable_gqa=True)
    got = ape_attention(q, k, v, positions, context, 0.3, ApeSetting())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature, scale", [(0.8, 1.0), (1.0, 0.9), (1.2, 0.8)])
def test_without_context_keys_nothing_changes(temperature, scale):
    q, k, v, positions, context = _inputs()
    exact = ape_attention(q, k, v, positions, torch.zeros_like(context), 0.3, ApeSetting())
    got = ape_attention(q, k, v, positions, torch.zeros_like(context), 0.3, ApeSetting(temperature, scale))
    torch.testing.assert_close(got, exact)


def test_the_mass_factor_scales_the_contexts_share_by_that_factor():
    q, k, v, positions, context = _inputs(rows=1)
    n = k.shape[2]
    # Values that tell the parts apart: 1 on the context keys, 0 elsewhere; the output is the context's share.
    v = context.float().view(1, 1, n, 1).expand(1, 2, n, 8).contiguous()
    share = ape_attention(q, k, v, positions, context, 0.3, ApeSetting())[..., 0]
    halved = ape_attention(q, k, v, positions, context, 0.3, ApeSetting(mass=0.5))[..., 0]
    torch.testing.assert_close(halved, 0.5 * share / (0.5 * share + (1 - share)))
