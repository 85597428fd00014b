"""Read `dataset.tsv` into a checked list of (file, label) samples and a train/val split.

The manifest is the single source of truth for what a run trains on: the S3 sync downloads only
the files it lists, the scan checks only those, and the pipelines read only those.

Columns (header names are stripped and case-insensitive): `image_path` (required, relative to
the dataset root), `label` (optional; else the parent folder name; classes sort numerically when
every label is an integer), `split` (optional, train, val or validation; else a split by a hash of each path and
the seed, stratified per class, that stays put as images are added).
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import stat
import sys
import time
import warnings
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .fanout import fan_out
from .listing_cache import CACHE_FROM, cache_key, cache_path, digest_key, load_digest, load_text, save_digest, save_text
from .samples import Sample, Samples, strings, unique_inverse  # noqa: F401  (Sample: the commands' own few)
from .tsv import (  # noqa: F401  (the names the rest of the project takes from here)
    COLUMNS,
    MANIFEST_NAME,
    ManifestError,
    Table,
    check_columns,
    check_header,
    preview,
    read_table,
    safe_relpath,
)

SPLITS = {"train": "train", "val": "val", "validation": "val"}
PROGRESS_FROM = 200_000  # rows from which reading says what it does (about 2 s on 2 cores)


@dataclass
class Manifest:
    root: Path
    classes: list[str]
    train: Samples
    val: Samples
    missing: list[str] = field(default_factory=list)  # image_path values skipped (--skip-missing)
    duplicates: int = 0  # duplicate rows dropped
    note: str = ""  # how the split was made, when the start-up summary should say it (an ImageFolder's)
    split_rule: str = "hash"  # how the split was made: "column" (split column), "folders" (train/ val/) or "hash"
    known_digest: str | None = field(default=None, repr=False, compare=False)  # digest(), kept (read_manifest)

    def __post_init__(self):
        self.train, self.val = Samples.of(self.train), Samples.of(self.val)

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.classes))

    def digest(self) -> str:
        """A hash of what a run reads: each sample's path (relative to the root), class and split, one line each,
        sorted by path within each split (on whole columns: 1.0-1.3 s at 1 M samples; read_manifest keeps it in
        the cache dir, listing_cache.load_digest)."""
        if self.known_digest is not None:
            return self.known_digest
        h = hashlib.sha256()
        root = str(self.root.resolve())
        names = strings(self.classes)
        for split, samples in (("train", self.train), ("val", self.val)):
            if not len(samples):
                continue
            order = np.argsort(samples.paths, kind="stable")
            rel = relative_to(samples.paths[order], root)
            lines = _add(_add(_add(rel, "\t"), names[samples.labels[order]].astype(rel.dtype)), f"\t{split}\n")
            h.update("".join(lines.tolist()).encode("utf-8", "surrogateescape"))
        return h.hexdigest()[:16]

    def without(self, bad) -> "Manifest":
        """The same manifest with the files in `bad` (absolute paths) left out."""
        bad = set(bad)
        return Manifest(self.root, self.classes, self.train.without(bad), self.val.without(bad), self.missing,
                        self.duplicates, self.note, self.split_rule, None if bad else self.known_digest)


def _add(a: np.ndarray, b) -> np.ndarray:
    """Elementwise concatenation of text columns (or a column and a str), StringDType or object."""
    if a.dtype == object or (isinstance(b, np.ndarray) and b.dtype == object):
        return np.add(a.astype(object), b.astype(object) if isinstance(b, np.ndarray) else b)
    return np.strings.add(a, b)


def relative_to(paths: np.ndarray, root: str) -> np.ndarray:
    """os.path.relpath(p, root) of each absolute path, by slicing where the path lies under `root` (all of them,
    but for links out of it) and os.path.relpath for the others."""
    prefix = root.rstrip("/") + "/"
    if paths.dtype == object:
        return np.array([p[len(prefix):] if p.startswith(prefix) else os.path.relpath(p, root) for p in paths.tolist()],
                        dtype=object)
    inside = np.strings.startswith(paths, prefix)
    out = np.strings.slice(paths, len(prefix), None)
    for i in np.flatnonzero(~inside):
        out[i] = os.path.relpath(str(paths[i]), root)
    return out


@dataclass
class Rows:
    """dataset.tsv's usable rows as columns, in file order: the path relative to the root, the line, the label
    and the split ("" where the row gives none); each file's lstat (mode 0: none there), size and mtime."""
    rel: np.ndarray
    lines: np.ndarray
    labels: np.ndarray
    splits: np.ndarray
    modes: np.ndarray
    sizes: np.ndarray
    mtimes: np.ndarray

    def take(self, index) -> "Rows":
        return Rows(*(getattr(self, f)[index] for f in ("rel", "lines", "labels", "splits", "modes", "sizes",
                                                        "mtimes")))


_NOT_NORMAL = ("//", "/./", "/../", "\\")  # and NUL, which numpy's string search cannot look for


def _is_plain(rel: np.ndarray) -> np.ndarray:
    """The paths that safe_relpath leaves as they are (relative, normalised, no backslash, no NUL, no drive):
    tested on the whole column, so only the others go through safe_relpath one by one."""
    if rel.dtype == object:
        return np.zeros(len(rel), dtype=bool)
    bad = (rel == "") | (rel == ".") | (rel == "..")
    for piece in _NOT_NORMAL:
        bad |= np.strings.find(rel, piece) >= 0
    for start in ("/", "./", "../"):
        bad |= np.strings.startswith(rel, start)
    for end in ("/", "/.", "/.."):
        bad |= np.strings.endswith(rel, end)
    bad |= np.strings.find(np.strings.slice(rel, 1, 2), ":") >= 0
    if "\x00" in "".join(rel.tolist()):
        bad |= np.array(["\x00" in x for x in rel.tolist()], dtype=bool)
    return ~bad


LSTAT_PARALLEL_FROM = 100_000  # files from which their lstats are shared with worker interpreters (fanout.py)
_LSTAT_WORKER = r"""
import os, sys
from array import array
prefix, out = os.fsencode(sys.argv[1]), array("q")
for name in sys.stdin.buffer.read().split(b"\0"):
    try:
        st = os.lstat(prefix + name)
        out.extend((st.st_mode, st.st_size, st.st_mtime_ns))
    except (OSError, ValueError):
        out.extend((0, -1, -1))
sys.stdout.buffer.write(out.tobytes())
"""


def _lstat_all(root: Path, rel: np.ndarray, parallel_from: int = LSTAT_PARALLEL_FROM
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mode, size, mtime_ns) of root/rel for each row, from one lstat each (mode 0 where there is none); from
    `parallel_from` files with a worker interpreter per further core (1 M lstats: 3.2 s in one process)."""
    prefix = str(root).rstrip("/") + "/"

    def here(names: list[str]) -> bytes:
        values, lstat = array("q"), os.lstat
        for r in names:
            try:
                st = lstat(prefix + r)
                values.extend((st.st_mode, st.st_size, st.st_mtime_ns))
            except (OSError, ValueError):
                values.extend((0, -1, -1))
        return values.tobytes()

    out = np.frombuffer(fan_out(rel.tolist(), _LSTAT_WORKER, [prefix], 24, here, parallel_from=parallel_from),
                        dtype=np.int64).reshape(-1, 3)
    return out[:, 0].astype(np.uint32), out[:, 1].copy(), out[:, 2].copy()


def _rpart(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(everything before the last "/", what follows it) of each path ("" and the path without one)."""
    if a.dtype == object:
        heads, _, tails = zip(*(x.rpartition("/") for x in a.tolist())) if len(a) else ((), (), ())
        return strings(list(heads)), strings(list(tails))
    head, _, tail = np.strings.rpartition(a, np.array("/", dtype=a.dtype))
    return head, tail


@dataclass
class Text:
    """What dataset.tsv's bytes alone decide (no file is touched), for the rows that pass every check of the text
    and repeat no earlier row, in file order: the path relative to the root, the line, the class name (its
    index into `label_names`), the split ("" where the row gives none), the folder of each path (its index into
    `folders`), and the number of exact repeats dropped; `units`: each path's split hash for `seed`
    (unit_hashes), where known. listing_cache.py keeps it while the file's bytes stay the same."""
    rel: np.ndarray
    lines: np.ndarray
    label_names: np.ndarray
    label_index: np.ndarray
    splits: np.ndarray
    folders: np.ndarray
    folder_index: np.ndarray
    duplicates: int
    seed: int | None = None
    units: np.ndarray | None = None

    def split_hashes(self, seed: int) -> np.ndarray:
        """unit_hashes of every row for `seed`, worked out once and kept."""
        if self.seed != seed or self.units is None:
            self.seed, self.units = seed, unit_hashes(self.rel.tolist(), seed)
        return self.units


def read_text(table: Table, root: Path, tsv) -> tuple[Text, list[tuple[int, str]]]:
    """dataset.tsv's rows checked as text (their paths, labels, splits, repeats): the usable rows, and the
    problems found as (line, message); a path that leaves the root is refused before any file is touched."""
    lines = np.asarray(table["_line"], dtype=np.int64)
    raw = strings(table["image_path"])
    problems: list[tuple[int, str]] = []
    rel = raw.copy()
    ok = np.ones(len(raw), dtype=bool)
    for i in np.flatnonzero(~_is_plain(raw)):
        try:
            rel[i] = safe_relpath(str(raw[i]), root)
        except ValueError as e:
            problems.append((int(lines[i]), f"line {lines[i]}: {e}; refused. Paths must stay inside the dataset root."))
            ok[i] = False
    heads = _rpart(rel)[0]
    if "label" in table.columns and any(table["label"]):
        labels = strings(table["label"])
        for i in np.flatnonzero(ok & (labels == "")):
            problems.append((int(lines[i]), f"line {lines[i]}: {str(rel[i])!r} has an empty label while other rows "
                                            "have one; fill it in or drop the row."))
    else:
        labels = _rpart(heads)[1]
        resolver = PathResolver(root)
        for i in np.flatnonzero(ok & (labels == "")):
            problems.append((int(lines[i]), f"line {lines[i]}: {str(rel[i])!r} is a directory; list the image "
                                            "files, one per row." if resolver.is_dir(str(rel[i])) else
                             f"line {lines[i]}: {str(rel[i])!r} has no 'label' and no class folder; "
                             "fill the label column or move it into a class folder."))
    ok &= labels != ""
    splits = np.full(len(raw), "", dtype=rel.dtype)
    if "split" in table.columns:
        given = strings(table["split"])
        if rel.dtype != object and given.dtype != object:
            lower = np.strings.lower(given)
        else:
            lower = strings([str(x).lower() for x in given.tolist()])
        for name, to in SPLITS.items():
            splits[lower == name] = to
        for i in np.flatnonzero(ok & (given != "") & (splits == "")):
            problems.append((int(lines[i]), f"line {lines[i]}: split {str(given[i])!r} is not one of train, val (or "
                                            "validation)."))
        ok &= (given == "") | (splits != "")
    keep = np.flatnonzero(ok)
    rel, lines, labels, splits, heads = rel[keep], lines[keep], labels[keep], splits[keep], heads[keep]
    _, inverse = unique_inverse(rel)
    first = np.full(int(inverse.max()) + 1 if len(inverse) else 0, len(inverse), dtype=np.intp)
    np.minimum.at(first, inverse, np.arange(len(inverse)))
    repeated = np.flatnonzero(np.arange(len(rel)) != first[inverse])
    for i in repeated:
        j = first[inverse[i]]
        if (labels[i], splits[i]) != (labels[j], splits[j]):
            problems.append((int(lines[i]), f"line {lines[i]}: {str(rel[i])!r} repeats line {lines[j]} with another "
                                            f"label or split ({str(labels[i])!r} vs {str(labels[j])!r}); keep one row."))
    once = np.setdiff1d(np.arange(len(rel)), repeated)
    label_names, label_index = unique_inverse(labels[once])
    folders, folder_index = unique_inverse(heads[once])
    return Text(rel[once], lines[once], label_names, label_index.astype(np.int32), splits[once], folders,
                folder_index.astype(np.int32), len(repeated)), problems


def check_files(text: Text, root: Path, tsv, problems: list[tuple[int, str]] = ()
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's file, one lstat each: (mode, size, mtime_ns) per row (mode 0: none there); a row naming a
    folder is a problem; a ManifestError names the first 20 problems (these and the text's), in file order."""
    problems = list(problems)
    modes, sizes, mtimes = _lstat_all(root, text.rel)
    folder = (modes & 0o170000) == stat.S_IFDIR
    resolver = PathResolver(root)
    for i in np.flatnonzero((modes & 0o170000) == stat.S_IFLNK):
        folder[i] = resolver.is_dir(str(text.rel[i]))  # a link to a folder
    for i in np.flatnonzero(folder):
        problems.append((int(text.lines[i]), f"line {text.lines[i]}: {str(text.rel[i])!r} is a directory; list the "
                                             "image files, one per row."))
    if problems:
        problems = [m for _, m in sorted(problems, key=lambda p: p[0])]
        raise ManifestError(f"{tsv}: {len(problems)} bad row(s):\n  " + "\n  ".join(problems[:20])
                            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""))
    return modes, sizes, mtimes


def parse_rows(table: Table, root: Path, tsv) -> tuple[Rows, int]:
    """The usable rows (as columns) and the number of duplicate rows dropped; a ManifestError naming the first
    20 bad rows, in file order, each by the first check it fails: its path (no file is touched for a path that
    leaves the root), its label, its split, a repeat of another row with another label or split, a folder."""
    text, problems = read_text(table, root, tsv)
    modes, sizes, mtimes = check_files(text, root, tsv, problems)
    return Rows(text.rel, text.lines, text.label_names[text.label_index], text.splits, modes, sizes, mtimes), \
        text.duplicates


def sort_classes(labels) -> list[str]:
    """Class names in order: numerically when every label is an integer in ASCII digits ('2' before '10'; '02' after
    '2', as text breaks the tie, so the order never depends on string hashing), else as text."""
    labels = set(labels)
    if all(_INTEGER.fullmatch(x) for x in labels):
        return sorted(labels, key=lambda x: (int(x), x))
    return sorted(labels)


_INTEGER = re.compile(r"-?[0-9]+")  # str.isdigit also takes '²', which int() refuses


def read_manifest(root: Path | str, *, val_fraction: float, seed: int, skip_missing: bool,
                  tsv: Path | str | None = None, cache_dir: Path | str | None = None,
                  cache_from: int = CACHE_FROM) -> Manifest:
    """Parse and check `root/dataset.tsv`. Raises ManifestError naming the row/column and the fix.
    On columns, with one lstat a file (its size and mtime kept for the scan): 1 M rows in about 9.6 s on 2 cores.
    With a `cache_dir`, a manifest of `cache_from` rows or more keeps its text's checks there (listing_cache.py)
    while its bytes stay the same, and each start only looks at the files again."""
    root = Path(root)
    tsv = Path(tsv) if tsv else root / MANIFEST_NAME
    started = time.perf_counter()
    text, problems, kept, fresh, data = None, [], None, True, None
    if cache_dir is not None:
        try:
            data = tsv.read_bytes()
        except OSError:  # read_table names the problem
            data = None
        if data is not None and data.count(b"\n") >= cache_from:
            kept = cache_path(cache_dir, tsv), cache_key(data, root)
            text = load_text(*kept, Text)
            fresh = text is None
    if text is None:
        table = read_table(tsv, data)  # the bytes the key was made of (a second read may see another file)
        check_columns(table, tsv)
        rows_read = len(table)
        if rows_read >= PROGRESS_FROM:
            print(f"{tsv}: {rows_read} rows; checking that each file is there (one stat each)", file=sys.stderr,
                  flush=True)
        text, problems = read_text(table, root, tsv)
    else:
        rows_read = len(text.rel) + text.duplicates
        if rows_read >= PROGRESS_FROM:
            print(f"{tsv}: {rows_read} rows (their text checked before: the same bytes); checking that each file "
                  "is there (one stat each)", file=sys.stderr, flush=True)
    modes, sizes, mtimes = check_files(text, root, tsv, problems)
    if text.duplicates:
        warnings.warn(f"{tsv}: dropped {text.duplicates} duplicate row(s) (same image_path, label and split).")

    # a broken symbolic link is not missing: the scan lists it as a bad image ("dangling symbolic link")
    kind = modes & 0o170000
    present = (kind == stat.S_IFREG) | (kind == stat.S_IFLNK)  # as os.path.isfile or os.path.islink says
    keep = np.flatnonzero(present)
    missing = text.rel[~present].tolist() if len(keep) < len(present) else []
    if missing and not skip_missing:
        raise ManifestError(f"{tsv}: {len(missing)} listed file(s) missing under {root}: "
                            f"{preview(missing)}. Sync the data again, fix the paths, or pass "
                            "--skip-missing to train without them.")

    def there(column: np.ndarray) -> np.ndarray:  # a million strings are not copied where every file is there
        return column if not missing else column[keep]

    rel, splits, label_index = there(text.rel), there(text.splits), there(text.label_index)
    used = np.unique(label_index)  # integers: numpy's default sort is safe here
    classes = sort_classes(text.label_names[used].tolist())
    if len(classes) < 2:
        raise ManifestError(f"{tsv}: found {len(classes)} class(es) {classes}; a classifier needs "
                            "at least two. Check the 'label' column or the class folders.")
    index = {c: i for i, c in enumerate(classes)}
    to_class = np.full(len(text.label_names), -1, dtype=np.int32)
    to_class[used] = [index[c] for c in text.label_names[used].tolist()]
    links = (there(modes) & 0o170000) == stat.S_IFLNK
    resolver = PathResolver(root)
    samples = Samples(absolute_paths(root, rel, links, folders=(text.folders, there(text.folder_index)),
                                     resolver=resolver),
                      to_class[label_index], there(text.lines),
                      np.where(links, -1, there(sizes)), np.where(links, -1, there(mtimes)))

    split_column = bool(np.any(splits != ""))
    hashed = text.units is not None and text.seed == seed
    if split_column:
        unsplit = rel[splits == ""].tolist()
        if unsplit:
            raise ManifestError(f"{tsv}: the 'split' column is empty for {preview(unsplit)}; "
                                "give every row train or val, or drop the column.")
        train, val = samples.take(splits == "train"), samples.take(splits == "val")
        rule = "column"
    else:
        train, val = stratified_split(samples, val_fraction, seed, units=there(text.split_hashes(seed)))
        rule = "hash"
    if not train and split_column:
        raise ManifestError(f"{tsv}: the 'split' column marks no row train (all {len(val)} say val, lines "
                            f"{val.lines.min()} to {val.lines.max()}): mark the rows to train on "
                            "split=train (with a split column, --val-fraction does not apply).")
    if not train:
        raise ManifestError(f"{tsv}: no training rows after the split; lower --val-fraction "
                            "or mark some rows split=train.")
    if kept is not None and (fresh or (not split_column and not hashed)):
        save_text(*kept, text)
    manifest = Manifest(root, classes, train, val, missing, text.duplicates, split_rule=rule)
    if kept is not None and not missing and not links.any():
        # every path is the root's resolved folders and the text's names: the digest follows from these alone
        key = digest_key(kept[1], val_fraction, seed, resolver.resolved(text.folders.tolist()))
        manifest.known_digest = load_digest(kept[0], key)
        if manifest.known_digest is None:
            manifest.known_digest = manifest.digest()
            save_digest(kept[0], key, manifest.known_digest)
    if rows_read >= PROGRESS_FROM:
        print(f"{tsv}: {len(train) + len(val)} files read and split in {time.perf_counter() - started:.1f} s",
              file=sys.stderr, flush=True)
    return manifest


def absolute_paths(root: Path, rel: np.ndarray, links: np.ndarray | None = None, folders=None,
                   resolver: PathResolver | None = None) -> np.ndarray:
    """The absolute path of each file root/rel, through its folders' symbolic links (each folder resolved once)
    and, where `links` marks the file itself a link, through it (PathResolver.absolute, one by one). `folders`:
    (the distinct folders, each path's index into them), where the caller has them; `resolver`: the caller's,
    to ask afterwards what each folder resolved to."""
    resolver = resolver or PathResolver(root)
    if not len(rel):
        return strings([])
    if folders is None:
        heads, tails = _rpart(rel)
        folders, inverse = unique_inverse(heads)
    else:
        folders, inverse = folders
        tails = _rpart(rel)[1]
    real = [resolver.folder(f) for f in folders.tolist()]
    if all(r is not None for r in real):
        out = _add(_add(strings([r.rstrip("/") for r in real])[inverse], "/"), tails)  # an object column if either
        # side has a name that is not UTF-8 (a linked folder's real name, say)
    else:
        out = strings([resolver.absolute(r) for r in rel.tolist()])
    for i in np.flatnonzero(links) if links is not None else ():
        out[i] = resolver.absolute(str(rel[i]))
    return out


class PathResolver:
    """Paths under one root, with one lstat per file: its folders' real paths are resolved once each (a
    million files in a thousand class folders: a thousand resolves, not a million, each of which stats every
    component of the path), and only a file that is itself a symbolic link is followed on its own."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self._root_s = str(self.root).rstrip("/") or "/"
        self._prefix = self._root_s.rstrip("/") + "/"
        self._folders: dict[str, str | None] = {}

    def folder(self, rel_dir: str) -> str | None:
        """The real path of the folder root/rel_dir, resolved once; None when it cannot be."""
        real = self._folders.get(rel_dir, False)
        if real is False:
            try:
                real = str(Path(os.path.join(self._root_s, rel_dir)).resolve(strict=True))
            except (OSError, RuntimeError):
                real = None
            self._folders[rel_dir] = real
        return real

    def resolved(self, folders: list[str]) -> list[str | None]:
        """What each of `folders` resolves to."""
        return [self.folder(f) for f in folders]

    def lstat(self, rel: str) -> os.stat_result | None:
        try:
            return os.lstat(self._prefix + rel)
        except (OSError, ValueError):
            return None

    def is_dir(self, rel: str) -> bool:
        """os.path.isdir: a folder, or a link to one."""
        st = self.lstat(rel)
        return st is not None and (stat.S_ISDIR(st.st_mode) or (stat.S_ISLNK(st.st_mode) and
                                                              os.path.isdir(os.path.join(self._root_s, rel))))

    def absolute(self, rel: str, st: os.stat_result | None = None) -> str:
        """The file's absolute path, through its symbolic links; a broken link (dangling, or a loop) stays the
        link itself, for the scan to name. `st`: the file's lstat when the caller has it."""
        st = self.lstat(rel) if st is None else st
        if st is not None and not stat.S_ISLNK(st.st_mode):
            head, name = posixpath.split(rel)
            folder = self.folder(head)
            if folder is not None:
                return f"{folder.rstrip('/')}/{name}"
        try:
            return str(Path(self._root_s, rel).resolve(strict=True))
        except (OSError, RuntimeError):
            return str(self.root.resolve() / rel)


def unit_hashes(rels, seed: int) -> np.ndarray:
    """For each relative path, a number in [0, 1) that depends only on it and the seed (the first 8 bytes of
    sha256("SEED:PATH") over 2**64)."""
    sha = hashlib.sha256
    h = np.fromiter((int.from_bytes(sha(f"{seed}:{r}".encode("utf-8", "surrogateescape")).digest()[:8], "big")
                     for r in rels), dtype=np.uint64, count=len(rels))
    return h.astype(np.float64) / 2.0**64


def stratified_split(samples, val_fraction: float, seed: int, rels=None, units=None) -> tuple[Samples, Samples]:
    """Each file goes to val when the hash of its path (relative to the root: `rels`, or the keys of a dict of
    {rel: Sample}) and the seed is below `val_fraction`, so adding or removing images never moves the others
    between train and val. Per class, when the hash gives no val image (or only val images), the file with the
    smallest (largest) hash is moved, so each class with at least two images keeps at least one in each split.
    Both splits are in class order, then by hash (then path), on whole columns. `units`: the hashes, where the
    caller has them (manifest.Text keeps them)."""
    if isinstance(samples, dict):
        rels, samples = list(samples), Samples.of(samples.values())
    if not len(samples):
        return samples, samples
    if units is None:
        units = unit_hashes(rels.tolist() if isinstance(rels, np.ndarray) else list(rels), seed)
    u = units
    order = np.lexsort((u, samples.labels))  # the path breaks ties of (class, hash): only where there are any
    # (sorting by a text column took 0.8 s at 1 M; equal 64-bit hashes in one class are as good as never)
    tied = (samples.labels[order][1:] == samples.labels[order][:-1]) & (u[order][1:] == u[order][:-1])
    if tied.any():
        order = np.lexsort((samples.paths, u, samples.labels))
    labels, u = samples.labels[order], u[order]
    starts = np.flatnonzero(np.r_[True, labels[1:] != labels[:-1]])
    sizes = np.diff(np.r_[starts, len(labels)])
    n_val = np.add.reduceat((u < val_fraction).astype(np.int64), starts)
    if val_fraction > 0:
        two = sizes >= 2
        n_val[two] = np.minimum(np.maximum(n_val[two], 1), sizes[two] - 1)
    group = np.repeat(np.arange(len(starts)), sizes)
    is_val = (np.arange(len(labels)) - starts[group]) < n_val[group]
    return samples.take(order[~is_val]), samples.take(order[is_val])
