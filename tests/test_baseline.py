"""The classic baseline: torchvision's RandomResizedCrop rule and a PIL + numpy reference."""
from __future__ import annotations

import random

import numpy as np

from dali_pipe.baseline import ClassicDataset, random_resized_crop_box
from dali_pipe.spec import ImageSpec


def test_crop_box_stays_inside_and_honours_scale_and_ratio():
    rng = random.Random(0)
    for w, h in [(640, 480), (100, 900), (37, 41)]:
        for _ in range(200):
            x, y, cw, ch = random_resized_crop_box(w, h, rng)
            assert 0 <= x and 0 <= y and x + cw <= w and y + ch <= h and cw > 0 and ch > 0
    rng = random.Random(1)
    areas = [cw * ch / (640 * 480) for _, _, cw, ch in (random_resized_crop_box(640, 480, rng) for _ in range(500))]
    assert min(areas) >= 0.07 and max(areas) <= 1.0 and np.median(areas) < 0.7


def test_validation_item_matches_pil_reference(photo_root):
    from PIL import Image

    spec = ImageSpec(32, 48, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    path = str(next(photo_root.glob("*/*.jpg")))
    x, label = ClassicDataset([path], [3], spec, training=False)[0]
    im = Image.open(path).convert("RGB").resize((48, 32), Image.BILINEAR)
    ref = ((np.asarray(im, np.float32) / 255 - np.array(spec.mean, np.float32)) / np.array(spec.std, np.float32))
    assert label == 3 and x.shape == (3, 32, 48)
    np.testing.assert_allclose(x.numpy(), ref.transpose(2, 0, 1), atol=1e-6)
