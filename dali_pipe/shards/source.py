"""Shards written by others, indexed and checked: each one's DALI index made once (one pass; one streaming GET
from S3 or HTTP; a gzipped one decompressed in the same pass), their classes and split. The modules beside this
one hold the rest of what the docstring below describes: where the shards are (shards/listing.py), a pack
(shards/packs.py), the member checks (shards/members.py), and what a run reads from any of them
(shards/shardset.py).

`--data` holds shards in one of two ways:

- a pack (`python -m dali_pipe pack`): `packed.json` with the classes, the split, and per shard its
  index file, sample count, size, sha256 and the image_path of each sample; a folder or s3:// prefix
  (`shards.packsync.fetch` brings it local);
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

import errno
import hashlib
import json
import os
import posixpath
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from ..https import explain_http, is_http, shown, status_of
from ..s3 import SyncError, TransferError, explain, parse_s3_uri
from ..stores import locate
from ..transfer import REQUEST_LIMIT, Engine
from ..workdir import atomic, human_bytes, remove_dead_temps
from .fetchers import SHARD_BOUNDS
from .format import (
    FAST_SUM,
    Counting,
    Gunzip,
    GzippedTarError,
    TarFormatError,
    find_scattered,
    format_index,
    index_tar,
    used_member,
)
from .listing import CLASSES_NAME, GUNZIP_DIR, Listed, list_peer, shard_stem
from .members import Collector, cache_file, covers, load_json
from .packsync import HEADROOM
from .shardset import Shard, ShardSet, ShardSourceError, progress_bar, write_file
from .verdicts import Verdicts, check_file, is_remote, verdict_key

S3_ATTEMPTS = 3  # streaming GETs of one shard (S3 or HTTP) while indexing it, when the connection is cut
VAL_WORDS = {"val", "valid", "validation"}
TEST_WORDS = {"test", "testing"}


# -- shards written by others -------------------------------------------------------------------


GUNZIP_RATIO_MAX = 100  # a .tar.gz of images decompresses to 1-3 times its size; past this it is stopped
GUNZIP_FLOOR = 64 << 20  # ... but a small one may always reach this many bytes


def _gz_room(items: list[Listed], cache_dir: Path) -> None:
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


def _gunzipped_size(item: Listed) -> int:
    size = item.size or 0
    if is_remote(item.path):
        return size
    try:
        with open(item.path, "rb") as f:  # gzip's ISIZE: the decompressed size modulo 4 GiB
            f.seek(-4, os.SEEK_END)
            return max(size, int.from_bytes(f.read(4), "little"))
    except OSError:
        return size


def _index_peer(item: Listed, cache_dir: Path, level: str, max_pixels: int, num_threads: int,
                verdicts: Verdicts) -> dict:
    """Index one shard written by others (once: cached by its identity) and check its members at
    `level` (at least the fast header checks, which cost nothing while its bytes pass). A gzipped shard
    is decompressed into its copy in the same pass; a copy that is gone or no longer matches its checksum is
    made again."""
    idx = cache_file(cache_dir, item.identity, ".idx")
    meta_path = cache_file(cache_dir, item.identity, ".json")
    meta = load_json(meta_path) if item.reuse else None
    if meta and idx.is_file() and covers(meta.get("checked"), level, max_pixels, meta["entries"]):
        if scattered := find_scattered(meta.get("keys") or []):  # an index an earlier version cached
            raise ShardSourceError(scattered_keys(item.name, scattered, meta["entries"]))
        if item.copy is None:
            return {**meta, "index": str(idx), "path": item.path}
        problem = check_file(item.copy, meta["size"], meta["sha256"], verdicts, xxh3=meta.get(FAST_SUM))
        if problem is None:
            return {**meta, "index": str(idx), "path": str(item.copy)}
        if item.copy.exists():
            print(f"shards: the decompressed copy of {item.name} ({item.copy}) {problem}; decompressing it again",
                  file=sys.stderr)
    level = "fast" if level == "off" else level
    collector = Collector(level, max_pixels, num_threads)
    try:
        indexed, stored = _read_source(item, collector)
    except TarFormatError as e:
        fix = "check the file, or leave it out of --data"
        if isinstance(e, GzippedTarError):  # (it said "not a readable tar (ReadError: invalid header)")
            fix = ("the server compressed it on the way (Content-Encoding: gzip, though asked for the bytes as stored: "
                   "Accept-Encoding: identity), or stores a .tar.gz under this name: serve .tar files as they are "
                   "(nginx: leave application/x-tar out of gzip_types), or name gzipped ones .tar.gz" if
                   is_http(item.path) else
                   "name it .tar.gz (read decompressed), or gunzip it")
        raise ShardSourceError(f"{item.name}: {e}; {fix}") from None
    if indexed.scattered:
        raise ShardSourceError(scattered_keys(item.name, indexed.scattered, len(indexed.entries)))
    if item.size is not None and stored != item.size:
        raise ShardSourceError(f"{item.name} changed while it was read ({stored} bytes, listed as {item.size}); "
                               "rerun when it no longer changes")
    if item.copy is not None:
        verdicts.record(item.copy, verdict_key(indexed.sha256, indexed.xxh3))  # what the next run checks
    checked = collector.close(len(indexed.entries))
    for e, ext in indexed.duplicates.items():
        checked["problems"].setdefault(str(e), f"holds two {ext} members (a key that repeats)")
    write_file(idx, format_index(indexed.entries))
    meta = {"source": item.name, "entries": len(indexed.entries), "size": indexed.size, "sha256": indexed.sha256,
            FAST_SUM: indexed.xxh3,
            "stored": stored, "keys": [e.key for e in indexed.entries], "checked": checked}
    write_file(meta_path, json.dumps(meta))
    return {**meta, "index": str(idx), "path": str(item.copy or item.path)}


def scattered_keys(name: str, scattered: dict[str, tuple[int, int]], entries: int) -> str:
    """The message for a tar whose samples' members are not next to each other (`tar -C DIR -cf x.tar .`
    stores a folder's files in the order the disk lists them): webdataset and DALI, like this reader, make a
    sample of consecutive members only, so each sample would be split into pieces without an image or a label."""
    shown = ", ".join(f"{k!r} (pieces {a + 1} and {b + 1})" for k, (a, b) in list(scattered.items())[:3])
    return (f"{name}: the members of {len(scattered)} sample(s) lie in more than one place in the tar, e.g. {shown}: "
            f"webdataset and DALI read a sample from consecutive members only, so the tar reads as {entries} samples, "
            "these as pieces without an image or a label, or twice. Write the tar with its members sorted by name "
            "(GNU tar: tar --sort=name -C DIR -cf SHARD.tar .), or pack the images with python -m dali_pipe pack")


def _read_source(item: Listed, collector: Collector, deadline_s: float | None = None):
    """(the index of the shard read once from its source, the bytes read from it), decompressed into its
    copy on the way for a gzipped one. An S3 or HTTP stream cut or short is read again from the start
    (S3_ATTEMPTS in all); nothing of it is stored but the copy. An HTTP body is read within `deadline_s`
    (default: an attempt's deadline, SHARD_BOUNDS.deadline of its size), once: a body that never ends
    hung the indexing for good. Both go through the transfer engine (Engine.reader)."""
    attempts = S3_ATTEMPTS if is_remote(item.path) else 1
    if deadline_s is None:
        deadline_s = SHARD_BOUNDS.deadline(item.size)
    for attempt in range(attempts):
        last = attempt + 1 == attempts
        collector.reset()
        started = time.monotonic()
        try:
            with _open_source(item, started + deadline_s) as raw:
                counted = Counting(raw)
                indexed = _index_stream(counted, item, collector)
            if item.size is None or counted.n == item.size or last:
                return indexed, counted.n
        except TransferError as e:  # what asking again cannot change is said at once
            if is_http(item.path):
                if e.code == "deadline" or time.monotonic() > started + deadline_s:  # another try would take as long
                    raise ShardSourceError(f"indexing {shown(item.path)}: no complete copy within its deadline "
                                           f"({deadline_s:.0f} s); a shard's server must send it whole within that, "
                                           "and end it") from None
                if last or status_of(e) is not None or "Content-Length" in e.detail:
                    raise ShardSourceError(f"indexing {explain_http(e, item.path, SHARD_BOUNDS)}") from None
            elif last or not (e.code in ("timeout", "connect", "http", "SlowDown", "InternalError") or
                              e.code.startswith("HTTP 5")):
                bucket, key = parse_s3_uri(item.path)
                raise SyncError(f"indexing {item.name}: {explain(e, bucket, key)}") from None
        except TarFormatError as e:
            if last or isinstance(e, GzippedTarError):  # (the same bytes come again)
                raise


@contextmanager
def _open_source(item: Listed, deadline: float | None = None):
    if is_remote(item.path):  # one streaming GET through the engine, within the shard's deadline
        bucket, key = locate(item.path)
        b = SHARD_BOUNDS
        limit = max(REQUEST_LIMIT, b.deadline(item.size))
        if is_http(item.path) and deadline is not None:  # a server's body that never ends is stopped at `deadline`
            limit = max(1.0, deadline - time.monotonic())
        engine = Engine(concurrency=1, connect_timeout=b.connect_timeout, read_timeout=b.read_timeout,
                        attempts=b.request_attempts, request_limit=limit)
        try:
            with engine.reader(bucket, key, deadline if is_http(item.path) else None) as body:
                yield body
        finally:
            engine.close()
    else:
        with open(item.path, "rb") as f:
            yield f


def _index_stream(raw, item: Listed, collector: Collector):
    if item.copy is None:
        return index_tar(raw, collector.member, used_member)
    try:
        item.copy.parent.mkdir(parents=True, exist_ok=True)
        with atomic(item.copy) as tmp, open(tmp, "wb") as out:
            room = shutil.disk_usage(item.copy.parent).free - HEADROOM
            indexed = index_tar(Gunzip(raw), collector.member, used_member,
                                copy_to=_Bounded(out, room, item, lambda: raw.n))
        return indexed
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ShardSourceError(f"no space left to decompress {item.name} into {item.copy.parent} ({e.strerror}); "
                                   "free space there, or pass another --cache-dir") from None
        raise ShardSourceError(f"cannot write the decompressed copy of {item.name} in {item.copy.parent} "
                               f"({e.strerror or e}); make it writable, or pass another --cache-dir") from None


class _Bounded:
    """A copy being written that may not pass `room` bytes (what the disk has free, HEADROOM kept), nor
    GUNZIP_RATIO_MAX times the compressed bytes read so far (`compressed()`; GUNZIP_FLOOR at least): a shard
    that decompresses to more than its gzip trailer said (the size modulo 4 GiB, which anyone can write), or
    whose size no server told, stops at the first bound it reaches."""

    def __init__(self, f, room: int, item: Listed, compressed):
        self.f, self.room, self.item, self.compressed, self.n = f, room, item, compressed, 0

    def write(self, data: bytes) -> None:
        self.n += len(data)
        if self.n > GUNZIP_FLOOR and self.n > self.compressed() * GUNZIP_RATIO_MAX:
            raise ShardSourceError(
                f"{self.item.name} decompresses to more than {GUNZIP_RATIO_MAX} times its compressed bytes (stopped "
                f"at {human_bytes(self.n)} from {human_bytes(self.compressed())}): a gzip bomb, or not a shard of "
                "images (images hardly compress, so a .tar.gz of them hardly grows); if it is right, decompress it "
                "yourself (gunzip) and pass the .tar")
        if self.n > self.room:
            raise ShardSourceError(f"{self.item.name} decompresses to more than the {human_bytes(max(0, self.room))} "
                                   f"free for it in {self.item.copy.parent} (keeping {human_bytes(HEADROOM)} spare); "
                                   "free space, or pass another --cache-dir")
        self.f.write(data)


def open_peer(data, *, num_threads: int, progress: bool, labels: bool = True) -> ShardSet:
    cache_dir = Path(data.cache_dir)
    found = list_peer(data.data, cache_dir)
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
        return set(re.split(r"[^a-z0-9]+", shard_stem(path[len(common):]).lower()))

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
