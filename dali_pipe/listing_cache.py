"""What dataset.tsv's bytes decide, kept between starts: its checked paths, lines, labels, splits, folders and
the split's hash of each path (manifest.Text), as columns in one .npz under the cache dir, used again only while
the file's bytes are the same (their sha256, the dataset root and this format are the key).

Reading a million-row dataset.tsv and checking it as text (paths, labels, splits, repeats, the split's sha256 of
each path) took 5-6 of read_manifest's 9.6 s on 2 cores, on every start, resume and "nothing to do", for a file
that does not change between them. The files themselves are still looked at on every start (manifest.check_files:
one lstat each, their sizes and mtimes for the scan): the cache holds no verdict about the disk.

A cache that is missing, damaged, of another format or of other bytes is only a slower start; it is written
atomically (workdir.atomic). Paths are stored (they are the dataset's own listing, as
dataset.tsv holds them, relative to the root): the cache sits beside the scan cache, in the cache dir.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

import numpy as np

from .samples import strings
from .workdir import atomic, write_atomic

FORMAT = 1  # bump when Text or the checks that make it change
FOLDER = "manifests"  # under the cache dir
CACHE_FROM = 50_000  # rows from which a manifest's text is kept (below, reading it takes under 0.5 s)
_TEXT = ("rel", "label_names", "splits", "folders")  # the text columns, stored as NUL-joined UTF-8


def cache_key(data: bytes, root: Path) -> str:
    """The cache key of dataset.tsv's bytes read under `root` (safe_relpath resolves absolute rows against it)."""
    h = hashlib.sha256(f"{FORMAT}\0{Path(root).resolve()}\0".encode("utf-8", "surrogateescape"))
    h.update(data)
    return h.hexdigest()


def cache_path(cache_dir: Path | str, tsv: Path) -> Path:
    """The cache file of one dataset.tsv (by its absolute path: one file per manifest, replaced as it changes)."""
    name = hashlib.sha256(str(Path(tsv).resolve()).encode("utf-8", "surrogateescape")).hexdigest()[:20]
    return Path(cache_dir) / FOLDER / f"{name}.npz"


def _blob(column: np.ndarray) -> np.ndarray:
    return np.frombuffer("\0".join(column.tolist()).encode("utf-8", "surrogateescape"), dtype=np.uint8)


def _unblob(blob: np.ndarray, n: int) -> np.ndarray:
    if n == 0:
        return strings([])
    values = blob.tobytes().decode("utf-8", "surrogateescape").split("\0")
    if len(values) != n:
        raise ValueError("a text column of another length")
    return strings(values)


def load_text(path: Path, want: str, text_type):
    """The Text saved at `path` for the key `want`; None where there is none, or another, or it is damaged."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            if meta.get("key") != want or meta.get("format") != FORMAT:
                return None
            n = {"rel": len(z["lines"]), "splits": len(z["lines"]), "label_names": int(meta["labels"]),
                 "folders": int(meta["folders"])}
            text = {k: _unblob(z[k], n[k]) for k in _TEXT}
            numbers = {k: z[k] for k in ("lines", "label_index", "folder_index")}
            units = z["units"] if meta.get("seed") is not None else None
        rows = len(numbers["lines"])
        if any(len(v) != rows for v in numbers.values()) or (units is not None and len(units) != rows) or \
                (rows and (numbers["label_index"].max() >= n["label_names"] or numbers["label_index"].min() < 0 or
                           numbers["folder_index"].max() >= n["folders"] or numbers["folder_index"].min() < 0)):
            return None
        return text_type(rel=text["rel"], lines=numbers["lines"], label_names=text["label_names"],
                         label_index=numbers["label_index"], splits=text["splits"], folders=text["folders"],
                         folder_index=numbers["folder_index"], duplicates=int(meta["duplicates"]),
                         seed=meta.get("seed"), units=units)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, EOFError,
            zipfile.BadZipFile):
        return None  # only a slower start


def save_text(path: Path, want: str, text) -> None:
    """Write `text` for the key `want` (atomically); a failure says so and costs only the next start's time."""
    meta = {"format": FORMAT, "key": want, "labels": len(text.label_names), "folders": len(text.folders),
            "duplicates": text.duplicates, "seed": text.seed if text.units is not None else None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                     **{k: _blob(getattr(text, k)) for k in _TEXT},
                     lines=np.asarray(text.lines, dtype=np.int64), label_index=text.label_index,
                     folder_index=text.folder_index,
                     units=text.units if text.units is not None else np.empty(0, dtype=np.float64))
    except OSError as e:
        print(f"manifest: could not keep the checked manifest in {path} ({e.strerror}); the next start reads "
              "dataset.tsv again", file=sys.stderr)


# -- the digest ------------------------------------------------------------------------------------
def digest_key(text_key: str, val_fraction: float, seed: int, resolved_folders: list[str | None]) -> str:
    """What a manifest's digest follows from, where no file is missing and none is itself a link: the text (its
    key, which holds the resolved root), the split's settings and what each folder resolves to now (a class folder
    that is a link may point elsewhere since)."""
    h = hashlib.sha256(json.dumps([text_key, repr(float(val_fraction)), int(seed)]).encode())
    h.update("\0".join(str(f) for f in resolved_folders).encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _digest_path(path: Path) -> Path:
    return path.with_name(path.stem + ".digest.json")


def load_digest(path: Path, key: str) -> str | None:
    """The digest kept beside the text at `path` (cache_path) for `key`, or None. Computing it takes 1.0-1.2 s at
    1 M files (a sort and a sha256 of every path), on every start and "nothing to do"."""
    try:
        kept = json.loads(_digest_path(path).read_text())
        digest = kept["digest"] if kept.get("key") == key else None
        return digest if isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{16}", digest) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_digest(path: Path, key: str, digest: str) -> None:
    """Keep `digest` for `key` (one per manifest: the last settings); a failure costs only the next start's time."""
    target = _digest_path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, json.dumps({"key": key, "digest": digest}))
    except OSError:
        pass  # the next start computes the digest again
