"""The classic loader, as the usual advice has it, tuned for the cores given: the benchmark's
baseline. A torch Dataset decodes with PIL (`.convert('RGB')`), does random-resized-crop, flip and
normalise on the CPU; a DataLoader runs it in worker processes with pinned memory, persistent
workers and a deep prefetch. Same file list, ImageSpec and batch size as the DALI pipeline.
"""
from __future__ import annotations

import math
import random

import numpy as np
import torch

from .spec import ImageSpec


def random_resized_crop_box(w: int, h: int, rng: random.Random, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params: (left, top, width, height) in pixels."""
    area = w * h
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        ar = math.exp(rng.uniform(*log_ratio))
        cw, ch = int(round(math.sqrt(target * ar))), int(round(math.sqrt(target / ar)))
        if 0 < cw <= w and 0 < ch <= h:
            return rng.randint(0, w - cw), rng.randint(0, h - ch), cw, ch
    in_ratio = w / h  # fallback: central crop
    if in_ratio < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    return (w - cw) // 2, (h - ch) // 2, cw, ch


class ClassicDataset(torch.utils.data.Dataset):
    def __init__(self, files: list[str], labels: list[int], spec: ImageSpec, training: bool = True):
        self.files, self.labels, self.spec, self.training = files, labels, spec, training
        self.mean = np.array(spec.mean, np.float32).reshape(3, 1, 1)
        self.std = np.array(spec.std, np.float32).reshape(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.files[i]) as im:
            im = im.convert("RGB")
        size = (self.spec.width, self.spec.height)
        resample = {"nearest": Image.NEAREST, "linear": Image.BILINEAR, "cubic": Image.BICUBIC,
                    "lanczos": Image.LANCZOS}[self.spec.interp]
        if self.training:
            rng = random.Random()  # per-worker torch seeding makes `random` differ across workers
            left, top, cw, ch = random_resized_crop_box(*im.size, rng)
            im = im.resize(size, resample, box=(left, top, left + cw, top + ch))
            if rng.random() < 0.5:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            im = im.resize(size, resample)
        x = np.asarray(im, dtype=np.float32).transpose(2, 0, 1) / 255.0
        x = (x - self.mean) / self.std
        return torch.from_numpy(x), self.labels[i]


def classic_loader(files: list[str], labels: list[int], spec: ImageSpec, *, batch_size: int, workers: int,
                   pin_memory: bool, training: bool = True, seed: int = 0) -> torch.utils.data.DataLoader:
    """The tuned classic DataLoader: one worker per core given, pinned memory for the H2D copy,
    persistent workers (no re-fork per epoch) and 4 batches prefetched per worker."""
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.utils.data.DataLoader(
        ClassicDataset(files, labels, spec, training), batch_size=batch_size, shuffle=training,
        drop_last=training, num_workers=workers, pin_memory=pin_memory, persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None, generator=g)
