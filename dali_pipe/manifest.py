"""Read `dataset.tsv` into a checked list of (file, label) samples and a train/val split.

The manifest is the single source of truth for what a run trains on: the S3 sync downloads only
the files it lists, the scan checks only those, and the pipelines read only those.

Columns (header names are stripped and case-insensitive): `image_path` (required, relative to
the dataset root), `label` (optional; else the parent folder name; classes sort numerically when
every label is an integer), `split` (optional, train, val or validation; else a split by a hash of each path and
the seed, stratified per class, that stays put as images are added).
"""
from __future__ import annotations

import csv
import difflib
import hashlib
import io
import os
import posixpath
import stat
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError

MANIFEST_NAME = "dataset.tsv"
SPLITS = {"train": "train", "val": "val", "validation": "val"}


class ManifestError(UserError):
    """The manifest cannot be used as it is; the message says which row or column and the fix."""


@dataclass(frozen=True)
class Sample:
    path: str  # absolute path of the image on local disk
    label: int  # index into Manifest.classes
    line: int  # line number in dataset.tsv (header is line 1), for error messages


@dataclass
class Manifest:
    root: Path
    classes: list[str]
    train: list[Sample]
    val: list[Sample]
    missing: list[str] = field(default_factory=list)  # image_path values skipped (--skip-missing)
    duplicates: int = 0  # duplicate rows dropped
    note: str = ""  # how the split was made, when the start-up summary should say it (an ImageFolder's)
    split_rule: str = "hash"  # how the split was made: "column" (split column), "folders" (train/ val/) or "hash"

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.classes))

    def digest(self) -> str:
        """A hash of what a run reads: each sample's path (relative to the root), class and split."""
        h = hashlib.sha256()
        root = self.root.resolve()
        for split, samples in (("train", self.train), ("val", self.val)):
            for s in sorted(samples, key=lambda s: s.path):
                h.update(f"{os.path.relpath(s.path, root)}\t{self.classes[s.label]}\t{split}\n".encode())
        return h.hexdigest()[:16]

    def without(self, bad: set[str]) -> "Manifest":
        """The same manifest with the files in `bad` (absolute paths) left out."""
        return Manifest(self.root, self.classes, [s for s in self.train if s.path not in bad],
                        [s for s in self.val if s.path not in bad], self.missing, self.duplicates, self.note,
                        self.split_rule)


def _preview(items: list[str], n: int = 5) -> str:
    shown = ", ".join(repr(i) for i in items[:n])
    return f"{shown}{f' ... and {len(items) - n} more' if len(items) > n else ''} ({len(items)} in all)"


def safe_relpath(image_path: str, root: Path) -> str:
    """Normalise a manifest path to a POSIX path relative to `root`, refusing any that escapes it.

    Purely lexical: nothing is opened, so a hostile row never touches the file system.
    Raises ValueError with the reason.
    """
    p = image_path.replace("\\", "/")
    if not p:
        raise ValueError("empty image_path")
    if "\x00" in p:
        raise ValueError("image_path contains a NUL byte")
    if posixpath.isabs(p) or (len(p) > 1 and p[1] == ":"):
        root_s = str(root.resolve()).replace("\\", "/").rstrip("/") + "/"
        norm = posixpath.normpath(p)
        if not norm.startswith(root_s):
            raise ValueError(f"absolute path {image_path!r} is outside the dataset root {str(root)!r}")
        p = norm[len(root_s):]
    norm = posixpath.normpath(p)
    if norm == "." or norm.startswith("../") or norm == ".." or posixpath.isabs(norm):
        raise ValueError(f"path {image_path!r} escapes the dataset root (uses '..')")
    return norm


@dataclass
class Table:
    """A manifest as read: the header's column names (trimmed, lower-case) and each non-blank row as a dict of
    trimmed strings by column, with `_line`, its line number in the file (the header is line 1)."""
    columns: list[str]
    rows: list[dict]
    header_line: int = 1

    def __getitem__(self, column: str) -> list:
        return [r[column] for r in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def empty(self) -> bool:
        return not self.rows


def read_table(tsv: Path | str) -> Table:
    """Load the TSV as strings, tolerating a BOM, CRLF, padding spaces, blank lines and trailing tabs.

    The standard library's csv reader, not pandas: pandas costs over a second to import, which a data
    mistake should not wait for (the CLI reads the manifest before torch and Lightning load), and with
    one field more than the header on the first row it silently takes the first column as the index.
    """
    try:
        raw = Path(tsv).read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"{tsv}: no such manifest. Put a {MANIFEST_NAME} with an 'image_path' "
                            "column at the dataset root, or pass the right --data.") from None
    except OSError as e:
        raise ManifestError(f"{tsv}: cannot be read ({e.strerror or e}).") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ManifestError(f"{tsv}: line {line}: not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                            "UTF-8.") from None
    lines = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE, strict=True)
    header, header_line, rows, problems = None, 1, [], []
    try:
        for number, fields in enumerate(lines, start=1):
            fields = [f.strip() for f in fields]
            if not any(fields):
                continue  # a blank line (or only tabs and spaces)
            if header is None:
                header, header_line = [f.lower() for f in fields], number
                continue
            extra = fields[len(header):]
            if any(extra):
                problems.append(f"line {number} has {len(fields)} tab-separated fields, the header {len(header)} "
                                f"({', '.join(header)})")
                continue
            rows.append({**dict(zip(header, fields + [""] * (len(header) - len(fields)))), "_line": number})
    except csv.Error as e:
        raise ManifestError(f"{tsv}: line {lines.line_num}: not a tab-separated table ({e}).") from None
    if header is None:
        raise ManifestError(f"{tsv}: the file is empty; it needs a header line with 'image_path'.")
    twice = sorted({c for c in header if header.count(c) > 1 and c})
    if twice:
        raise ManifestError(f"{tsv}: line {header_line}: column(s) {', '.join(map(repr, twice))} appear more than "
                            "once in the header (names are case-insensitive); keep one of each.")
    if problems:
        raise ManifestError(f"{tsv}: not a tab-separated table: " + "; ".join(problems[:5])
                            + (f"; ... and {len(problems) - 5} more" if len(problems) > 5 else "")
                            + ". Each line needs at most as many tab-separated fields as the header.")
    return Table(header, rows, header_line)


COLUMNS = ("image_path", "label", "split")


def check_columns(table: Table, tsv) -> None:
    """Header names are stripped and case-insensitive (read_table lowers them); a column that
    nearly matches a known one (`lable`, `imagepath`) is a typo, not an extra column; a header of
    comma-separated names is a CSV file."""
    check_header(table, tsv)
    if table.empty:
        raise ManifestError(f"{tsv}: no rows. List at least two classes of images under 'image_path'.")


def check_header(table: Table, tsv) -> None:
    """The header names an image_path column and no near-miss of a known one; else one message naming the
    header's line and what it looks like (a typo of which column, a comma-separated file)."""
    cols, where = table.columns, f"{tsv}: line {table.header_line}"
    for sep, name in ((",", "comma"), (";", "semicolon")):
        if len(cols) == 1 and sep in cols[0]:
            raise ManifestError(f"{where}: the header {cols[0]!r} is {name}-separated: this is a CSV file, and "
                                f"{MANIFEST_NAME} is tab-separated. Save it with a tab between the columns (for "
                                f"example pandas.read_csv({str(tsv)!r}, sep={sep!r}).to_csv(..., sep='\\t', "
                                "index=False)).")
    typos = [(c, close[0]) for c in cols if c not in COLUMNS
             for close in [difflib.get_close_matches(c, COLUMNS, n=1, cutoff=0.75)] if close and close[0] not in cols]
    if typos:
        raise ManifestError(f"{where}: " + "; ".join(f"column {c!r} looks like a typo of {k!r}" for c, k in typos)
                            + f"; rename {'it' if len(typos) == 1 else 'them'} (the known columns are "
                            f"{', '.join(COLUMNS)}).")
    if "image_path" in cols:
        return
    raise ManifestError(f"{where}: no 'image_path' column (found {cols}). Add a header line whose "
                        "first field is image_path, tab-separated.")


def parse_rows(table: Table, root: Path, tsv) -> tuple[dict[str, tuple[int, str, str | None]], int]:
    """{relative path: (line, label, split)} and the number of duplicate rows dropped."""
    problems: list[str] = []
    rows: dict[str, tuple[int, str, str | None]] = {}
    duplicates = 0
    labelled = "label" in table.columns and any(table["label"])
    has_split = "split" in table.columns
    paths = PathResolver(root)
    for rec in table.rows:
        line = rec["_line"]
        try:
            rel = safe_relpath(rec["image_path"], root)
        except ValueError as e:
            problems.append(f"line {line}: {e}; refused. Paths must stay inside the dataset root.")
            continue
        if paths.is_dir(rel):
            problems.append(f"line {line}: {rel!r} is a directory; list the image files, one per row.")
            continue
        if labelled:
            label = rec["label"]
            if not label:
                problems.append(f"line {line}: {rel!r} has an empty label while other rows have one; fill it "
                                "in or drop the row.")
                continue
        else:
            label = posixpath.basename(posixpath.dirname(rel))
            if not label:
                problems.append(f"line {line}: {rel!r} has no 'label' and no class folder; "
                                "fill the label column or move it into a class folder.")
                continue
        split = None
        if has_split and rec["split"]:
            split = SPLITS.get(rec["split"].lower())
            if split is None:
                problems.append(f"line {line}: split {rec['split']!r} is not one of train, val (or validation).")
                continue
        if rel in rows:
            first_line, first_label, first_split = rows[rel]
            if (first_label, first_split) != (label, split):
                problems.append(f"line {line}: {rel!r} repeats line {first_line} with another "
                                f"label or split ({label!r} vs {first_label!r}); keep one row.")
            duplicates += 1
            continue
        rows[rel] = (line, label, split)
    if problems:
        raise ManifestError(f"{tsv}: {len(problems)} bad row(s):\n  " + "\n  ".join(problems[:20])
                            + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""))
    return rows, duplicates


def sort_classes(labels) -> list[str]:
    """Class names in order: numerically when every label is an integer ('2' before '10'), else as text."""
    labels = set(labels)
    if all(x.lstrip("-").isdigit() for x in labels):
        return sorted(labels, key=int)
    return sorted(labels)


def read_manifest(root: Path | str, *, val_fraction: float, seed: int, skip_missing: bool,
                  tsv: Path | str | None = None) -> Manifest:
    """Parse and check `root/dataset.tsv`. Raises ManifestError naming the row/column and the fix."""
    root = Path(root)
    tsv = Path(tsv) if tsv else root / MANIFEST_NAME
    table = read_table(tsv)
    check_columns(table, tsv)
    rows, duplicates = parse_rows(table, root, tsv)
    if duplicates:
        warnings.warn(f"{tsv}: dropped {duplicates} duplicate row(s) (same image_path, label and split).")

    # a broken symbolic link is not missing: the scan lists it as a bad image ("dangling symbolic link")
    paths = PathResolver(root)
    found: dict[str, str] = {}  # rel -> absolute path, from one lstat each
    missing = []
    for rel in rows:
        st = paths.lstat(rel)
        if st is None or not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            missing.append(rel)  # as os.path.isfile and os.path.islink both say no
        else:
            found[rel] = paths.absolute(rel, st)
    if missing and not skip_missing:
        raise ManifestError(f"{tsv}: {len(missing)} listed file(s) missing under {root}: "
                            f"{_preview(missing)}. Sync the data again, fix the paths, or pass "
                            "--skip-missing to train without them.")
    for rel in missing:
        del rows[rel]

    classes = sort_classes(label for _, label, _ in rows.values())
    if len(classes) < 2:
        raise ManifestError(f"{tsv}: found {len(classes)} class(es) {classes}; a classifier needs "
                            "at least two. Check the 'label' column or the class folders.")
    index = {c: i for i, c in enumerate(classes)}
    samples = {rel: Sample(found[rel], index[label], line) for rel, (line, label, _) in rows.items()}

    split_column = "split" in table.columns and any(split for _, _, split in rows.values())
    if split_column:
        unsplit = [rel for rel, (_, _, s) in rows.items() if s is None]
        if unsplit:
            raise ManifestError(f"{tsv}: the 'split' column is empty for {_preview(unsplit)}; "
                                "give every row train or val, or drop the column.")
        train = [samples[r] for r, (_, _, s) in rows.items() if s == "train"]
        val = [samples[r] for r, (_, _, s) in rows.items() if s == "val"]
        rule = "column"
    else:
        train, val = stratified_split(samples, val_fraction, seed)
        rule = "hash"
    if not train and split_column:
        raise ManifestError(f"{tsv}: the 'split' column marks no row train (all {len(val)} say val, lines "
                            f"{min(s.line for s in val)} to {max(s.line for s in val)}): mark the rows to train on "
                            "split=train (with a split column, --val-fraction does not apply).")
    if not train:
        raise ManifestError(f"{tsv}: no training rows after the split; lower --val-fraction "
                            "or mark some rows split=train.")
    return Manifest(root, classes, train, val, missing, duplicates, split_rule=rule)


class PathResolver:
    """Paths under one root, with one lstat per file: its folders' real paths are resolved once each (a
    million files in a thousand class folders: a thousand resolves, not a million, each of which stats every
    component of the path), and only a file that is itself a symbolic link is followed on its own."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self._root_s = str(self.root).rstrip("/") or "/"
        self._prefix = self._root_s.rstrip("/") + "/"
        self._folders: dict[str, str | None] = {}

    def _folder(self, rel_dir: str) -> str | None:
        real = self._folders.get(rel_dir, False)
        if real is False:
            try:
                real = str(Path(os.path.join(self._root_s, rel_dir)).resolve(strict=True))
            except (OSError, RuntimeError):
                real = None
            self._folders[rel_dir] = real
        return real

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
            folder = self._folder(head)
            if folder is not None:
                return f"{folder.rstrip('/')}/{name}"
        try:
            return str(Path(self._root_s, rel).resolve(strict=True))
        except (OSError, RuntimeError):
            return str(self.root.resolve() / rel)


def _unit_hash(rel: str, seed: int) -> float:
    """A number in [0, 1) that depends only on the file's relative path and the seed."""
    digest = hashlib.sha256(f"{seed}:{rel}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def stratified_split(samples: dict[str, Sample], val_fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """Each file goes to val when the hash of its path and the seed is below `val_fraction`, so
    adding or removing images never moves the others between train and val. Per class, when the
    hash gives no val image (or only val images), the file with the smallest (largest) hash is
    moved, so each class with at least two images keeps at least one in each split."""
    by_class: dict[int, list[tuple[float, Sample]]] = defaultdict(list)
    for rel, s in samples.items():
        by_class[s.label].append((_unit_hash(rel, seed), s))
    train, val = [], []
    for label in sorted(by_class):
        group = sorted(by_class[label], key=lambda x: (x[0], x[1].path))
        n_val = sum(h < val_fraction for h, _ in group)
        if val_fraction > 0 and len(group) >= 2:
            n_val = min(max(n_val, 1), len(group) - 1)
        val += [s for _, s in group[:n_val]]
        train += [s for _, s in group[n_val:]]
    return train, val
