"""A generated corpus of hostile and odd image files, mixed with good photos (used by test_scan)."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

# file name -> reason the scan must give (substring); None means the file must train
BAD = {
    "bad/truncated.jpg": "truncated JPEG",
    "bad/text.jpg": "not an image (text)",
    "bad/empty.jpg": "empty file",
    "bad/bomb.jpg": "30000x30000 exceeds --max-pixels",
    "bad/anim.gif": "unsupported format GIF",
    "bad/bad_huffman.jpg": "corrupt JPEG data",  # headers parse, the Huffman table is bogus: only --scan full finds it
}
ODD = ["odd/cmyk.jpg", "odd/gray.jpg", "odd/progressive.jpg", "odd/exif_rot.jpg", "odd/rgba.png",
       "odd/palette.png", "odd/gray16.png", "odd/png_named.jpg", "odd/bitmap.bmp", "odd/scan.tiff",
       "odd/tiny1x1.jpg"]


def _jpeg_bytes(im, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, format="JPEG", **kw)
    return b.getvalue()


def _patch_sof(data: bytes, w: int, h: int) -> bytes:
    """Rewrite the frame header's size: a small file that claims w x h pixels."""
    i = 2
    while i < len(data):
        marker, seglen = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if marker in (0xC0, 0xC1, 0xC2):
            return data[:i + 5] + h.to_bytes(2, "big") + w.to_bytes(2, "big") + data[i + 9:]
        i += 2 + seglen
    raise ValueError("no SOF marker")


def make_corpus(root: Path, good_per_class: int = 12) -> dict[str, str | None]:
    """Write good photos, odd-but-valid files and bad files under root with a dataset.tsv (label column).

    Returns {image_path: expected bad reason or None}.
    """
    import skimage.data
    from PIL import Image

    from dali_pipe.demo import make_photo_dataset

    make_photo_dataset(root, classes=2, per_class=good_per_class, with_label_column=True)
    photo = Image.fromarray(skimage.data.astronaut()).resize((128, 128))
    (root / "bad").mkdir(exist_ok=True)
    (root / "odd").mkdir(exist_ok=True)
    good = _jpeg_bytes(photo)
    (root / "bad/truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "bad/text.jpg").write_text("this is not an image, it is a note\n")
    (root / "bad/empty.jpg").write_bytes(b"")
    (root / "bad/bomb.jpg").write_bytes(_patch_sof(good, 30000, 30000))
    photo.save(root / "bad/anim.gif")
    i = good.index(b"\xff\xc4")  # first DHT segment: keep its length, make its code counts impossible
    (root / "bad/bad_huffman.jpg").write_bytes(good[:i + 4] + b"\x00" + b"\xff" * 16 + good[i + 21:])

    photo.convert("CMYK").save(root / "odd/cmyk.jpg")
    photo.convert("L").save(root / "odd/gray.jpg")
    photo.save(root / "odd/progressive.jpg", progressive=True)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    photo.resize((160, 96)).save(root / "odd/exif_rot.jpg", exif=exif)
    photo.convert("RGBA").save(root / "odd/rgba.png")
    photo.convert("P").save(root / "odd/palette.png")
    Image.fromarray((np.asarray(photo.convert("L")).astype(np.uint16) * 257)).save(root / "odd/gray16.png")
    photo.save(root / "odd/png_named.jpg", format="PNG")
    photo.save(root / "odd/bitmap.bmp")
    photo.save(root / "odd/scan.tiff")
    Image.new("RGB", (1, 1), (200, 30, 30)).save(root / "odd/tiny1x1.jpg")

    rows = (root / "dataset.tsv").read_text().splitlines()
    rows += [f"{p}\tastronaut" for p in list(BAD) + ODD]
    (root / "dataset.tsv").write_text("\n".join(rows) + "\n")
    expected = {p: r for p, r in BAD.items()}
    expected.update({p: None for p in ODD})
    return expected
