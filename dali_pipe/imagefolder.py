"""A folder of class subfolders (no dataset.tsv) as a dataset, exactly as torchvision's ImageFolder reads it.

- Classes: the folders directly under the root, sorted as strings (`find_classes`: hidden folders too,
  links to folders too); a class's index is its position, so the indices are torchvision's `class_to_idx`.
- Samples: every file at any depth below a class folder whose name ends in one of torchvision's
  IMG_EXTENSIONS, in any case (hidden files too, as torchvision lists them), in torchvision's order
  (`sorted(os.walk(class_dir, followlinks=True))`, then the names sorted). Other files are ignored; a
  file that does not hold the image its name says (or that DALI cannot decode) is the scan's to list.
- A class folder without images is refused, naming it, as torchvision refuses it (`allow_empty=False`):
  a class the data cannot teach would still be a class of the model.
- Split: ImageNet's layout, `train/` and `val/` (or `validation/`) folders of class folders (a `test/`
  beside them is left out), uses val/ for validation, with train/'s classes; otherwise --val-fraction of
  each class goes to validation by a hash of its path and --seed, as for a dataset.tsv without a split
  column (manifest.stratified_split). The start-up summary says which rule it used.

On S3 (s3://bucket/prefix of the same layout) the image objects are listed once, synced to the cache dir
(`sync.sync_files`), and the listing is kept beside them (LISTING_NAME), so that objects removed from the
bucket since an earlier sync are not read.

`implied_manifest` is the dataset.tsv the folder implies (`python -m dali_pipe manifest DIR`), for users
who want to edit it.
"""
from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path

import numpy as np

from .forms import IMG_EXTENSIONS, find_classes, is_image_name, pair_folders, pair_val
from .manifest import MANIFEST_NAME, Manifest, ManifestError, absolute_paths, sort_classes, stratified_split
from .s3 import SyncError
from .samples import Samples, member, strings
from .stop import check
from .sync import SyncStats, sync_files
from .workdir import write_atomic

LISTING_NAME = ".imagefolder-files.json"  # in the local copy of an s3:// ImageFolder: the keys its last sync listed
PAIR_NOTE = "split: the train/ and val/ folders (ImageNet's layout)"


class ImageFolderError(ManifestError):
    """An ImageFolder that cannot be read as it is; the message names the folder and the fix."""


# -- the listing, torchvision's ------------------------------------------------------------------
def class_files(root: Path, cls: str, links: set[str] | None = None, seen: dict | None = None,
                split: str = "") -> list[str]:
    """torchvision's `make_dataset` for one class: the image files below root/cls, relative to root, in its order
    (`sorted(os.walk(root/cls, followlinks=True))`, then the names sorted), walked with os.scandir, whose entries
    say which are links without a stat each. `links`: gets the relative paths of files that are links.

    Where torchvision's walk goes wrong, this raises ImageFolderError naming both paths: a folder that is its own
    ancestor (a link to a parent: torchvision lists the same images again and again under longer names and other
    labels until the path is too long; 29 files made 1184 samples), and, through `seen` ({(device, inode): (path,
    split)} shared by the caller across the splits), a folder reached from both train/ and val/ (the same images
    trained on and validated on). A folder reached twice within one split is listed twice, as torchvision does."""
    found: list[tuple[str, list[tuple[str, bool]]]] = []
    seen = {} if seen is None else seen

    def walk(folder: str, ancestors: dict) -> None:
        check()  # SIGTERM, Ctrl-C (stop.py): once a folder (a million files on a network disk take minutes)
        try:
            st = os.stat(folder)
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            return  # as os.walk: an unreadable folder yields nothing
        key = (st.st_dev, st.st_ino)
        if key in ancestors:
            raise ImageFolderError(f"{folder} is {ancestors[key]} again, one of its own parents (a symbolic link "
                                   "loop): its images would be read again and again under other names and classes; "
                                   "remove the link")
        before, where = seen.setdefault(key, (folder, split))
        if where != split:
            raise ImageFolderError(f"{folder} is the folder {before} (through a symbolic link), which the {where} "
                                   f"split holds too: its images would be both trained on and validated on; remove "
                                   "the link, or copy the images you mean into one split")
        ancestors = {**ancestors, key: folder}
        files, below = [], []
        for e in entries:
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                below.append(e.name)
            elif is_image_name(e.name):
                files.append((e.name, e.is_symlink()))
        found.append((folder, sorted(files)))
        for name in below:
            walk(os.path.join(folder, name), ancestors)

    walk(str(root / cls), {})
    out = []
    top = str(root).rstrip("/") + "/"
    for folder, files in sorted(found, key=lambda f: f[0]):
        prefix = folder[len(top):] + "/" if folder.startswith(top) else os.path.relpath(folder, root) + "/"
        for name, link in files:
            out.append(prefix + name)
            if link and links is not None:
                links.add(prefix + name)
    return out


def tree(root: Path, listing: list[str] | None = None, links: set[str] | None = None,
         seen: dict | None = None, split: str = "") -> dict[str, list[str]]:
    """{class: its image files relative to root}, classes in index order. `listing`: the object keys of an S3
    copy (relative to root), read as the same folders would be on disk. `links`: gets the files that are links.
    `seen`, `split`: the folders walked so far and this tree's split, shared by the caller across the splits of
    one dataset (class_files)."""
    if listing is None:
        seen = {} if seen is None else seen
        return {c: class_files(root, c, links, seen, split) for c in find_classes(root)}
    out: dict[str, list[tuple[str, str]]] = {}
    for key in listing:
        head, _, rest = key.partition("/")
        if rest:
            out.setdefault(head, [])
            if is_image_name(posixpath.basename(key)):
                out[head].append((posixpath.dirname(key), posixpath.basename(key)))
    return {c: [posixpath.join(d, f) for d, f in sorted(out[c])] for c in sorted(out)}


def _pair(root: Path, listing: list[str] | None) -> dict[str, str] | None:
    """{"train": "train", "val": "val" or "validation"} for ImageNet's layout, else None."""
    if listing is None:
        found = pair_folders(root)
        return None if found is None else {k: v.name for k, v in found.items()}
    tops = {k.split("/", 1)[0] for k in listing if k.count("/") >= 2 and not k.startswith(".")}
    val = pair_val(tops, str(root))
    return None if val is None else {"train": "train", "val": val}


def _sub(listing: list[str] | None, folder: str) -> list[str] | None:
    if listing is None:
        return None
    return [k[len(folder) + 1:] for k in listing if k.startswith(folder + "/")]


def _refuse_empty(root: Path, classes: dict[str, list[str]]) -> None:
    empty = [c for c, files in classes.items() if not files]
    if empty:
        shown = ", ".join(repr(c) for c in empty[:5]) + (f" ... and {len(empty) - 5} more" if len(empty) > 5 else "")
        raise ImageFolderError(
            f"{root} (an ImageFolder): {len(empty)} class folder(s) hold no image ({shown}; images end in "
            f"{', '.join(IMG_EXTENSIONS)}), which torchvision's ImageFolder refuses too. Remove them, or write the "
            f"dataset.tsv the folder implies without them (python -m dali_pipe manifest {root}) and edit it")


def read_image_folder(root: Path | str, *, val_fraction: float, seed: int,
                      listing: list[str] | None = None) -> Manifest:
    """The ImageFolder at `root` as a Manifest (classes and indices torchvision's; the split as the module
    docstring says). `listing`: the keys of an S3 copy (default: those its sync recorded, else the disk)."""
    root = Path(root)
    if listing is None and (root / LISTING_NAME).is_file():
        listing = json.loads((root / LISTING_NAME).read_text())["files"]
    pair = _pair(root, listing)
    if pair:
        links: dict[str, set[str]] = {"train": set(), "val": set()}
        seen: dict = {}  # a folder reached from both splits is refused (class_files)
        train_tree = tree(root / pair["train"], _sub(listing, pair["train"]), links["train"], seen, "train")
        val_tree = tree(root / pair["val"], _sub(listing, pair["val"]), links["val"], seen, "val")
        _refuse_empty(root / pair["train"], train_tree)
        _refuse_empty(root / pair["val"], val_tree)
        extra = sorted(set(val_tree) - set(train_tree))
        if extra:
            raise ImageFolderError(f"{root / pair['val']}: class folder(s) {extra[:5]} are not in "
                                   f"{root / pair['train']}; the classes are train/'s: add them there, or remove them")
        classes = list(train_tree)
        index = {c: i for i, c in enumerate(classes)}
        split = {name: _samples(root, {index[c]: [posixpath.join(pair[name], r) for r in files]
                                       for c, files in t.items()},
                                {posixpath.join(pair[name], r) for r in links[name]})[1]
                 for name, t in (("train", train_tree), ("val", val_tree))}
        train, val, note, rule = split["train"], split["val"], PAIR_NOTE, "folders"
    else:
        linked: set[str] = set()
        t = tree(root, listing, linked)
        _refuse_empty(root, t)
        classes = list(t)
        rels, samples = _samples(root, dict(enumerate(t.values())), linked)
        train, val = stratified_split(samples, val_fraction, seed, rels=rels)
        note = (f"split: {val_fraction:g} of each class for validation by a hash of its path and --seed (no train/ "
                "and val/ folders)")
        rule = "hash"
    if len(classes) < 2:
        raise ImageFolderError(f"{root} (an ImageFolder): found {len(classes)} class folder(s) {classes}; a "
                               "classifier needs at least two: put each class's images in a folder of its own")
    if not train:
        raise ImageFolderError(f"{root} (an ImageFolder): no training images after the split; lower --val-fraction")
    return Manifest(root, classes, train, val, note=note, split_rule=rule)


def _samples(root: Path, by_class: dict[int, list[str]], links: set[str]) -> tuple[np.ndarray, Samples]:
    """(the relative paths, the Samples) of {class index: files relative to root}, as columns."""
    rels = strings([r for files in by_class.values() for r in files])
    labels = np.repeat(np.array(list(by_class), dtype=np.int32), [len(f) for f in by_class.values()])
    linked = member(rels, links) if links else None
    return rels, Samples(absolute_paths(root, rels, linked), labels)


# -- S3 --------------------------------------------------------------------------------------------
def sync_image_folder(uri: str, dest: Path, *, workers: int, progress: bool = True) -> tuple[SyncStats, list[str]]:
    """Sync the images of the ImageFolder at an s3:// prefix into `dest` (only image files below a folder)
    and record the listing beside them; returns the sync's stats and the listing (keys relative to the prefix)."""
    stats, names = sync_files(uri, dest, keep=lambda k: "/" in k and is_image_name(k), workers=workers,
                              progress=progress)
    if not names:
        raise SyncError(f"{uri} holds no images in class folders (an ImageFolder needs PREFIX/CLASS/IMAGE, images "
                        f"ending in {', '.join(IMG_EXTENSIONS)})")
    write_atomic(dest / LISTING_NAME, json.dumps({"files": names}))
    return stats, names


# -- the dataset.tsv the folder implies -----------------------------------------------------------
def implied_manifest(root: Path | str) -> tuple[str, list[str]]:
    """(the text of the dataset.tsv the ImageFolder at `root` implies, notes for the user). Columns image_path
    and label (the class folder), and split for ImageNet's layout; empty class folders are left out (noted)."""
    root = Path(root)
    pair = _pair(root, None)
    notes, rows = [], []
    parts = [(pair[name], name) for name in ("train", "val")] if pair else [("", None)]
    seen: dict = {}
    for folder, split in parts:
        t = tree(root / folder if folder else root, seen=seen, split=split or "")
        empty = [c for c, files in t.items() if not files]
        if empty:
            notes.append(f"left out {len(empty)} class folder(s) without images: {', '.join(empty[:5])}")
        for c, files in t.items():
            for rel in files:
                path = posixpath.join(folder, rel) if folder else rel
                rows.append((path, c) if split is None else (path, c, split))
    bad = [r[0] for r in rows if any(ch in r[0] or ch in r[1] for ch in "\t\r\n")]
    if bad:
        raise ImageFolderError(f"{root}: {len(bad)} path(s) hold a tab or a line break, which a dataset.tsv cannot "
                               f"hold, e.g. {bad[0]!r}; rename them")
    labels = {r[1] for r in rows}
    if len(labels) >= 2 and sort_classes(labels) != sorted(labels):
        notes.append("the class names are numbers: dataset.tsv orders them as numbers (2 before 10), the ImageFolder "
                     "(as torchvision) as text (10 before 2), so the class indices differ between the two")
    if pair:
        notes.append(PAIR_NOTE.replace("split: ", "the split column keeps "))
    header = ["image_path", "label"] + (["split"] if pair else [])
    return "\n".join(["\t".join(header)] + ["\t".join(r) for r in rows]) + "\n", notes


def write_manifest(root: Path | str, *, force: bool) -> tuple[Path, int, list[str]]:
    """Write root/dataset.tsv as the ImageFolder implies it (atomically); an existing one only with `force`.
    Returns (its path, rows, notes)."""
    root = Path(root)
    target = root / MANIFEST_NAME
    if not root.is_dir():
        raise ImageFolderError(f"{root} is not a folder; pass the ImageFolder's root (its class folders inside)")
    if target.exists() and not force:
        raise ImageFolderError(f"{target} exists already; pass --force to replace it with what the folders imply")
    text, notes = implied_manifest(root)
    rows = text.count("\n") - 1
    if not rows:
        raise ImageFolderError(f"{root} holds no class folders of images (CLASS/IMAGE, images ending in "
                               f"{', '.join(IMG_EXTENSIONS)}); nothing to write")
    check()  # a stop asked for while the folders were listed: nothing written
    try:
        write_atomic(target, text)
    except OSError as e:
        raise ImageFolderError(f"cannot write {target} ({e.strerror}); make the folder writable or free space "
                               "there") from None
    return target, rows, notes
