"""Generate a small, learnable photo dataset in the seed's layout (class folders + dataset.tsv).

Each class is one real photograph from scikit-image; samples are random crops of it, rescaled,
colour-jittered and re-encoded as JPEG. Telling the classes apart is easy enough for the tiny ViT
to learn on two CPU cores in about a minute, yet every file is a real photo, not noise.
"""
from __future__ import annotations

import os
from pathlib import Path

from .workdir import atomic, lock, unlock, write_atomic

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")


def _photo(name: str) -> "PIL.Image.Image":  # noqa: F821
    """scikit-image's photograph `name`; or, on a machine without scikit-image, the copy that
    `export_photos` wrote into $DALI_PIPE_PHOTOS."""
    from PIL import Image

    folder = os.environ.get("DALI_PIPE_PHOTOS")
    if folder and os.path.exists(os.path.join(folder, f"{name}.png")):
        return Image.open(os.path.join(folder, f"{name}.png")).convert("RGB")
    import skimage.data

    return Image.fromarray(getattr(skimage.data, name)()).convert("RGB")


def export_photos(folder: Path | str) -> Path:
    """Write the source photographs as lossless PNGs, for machines without scikit-image."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in PHOTOS:
        _photo(name).save(folder / f"{name}.png", optimize=True)
    return folder


def make_photo_dataset(root: Path | str, *, classes: int = 4, per_class: int = 40, side: tuple[int, int] = (96, 160),
                       seed: int = 0, quality: int = 90, with_label_column: bool = False) -> Path:
    """Write `classes` x `per_class` JPEGs under root/<class>/ and root/dataset.tsv; return root.

    `side` bounds the longer side of each image in pixels (e.g. (1800, 2200) for 2000 px photos).
    Idempotent: an existing complete dataset with the same manifest is left as it is.
    """
    import numpy as np  # deferred with PIL: train.py imports this module to answer --help
    from PIL import Image, ImageEnhance

    if not 2 <= classes <= len(PHOTOS):
        raise ValueError(f"classes must be 2..{len(PHOTOS)}, got {classes}")
    root = Path(root)
    tsv = root / "dataset.tsv"
    rng = np.random.default_rng(seed)
    rows = []
    for c in PHOTOS[:classes]:
        src = _photo(c)
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            rel = f"{c}/{c}_{i:04d}.jpg"
            rows.append(f"{rel}\t{c}" if with_label_column else rel)
            if (root / rel).exists() and tsv.exists():
                continue
            w, h = src.size
            scale = rng.uniform(0.35, 1.0)
            cw, ch = int(w * scale), int(h * scale * rng.uniform(0.8, 1.25))
            ch = min(ch, h)
            x, y = rng.integers(0, w - cw + 1), rng.integers(0, h - ch + 1)
            im = src.crop((x, y, x + cw, y + ch))
            longer = rng.integers(side[0], side[1] + 1)
            f = longer / max(cw, ch)
            im = im.resize((max(1, round(cw * f)), max(1, round(ch * f))), Image.BICUBIC)
            im = ImageEnhance.Brightness(im).enhance(rng.uniform(0.7, 1.3))
            im = ImageEnhance.Color(im).enhance(rng.uniform(0.6, 1.4))
            with atomic(root / rel) as tmp:
                im.save(tmp, format="JPEG", quality=quality)
    header = "image_path\tlabel" if with_label_column else "image_path"
    text = header + "\n" + "\n".join(rows) + "\n"
    if not tsv.exists() or tsv.read_text() != text:
        write_atomic(tsv, text)
    return root


DEMO_CLASSES, DEMO_PER_CLASS = 4, 100


def demo_dataset(cache_dir: Path | str, *, seed: int = 0) -> Path:
    """The demo set (400 photos in 4 classes) under CACHE_DIR/demo-photos, generated once: what --data
    defaults to, for train.py and for DaliDataModule(data=None). One process generates it at a time."""
    root = Path(cache_dir) / "demo-photos"
    if not (root / "dataset.tsv").is_file():
        print(f"demo: generating {DEMO_CLASSES * DEMO_PER_CLASS} photos from scikit-image's photographs in {root} "
              "(once, a few seconds)", flush=True)
    lock(root, "demo run generating its photos", "wait a few seconds and rerun")
    try:
        return make_photo_dataset(root, classes=DEMO_CLASSES, per_class=DEMO_PER_CLASS, seed=seed)
    finally:
        unlock(root)
