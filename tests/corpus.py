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


ODD_NAMES = ["my photo {i}.jpg", "IMG.2021.{i}.x.jpg", "café_{i}_ü.jpg", "#{i} hash.jpg", "{i}% off.jpg",
             "a+b {i}.jpg", "one, two {i}.jpg", "it's \"{i}\".jpg", "nested/deeper dir/{i}.jpg", "sub.dir/{i}.JPG",
             "same stem {i}.jpg", "same_stem_{i}.jpg"]  # the last two differ only in characters a key cannot hold


def odd_names_dataset(photo_root: Path, dest: Path) -> Path:
    """photo_root's 48 photos under names a manifest may hold (spaces, dots, unicode, # % + , quotes, nested
    folders; two names that differ only in characters a key cannot hold), each photo its own class
    ('s007', so a batch's labels say which photos it holds). dataset.tsv writes one path per class with a
    leading './' (which must come back exactly as written)."""
    photos = sorted(photo_root.glob("*/*.jpg"))
    lines = ["image_path\tlabel"]
    for i, photo in enumerate(photos):
        rel = f"{photo.parent.name}/{ODD_NAMES[i % len(ODD_NAMES)].format(i=i)}"
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).symlink_to(photo)
        lines.append(f"{'./' if i % 12 == 0 else ''}{rel}\ts{i:03d}")
    (dest / "dataset.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dest


def peer_shards(photo_root: Path, dest: Path, *, val_every: int | None = 8, maxcount: int = 20,
                extra=None) -> dict[str, int]:
    """photo_root's photos written by webdataset's own ShardWriter, as others write shards: `KEY.jpg`
    (some as png or webp), `KEY.cls` (webdataset's plain integer; each photo its own class) and
    `KEY.json` with the label name. Every `val_every`-th photo goes to `val-%06d.tar`, the rest to
    `train-%06d.tar` (None: all to `shard-%06d.tar`), `maxcount` samples per shard. `extra(write)` may
    add samples (`write(sample)`) to the last training shard. Returns {key: cls} of the photos."""
    import webdataset as wds
    from PIL import Image

    photos = sorted(photo_root.glob("*/*.jpg"))
    dest.mkdir(parents=True, exist_ok=True)
    names = {"train": "shard"} if val_every is None else {"train": "train", "val": "val"}
    writers = {split: wds.ShardWriter(str(dest / f"{name}-%06d.tar"), maxcount=maxcount, verbose=0)
               for split, name in names.items()}
    labels = {}
    for i, photo in enumerate(photos):
        key = f"photo {i:03d}" if i % 5 == 0 else f"p{i:03d}"  # a space: the index must still parse
        sample = {"__key__": key, "cls": i, "json": {"label": f"s{i:03d}"}}
        if i % 7 == 3:
            buf = io.BytesIO()
            Image.open(photo).save(buf, format="PNG" if i % 2 else "WEBP")
            sample["png" if i % 2 else "webp"] = buf.getvalue()
        else:
            sample["jpg"] = photo.read_bytes()
        writers["val" if val_every and i % val_every == 5 else "train"].write(sample)
        labels[key] = i
    if extra:
        extra(writers["train"].write)
    for w in writers.values():
        w.close()
    return labels
