"""Mixup and cutmix: soft targets, label smoothing composing, box areas, determinism by key."""
from __future__ import annotations

import torch

from model.mixing import MixSettings, mix, soft_targets


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.rand(4, 3, 32, 32, generator=g), torch.tensor([0, 1, 2, 3])


def test_label_smoothing_targets():
    t = soft_targets(torch.tensor([1, 0]), 4, 0.1)
    assert torch.allclose(t[0], torch.tensor([0.025, 0.925, 0.025, 0.025])) and torch.allclose(t.sum(1), torch.ones(2))


def test_mixup_gives_soft_targets_that_match_the_pixel_mix():
    x, y = _batch()
    mixed, targets = mix(x, y, 4, MixSettings(0.2, 0.0, 0.0), key=(0, 0, 0, 5))
    lam = float(targets[0, 0])
    assert 0 < lam < 1 and torch.allclose(targets.sum(1), torch.ones(4))
    assert torch.allclose(targets[0], torch.tensor([lam, 0, 0, 1 - lam]))  # sample 0 paired with sample 3
    assert torch.allclose(mixed[0], lam * x[0] + (1 - lam) * x[3], atol=1e-6)


def test_cutmix_target_is_the_pasted_area_share_and_smoothing_composes():
    x, y = _batch()
    mixed, targets = mix(x, y, 4, MixSettings(0.0, 1.0, 0.1), key=(0, 0, 1, 2))
    pasted = (mixed[0] != x[0]).any(0).float().mean().item()  # share of pixels now from sample 3
    own = 1 - pasted
    expected = torch.full((4,), 0.025)
    expected[0] += 0.9 * own
    expected[3] += 0.9 * (1 - own)
    assert torch.allclose(targets[0], expected, atol=1e-6)


def test_same_key_same_mix_other_key_other_mix():
    x, y = _batch()
    cfg = MixSettings(0.2, 1.0, 0.0)
    a, b, c = (mix(x, y, 4, cfg, key=k)[1] for k in ((0, 0, 0, 1), (0, 0, 0, 1), (0, 0, 0, 2)))
    assert torch.equal(a, b) and not torch.equal(a, c)
