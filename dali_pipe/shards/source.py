"""Where shards come from, and what a run reads from them: classes, split, the bad members left out.

`--data` holds shards in one of two ways:

- a pack (`python -m dali_pipe pack`): `packed.json` with the classes, the split, and per shard its
  index file, sample count, size, sha256 and the image_path of each sample; a folder or s3:// prefix
  (`shards.cache.fetch` brings it local);
- shards written by others (webdataset's `ShardWriter`, img2dataset, any WebDataset tool) with no
  packed.json and no dataset.tsv, as `.tar`, `.tar.gz` or `.tgz`: a folder of them (or, when it holds
  none itself, its train/, val/ and test/ subfolders of them), one shard file, a brace pattern
  (`shards/train-{000000..000099}.tar`, nested groups too, expanded by braceexpand as webdataset
  does), an s3:// prefix (or its train/ and val/ sub-prefixes), or https:// URLs (one, or a brace
  pattern: a server lists no folder). Each shard is indexed once (`format.index_tar`, one pass; on S3
  or HTTP one streaming GET) into CACHE_DIR/shards, with its size, sha256 and XXH3-128; the user's folder or
  bucket is never written. A gzipped shard is decompressed in that same pass into CACHE_DIR/gunzip
  (one copy per source, refused up front when the copies would not fit on the cache disk with
  cache.HEADROOM spare, bounded while written), and read from there: checked by its checksum on every run
  (a cached verdict: a stat), made again when gone or damaged. Images and labels: the members
  `format.pick_member` chooses (plain jpg, jpeg, png, webp and `cls`; else compound names such as
  `image.jpg` and `label.cls`, as webdataset's `to_tuple` reads them). Classes are the `cls`
  integers, named by a `classes.txt` beside the shards (one name per line, in index order), else by
  the `label` of each sample's `json`, else by the integers themselves; predict reads no `cls`, so
  shards without labels (img2dataset, LAION) are labelled too. The split: shards named
  `val`/`validation` (in their path below the folder that holds them all) are validation and the rest
  training, shards named `test` neither (said at start-up); when no shard is named val, a sample goes
  to validation when a hash of its key and --seed falls below --val-fraction (so adding shards never
  moves a sample). Every file beside the shards that is neither a shard nor a known sidecar (indexes,
  classes.txt, img2dataset's per-shard parquet and stats, a README) is named at start-up.

Every shard's samples are then checked before any pipeline is built, their verdicts cached by shard
(path, size, mtime; or URL, size, ETag): the `.cls` of each (outside the classes of a pack: an error
naming the shard and key), and with `--scan fast|full` its image, with the checks the file scan uses
(headers; or a decode with DALI's CPU decoder). Bad members of peer shards (no `.cls`, a non-integer
one, no image, several candidates and none to prefer, a duplicate key, an image that fails the scan)
and bad images of packs are kept out of the pipeline through `Shards.excluded` and listed in
bad_images.tsv with shard and key, under the same --max-bad-fraction bound as files.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import posixpath
import re
import shutil
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from braceexpand import UnbalancedBracesError, braceexpand

from ..config import DataSettings
from ..errors import UserError
from ..forms import (
    SHARD_FOLDERS,
    SHARD_SUFFIXES,
    UnfinishedPackError,
    is_shard_name,
    shard_files,
    split_of,
    unfinished_pack,
)
from ..https import HttpError, Stopped, head, is_http, open_stream, read_small, shown
from ..samples import Shards
from ..scan import DaliDecoder, ScanResult, check_bytes
from ..sync import SyncError, explain, local_target, make_client, parse_s3_uri
from ..tsv import row as tsv_row
from ..workdir import human_bytes, remove_dead_temps
from .cache import ATTEMPT_DEADLINE, HEADROOM, MIN_RATE, Verdicts, check_file, is_remote, verdict_key
from .format import (
    FAST_SUM,
    IMAGE_EXTS,
    IMAGE_NAMES,
    LABEL_EXT,
    LABEL_NAMES,
    PACKED_NAME,
    Counting,
    Gunzip,
    IndexEntry,
    IndexFormatError,
    PackedFormatError,
    TarFormatError,
    cls_problem,
    format_index,
    image_member,
    index_tar,
    json_image_path,
    json_label,
    label_member,
    member_bytes,
    meta_member,
    parse_cls,
    parse_packed,
    pick_member,
    read_index,
    used_member,
)

CLASSES_NAME = "classes.txt"
S3_ATTEMPTS = 3  # streaming GETs of one shard (S3 or HTTP) while indexing it, when the connection is cut
VAL_WORDS = {"val", "valid", "validation"}
TEST_WORDS = {"test", "testing"}
GZIP_SUFFIXES = (".tar.gz", ".tgz")
GUNZIP_DIR = "gunzip"  # CACHE/gunzip: the decompressed copies of gzipped shards
UNUSED_SHOWN = 8  # unread files named at start-up (then a count)
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")
MANIFEST_NAME = "dataset.tsv"
# files beside shards that are not data and not worth a word (lower case): what others' tools write next to
# their shards (indexes, img2dataset's NNNNN.parquet and NNNNN_stats.json, named after a shard), docs
SIDECAR_NAMES = {CLASSES_NAME, PACKED_NAME, MANIFEST_NAME, "bad_images.tsv", "stats.json", "readme", "readme.md",
                 "readme.txt", "license", "license.txt", "license.md", "dataset_info.json"}
SIDECAR_SUFFIXES = (".idx", ".index", ".wids.json")


class ShardSourceError(UserError):
    """Shards that cannot be read as they are; the message names the file, shard or key and the fix."""


# -- what --data is -----------------------------------------------------------------------------
def is_brace_pattern(data: str) -> bool:
    """Whether --data is a brace pattern (`shards-{000..099}.tar`, nested too) that names several shards."""
    if "{" not in data:
        return False
    try:
        return _expand(data) != [data]
    except UnbalancedBracesError:
        return True  # taken as a pattern, so that expand_braces names what is wrong with it


def expand_braces(pattern: str) -> list[str]:
    """The shards a brace pattern names, in order, exactly as webdataset expands them (it uses braceexpand:
    `{000..099}` keeps the zero padding, `{a,b}`, nested groups, several groups). Unbalanced braces are
    refused, naming the pattern."""
    try:
        return _expand(pattern)
    except UnbalancedBracesError:
        raise ShardSourceError(f"--data {shown(pattern)!r}: its braces do not balance; write a pattern such as "
                               "shards/train-{000000..000099}.tar") from None


def _expand(pattern: str) -> list[str]:
    return list(braceexpand(pattern))


def is_gzip(name: str) -> bool:
    return name.lower().endswith(GZIP_SUFFIXES)


def _stem(name: str) -> str:
    """A shard's name without its suffix (`val-000000.tar.gz` -> `val-000000`)."""
    low = name.lower()
    return name[: -len(next(x for x in SHARD_SUFFIXES if low.endswith(x)))] if is_shard_name(name) else name


def list_first(client, bucket: str, base: str) -> list[str]:
    """The first page (1000) of the keys below s3://bucket/base, relative to it, sub-folders included."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        page = client.list_objects_v2(Bucket=bucket, Prefix=base)
    except (BotoCoreError, ClientError) as e:
        raise SyncError(explain(e, bucket, base)) from None
    return [obj["Key"][len(base):] for obj in page.get("Contents", [])]


def parquet_keys(keys) -> list[str]:
    """The .parquet files among object keys (relative to the prefix), where `forms.parquet_files` finds them
    in a folder: at the top, in data/, or in split folders."""
    def found(k: str) -> bool:
        parts = k.split("/")
        return k.endswith(".parquet") and not any(p.startswith(".") for p in parts) and len(parts) <= 3 and all(
            p == "data" or split_of(p) is not None for p in parts[:-1])

    return sorted(k for k in keys if found(k))


def list_top(client, bucket: str, base: str, pages: int | None = None,
              folders: list | None = None) -> dict[str, tuple[int, str]]:
    """{name: (size, ETag)} of the objects directly under s3://bucket/base (not in its sub-folders); the
    sub-folders' names are appended to `folders` when given."""
    from botocore.exceptions import BotoCoreError, ClientError

    out: dict[str, tuple[int, str]] = {}
    try:
        for n, page in enumerate(client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base,
                                                                                 Delimiter="/")):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(base):]] = (obj["Size"], obj["ETag"].strip('"'))
            if folders is not None:
                folders += [p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", [])]
            if pages is not None and n + 1 >= pages:
                break
    except (BotoCoreError, ClientError) as e:
        raise SyncError(explain(e, bucket, base)) from None
    return out


# -- what a run reads ---------------------------------------------------------------------------
@dataclass
class Shard:
    """One shard and what its check found, entry by entry (positions in its index file)."""
    name: str  # as a person reads it: the file name, or the s3:// URL
    path: str  # what the reader opens: an absolute local path or an s3:// URL
    index_path: str  # local DALI index
    size: int | None
    sha256: str | None
    keys: list[str]
    image_paths: list[str]  # what bad_images.tsv and predict call each sample
    cls: list[int | None]  # the class index in each .cls (None: unknown or bad)
    bad: dict[int, str] = field(default_factory=dict)  # entry -> reason it is left out
    split: list[str] = field(default_factory=list)  # "train", "val" or "test" (left out of both) per entry
    label_names: list[str | None] = field(default_factory=list)  # json labels (shards of others)
    group: object = None  # a table shard's samples.TableGroup (Hugging Face datasets, shards/tables.py)
    origin: str = ""  # where the user keeps it (a .tar.gz's path, where `path` is its decompressed copy)
    xxh3: str | None = None  # the fast checksum (format.FAST_SUM), checked instead of the sha256 where known

    def __post_init__(self):
        self.origin = self.origin or self.path


@dataclass
class ShardSet:
    """What a run reads from shards (the questions a Manifest answers, for shards)."""
    data: str
    kind: str  # "pack", "shards", or "parquet" / "arrow" (shards/tables.py)
    classes: list[str]
    shards: list[Shard]
    remap: tuple[int, ...] | None = None  # cls integer -> class position (shards of others, sparse cls)
    note: str = ""  # where the class names came from (the start-up summary says it)
    root: Path | None = None  # a pack: the local folder holding packed.json and the index files
    meta: dict = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unscanned: int = 0  # shards read from S3 as needed, whose members could not be checked beforehand
    unused: list[str] = field(default_factory=list)  # what --data holds and is not read (said at start-up)
    held_out: str = ""  # shards named test, neither trained on nor validated (said at start-up)
    labels: bool = True  # False: predict, which reads no cls (shards without labels are read too)
    split_rule: str = "hash"  # how the split was made: "pack" (packed.json), "names" (val shards) or "hash"
    train: Shards = field(init=False)
    val: Shards = field(init=False)
    test: Shards = field(init=False)
    everything: Shards = field(init=False)  # every shard once, the bad members left out (predict)

    def __post_init__(self):
        self.train, self.val = self._select("train"), self._select("val")
        self.test = self._select("test")  # held out: a Hugging Face dataset's test files (evaluate --split test)
        self.everything = self._select(None)

    def _select(self, split: str | None) -> Shards:
        def left_out(s: Shard, e: int) -> bool:
            return e in s.bad or (split is not None and s.split[e] != split)

        chosen = [s for s in self.shards if not all(left_out(s, e) for e in range(len(s.keys)))]
        excluded = frozenset((i, e) for i, s in enumerate(chosen) for e in range(len(s.keys)) if left_out(s, e))
        groups = tuple(s.group for s in chosen) if any(s.group is not None for s in chosen) else None
        return Shards(paths=tuple(s.path for s in chosen), index_paths=tuple(s.index_path for s in chosen),
                      samples=sum(len(s.keys) for s in chosen) - len(excluded), remap=self.remap,
                      sizes=tuple(s.size for s in chosen), sha256=tuple(s.sha256 for s in chosen),
                      xxh3=tuple(s.xxh3 for s in chosen) if any(s.xxh3 for s in chosen) else None, excluded=excluded,
                      groups=groups, labels=self.labels)

    @property
    def total(self) -> int:
        return sum(len(s.keys) for s in self.shards)

    @property
    def bad(self) -> list[tuple[Shard, int, str]]:
        return [(s, e, r) for s in self.shards for e, r in sorted(s.bad.items())]

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.classes))

    def names(self, shards: Shards) -> list[str]:
        """The image_path of each sample `shards` yields outside training, in that order."""
        by_path = {(s.path, s.index_path): s for s in self.shards}
        out = []
        for i, (path, idx) in enumerate(zip(shards.paths, shards.index_paths)):
            s = by_path[(path, idx)]
            out += [p for e, p in enumerate(s.image_paths) if (i, e) not in shards.excluded]
        return out

    def digest(self) -> str:
        """A hash of what a run reads: classes, shards, split and the members left out."""
        if self.kind == "pack" and not any(s.bad for s in self.shards):  # as before checks existed: resumes match
            splits = {name: {**split, "shards": [{k: v for k, v in s.items() if k != FAST_SUM} for s in split["shards"]]}
                      for name, split in self.meta["splits"].items()}  # the same pack before the fast checksum too
            return hashlib.sha256(json.dumps([self.classes, splits], sort_keys=True).encode()).hexdigest()[:16]
        h = hashlib.sha256(json.dumps(self.classes).encode())
        for s in self.shards:
            h.update(f"{s.name}\t{s.size}\t{s.sha256}\t{len(s.keys)}\n".encode())
            h.update(json.dumps([s.split, sorted(s.bad)]).encode())
            if s.group is not None:  # a table's labels come from a column the settings choose
                h.update(json.dumps(s.cls).encode())
        return h.hexdigest()[:16]

    def without(self, bad) -> "ShardSet":
        return self  # bad members are already left out (excluded)

    def scan_result(self):
        return ScanResult(bad={f"{s.name} {s.keys[e]}": r for s, e, r in self.bad}, total=self.total)


# -- opening --------------------------------------------------------------------------------------
def open_packed(data: str, cache_dir: str | Path) -> ShardSet:
    """The pack at --data read from local disk (after `shards.cache.fetch` for s3://), with its structural
    checks but no check of its members (that is `open_shards`)."""
    return open_pack(DataSettings(data=data, cache_dir=str(cache_dir), scan="off"), members=False)


def _pack_root(data: str, cache_dir) -> Path:
    if data.startswith("s3://"):
        return local_target(data, Path(cache_dir))
    return Path(data)


def open_pack(data, *, members: bool, num_threads: int = 1, progress: bool = False) -> ShardSet:
    root = _pack_root(data.data, data.cache_dir)
    remote = data.data.startswith("s3://")
    path = root / PACKED_NAME
    if not path.is_file():
        raise ShardSourceError(f"{path} is missing; pack the data first (python -m dali_pipe pack)")
    try:
        meta = parse_packed(path.read_bytes(), str(path))
    except PackedFormatError as e:
        raise ShardSourceError(str(e)) from None
    classes = list(meta["classes"])
    shards = []
    for split, info in meta["splits"].items():
        listed = info.get("shards", [])
        for s in listed:
            shards.append(_pack_shard(root, s, split, path, data.data.rstrip("/") if remote else None))
        if sum(s["samples"] for s in listed) != info.get("samples"):
            raise ShardSourceError(f"{path}: splits.{split}.samples is {info.get('samples')}, its shards hold "
                                   f"{sum(s['samples'] for s in listed)}; packed.json was edited or damaged: pack "
                                   "the data again")
    if members:
        _check_pack_members(shards, classes, data, num_threads=num_threads, progress=progress)
    unscanned = sum(1 for s in shards if s.path.startswith("s3://"))
    return ShardSet(data.data, "pack", classes, shards, root=root, meta=meta, unscanned=unscanned, split_rule="pack")


def _pack_shard(root: Path, s: dict, split: str, packed: Path, prefix: str | None) -> Shard:
    idx = root / s["index"]
    if not idx.is_file():
        raise ShardSourceError(f"{idx} is missing (packed.json lists it for {s['name']}); copy the whole pack "
                               "again, or pack the data again")
    try:
        entries = read_index(idx)
    except (IndexFormatError, UnicodeDecodeError) as e:
        raise ShardSourceError(f"{e}; copy the whole pack again, or pack the data again") from None
    if len(entries) != s["samples"]:
        raise ShardSourceError(f"{packed}: {s['name']} holds {s['samples']} samples by packed.json, but its index "
                               f"{idx.name} lists {len(entries)}; packed.json was edited or damaged: pack the data "
                               "again")
    local = root / s["name"]
    if local.is_file() and local.stat().st_size == s["size"]:
        where = str(local.resolve())
    elif prefix is not None:
        where = f"{prefix}/{s['name']}"
    else:
        raise ShardSourceError(f"{local} is missing or incomplete ({s['size']} bytes expected); pack again or copy "
                               "the whole pack")
    keys = [e.key for e in entries]
    paths = s.get("image_paths") or keys
    if len(paths) != len(keys):
        raise ShardSourceError(f"{packed}: {s['name']} lists {len(paths)} image_paths for {len(keys)} samples; "
                               "pack the data again")
    end = max((off + size for e in entries for off, size in e.members.values()), default=0)
    if local.is_file() and end > local.stat().st_size:
        raise ShardSourceError(f"{idx} points past the end of {local.name} ({end} > {local.stat().st_size} bytes); "
                               "the index does not belong to this shard: copy the whole pack again")
    return Shard(s["name"], where, str(idx.resolve()), s.get("size"), s.get("sha256"), keys, list(paths),
                 [None] * len(keys), split=[split] * len(keys), xxh3=s.get(FAST_SUM))


def _check_pack_members(shards: list[Shard], classes: list[str], data, *, num_threads: int, progress: bool) -> None:
    """Each local shard's .cls (an error when outside the classes) and, with --scan, its images."""
    level = data.scan
    remove_dead_temps(Path(data.cache_dir) / "shards", ".*.tmp-*")  # what a writer killed with -9 left half written
    bar = progress_bar(len(shards), "check pack", progress)
    for s in shards:
        if s.path.startswith("s3://"):
            bar.update(1)
            continue
        checked = _cached_check(s, Path(data.cache_dir), level, data.max_pixels, num_threads)
        for e, raw_problem in {**checked["labels"], **checked["problems"]}.items():
            raise ShardSourceError(f"{s.name}: sample {s.keys[int(e)]!r} {raw_problem} (in {s.index_path}); the pack "
                                   "is damaged: pack the data again")
        recorded = s.image_paths if s.image_paths != s.keys else [None] * len(s.keys)  # packed/1: no image_paths
        for e, (said, listed) in enumerate(zip(checked.get("paths") or [None] * len(s.keys), recorded)):
            if said is not None and listed is not None and said != listed:
                raise ShardSourceError(
                    f"{s.name}: sample {e + 1} of its index {s.index_path} is {said!r} by its json member, but "
                    f"packed.json lists {listed!r} there; the index or packed.json does not belong to this shard: copy "
                    "the whole pack again, or pack the data again")
        for e, c in enumerate(checked["cls"]):
            if c is not None and c >= len(classes):
                raise ShardSourceError(
                    f"{s.name}: sample {s.keys[e]!r} has class {c}, but packed.json lists {len(classes)} classes "
                    f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}); packed.json does not belong "
                    "to these shards: pack the data again")
        s.cls = checked["cls"]
        if level != "off":
            s.bad = {int(e): r for e, r in checked["images"].items()}
        bar.update(1)
    bar.close()


# -- checking members ----------------------------------------------------------------------------
LEVELS = {"off": 0, "fast": 1, "full": 2}


class _Collector:
    """Receives a shard's members sample by sample and records, per entry, its class index, json label,
    structural problem and (at `level`) image verdict."""

    def __init__(self, level: str, max_pixels: int, num_threads: int):
        self.level, self.max_pixels = level, max_pixels
        self.cls: dict[int, int | None] = {}
        self.names: dict[int, str | None] = {}
        self.paths: dict[int, str | None] = {}  # the json member's image_path (packs)
        self.problems: dict[int, str] = {}  # no image, several candidates, a member not where the index says
        self.labels: dict[int, str] = {}  # no usable cls (only training and evaluation need one)
        self.images: dict[int, str] = {}
        self._pos, self._key, self._members, self._batch = None, "", {}, {}
        self._decoder = None
        if level == "full":
            self._decoder = DaliDecoder(num_threads)

    def reset(self) -> None:
        """Forget what was collected (the shard is read again from its start)."""
        self.cls, self.names, self.paths, self.problems, self.labels, self.images = {}, {}, {}, {}, {}, {}
        self._pos, self._key, self._members, self._batch = None, "", {}, {}

    def member(self, pos: int, key: str, ext: str, data: bytes | None) -> None:
        """One member of entry `pos` (data None: a member no check reads)."""
        if pos != self._pos:
            self._finish()
            self._pos, self._key, self._members = pos, key, {}
        self._members.setdefault(ext, data)

    def problem(self, pos: int, reason: str) -> None:
        """A structural problem of entry `pos` found by the reader (the first one is kept)."""
        self.problems.setdefault(pos, reason)

    def _finish(self) -> None:
        if self._pos is None:
            return

        pos, m = self._pos, self._members
        img, images = pick_member(m, IMAGE_EXTS, IMAGE_NAMES)
        ext, labels = pick_member(m, (LABEL_EXT,), LABEL_NAMES)
        raw = m.get(ext) if ext else None
        problem = cls_problem(raw) if ext or len(labels) < 2 else self._several("label", labels, images)
        self.cls[pos] = parse_cls(raw) if problem is None else None
        if problem:
            self.labels.setdefault(pos, problem)
        meta = meta_member(m)
        self.names[pos] = json_label(m[meta]) if meta else None
        self.paths[pos] = json_image_path(m[meta]) if meta else None
        if img is None:
            self.problems.setdefault(pos, self._several("image", images, labels) if len(images) > 1 else
                                     "has no image member (jpg, jpeg, png or webp)")
        elif self.level != "off":
            reason = check_bytes(m[img], self.max_pixels)
            if reason:
                self.images[pos] = reason
            elif self._decoder is not None:
                self._batch[pos] = m[img]
                if len(self._batch) >= self._decoder.batch_size:
                    self._flush()
        self._pos, self._members = None, {}

    def _several(self, what: str, members: list[str], others: list[str]) -> str:
        """Why a sample with several compound members for its image (or label) and no plain one is left out."""
        named = {"image": "image.jpg", "label": "label.cls"}[what]
        reason = (f"holds several {what} members ({', '.join(members[:4])}) and no plain one; name the one to read "
                  f"KEY.{named.split('.')[1]} or KEY.{named}")
        if {x.split(".", 1)[0] for x in members} & {x.split(".", 1)[0] for x in others}:  # v1.jpg + v1.cls, v2.jpg ...
            reason += (f" (if these are samples whose keys hold a dot, {self._key}.{members[0].split('.')[0]} and so on, "
                       "webdataset reads them as one sample too: a key ends at the first dot, so write keys without "
                       "dots)")
        return reason

    def _flush(self) -> None:
        if self._batch:
            self.images.update(self._decoder.decode(self._batch))
            self._batch = {}

    def close(self, n: int) -> dict:
        self._finish()
        for e in range(n):  # an entry no member reached (a tar with entries of none): no cls, no image
            if e not in self.cls:
                self._pos, self._key, self._members = e, "", {}
                self._finish()
        if self._decoder is not None:
            self._flush()
        return {"cls": [self.cls.get(e) for e in range(n)], "names": [self.names.get(e) for e in range(n)],
                "paths": [self.paths.get(e) for e in range(n)],
                "problems": {str(e): r for e, r in self.problems.items()},
                "labels": {str(e): r for e, r in self.labels.items()},
                "images": {str(e): r for e, r in self.images.items()}, "level": self.level,
                "max_pixels": self.max_pixels}


def _read_members(path: str, entries: list[IndexEntry], collector: _Collector, images: bool) -> None:
    """Feed each entry's label, json and (when `images`) image member from a local tar, after checking
    that the tar header before each names that member (an index of another shard points elsewhere)."""
    with open(path, "rb") as f:
        for pos, e in enumerate(entries):
            collector.member(pos, e.key, "", b"")  # the entry, even with none of the members below
            img = image_member(e.members)
            for ext in (label_member(e.members), meta_member(e.members), img):
                if ext:
                    off, size = e.members[ext]
                    named = None
                    if off >= 512:
                        f.seek(off - 512)
                        try:
                            head = tarfile.TarInfo.frombuf(f.read(512), "utf-8", "surrogateescape")
                            named = (head.name, head.size)
                        except (tarfile.HeaderError, ValueError):
                            pass
                    f.seek(off)
                    if named != (f"{e.key}.{ext}", size):
                        collector.problem(pos, f"is not where the index says: the tar member at byte {off} is "
                                               f"{'not a tar member' if named is None else repr(named[0])}, the index "
                                               f"names {e.key}.{ext}")
                        continue
                    collector.member(pos, e.key, ext, member_bytes(f.read, size) if images or ext != img else b"")


def cache_file(cache_dir: Path, identity: str, suffix: str) -> Path:
    return cache_dir / "shards" / (hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:32]
                                   + suffix)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8", errors="surrogateescape")
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ShardSourceError(f"no space left to write {path} ({e.strerror}); free space there, or pass "
                                   "another --cache-dir / --output") from None
        raise ShardSourceError(f"cannot write {path} ({e.strerror or e}); make its folder writable, or pass another "
                               "--cache-dir / --output") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8", errors="surrogateescape"))
    except (OSError, ValueError):
        return None


def _covers(checked: dict | None, level: str, max_pixels: int, n: int) -> bool:
    """Whether a cached check holds what this run needs (a check without "labels" is of an older version)."""
    return bool(checked) and "labels" in checked and len(checked["cls"]) == n and LEVELS[checked["level"]] >= LEVELS[
        level] and (level == "off" or checked["max_pixels"] == max_pixels)


def _cached_check(s: Shard, cache_dir: Path, level: str, max_pixels: int, num_threads: int) -> dict:
    """A local pack shard's member check, cached by (shard, index) path, size and mtime."""
    st, ist = os.stat(s.path), os.stat(s.index_path)
    identity = f"pack\0{s.path}\0{st.st_size}\0{st.st_mtime_ns}\0{s.index_path}\0{ist.st_size}\0{ist.st_mtime_ns}"
    cache = cache_file(cache_dir, identity, ".json")
    checked = load_json(cache)
    if not _covers(checked, level, max_pixels, len(s.keys)) or "paths" not in checked:  # no paths: an older check
        entries = read_index(s.index_path)
        collector = _Collector(level, max_pixels, num_threads)
        _read_members(s.path, entries, collector, images=level != "off")
        checked = collector.close(len(entries))
        write_atomic(cache, json.dumps(checked))
    return checked


# -- shards written by others -------------------------------------------------------------------
@dataclass
class _Listed:
    name: str  # file name or URL (redacted), for messages
    path: str  # local absolute path, s3:// or https:// URL
    identity: str  # what the cached index is valid for
    size: int | None  # of the file or object as stored (compressed, for a .tar.gz)
    copy: Path | None = None  # a gzipped shard: where its decompressed tar is kept (CACHE/gunzip)
    reuse: bool = True  # False: indexed again on every run (a server that gives no ETag or Last-Modified)


@dataclass
class _Found:
    """What --data names: its shards, the text of its classes.txt, and the files beside them that are not read."""
    items: list[_Listed]
    classes_txt: str | None = None
    unused: list[str] = field(default_factory=list)


def _gunzip_copy(cache_dir: Path, item: _Listed) -> _Listed:
    """A gzipped shard's decompressed tar lives at one place per source (a digest of its path or URL), so a
    shard that changed replaces its own copy and the folder holds one copy per shard ever read."""
    if is_gzip(item.path.split("?", 1)[0]):
        digest = hashlib.sha256(item.path.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        base = _stem(item.path.split("?", 1)[0].rsplit("/", 1)[-1])
        item.copy = cache_dir / GUNZIP_DIR / f"{digest}-{_UNSAFE_NAME.sub('_', base)[:80]}.tar"
    return item


def _list_peer(data: str, cache_dir: Path) -> _Found:
    """The shards --data names, in order, with their classes.txt and the unread files beside them."""
    if is_http(data):
        found = _list_http(data)
    elif data.startswith("s3://"):
        found = _list_s3(data)
    else:
        found = _list_local(data)
    found.items = [_gunzip_copy(cache_dir, it) for it in found.items]
    return found


def _list_local(data: str) -> _Found:
    folders: list[Path] = []
    if is_brace_pattern(data):
        paths = [Path(p) for p in expand_braces(data)]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ShardSourceError(f"--data {data!r}: {len(missing)} of its {len(paths)} shard(s) do not exist, e.g. "
                                   f"{missing[0]}; fix the pattern or the files")
        folder = Path(posixpath.commonpath([str(p.parent) for p in paths])) if len(paths) > 1 else paths[0].parent
    elif Path(data).is_file():
        paths, folder = [Path(data)], Path(data).parent
    else:
        folder = Path(data)
        paths, folders = shard_files(folder)
    stopped = unfinished_pack(folder)  # (a shard or a pattern inside a stopped pack's folder names part of it)
    if stopped:
        raise UnfinishedPackError(stopped)
    dangling = [p for p in paths if p.is_symlink() and not p.exists()]
    if dangling:
        raise ShardSourceError(f"{dangling[0]} is a dangling symbolic link (-> {os.readlink(dangling[0])}); "
                               f"{len(dangling)} shard link(s) in {dangling[0].parent} point nowhere: fix or remove them")
    listed = []
    for p in paths:
        st = p.stat()
        path = str(p.resolve())
        listed.append(_Listed(str(p.relative_to(folder)), path,  # `val/part-0.tar` beside `train/part-0.tar`
                              f"file\0{path}\0{st.st_size}\0{st.st_mtime_ns}", st.st_size))
    unused = _unread_local(folder, paths, folders) if Path(data).is_dir() else []
    classes = folder / CLASSES_NAME
    return _Found(listed, classes.read_text(encoding="utf-8-sig") if classes.is_file() else None,  # -sig: a BOM
                  unused)


def _unread(names: list[tuple[str, bool]], used: set[str], stems: set[str], prefix: str = "") -> list[str]:
    """Of (name, is a folder) in a folder, those neither used nor a sidecar (hidden names aside), as
    `prefix + name` with why where it helps."""
    out = []
    for name, is_dir in names:
        if name.startswith(".") or name in used:
            continue
        low = name.lower()
        if not is_dir and (low in SIDECAR_NAMES or low.endswith(SIDECAR_SUFFIXES)
                           or name.split(".", 1)[0].removesuffix("_stats") in stems):
            continue
        if is_dir:
            out.append(f"{prefix}{name}/ (a folder)")
        elif re.search(r"\.(tar\.(bz2|xz|zst|lz4)|tbz2?|txz|zip|7z|rar)$", low):
            out.append(f"{prefix}{name} (only .tar, .tar.gz and .tgz shards are read)")
        else:
            out.append(prefix + name)
    return out


def _unread_local(folder: Path, paths: list[Path], subfolders: list[Path]) -> list[str]:
    stems = {_stem(p.name) for p in paths}
    used = {p.name for p in paths} | {d.name for d in subfolders}
    out = _unread([(p.name, p.is_dir()) for p in sorted(folder.iterdir())], used, stems)
    for d in subfolders:
        out += _unread([(p.name, p.is_dir()) for p in sorted(d.iterdir())], used | {CLASSES_NAME}, stems,
                       prefix=f"{d.name}/")
        if (d / CLASSES_NAME).is_file() and not (folder / CLASSES_NAME).is_file():
            out.append(f"{d.name}/{CLASSES_NAME} (classes.txt is read beside the subfolders: move it up)")
    return out


def _list_s3(data: str) -> _Found:
    from botocore.exceptions import BotoCoreError, ClientError

    client = make_client(4)
    unused: list[str] = []
    if is_brace_pattern(data):  # its shards may lie in several folders (`{train,val}/part-0.tar`): each listed once
        urls = expand_braces(data)
        folders: dict[str, dict] = {}
        for u in urls:
            folder = u.rsplit("/", 1)[0]
            if folder not in folders:
                b, p = parse_s3_uri(folder)
                folders[folder] = list_top(client, b, f"{p}/" if p else "")
        missing = [u for u in urls if u.rsplit("/", 1)[1] not in folders[u.rsplit("/", 1)[0]]]
        if missing:
            raise ShardSourceError(f"--data {data!r}: {len(missing)} of its {len(urls)} shard(s) are not in S3, e.g. "
                                   f"{missing[0]}; fix the pattern or upload them")
        bucket, prefix = parse_s3_uri(urls[0].rsplit("/", 1)[0])
        base = f"{prefix}/" if prefix else ""
        remote = folders[urls[0].rsplit("/", 1)[0]]
        found = [(u, folders[u.rsplit("/", 1)[0]][u.rsplit("/", 1)[1]]) for u in urls]
        names = [u.rsplit("/", 1)[1] for u in urls]
    else:
        bucket, prefix = parse_s3_uri(data)
        base = f"{prefix}/" if prefix else ""
        subs: list[str] = []
        remote = list_top(client, bucket, base, folders=subs)
        names = sorted(n for n in remote if is_shard_name(n))
        found = [(f"s3://{bucket}/{base}{n}", remote[n]) for n in names]
        used_subs = []
        if not found:  # train/ and val/ sub-prefixes of shards
            for sub in sorted(f for f in subs if f.lower() in SHARD_FOLDERS):
                inside = list_top(client, bucket, f"{base}{sub}/")
                shard_names = sorted(n for n in inside if is_shard_name(n))
                if shard_names:
                    used_subs.append(sub)
                    found += [(f"s3://{bucket}/{base}{sub}/{n}", inside[n]) for n in shard_names]
                    names += [f"{sub}/{n}" for n in shard_names]
                    unused += _unread([(n, False) for n in sorted(inside)], set(shard_names) | {CLASSES_NAME},
                                      {_stem(n) for n in shard_names}, prefix=f"{sub}/")
        unused = _unread([(n, False) for n in sorted(remote)] + [(f, True) for f in sorted(subs)],
                         set(names) | set(used_subs), {_stem(n.rsplit("/", 1)[-1]) for n in names}) + unused
    listed = []
    for url, (size, etag) in found:
        b, key = parse_s3_uri(url)
        listed.append(_Listed(url, url, f"s3\0{b}\0{key}\0{size}\0{etag}", size))
    classes = None
    if CLASSES_NAME in remote:
        try:
            classes = client.get_object(Bucket=bucket, Key=base + CLASSES_NAME)["Body"].read().decode("utf-8-sig")
        except (BotoCoreError, ClientError) as e:
            raise SyncError(explain(e, bucket, base + CLASSES_NAME)) from None
    return _Found(listed, classes, unused)


def _list_http(data: str) -> _Found:
    """https:// shards: one URL or a brace pattern of them (a server lists no folder). One HEAD each gives
    the size and validator a cached index is kept for; classes.txt is looked for beside the first shard."""
    urls = expand_braces(data) if is_brace_pattern(data) else [data]
    if not all(is_http(u) for u in urls):
        raise ShardSourceError(f"--data {shown(data)!r}: a pattern names shards of one source: all https:// (or "
                               "http://) URLs, or all local, or all s3://")
    named = [u for u in urls if not is_shard_name(urlsplit(u).path)]
    if named:
        raise ShardSourceError(f"--data {shown(named[0])!r} names no shard: https:// URLs are read as WebDataset "
                               "shards (.tar, .tar.gz, .tgz), one URL or a brace pattern (a server lists no folder); "
                               "sync other data to a folder or S3 first")
    with ThreadPoolExecutor(min(8, len(urls))) as pool:
        heads = list(pool.map(_head, urls))
    missing = [(u, e) for u, e in zip(urls, heads) if isinstance(e, HttpError)]
    if missing:
        raise ShardSourceError(f"--data {shown(data)!r}: {len(missing)} of its {len(urls)} shard(s) cannot be read, "
                               f"e.g. {missing[0][1]}")
    listed = [_Listed(shown(u), u, f"http\0{u}\0{size}\0{validator}", size, reuse=validator is not None)
              for u, (size, validator) in zip(urls, heads)]
    parts = [urlsplit(u) for u in urls]
    common = posixpath.commonpath([posixpath.dirname(p.path) for p in parts]) if all(
        p.netloc == parts[0].netloc for p in parts) else posixpath.dirname(parts[0].path)
    raw = read_small(parts[0]._replace(path=posixpath.join(common, CLASSES_NAME), query="", fragment="").geturl())
    return _Found(listed, raw.decode("utf-8-sig") if raw is not None else None)


def _head(url: str):
    try:
        return head(url)
    except HttpError as e:
        return e


def _gz_room(items: list[_Listed], cache_dir: Path) -> None:
    """Refuse, before decompressing anything, gzipped shards whose copies would not fit on the cache disk
    with HEADROOM to spare; a local one's size is read from its gzip trailer, a remote one's taken as its
    compressed size (JPEG members barely compress)."""
    todo = [it for it in items if it.copy is not None and not it.copy.is_file()]
    if not todo:
        return
    need = sum(_gunzipped_size(it) for it in todo)
    try:
        (cache_dir / GUNZIP_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ShardSourceError(f"cannot make {cache_dir / GUNZIP_DIR} for the decompressed copies of the gzipped "
                               f"shards ({e.strerror or e}); make the cache dir writable, or pass another "
                               "--cache-dir") from None
    free = shutil.disk_usage(cache_dir / GUNZIP_DIR).free
    if need + HEADROOM > free:
        raise ShardSourceError(
            f"{len(todo)} gzipped shard(s) decompress to about {human_bytes(need)} in {cache_dir / GUNZIP_DIR}, whose "
            f"disk has {human_bytes(free)} free (keeping {human_bytes(HEADROOM)} spare); free space, pass another "
            "--cache-dir, or decompress the shards yourself (gunzip) and pass the .tar files")


def _gunzipped_size(item: _Listed) -> int:
    size = item.size or 0
    if is_remote(item.path):
        return size
    try:
        with open(item.path, "rb") as f:  # gzip's ISIZE: the decompressed size modulo 4 GiB
            f.seek(-4, os.SEEK_END)
            return max(size, int.from_bytes(f.read(4), "little"))
    except OSError:
        return size


def _index_peer(item: _Listed, cache_dir: Path, level: str, max_pixels: int, num_threads: int,
                verdicts: Verdicts) -> dict:
    """Index one shard written by others (once: cached by its identity) and check its members at
    `level` (at least the fast header checks, which cost nothing while its bytes pass). A gzipped shard
    is decompressed into its copy in the same pass; a copy that is gone or no longer matches its checksum is
    made again."""
    idx = cache_file(cache_dir, item.identity, ".idx")
    meta_path = cache_file(cache_dir, item.identity, ".json")
    meta = load_json(meta_path) if item.reuse else None
    if meta and idx.is_file() and _covers(meta.get("checked"), level, max_pixels, meta["entries"]):
        if item.copy is None:
            return {**meta, "index": str(idx), "path": item.path}
        problem = check_file(item.copy, meta["size"], meta["sha256"], verdicts, xxh3=meta.get(FAST_SUM))
        if problem is None:
            return {**meta, "index": str(idx), "path": str(item.copy)}
        if item.copy.exists():
            print(f"shards: the decompressed copy of {item.name} ({item.copy}) {problem}; decompressing it again",
                  file=sys.stderr)
    level = "fast" if level == "off" else level
    collector = _Collector(level, max_pixels, num_threads)
    try:
        indexed, stored = _read_source(item, collector)
    except TarFormatError as e:
        raise ShardSourceError(f"{item.name}: {e}; check the file, or leave it out of --data") from None
    if item.size is not None and stored != item.size:
        raise ShardSourceError(f"{item.name} changed while it was read ({stored} bytes, listed as {item.size}); "
                               "rerun when it no longer changes")
    if item.copy is not None:
        verdicts.record(item.copy, verdict_key(indexed.sha256, indexed.xxh3))  # what the next run checks
    checked = collector.close(len(indexed.entries))
    for e, ext in indexed.duplicates.items():
        checked["problems"].setdefault(str(e), f"holds two {ext} members (a key that repeats)")
    write_atomic(idx, format_index(indexed.entries))
    meta = {"source": item.name, "entries": len(indexed.entries), "size": indexed.size, "sha256": indexed.sha256,
            FAST_SUM: indexed.xxh3,
            "stored": stored, "keys": [e.key for e in indexed.entries], "checked": checked}
    write_atomic(meta_path, json.dumps(meta))
    return {**meta, "index": str(idx), "path": str(item.copy or item.path)}


def _read_source(item: _Listed, collector: _Collector, deadline_s: float | None = None):
    """(the index of the shard read once from its source, the bytes read from it), decompressed into its
    copy on the way for a gzipped one. An S3 or HTTP stream cut or short is read again from the start
    (S3_ATTEMPTS in all); nothing of it is stored but the copy. An HTTP body is read within `deadline_s`
    (default: an attempt's deadline, ATTEMPT_DEADLINE plus its size at MIN_RATE), once: a body that never ends
    hung the indexing for good."""
    from botocore.exceptions import BotoCoreError, ClientError

    attempts = S3_ATTEMPTS if is_remote(item.path) else 1
    if deadline_s is None:
        deadline_s = ATTEMPT_DEADLINE + (item.size or 0) / MIN_RATE
    for attempt in range(attempts):
        last = attempt + 1 == attempts
        collector.reset()
        try:
            with _open_source(item, time.monotonic() + deadline_s) as raw:
                counted = Counting(raw)
                indexed = _index_stream(counted, item, collector)
            if item.size is None or counted.n == item.size or last:
                return indexed, counted.n
        except ClientError as e:
            bucket, key = parse_s3_uri(item.path)
            raise SyncError(f"indexing {item.name}: {explain(e, bucket, key)}") from None
        except BotoCoreError as e:
            if last:
                bucket, key = parse_s3_uri(item.path)
                raise SyncError(f"indexing {item.name}: {explain(e, bucket, key)}") from None
        except Stopped as e:  # past its deadline: another attempt would take as long
            raise ShardSourceError(f"indexing {e} ({deadline_s:.0f} s); a shard's server must send it whole within "
                                   "that, and end it") from None
        except HttpError as e:
            if e.status is not None or last:
                raise ShardSourceError(f"indexing {e}") from None
        except TarFormatError:
            if last:
                raise


@contextmanager
def _open_source(item: _Listed, deadline: float | None = None):
    if item.path.startswith("s3://"):
        bucket, key = parse_s3_uri(item.path)
        body = make_client(1).get_object(Bucket=bucket, Key=key)["Body"]
        try:
            yield body
        finally:
            body.close()
    elif is_http(item.path):
        body, _, _ = open_stream(item.path, deadline=deadline)
        with body:
            yield body
    else:
        with open(item.path, "rb") as f:
            yield f


def _index_stream(raw, item: _Listed, collector: _Collector):
    if item.copy is None:
        return index_tar(raw, collector.member, used_member)
    tmp = item.copy.with_name(f".{item.copy.name}.tmp-{os.getpid()}")
    try:
        item.copy.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            room = shutil.disk_usage(item.copy.parent).free - HEADROOM
            indexed = index_tar(Gunzip(raw), collector.member, used_member, copy_to=_Bounded(out, room, item))
        os.replace(tmp, item.copy)
        return indexed
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ShardSourceError(f"no space left to decompress {item.name} into {item.copy.parent} ({e.strerror}); "
                                   "free space there, or pass another --cache-dir") from None
        raise ShardSourceError(f"cannot write the decompressed copy of {item.name} in {item.copy.parent} "
                               f"({e.strerror or e}); make it writable, or pass another --cache-dir") from None
    finally:
        tmp.unlink(missing_ok=True)


class _Bounded:
    """A copy being written that may not pass `room` bytes (what the disk has free, HEADROOM kept): a shard that
    decompresses to more than its gzip trailer said (or than a remote one's size suggested) stops there."""

    def __init__(self, f, room: int, item: _Listed):
        self.f, self.room, self.item, self.n = f, room, item, 0

    def write(self, data: bytes) -> None:
        self.n += len(data)
        if self.n > self.room:
            raise ShardSourceError(f"{self.item.name} decompresses to more than the {human_bytes(max(0, self.room))} "
                                   f"free for it in {self.item.copy.parent} (keeping {human_bytes(HEADROOM)} spare); "
                                   "free space, or pass another --cache-dir")
        self.f.write(data)


def open_peer(data, *, num_threads: int, progress: bool, labels: bool = True) -> ShardSet:
    cache_dir = Path(data.cache_dir)
    found = _list_peer(data.data, cache_dir)
    listed = found.items
    if not listed:
        raise ShardSourceError(f"--data {shown(data.data)!r} holds no shards (.tar, .tar.gz, .tgz), no dataset.tsv and "
                               "no packed.json; pass a dataset folder, a pack, or a folder / file / brace pattern / "
                               "s3:// prefix / https:// URL of WebDataset shards")
    remove_dead_temps(cache_dir / "shards", ".*.tmp-*")  # what a writer killed with -9 left half written
    remove_dead_temps(cache_dir / GUNZIP_DIR, ".*.tmp-*")
    _gz_room(listed, cache_dir)
    verdicts = Verdicts(cache_dir)
    bar = progress_bar(len(listed), "index shards", progress)
    metas = []
    try:
        if is_remote(listed[0].path) and len(listed) > 1:
            with ThreadPoolExecutor(min(4, len(listed))) as pool:
                for meta in pool.map(lambda it: _index_peer(it, cache_dir, data.scan, data.max_pixels, 1, verdicts),
                                     listed):
                    metas.append(meta)
                    bar.update(1)
        else:
            for it in listed:
                metas.append(_index_peer(it, cache_dir, data.scan, data.max_pixels, num_threads, verdicts))
                bar.update(1)
    finally:
        bar.close()
        verdicts.save()
    shards, seen = [], {}
    for it, meta in zip(listed, metas):
        checked = meta["checked"]
        bad = {int(e): r for e, r in checked["problems"].items()}
        if labels:
            for e, r in checked["labels"].items():
                bad.setdefault(int(e), r)
        if data.scan != "off":
            for e, r in checked["images"].items():
                bad.setdefault(int(e), r)
        for e, key in enumerate(meta["keys"]):
            if key in seen and e not in bad:
                bad[e] = f"duplicate key (also in {seen[key]})"
            seen.setdefault(key, it.name)
        shards.append(Shard(it.name, meta["path"], meta["index"], meta["size"], meta["sha256"], meta["keys"],
                            list(meta["keys"]), checked["cls"], bad, label_names=checked["names"], origin=it.path,
                            xxh3=meta.get(FAST_SUM)))
    if labels:
        classes, remap, note = _peer_classes(shards, found.classes_txt, data.data)
    else:  # predict: the model names the classes; the shards' labels, where there are any, are not read
        classes, remap, note = [], None, ""
    held_out, rule = _peer_split(shards, data.val_fraction, data.seed)
    return ShardSet(data.data, "shards", classes, shards, remap=remap, note=note, unused=found.unused,
                    held_out=held_out, labels=labels, split_rule=rule)


def _peer_classes(shards: list[Shard], classes_txt: str | None, data: str):
    """(class names, cls -> position remap or None, a note saying where the names came from)."""
    good = [(s, e, s.cls[e]) for s in shards for e in range(len(s.keys)) if e not in s.bad]
    used = sorted({c for _, _, c in good})
    if not used:
        seen = "; ".join([f"{s.name} {s.keys[e]!r}: {r}" for s in shards for e, r in list(s.bad.items())[:2]][:3])
        raise ShardSourceError(f"--data {shown(data)!r}: no sample has a usable image and an integer cls (e.g. {seen}); "
                               "training and evaluation need KEY.jpg (or jpeg, png, webp) and KEY.cls members "
                               "(predict labels shards without cls)")
    if classes_txt is not None:
        names = [line.strip() for line in classes_txt.splitlines()]
        while names and not names[-1]:
            names.pop()
        for s, e, c in good:
            if c >= len(names):
                raise ShardSourceError(f"{s.name}: sample {s.keys[e]!r} has class {c}, but {CLASSES_NAME} names "
                                       f"{len(names)} classes (one per line, from 0); add the missing names")
        classes, note = [names[c] or str(c) for c in used], f"classes named by {CLASSES_NAME}"
        first: dict[str, int] = {}
        for c, name in zip(used, classes):  # one name for two classes would merge them wherever labels go by name
            if name in first:
                raise ShardSourceError(f"{CLASSES_NAME} names class {first[name]} and class {c} alike ({name!r}, lines "
                                       f"{first[name] + 1} and {c + 1}); give each class its own name")
            first[name] = c
    else:
        by_cls: dict[int, set] = {}
        for s, e, c in good:
            by_cls.setdefault(c, set()).add(s.label_names[e])
        single = all(len(v) == 1 and None not in v for v in by_cls.values())
        names = [next(iter(by_cls[c])) for c in used] if single else []
        if single and len(set(names)) == len(names):
            classes, note = names, "classes named by the json label"
        else:
            classes = [str(c) for c in used]
            clash = next((f"; the json labels disagree (cls {c}: {sorted(map(str, v))[:3]})" for c, v in by_cls.items()
                          if len(v) > 1 and None not in v), "")
            note = f"classes are the cls integers (no {CLASSES_NAME}, no json label){clash}"
    position = {c: i for i, c in enumerate(used)}  # a dict: linear in the largest cls (sparse ids: millions)
    remap = None if used == list(range(len(used))) else tuple(position.get(c, -1) for c in range(used[-1] + 1))
    return classes, remap, note


def unit_hash(key: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}:{key}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _peer_split(shards: list[Shard], val_fraction: float, seed: int) -> tuple[str, str]:
    """Shards named val/validation are validation; without any, a hash of (seed, key) per sample. Shards
    named test are neither trained on nor validated (unless every shard is): a line saying so is returned.
    A shard's name is its path below the folder that holds them all (`val/part-0` for
    `shards/{train,val}/part-0.tar`), as the user wrote it (not its decompressed copy's). Returns that line
    (or "") and the rule that made the split: "names" or "hash"."""
    paths = [urlsplit(s.origin).path if is_http(s.origin) else s.origin.split("://", 1)[-1] for s in shards]
    common = posixpath.commonpath(paths) if len(paths) > 1 else posixpath.dirname(paths[0])
    common = posixpath.dirname(common) if common in paths else common  # one shard, or the same shard twice

    def words(path: str) -> set[str]:
        return set(re.split(r"[^a-z0-9]+", _stem(path[len(common):]).lower()))

    test = [bool(words(p) & TEST_WORDS) and not words(p) & VAL_WORDS for p in paths]
    if all(test):
        test = [False] * len(paths)
    named = [bool(words(p) & VAL_WORDS) for p in paths]
    for s, is_val, is_test in zip(shards, named, test):
        if is_test:
            s.split = ["test"] * len(s.keys)
        elif any(named):
            s.split = ["val" if is_val else "train"] * len(s.keys)
        else:
            s.split = ["val" if unit_hash(k, seed) < val_fraction else "train" for k in s.keys]
    tests = [s.name for s, t in zip(shards, test) if t]
    rule = "names" if any(named) else "hash"
    if not tests:
        return "", rule
    return (f"data: {len(tests)} test shard(s) ({', '.join(tests[:3])}{', ...' if len(tests) > 3 else ''}) are neither "
            "trained on nor validated; evaluate them with --split test"), rule


# -- reporting ------------------------------------------------------------------------------------
def write_member_report(shards: ShardSet, out: Path, extra: list = ()) -> Path:
    """OUT/bad_images.tsv for shards: image_path (the dataset.tsv path of a pack's sample, else its key),
    reason, shard, key; `extra`: more (Shard, entry, reason) rows (images that could not be packed)."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / "bad_images.tsv"
    rows = [tsv_row(("image_path", "reason", "shard", "key"))] + [
        tsv_row((s.image_paths[e], reason, s.name, s.keys[e])) for s, e, reason in shards.bad + list(extra)]
    write_atomic(report, "".join(rows))
    return report


def report(shards: ShardSet, scan: str, out: Path) -> None:
    """Write OUT/bad_images.tsv and say what was left out (and what could not be checked)."""
    if shards.bad or scan != "off":
        path = write_member_report(shards, out)
        if shards.bad:
            print(f"scan: excluded {len(shards.bad)} of {shards.total} sample(s) of the shards; reasons in {path}",
                  file=sys.stderr)
    if shards.unscanned:
        print(f"scan: {shards.unscanned} shard(s) are read from S3 as needed; their members were not checked "
              "beforehand (pass --packed-s3 sync to check them)", file=sys.stderr)
    if shards.held_out:
        print(shards.held_out, file=sys.stderr)
    if shards.unused:
        print(f"data: not read: {'; '.join(shards.unused[:UNUSED_SHOWN])}"
              f"{f'; and {len(shards.unused) - UNUSED_SHOWN} more' if len(shards.unused) > UNUSED_SHOWN else ''} "
              "(neither shards nor a file known to lie beside them)", file=sys.stderr)


def progress_bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="shard", disable=not progress or total < 2, file=sys.stderr,
                mininterval=1.0)
