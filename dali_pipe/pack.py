"""`python -m dali_pipe pack SRC DST`: pre-resized WebDataset shards that DALI reads directly.

Each good image of the dataset (the scan runs first; bad images are listed in DST/bad_images.tsv
and never packed) is normalised once:
- EXIF orientation applied; CMYK, grayscale, palette, 16-bit and PNG/BMP/TIFF/WebP made RGB JPEG;
- a longer side above `--max-side` downscaled with Lanczos, aspect kept, re-encoded at `--quality`;
- an RGB JPEG already within `--max-side` (and upright) copied byte for byte.

It writes, per split (fixed now: the manifest's split column, or --val-fraction/--seed):
- `train-000000.tar`, ... : tar members `KEY.jpg` and `KEY.cls` (the class index, six ASCII
  digits, as WebDataset's `.cls`), KEY being the image's path without its extension (stable);
- `train-000000.idx`, ... : DALI's index (the format of DALI's wds2idx tool, v1.2);
- `packed.json`: classes, per-split counts, every shard with its size, sample count and sha256,
  and the pack settings. It is written last: a DST without it is an unfinished pack.

Deterministic: samples go into shards in an order set by --seed (so shards mix classes), tar
headers carry no time or owner, and JPEG encoding is repeatable, so the same input and settings
give byte-identical shards. Resumable: each shard is written under a temporary name and renamed;
`.pack-progress.json` records finished shards, and a rerun continues after the last one.
Parallel: images are normalised in a process pool (`--workers`), shards written in order.
"""
from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .pipeline import LABEL_DIGITS
from .shards.format import IndexEntry, file_sha256, format_index

PACKED_NAME = "packed.json"
PROGRESS_NAME = ".pack-progress.json"
FORMAT = "dali_pipe-packed/1"


class PackError(UserError):
    """The pack cannot be made (or continued) as asked; the message says why and what to do."""


# -- one image -----------------------------------------------------------------------------------
def normalise(path: str, max_side: int, quality: int) -> tuple[bytes, tuple[int, int]] | str:
    """(JPEG bytes, (width, height)) ready to pack, or the reason the image cannot be packed."""
    from PIL import Image, ImageOps

    try:
        with open(path, "rb") as f:
            raw = f.read()
        im = Image.open(io.BytesIO(raw))
        orientation = im.getexif().get(0x0112, 1)
        if im.format == "JPEG" and im.mode == "RGB" and orientation == 1 and max(im.size) <= max_side:
            return raw, im.size
        if im.format == "JPEG" and max(im.size) > 2 * max_side:
            im.draft("RGB", (2 * max_side, 2 * max_side))  # DCT-domain downscale, then Lanczos for quality
        im = ImageOps.exif_transpose(im)
        if im.mode in ("I;16", "I;16B", "I;16L", "I"):
            im = im.point(lambda v: v / 257).convert("L")
        if im.mode != "RGB":
            im = im.convert("RGB")
        if max(im.size) > max_side:
            scale = max_side / max(im.size)
            im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))), Image.LANCZOS)
        out = io.BytesIO()
        im.save(out, format="JPEG", quality=quality)
        return out.getvalue(), im.size
    except Exception as e:  # PIL raises many kinds for broken files
        return f"cannot be packed ({type(e).__name__}: {str(e)[:100]})"


def _normalise_job(job):
    index, path, max_side, quality = job
    return index, normalise(path, max_side, quality)


# -- shards ----------------------------------------------------------------------------------------
def sample_key(rel: str) -> str:
    """The WebDataset key of an image: its path without the extension, no dots (DALI splits the
    key from the extensions at the first dot of the file name)."""
    stem = rel.rsplit(".", 1)[0] if "." in rel.rsplit("/", 1)[-1] else rel
    head, _, name = stem.rpartition("/")
    return (head + "/" if head else "") + name.replace(".", "_")


def label_bytes(label: int) -> bytes:
    return f"{label:0{LABEL_DIGITS}d}".encode()


class ShardWriter:
    """Writes one tar and its DALI index under temporary names; `close()` renames them into place."""

    def __init__(self, directory: Path, name: str):
        self.directory, self.name = directory, name
        self.tmp = directory / f".{name}.tar.tmp-{os.getpid()}"
        self._f = open(self.tmp, "wb")
        self._tar = tarfile.open(fileobj=self._f, mode="w", format=tarfile.USTAR_FORMAT)
        self.entries: list[IndexEntry] = []
        self.next = 0  # the position (in the split's packing order) after this shard's last sample

    def add(self, key: str, jpeg: bytes, label: int, position: int) -> None:
        members = {}
        for ext, data in (("jpg", jpeg), ("cls", label_bytes(label))):
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            self._tar.addfile(info, io.BytesIO(data))
            members[ext] = (self._tar.offset - (len(data) + 511) // 512 * 512, len(data))
        self.entries.append(IndexEntry(key, members))
        self.next = position + 1

    @property
    def size(self) -> int:
        return self._tar.offset

    def close(self) -> dict:
        self._tar.close()
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        tar, idx = self.directory / f"{self.name}.tar", self.directory / f"{self.name}.idx"
        idx_tmp = self.directory / f".{self.name}.idx.tmp-{os.getpid()}"
        idx_tmp.write_text(format_index(self.entries))
        os.replace(self.tmp, tar)
        os.replace(idx_tmp, idx)
        return {"name": tar.name, "index": idx.name, "samples": len(self.entries), "size": tar.stat().st_size,
                "sha256": file_sha256(tar), "next": self.next}

    def abort(self) -> None:
        self._f.close()
        self.tmp.unlink(missing_ok=True)


# -- the pack --------------------------------------------------------------------------------------
@dataclass
class PackStats:
    packed: dict[str, int]  # per split
    bad: int
    shards: int
    skipped_shards: int  # already complete from an earlier run


def order(samples, seed: int):
    """Samples in a seeded order that depends on nothing but the file list and the seed."""
    import random

    ordered = sorted(samples, key=lambda s: s.path)
    random.Random(seed).shuffle(ordered)
    return ordered


def pack_manifest(manifest, dst: Path, *, max_side: int, quality: int, shard_size: int, workers: int, seed: int,
                  bad: dict[str, str], progress: bool = True) -> PackStats:
    """Pack the manifest's (good) samples into shards under `dst`; see the module docstring."""
    from multiprocessing import get_context

    from tqdm import tqdm

    dst.mkdir(parents=True, exist_ok=True)
    root = manifest.root.resolve()
    settings = {"max_side": max_side, "quality": quality, "shard_size": shard_size, "seed": seed,
                "samples": manifest.digest()}
    prog = _load_progress(dst, settings)
    splits = {"train": order(manifest.train, seed), "val": order(manifest.val, seed)}
    keys = _keys(splits, root)
    done = {split: (prog["splits"].get(split) or [{"next": 0}])[-1]["next"] for split in splits}
    todo = [(split, i, s) for split, samples in splits.items() for i, s in enumerate(samples) if i >= done[split]]
    skipped = sum(len(v) for v in prog["splits"].values())
    failed = prog.setdefault("failed", {})  # images that could not be decoded (kept across reruns)
    bar = tqdm(total=len(todo), unit="img", desc="pack", disable=not progress or not todo, file=sys.stderr,
               mininterval=1.0)
    writers: dict[str, ShardWriter | None] = {split: None for split in splits}
    jobs = [(n, s.path, max_side, quality) for n, (_, _, s) in enumerate(todo)]
    pool = get_context("spawn").Pool(workers) if workers > 1 and len(jobs) > 1 else None
    try:
        results = pool.imap(_normalise_job, jobs, chunksize=4) if pool else map(_normalise_job, jobs)
        for n, result in results:
            split, i, sample = todo[n]
            bar.update(1)
            if isinstance(result, str):
                failed[sample.path] = result
                continue
            if writers[split] is None:
                number = len(prog["splits"].setdefault(split, []))
                writers[split] = ShardWriter(dst, f"{split}-{number:06d}")
            writers[split].add(keys[split][i], result[0], sample.label, i)
            if writers[split].size >= shard_size:
                _finish(dst, prog, split, writers)
        for split in splits:
            if writers[split] is not None:
                _finish(dst, prog, split, writers)
    except BaseException:
        for w in writers.values():
            if w is not None:
                w.abort()
        raise
    finally:
        bar.close()
        if pool:
            pool.terminate()
    all_bad = {**bad, **failed}
    packed = {split: sum(s["samples"] for s in prog["splits"].get(split, [])) for split in splits}
    _write_packed(dst, manifest, prog, packed, settings, len(all_bad))
    from .scan import write_report

    write_report(all_bad, root, dst)
    return PackStats(packed, len(all_bad), sum(len(v) for v in prog["splits"].values()), skipped)


def _keys(splits: dict, root: Path) -> dict[str, list[str]]:
    """Stable, unique keys per split, from the images' paths."""
    out, seen = {}, set()
    for split, samples in splits.items():
        keys = []
        for s in samples:
            key = sample_key(os.path.relpath(s.path, root))
            base, n = key, 1
            while key in seen:
                n += 1
                key = f"{base}_{n}"
            seen.add(key)
            keys.append(key)
        out[split] = keys
    return out


def _load_progress(dst: Path, settings: dict) -> dict:
    path = dst / PROGRESS_NAME
    if (dst / PACKED_NAME).is_file() and not path.is_file():
        raise PackError(f"{dst} already holds a finished pack; pack into another folder or delete this one")
    if not path.is_file():
        return {"settings": settings, "splits": {}}
    prog = json.loads(path.read_text())
    if prog.get("settings") != settings:
        raise PackError(f"{dst} holds an unfinished pack of other data or settings ({prog.get('settings')}); pack "
                        "into another folder, or delete this one to start over")
    for shards in prog["splits"].values():  # a shard recorded as done must still be there, whole
        for s in shards:
            tar = dst / s["name"]
            if not tar.is_file() or tar.stat().st_size != s["size"]:
                raise PackError(f"{tar} is missing or changed since it was packed; delete {dst} and pack again")
    from .workdir import remove_dead_temps

    remove_dead_temps(dst, ".*.tmp-*")
    return prog


def _finish(dst: Path, prog: dict, split: str, writers: dict) -> None:
    prog["splits"].setdefault(split, []).append(writers[split].close())
    writers[split] = None
    tmp = dst / f".{PROGRESS_NAME}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(prog))
    os.replace(tmp, dst / PROGRESS_NAME)


def _write_packed(dst: Path, manifest, prog: dict, packed: dict, settings: dict, bad: int) -> None:
    meta = {"format": FORMAT, "classes": manifest.classes,
            "splits": {split: {"samples": packed[split],
                               "shards": [{k: v for k, v in s.items() if k != "next"} for s in shards]}
                       for split, shards in prog["splits"].items()},
            "settings": {k: v for k, v in settings.items() if k != "samples"}, "source_digest": settings["samples"],
            "bad_images": bad}
    tmp = dst / f".{PACKED_NAME}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, dst / PACKED_NAME)
    (dst / PROGRESS_NAME).unlink(missing_ok=True)
