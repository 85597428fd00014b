"""Shared by evaluate and predict: load the trained model and run a DALI loader through it."""
from __future__ import annotations

from contextlib import nullcontext

from ..config import Settings, resolve
from .noise import quiet_known_noise


def prepared(s: Settings, output: str) -> Settings:
    """Resolved settings for an inference command (commands.py checked that --model is given)."""
    quiet_known_noise()  # transformers' "Loading weights" bar, among others
    s.run.output = output
    return resolve(s)


def run_model(model, loader, device: str, precision: str):
    """(logits (N, C) float32 on the CPU, labels (N,)) over the loader, in eval mode, no gradients."""
    import torch

    dev = torch.device("cuda", 0) if device == "gpu" else torch.device("cpu")
    model.to(dev).eval()
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    autocast = torch.autocast(dev.type, dtype=dtype) if dtype else nullcontext()
    logits, labels = [], []
    with torch.no_grad(), autocast:
        for images, y in loader:  # images (B,3,H,W) float on the loader's device; y (B,) int64
            logits.append(model(pixel_values=images.to(dev, non_blocking=True)).logits.float().cpu())
            labels.append(y.cpu())
    return torch.cat(logits), torch.cat(labels)
