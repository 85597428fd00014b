"""Write torchvision's own reading of a tricky ImageFolder tree as a test fixture (run by hand, not by the suite).

torchvision is not a dependency of this project, and its PyPI wheels (built against CUDA torch) cannot load
their C operators beside the lock's CPU torch. Its ImageFolder is pure Python, though: this script runs
torchvision's own datasets/folder.py (ImageFolder, find_classes, make_dataset, IMG_EXTENSIONS) with the
package's __init__ (which registers the C operators) skipped. In a throwaway venv:

    python3 -m venv /tmp/tv && /tmp/tv/bin/pip install torchvision==0.28.0   # resolves torch 2.13.0 (the lock's)
    /tmp/tv/bin/python tests/torchvision_imagefolder/make_fixture.py

It builds the tree of `build_tree` (case, unicode, dots, hidden entries, nested folders, linked folders,
non-image files) in a temporary folder, reads it with ImageFolder, and writes expected.json: torchvision's
version, classes, class_to_idx and samples (paths relative to the root), and the error torchvision raises
for a tree with an empty class folder. tests/test_imagefolder.py builds the same tree and compares.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = [  # relative paths; every one is written, torchvision picks what it lists
    "Zebra/z1.jpg", "apple/a.JPG", "apple/b.jpeg", "apple/notes.txt", "apple/anim.gif", "apple/.hidden.png",
    "apple/sub/deep/c.Png", "apple/noext", "apple/archive.jpg.zip", "apple.v2/x.webp", "apple.v2/y.tif",
    "apple.v2/z.TIFF", "apple.v2/w.JPEG", "\u00e9clair/\u00e9t\u00e9.jpg", "\u00e9clair/\u00fc.bmp", "e\u0301clair/n.jpg",
    "10/p.ppm", "10/q.pgm", "2/r.jpg", "2/R.jpg", ".hidden_class/h.jpg", "nested/a/b/c/d.jpg", "nested/a.jpg",
    "nested/a b/e.jpg", "nested/a-b/f.png", "nested/a.b/g.png", "root.jpg", "notes.txt", "with space/s p.jpg",
]
OUTSIDE = ["linked/l.jpg", "linked/deeper/m.png"]  # outside the root, reached through links


def build_tree(root: Path, *, empty_class: bool = False) -> Path:
    """The tree under root/data (plus root/elsewhere, which two links point into); returns root/data."""
    data = root / "data"
    for rel in FILES:
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_bytes(b"\xff\xd8\xff")  # the listing never opens a file
    for rel in OUTSIDE:
        (root / "elsewhere" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "elsewhere" / rel).write_bytes(b"\xff\xd8\xff")
    os.symlink(root / "elsewhere" / "linked", data / "linked")  # a linked class folder
    os.symlink(root / "elsewhere" / "linked" / "deeper", data / "Zebra" / "via-link")  # a linked folder in a class
    if empty_class:
        (data / "empty").mkdir()
        (data / "empty" / "readme.txt").write_text("no image here")
    return data


def _torchvision():
    import torch

    site = Path(torch.__file__).parents[1]
    for name in ("torchvision", "torchvision.datasets"):  # packages without their __init__ (the C operators)
        module = types.ModuleType(name)
        module.__path__ = [str(site.joinpath(*name.split(".")))]
        sys.modules[name] = module
    import torchvision.version
    from torchvision.datasets.folder import IMG_EXTENSIONS, ImageFolder

    return torchvision.version.__version__, IMG_EXTENSIONS, ImageFolder


def main() -> None:
    version, extensions, ImageFolder = _torchvision()
    with tempfile.TemporaryDirectory() as tmp:
        data = build_tree(Path(tmp))
        folder = ImageFolder(str(data))
        samples = [[os.path.relpath(p, data), i] for p, i in folder.samples]
        with tempfile.TemporaryDirectory() as tmp2:
            try:
                ImageFolder(str(build_tree(Path(tmp2), empty_class=True)))
                empty_error = None
            except FileNotFoundError as e:
                empty_error = str(e).replace(tmp2, "${ROOT}")
    expected = {"torchvision": version, "IMG_EXTENSIONS": list(extensions), "classes": folder.classes,
                "class_to_idx": folder.class_to_idx, "samples": samples, "empty_class_error": empty_error}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {HERE / 'expected.json'}: torchvision {version}, {len(folder.classes)} classes, {len(samples)} samples")


if __name__ == "__main__":
    main()
