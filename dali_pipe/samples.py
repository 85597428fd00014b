"""Samples as columns: a million images are a few numpy arrays, not a million Python objects.

`Samples` holds each split of a dataset read from files (dataset.tsv, an ImageFolder): the absolute paths as
one numpy string array (numpy's variable-width `StringDType`: the characters live in one arena), the class
indices and the manifest's line numbers as int32, and, where the listing stat()ed the files, their sizes and
modification times as int64 (-1 where unknown), so that the scan need not stat them again. Selecting, joining,
sorting and hashing run on whole columns (`np.strings`, `np.argsort`, a set lookup per entry for `without`); a `Sample` is made only where
one is asked for (`samples[i]`, iterating), which the commands do over small sets (predict, pack's items).

A path that is not valid UTF-8 on disk (Python holds its bytes as surrogate escapes, which StringDType cannot
store) makes that column an object array instead: slower, and the same answers.

Measured at 1 M paths on this project's 2-core machine: the column of paths is built in 0.1 s and takes
66 MB where a list of `Sample` dataclasses took about 600 MB; a stable sort takes 0.3 s, `without` 0.1 s.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.dtypes import StringDType

STRINGS = StringDType()


@dataclass(frozen=True)
class Sample:
    """One sample, made on demand from the columns (`Samples[i]`)."""
    path: str  # absolute path of the image on local disk
    label: int  # index into the classes
    line: int  # line number in dataset.tsv (header is line 1), for error messages; 0 when there is none


def strings(values) -> np.ndarray:
    """A column of text: StringDType, or an object array when a value cannot be encoded as UTF-8."""
    if isinstance(values, np.ndarray) and (values.dtype == STRINGS or values.dtype == object):
        return values
    try:
        return np.array(values, dtype=STRINGS) if len(values) else np.empty(0, dtype=STRINGS)
    except UnicodeEncodeError:  # a surrogate-escaped name (not UTF-8 on disk)
        out = np.empty(len(values), dtype=object)
        out[:] = list(values)
        return out


def member(column: np.ndarray, values: set) -> np.ndarray:
    """Which entries of a text column are in `values`, by a set lookup each (np.isin sorts StringDType columns
    slowly: 28 s for 100 k paths against 31 k; this takes 0.1 s at 1 M)."""
    return np.fromiter((x in values for x in column.tolist()), dtype=bool, count=len(column))


def unique_inverse(column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(column, return_inverse=True), on a stable sort. numpy 2.4's heapsort of StringDType crashes the
    process (SIGSEGV: every order tried), and its default sort (introsort) falls back to heapsort on some
    orders: 2000 paths in 1000 class folders listed in turn crashed np.unique on their labels. Never sort a text
    column with numpy's default kind; `kind="stable"` (timsort) and np.lexsort hold."""
    order = np.argsort(column, kind="stable")
    ordered = column[order]
    first = np.ones(len(ordered), dtype=bool)
    first[1:] = ordered[1:] != ordered[:-1]
    inverse = np.empty(len(column), dtype=np.intp)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


def _column(values, dtype, n: int, fill: int) -> np.ndarray:
    if values is None:
        return np.full(n, fill, dtype=dtype)
    out = np.asarray(values, dtype=dtype)
    if out.shape != (n,):
        raise ValueError(f"a column of {out.shape} beside {n} paths")
    return out


class Samples:
    """The samples of one split, as columns of equal length (see the module's documentation)."""

    __slots__ = ("paths", "labels", "lines", "sizes", "mtimes")

    def __init__(self, paths, labels, lines=None, sizes=None, mtimes=None):
        self.paths = strings(paths)
        n = len(self.paths)
        self.labels = _column(labels, np.int32, n, 0)
        self.lines = _column(lines, np.int32, n, 0)
        self.sizes = _column(sizes, np.int64, n, -1)
        self.mtimes = _column(mtimes, np.int64, n, -1)

    @classmethod
    def of(cls, samples) -> "Samples":
        """Samples from Samples (itself) or from an iterable of Sample (a command's own few)."""
        if isinstance(samples, Samples):
            return samples
        samples = list(samples)
        return cls([s.path for s in samples], [s.label for s in samples], [s.line for s in samples])

    def __len__(self) -> int:
        return len(self.paths)

    def __bool__(self) -> bool:
        return len(self.paths) > 0

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            return Sample(str(self.paths[i]), int(self.labels[i]), int(self.lines[i]))
        return self.take(i)

    def __iter__(self):
        for p, label, line in zip(self.paths.tolist(), self.labels.tolist(), self.lines.tolist()):
            yield Sample(p, label, line)

    def __add__(self, other) -> "Samples":
        other = Samples.of(other)
        paths = (np.concatenate([self.paths, other.paths]) if self.paths.dtype == other.paths.dtype else
                 np.concatenate([self.paths.astype(object), other.paths.astype(object)]))
        return Samples(paths, *(np.concatenate([getattr(self, c), getattr(other, c)])
                                for c in ("labels", "lines", "sizes", "mtimes")))

    def __eq__(self, other) -> bool:
        if not isinstance(other, (Samples, list, tuple)):
            return NotImplemented
        other = Samples.of(other)
        return (len(self) == len(other) and bool(np.all(self.paths == other.paths))
                and bool(np.all(self.labels == other.labels)) and bool(np.all(self.lines == other.lines)))

    def __repr__(self) -> str:
        return f"Samples({len(self)} samples)"

    def take(self, index) -> "Samples":
        """The samples at `index` (positions, a slice or a boolean mask), in that order."""
        return Samples(self.paths[index], self.labels[index], self.lines[index], self.sizes[index], self.mtimes[index])

    def without(self, paths) -> "Samples":
        """These samples less those whose path is in `paths` (any iterable of absolute paths)."""
        paths = set(paths)
        if not paths or not len(self):
            return self
        return self.take(~member(self.paths, paths))

    @property
    def files(self) -> list[str]:
        """The paths as a list of str (what DALI's file reader takes)."""
        return self.paths.tolist()

    @property
    def stats(self) -> tuple[np.ndarray, np.ndarray]:
        """(sizes, modification times in ns), -1 where the listing did not stat the file."""
        return self.sizes, self.mtimes


# -- what the pipeline reads: the value types its two readers take (pipeline.py), made by the forms' readers
@dataclass(frozen=True)
class Files:
    """Images as files: absolute paths and integer labels (lists, or columns: dali_pipe/samples.py)."""
    files: list[str] | np.ndarray
    labels: list[int] | np.ndarray

    def __len__(self) -> int:
        return len(self.files)


@dataclass(frozen=True)
class TableGroup:
    """A shard of table rows (a Hugging Face dataset): one row group of a Parquet file, or one record batch
    of a save_to_disk Arrow file; the image column holds each row's encoded bytes, `labels` its class index."""
    fmt: str  # "parquet" or "arrow"
    group: int  # the row group's (record batch's) position in its file
    column: str  # the image column (datasets' Image: a struct of bytes and path; or plain binary)
    labels: tuple[int, ...]  # per row; -1 where the row has no usable label (it is excluded)
    span: tuple[int, int, str] | None = None  # Parquet: (start, end, XXH3-128) of the bytes the image column's chunks
    # of this group take in the file, as checked (what the reader reads); None: the file is hashed whole (Arrow)


@dataclass(frozen=True)
class Shards:
    """Images in shards: WebDataset tars (a pack, or shards written by others), or row groups of a Hugging
    Face dataset's tables. Per shard its path (a tar, local, s3:// or https://; a local Parquet or Arrow file),
    its local DALI index file (tables: a name for the group), the usable samples, and a lookup from the shards'
    class indices to the model's (evaluate; sparse `cls` integers). Per shard, its size, sha256 and fast checksum where
    known; `excluded` holds (shard position, entry position in its index) of the members every reader
    skips; `groups` (tables) the TableGroup of each shard, None for a tar. `labels` False: no `cls` is read
    (predict; every label is -1), so shards without labels are read too."""
    paths: tuple[str, ...]
    index_paths: tuple[str, ...]
    samples: int
    remap: tuple[int, ...] | None = None
    sizes: tuple[int | None, ...] | None = None
    sha256: tuple[str | None, ...] | None = None
    xxh3: tuple[str | None, ...] | None = None  # the fast checksum (shards/format.FAST_SUM) where known
    excluded: frozenset[tuple[int, int]] = frozenset()
    groups: tuple[TableGroup | None, ...] | None = None
    labels: bool = True

    def __len__(self) -> int:
        return self.samples

    def __add__(self, other: "Shards") -> "Shards":
        n = len(self.paths)

        def per_shard(a, b, count_a, count_b):
            return None if a is None and b is None else tuple(a or (None,) * count_a) + tuple(b or (None,) * count_b)

        return Shards(self.paths + other.paths, self.index_paths + other.index_paths, self.samples + other.samples,
                      self.remap, sizes=per_shard(self.sizes, other.sizes, n, len(other.paths)),
                      sha256=per_shard(self.sha256, other.sha256, n, len(other.paths)),
                      xxh3=per_shard(self.xxh3, other.xxh3, n, len(other.paths)),
                      excluded=self.excluded | frozenset((i + n, e) for i, e in other.excluded),
                      groups=per_shard(self.groups, other.groups, n, len(other.paths)),
                      labels=self.labels and other.labels)
