"""The demo photo set: seed layout, real photos, idempotent."""
from __future__ import annotations

from dali_pipe.demo import make_photo_dataset


def test_layout_and_idempotence(tmp_path):
    from PIL import Image

    root = make_photo_dataset(tmp_path / "d", classes=2, per_class=3, side=(80, 90), with_label_column=True)
    rows = (root / "dataset.tsv").read_text().splitlines()
    assert rows[0] == "image_path\tlabel" and len(rows) == 7 and rows[1] == "astronaut/astronaut_0000.jpg\tastronaut"
    with Image.open(root / "coffee/coffee_0002.jpg") as im:
        assert im.format == "JPEG" and 80 <= max(im.size) <= 90
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")}
    make_photo_dataset(tmp_path / "d", classes=2, per_class=3, side=(80, 90), with_label_column=True)
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")} == before
