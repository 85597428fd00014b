"""Mixup and cutmix on a batch already on its device, with soft targets (label smoothing composes).

As in timm's `Mixup`: each batch is paired with itself reversed (`flip(0)`, no shuffle index to
copy), lambda is drawn from Beta(alpha, alpha), and when both are on, each batch takes mixup or
cutmix with equal odds. Lambda and the box are drawn on the host from a generator keyed by
(seed, rank, epoch, batch): nothing waits for the GPU, and a resumed run mixes exactly as the
original.

Hand-written rather than timm's `Mixup`: timm is not a dependency, and its class draws from
NumPy's global state, which a resume could not reproduce.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class MixSettings:
    mixup_alpha: float
    cutmix_alpha: float
    label_smoothing: float

    @property
    def active(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0


def soft_targets(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """One-hot targets with label smoothing: 1 - s + s/C for the class, s/C elsewhere."""
    off = smoothing / num_classes
    return torch.full((labels.numel(), num_classes), off, device=labels.device).scatter_(
        1, labels.view(-1, 1), 1.0 - smoothing + off)


def mix(images: torch.Tensor, labels: torch.Tensor, num_classes: int, cfg: MixSettings, *,
        key: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mixed images, soft targets (B, C)) for one training batch; `key` (seed, rank, epoch, batch)
    seeds the draws."""
    rng = np.random.default_rng(list(key))
    targets = soft_targets(labels, num_classes, cfg.label_smoothing)
    use_cutmix = cfg.cutmix_alpha > 0 and (cfg.mixup_alpha <= 0 or rng.random() < 0.5)
    if use_cutmix:
        lam = float(rng.beta(cfg.cutmix_alpha, cfg.cutmix_alpha))
        h, w = images.shape[-2:]
        cut = np.sqrt(1.0 - lam)
        ch, cw = int(h * cut), int(w * cut)
        cy, cx = int(rng.integers(h)), int(rng.integers(w))
        y0, y1 = np.clip(cy - ch // 2, 0, h), np.clip(cy + ch // 2, 0, h)
        x0, x1 = np.clip(cx - cw // 2, 0, w), np.clip(cx + cw // 2, 0, w)
        images = images.clone()
        images[..., y0:y1, x0:x1] = images.flip(0)[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)  # the share of the image that kept its own label
    else:
        lam = float(rng.beta(cfg.mixup_alpha, cfg.mixup_alpha))
        images = images * lam + images.flip(0) * (1.0 - lam)
    return images, targets * lam + targets.flip(0) * (1.0 - lam)
