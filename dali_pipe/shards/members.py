"""Checking the members of a shard before any pipeline is built: each sample's image and label member (the
`cls` of each; with --scan fast|full its image, with the checks the file scan uses), collected per shard by
`Collector`, with the verdicts cached per shard under the cache dir (keyed by path, size and mtime; or URL,
size and ETag), so only the first run reads the shards.
"""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

from ..scan import DaliDecoder, check_bytes
from .format import (
    IMAGE_EXTS,
    IMAGE_NAMES,
    LABEL_EXT,
    LABEL_NAMES,
    IndexEntry,
    cls_problem,
    image_member,
    json_image_path,
    json_label,
    label_member,
    member_bytes,
    meta_member,
    parse_cls,
    pick_member,
    read_index,
)
from .shardset import Shard, write_file

LEVELS = {"off": 0, "fast": 1, "full": 2}


class Collector:
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


def read_members(path: str, entries: list[IndexEntry], collector: Collector, images: bool) -> None:
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


def load_json(path: Path) -> dict | None:
    """A cache file's object, or None where it is missing, damaged or not an object (then it is made again)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8", errors="surrogateescape"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def covers(checked: dict | None, level: str, max_pixels: int, n: int) -> bool:
    """Whether a cached check holds what this run needs (a check without "labels" is of an older version)."""
    return bool(checked) and "labels" in checked and len(checked["cls"]) == n and LEVELS[checked["level"]] >= LEVELS[
        level] and (level == "off" or checked["max_pixels"] == max_pixels)


def cached_check(s: Shard, cache_dir: Path, level: str, max_pixels: int, num_threads: int) -> dict:
    """A local pack shard's member check, cached by (shard, index) path, size and mtime."""
    st, ist = os.stat(s.path), os.stat(s.index_path)
    identity = f"pack\0{s.path}\0{st.st_size}\0{st.st_mtime_ns}\0{s.index_path}\0{ist.st_size}\0{ist.st_mtime_ns}"
    cache = cache_file(cache_dir, identity, ".json")
    checked = load_json(cache)
    if not covers(checked, level, max_pixels, len(s.keys)) or "paths" not in checked:  # no paths: an older check
        entries = read_index(s.index_path)
        collector = Collector(level, max_pixels, num_threads)
        read_members(s.path, entries, collector, images=level != "off")
        checked = collector.close(len(entries))
        write_file(cache, json.dumps(checked))
    return checked
