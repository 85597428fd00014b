"""What a run reads from shards, whatever form they came in: `Shard` (one shard and what its check found, entry by
entry) and `ShardSet` (the classes, the split and the bad members: the questions a Manifest answers, for
shards), with the report of the members left out (bad_images.tsv) and the progress bar of their checks.
"""
from __future__ import annotations

import errno
import hashlib
import json
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..errors import UserError
from ..samples import Shards
from ..scan import ScanResult
from ..tsv import row as tsv_row
from ..workdir import write_atomic
from .format import FAST_SUM

UNUSED_SHOWN = 8  # unread files named at start-up (then a count)


class ShardSourceError(UserError):
    """Shards that cannot be read as they are; the message names the file, shard or key and the fix."""


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
        out = []
        for i in range(len(shards.paths)):  # by shard (a million samples: one lookup per shard, not per sample)
            out += [p for e, p in enumerate(self.shard_at(shards, i).image_paths) if (i, e) not in shards.excluded]
        return out

    def members(self, shards: Shards) -> list[tuple[int, int]]:
        """(shard position, entry) of each sample `shards` yields outside training, in that order."""
        return [(i, e) for i in range(len(shards.paths)) for e in range(len(self.shard_at(shards, i).image_paths))
                if (i, e) not in shards.excluded]

    def shard_at(self, shards: Shards, i: int) -> Shard:
        """The Shard at position i of `shards` (one of this set's selections)."""
        return self._by_path[(shards.paths[i], shards.index_paths[i])]

    @cached_property
    def _by_path(self) -> dict:
        return {(s.path, s.index_path): s for s in self.shards}

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


def write_member_report(shards: ShardSet, out: Path, extra: list = ()) -> Path:
    """OUT/bad_images.tsv for shards: image_path (the dataset.tsv path of a pack's sample, else its key),
    reason, shard, key; `extra`: more (Shard, entry, reason) rows (images that could not be packed)."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / "bad_images.tsv"
    rows = [tsv_row(("image_path", "reason", "shard", "key"))] + [
        tsv_row((s.image_paths[e], reason, s.name, s.keys[e])) for s, e, reason in shards.bad + list(extra)]
    write_file(report, "".join(rows))
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


def write_file(path: Path, text: str) -> None:
    """workdir.write_atomic (its folder made first), with a full or unwritable disk told as a ShardSourceError
    naming the file and the way out."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ShardSourceError(f"no space left to write {path} ({e.strerror}); free space there, or pass "
                                   "another --cache-dir / --output") from None
        raise ShardSourceError(f"cannot write {path} ({e.strerror or e}); make its folder writable, or pass another "
                               "--cache-dir / --output") from None
