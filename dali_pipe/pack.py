"""`python -m dali_pipe pack SRC DST`: pre-resized WebDataset shards that DALI reads directly.

SRC is a dataset (dataset.tsv and image files) or shards (a pack, or shards written by others, see
shards/source.py). Each good image (the scan runs first; bad ones are listed in DST/bad_images.tsv and
never packed) is normalised once:
- EXIF orientation applied; CMYK, grayscale, palette, 16-bit and PNG/BMP/TIFF/WebP made RGB JPEG;
- a longer side above `--max-side` downscaled with Lanczos, aspect kept, re-encoded at `--quality`;
- an RGB JPEG already within `--max-side` (and upright) copied byte for byte.

It writes, per split (fixed now: the manifest's split column, or --val-fraction/--seed; the shards'
own split):
- `train-000000.tar`, ... : per sample `KEY.jpg`, `KEY.cls` (the class index, plain decimal) and
  `KEY.json` (`image_path` as dataset.tsv wrote it, and the label name), KEY made from the path and
  safe by construction (shards/format.py `sample_keys`);
- `train-000000.idx`, ... : DALI's index (the format of DALI's wds2idx tool, v1.2);
- `packed.json`: classes, per-split counts, every shard with its size, sample count, sha256, xxh3_128 and the
  image_path of each sample in index order, and the pack settings. It is written last: a DST without
  it is an unfinished pack.

Deterministic: samples go into shards in an order set by --seed (so shards mix classes), tar
headers carry no time or owner, and JPEG encoding is repeatable, so the same input and settings
give byte-identical shards. Resumable: each shard is written under a temporary name and renamed;
`.pack-progress.json` records finished shards (a line appended for each), and a rerun continues after the last one (and is
removed when the pack is finished). A rerun over a finished pack of the same input and settings has
nothing to do. Parallel: images are normalised in a process pool (`--workers`), shards written in order.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import sys
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from .config import default_cache_dir
from .errors import UserError
from .forms import PROGRESS_NAME
from .manifest import relative_to
from .scan import write_report
from .shards.format import (
    FAST_SUM,
    FORMAT,
    PACKED_NAME,
    IndexEntry,
    PackedFormatError,
    TarFormatError,
    cls_bytes,
    fast_digest,
    file_sha256,
    format_index,
    image_member,
    index_tar,
    json_bytes,
    parse_packed,
    read_index,
    sample_keys,
    tar_end,
    tar_member,
)
from .shards.shardset import write_member_report
from .shards.verdicts import Verdicts, verdict_key
from .stop import check
from .tsv import MANIFEST_NAME, read_table
from .workdir import atomic, remove_dead_temps, write_atomic


class PackError(UserError):
    """The pack cannot be made (or continued) as asked; the message says why and what to do."""


# -- one image -----------------------------------------------------------------------------------
def _read(source: str | tuple[str, int, int]) -> bytes:
    """A file's bytes, or (tar path, offset, size): a shard member's."""
    if isinstance(source, str):
        with open(source, "rb") as f:
            return f.read()
    path, offset, size = source
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def normalise(source, max_side: int, quality: int) -> tuple[bytes, tuple[int, int]] | str:
    """(JPEG bytes, (width, height)) ready to pack, or the reason the image cannot be packed.
    `source` is a file path, or (tar path, offset, size) of a shard member."""
    from PIL import Image, ImageOps

    try:
        raw = _read(source)
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
    index, source, max_side, quality = job
    return index, normalise(source, max_side, quality)


# -- what is packed --------------------------------------------------------------------------------
MIN_SHARDS = 8  # each split is cut into at least this many shards (where it has as many images): with one
# shard, streaming has nothing to fetch ahead of the reader, and ranks or readers nothing to share


@dataclass(frozen=True)
class Item:
    """One sample to pack."""
    ident: str  # stable identity (ordering, the report): the image's absolute path, or "SHARD\nKEY"
    rel: str  # what its key is made from: the path relative to the dataset root, or the shard key
    image_path: str  # what its json member and packed.json call it: dataset.tsv's image_path, or the key
    label: int  # index into the pack's classes
    split: str  # "train" or "val"
    source: str | tuple[str, int, int]  # a file, or (tar path, offset, size) of a shard member


def manifest_items(manifest) -> list[Item]:
    """The manifest's samples, each with its image_path exactly as dataset.tsv wrote it."""
    root = manifest.root.resolve()
    written = _written_paths(root)
    items = []
    for split, samples in (("train", manifest.train), ("val", manifest.val)):
        rel = relative_to(samples.paths, str(root)).tolist()  # (os.path.relpath each: 1.2 s a 20 k samples)
        for path, r, label, line in zip(samples.paths.tolist(), rel, samples.labels.tolist(), samples.lines.tolist()):
            items.append(Item(path, r, written.get(line, r), label, split, path))
    return items


def _written_paths(root: Path) -> dict[int, str]:
    """{line: image_path as dataset.tsv wrote it (padding trimmed)}, or {} without a readable manifest."""
    try:
        df = read_table(root / MANIFEST_NAME)
        return dict(zip(df["_line"], df["image_path"]))
    except (UserError, KeyError, OSError):
        return {}


def shard_items(shards, cache_dir: str | Path | None = None, extract=None) -> list[Item]:
    """The usable samples of a ShardSet (local tars; or, where its form has an `extract`, a Hugging Face
    dataset's tables, whose images are first unpacked into the cache dir), labelled by class position."""
    items = []
    if extract is not None:
        spans = extract(shards, cache_dir or default_cache_dir())
        return [Item(f"{s.name}\n{s.keys[e]}", s.keys[e], s.image_paths[e], s.cls[e], s.split[e], spans[(i, e)])
                for i, s in enumerate(shards.shards) for e in range(len(s.keys)) if e not in s.bad]
    for s in shards.shards:
        if "://" in s.path:
            raise PackError(f"{s.name} is not on local disk; pack reads shards from local disk (sync them first)")
        for e, entry in enumerate(read_index(s.index_path)):
            if e in s.bad:
                continue
            label = s.cls[e] if shards.remap is None else shards.remap[s.cls[e]]
            off, size = entry.members[image_member(entry.members)]
            items.append(Item(f"{s.name}\n{s.keys[e]}", s.keys[e], s.image_paths[e], label, s.split[e],
                              (s.path, off, size)))
    return items


def order(samples, seed: int, key=lambda s: s.path):
    """Samples in a seeded order that depends on nothing but the sample list and the seed."""
    ordered = sorted(samples, key=key)
    random.Random(seed).shuffle(ordered)
    return ordered


# -- shards ----------------------------------------------------------------------------------------
class ShardWriter:
    """Writes one tar and its DALI index under temporary names; `close()` renames them into place. Each sample's
    three members go out in one write (tar_member: no tarfile objects), hashed on the way (no second read)."""

    def __init__(self, directory: Path, name: str):
        self.directory, self.name = directory, name
        self.tmp = directory / f".{name}.tar.tmp-{os.getpid()}"
        self.idx_tmp = directory / f".{name}.idx.tmp-{os.getpid()}"
        self._f = open(self.tmp, "wb", buffering=1 << 20)
        self._sums = (hashlib.sha256(), fast_digest())
        self.size = 0  # bytes written so far
        self.entries: list[IndexEntry] = []
        self.image_paths: list[str] = []
        self.next = 0  # the position (in the split's packing order) after this shard's last sample

    def _write(self, chunk: bytes) -> None:
        self._f.write(chunk)
        for s in self._sums:
            s.update(chunk)
        self.size += len(chunk)

    def add(self, key: str, jpeg: bytes, label: int, label_name: str, image_path: str, position: int) -> None:
        members, parts, at = {}, [], self.size
        for ext, data in (("jpg", jpeg), ("cls", cls_bytes(label)), ("json", json_bytes(image_path, label_name))):
            parts.append(tar_member(f"{key}.{ext}", data))
            members[ext] = (at + 512, len(data))
            at += len(parts[-1])
        self._write(b"".join(parts))
        self.entries.append(IndexEntry(key, members))
        self.image_paths.append(image_path)
        self.next = position + 1

    def close(self) -> dict:
        self._write(tar_end(self.size))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        tar, idx = self.directory / f"{self.name}.tar", self.directory / f"{self.name}.idx"
        with atomic(idx, self.idx_tmp) as idx_tmp:  # the tar lands first, then its index
            idx_tmp.write_text(format_index(self.entries))
            with atomic(tar, self.tmp):  # (written above: it only lands)
                pass
        return {"name": tar.name, "index": idx.name, "samples": len(self.entries), "size": self.size,
                "sha256": self._sums[0].hexdigest(), FAST_SUM: self._sums[1].hexdigest(),
                "image_paths": self.image_paths, "next": self.next}

    def abort(self) -> None:
        try:
            self._f.close()
        except OSError:  # a full disk fails the flush too; the file goes anyway
            pass
        self.tmp.unlink(missing_ok=True)
        self.idx_tmp.unlink(missing_ok=True)


# -- the pack --------------------------------------------------------------------------------------
@dataclass
class PackStats:
    packed: dict[str, int]  # per split
    bad: int
    shards: int
    skipped_shards: int  # already complete from an earlier run
    done_before: bool = False  # DST already held this pack: nothing was written


def pack_settings(*, digest: str, max_side: int, quality: int, shard_size: int, seed: int) -> dict:
    """What makes a pack what it is: the input (its digest) and the settings."""
    return {"max_side": max_side, "quality": quality, "shard_size": shard_size, "seed": seed, "samples": digest}


def same_pack(meta: dict, settings: dict) -> bool:
    """Whether packed.json `meta` is the pack that `settings` make (this format, input and settings)."""
    return (meta.get("format") == FORMAT and meta.get("source_digest") == settings["samples"]
            and meta.get("settings") == {k: v for k, v in settings.items() if k != "samples"})


def difference(meta: dict, settings: dict) -> str:
    """In words, what differs between packed.json `meta` and `settings`."""
    if meta.get("format") != FORMAT:
        return f"format {meta.get('format')!r}, this version writes {FORMAT!r}"
    if meta.get("source_digest") != settings["samples"]:
        return "other input data (images, labels or split)"
    old = meta.get("settings", {})
    return ", ".join(f"{k} {old.get(k)!r} there, {v!r} now" for k, v in settings.items()
                     if k != "samples" and old.get(k) != v) or "other settings"


def finished(dst: Path, settings: dict, cache_dir: str | Path | None = None) -> dict | None:
    """packed.json of DST when DST holds a finished pack of exactly `settings`, every file of it whole
    (each shard's sha256, XXH3-128 and index checked; with `cache_dir`, verdicts are cached there by path, size and
    mtime); None when DST holds no finished pack. A finished pack of other input or settings is an error."""
    path = dst / PACKED_NAME
    if not path.is_file() or (dst / PROGRESS_NAME).is_file():
        return None
    try:
        meta = parse_packed(path.read_bytes(), str(path))  # held to what every reader of the pack holds it to
    except OSError:
        raise PackError(f"{path} is damaged; delete {dst} and pack again") from None
    except PackedFormatError as e:
        raise PackError(f"{e} (delete {dst} first)") from None
    if not same_pack(meta, settings):
        raise PackError(f"{dst} already holds a finished pack of {difference(meta, settings)}; pack into another "
                        "folder, or delete this one to pack it again")
    verdicts = None
    if cache_dir is not None:
        verdicts = Verdicts(cache_dir)
    for split in meta["splits"].values():
        for s in split["shards"]:
            tar = dst / s["name"]
            if not tar.is_file() or tar.stat().st_size != s["size"] or not (dst / s["index"]).is_file():
                raise PackError(f"{tar} (or its index) is missing or changed since it was packed; delete {dst} and "
                                "pack again")
            problem = _shard_problem(tar, dst / s["index"], s, verdicts)
            if problem:
                raise PackError(f"{problem}, so it changed since it was packed; delete {dst} and pack again")
    if verdicts is not None:
        verdicts.save()
    return meta


def _shard_problem(tar: Path, index: Path, s: dict, verdicts) -> str | None:
    """What is wrong with a finished shard and its index, or None: the shard's bytes against packed.json's
    sha256 and XXH3-128 (a verdict cached by path, size and mtime spares the read: one of both checksums,
    not a reader's of one), the index against the one the shard's own bytes give (checked whenever the
    shard is read)."""
    sha, fast = s.get("sha256"), s.get(FAST_SUM)
    verdict = f"{sha}+{verdict_key(None, fast)}" if sha and fast else verdict_key(sha, fast)
    if verdict is not None and verdicts is not None and verdicts.matches(tar, verdict) and verdicts.matches(
            index, file_sha256(index)):
        return None
    try:
        with open(tar, "rb") as f:
            indexed = index_tar(f)
    except TarFormatError as e:
        return f"{tar} is {e}"
    if sha is not None and indexed.sha256 != sha:
        return f"{tar} has sha256 {indexed.sha256[:12]}..., packed.json records {sha[:12]}..."
    if fast is not None and indexed.xxh3 != fast:
        return f"{tar} has {FAST_SUM} {indexed.xxh3[:12]}..., packed.json records {fast[:12]}..."
    if index.read_text(encoding="utf-8", errors="surrogateescape") != format_index(indexed.entries):
        return f"{index} is not the index of {tar.name}"
    if verdict is not None and verdicts is not None:
        verdicts.record(tar, verdict)
        verdicts.record(index, file_sha256(index))
    return None


def pack_manifest(manifest, dst: Path, *, max_side: int, quality: int, shard_size: int, workers: int, seed: int,
                  bad: dict[str, str], progress: bool = True, cache_dir: str | Path | None = None) -> PackStats:
    """Pack the manifest's (good) samples into shards under `dst`; see the module docstring. `bad`:
    {absolute path: reason} of the images left out before packing (for DST/bad_images.tsv)."""
    root = manifest.root.resolve()

    def report(failed: dict[str, str]) -> int:
        write_report({**bad, **failed}, root, dst)
        return len(bad) + len(failed)

    settings = pack_settings(digest=manifest.digest(), max_side=max_side, quality=quality, shard_size=shard_size,
                             seed=seed)
    return pack_items(manifest_items(manifest), manifest.classes, dst, settings=settings, workers=workers,
                      report=report, progress=progress, cache_dir=cache_dir)


def pack_shards(shards, dst: Path, *, max_side: int, quality: int, shard_size: int, workers: int, seed: int,
                progress: bool = True, cache_dir: str | Path | None = None, extract=None) -> PackStats:
    """Pack the usable samples of a ShardSet (a pack, shards written by others, a Hugging Face dataset's tables)
    into shards under `dst`; `extract`: its form's (inputs.Form.extract), where the images are not tar members."""
    where = {f"{s.name}\n{k}": (s, e) for s in shards.shards for e, k in enumerate(s.keys)}

    def report(failed: dict[str, str]) -> int:
        extra = [(*where[ident], reason) for ident, reason in failed.items()]
        write_member_report(shards, dst, extra)
        return len(shards.bad) + len(extra)

    settings = pack_settings(digest=shards.digest(), max_side=max_side, quality=quality, shard_size=shard_size,
                             seed=seed)
    return pack_items(shard_items(shards, cache_dir, extract), shards.classes, dst, settings=settings, workers=workers, report=report,
                      progress=progress, cache_dir=cache_dir)


def pack_items(items: list[Item], classes: list[str], dst: Path, *, settings: dict, workers: int, report,
               progress: bool = True, cache_dir: str | Path | None = None) -> PackStats:
    """Pack `items` under `dst`; `report(failed)` writes DST/bad_images.tsv (with the images that could
    not be packed, {ident: reason}) and returns how many images were left out in all. `cache_dir` keeps
    the verdicts of the check of a finished pack (see `finished`)."""
    from tqdm import tqdm

    dst.mkdir(parents=True, exist_ok=True)
    meta = finished(dst, settings, cache_dir)
    if meta is not None:
        return PackStats({k: v["samples"] for k, v in meta["splits"].items()}, meta.get("bad_images", 0),
                         sum(len(v["shards"]) for v in meta["splits"].values()),
                         sum(len(v["shards"]) for v in meta["splits"].values()), done_before=True)
    prog = _load_progress(dst, settings)
    splits = {split: order([i for i in items if i.split == split], settings["seed"], key=lambda i: i.ident)
              for split in ("train", "val")}
    keys = sample_keys([i.rel for i in items])
    done = {split: (prog["splits"].get(split) or [{"next": 0}])[-1]["next"] for split in splits}
    todo = [(split, i, s) for split, samples in splits.items() for i, s in enumerate(samples) if i >= done[split]]
    skipped = sum(len(v) for v in prog["splits"].values())
    failed = prog.setdefault("failed", {})  # images that could not be decoded (kept across reruns)
    bar = tqdm(total=len(todo), unit="img", desc="pack", disable=not progress or not todo, file=sys.stderr,
               mininterval=1.0)
    writers: dict[str, ShardWriter | None] = {split: None for split in splits}
    cap = {split: max(1, math.ceil(len(samples) / MIN_SHARDS)) for split, samples in splits.items()}
    by_count = False  # whether a shard was closed by `cap` before --shard-size (said at the end)
    jobs = [(n, s.source, settings["max_side"], settings["quality"]) for n, (_, _, s) in enumerate(todo)]
    pool = get_context("spawn").Pool(workers) if workers > 1 and len(jobs) > 1 else None
    try:
        chunk = max(1, min(64, len(jobs) // (8 * workers)))  # few round trips, yet every worker busy to the end
        results = pool.imap(_normalise_job, jobs, chunksize=chunk) if pool else map(_normalise_job, jobs)
        for n, result in results:
            check()  # SIGTERM, Ctrl-C: the shards being written are removed (below), the finished ones kept
            split, i, item = todo[n]
            bar.update(1)
            if isinstance(result, str):
                failed[item.ident] = result
                continue
            if writers[split] is None:
                number = len(prog["splits"].setdefault(split, []))
                writers[split] = ShardWriter(dst, f"{split}-{number:06d}")
            writers[split].add(keys[item.rel], result[0], item.label, classes[item.label], item.image_path, i)
            full = writers[split].size >= settings["shard_size"]
            if full or len(writers[split].entries) >= cap[split]:
                by_count = by_count or not full
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
    n_bad = report(dict(failed))
    packed = {split: sum(s["samples"] for s in prog["splits"].get(split, [])) for split in splits}
    _write_packed(dst, classes, prog, packed, settings, n_bad)
    if by_count and progress:
        print(f"pack: each split in {MIN_SHARDS} shards or more (at most "
              + ", ".join(f"{cap[s]} {s}" for s in splits if splits[s]) + " images a shard), so that streaming has "
              f"shards to fetch ahead and several readers shards to share; --shard-size "
              f"({settings['shard_size']:,} bytes) was not reached", file=sys.stderr)
    return PackStats(packed, n_bad, sum(len(v) for v in prog["splits"].values()), skipped)


def read_progress(dst: Path) -> dict | None:
    """An unfinished pack's progress, {"settings", "splits": {split: [shard records]}, "failed": {ident: reason}}, or
    None without one. The file is JSON lines: the settings first, then one line a finished shard (with the images
    that failed since the one before), appended as each is written: rewriting the whole progress at each shard, as
    before, made a pack quadratic in its shards (each record lists its images). A line a kill cut short is skipped
    (its shard is written again); a progress file of the earlier form (one JSON object) is read as it was."""
    try:
        text = (dst / PROGRESS_NAME).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    try:
        whole = json.loads(text)
        if isinstance(whole, dict) and "settings" in whole:
            return {"failed": {}, **whole, "splits": whole.get("splits") or {}}
    except ValueError:
        pass
    prog = None
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if prog is None:
            if "settings" not in rec:
                return None
            prog = {"settings": rec["settings"], "splits": {}, "failed": {}}
        else:
            prog["failed"].update(rec.get("failed") or {})
            if "shard" in rec:
                prog["splits"].setdefault(rec["split"], []).append(rec["shard"])
    return prog


def _load_progress(dst: Path, settings: dict) -> dict:
    prog = read_progress(dst)
    if prog is None:  # the file is written at the first shard (a pack stopped before one is not "unfinished")
        remove_dead_temps(dst, ".*.tmp-*")  # (but may have left that shard's temporary file)
        return {"settings": settings, "splits": {}, "failed": {}, "logged": set()}
    if prog.get("settings") != settings:
        raise PackError(f"{dst} holds an unfinished pack of other data or settings ({prog.get('settings')}); pack "
                        "into another folder, or delete this one to start over")
    for shards in prog["splits"].values():  # a shard recorded as done must still be there, whole
        for s in shards:
            tar = dst / s["name"]
            if not tar.is_file() or tar.stat().st_size != s["size"]:
                raise PackError(f"{tar} is missing or changed since it was packed; delete {dst} and pack again")

    remove_dead_temps(dst, ".*.tmp-*")
    lines = [{"settings": prog["settings"]}, {"failed": prog["failed"]}] + [
        {"split": split, "shard": shard} for split, shards in prog["splits"].items() for shard in shards]
    write_atomic(dst / PROGRESS_NAME, "".join(json.dumps(line) + "\n" for line in lines))  # (an earlier form's, as lines)
    prog["logged"] = set(prog["failed"])  # failures written to the file already
    return prog


def _finish(dst: Path, prog: dict, split: str, writers: dict) -> None:
    shard = writers[split].close()
    prog["splits"].setdefault(split, []).append(shard)
    writers[split] = None
    new = {k: v for k, v in prog["failed"].items() if k not in prog["logged"]}
    if not (dst / PROGRESS_NAME).is_file():
        write_atomic(dst / PROGRESS_NAME, json.dumps({"settings": prog["settings"]}) + "\n")
    with open(dst / PROGRESS_NAME, "a", encoding="utf-8") as f:
        f.write(json.dumps({"split": split, "shard": shard, "failed": new}) + "\n")
    prog["logged"].update(new)


def _write_packed(dst: Path, classes: list[str], prog: dict, packed: dict, settings: dict, bad: int) -> None:
    meta = {"format": FORMAT, "classes": list(classes),
            "splits": {split: {"samples": packed[split],
                               "shards": [{k: v for k, v in s.items() if k != "next"} for s in shards]}
                       for split, shards in prog["splits"].items()},
            "settings": {k: v for k, v in settings.items() if k != "samples"}, "source_digest": settings["samples"],
            "bad_images": bad}
    write_atomic(dst / PACKED_NAME, json.dumps(meta, indent=1, ensure_ascii=False))
    (dst / PROGRESS_NAME).unlink(missing_ok=True)
