"""The names and rules the input forms are told apart by, from names alone (no image opened, no heavy library
imported, so a data mistake is reported at once): the file names that mark a form, and the ecosystem's own
rules that the forms follow. Which forms there are, in which order they are tried and how each is read is
the registry's (dali_pipe/inputs/).

The rules are the peers' own: torchvision's `find_classes` (class folders sorted as strings), its
IMG_EXTENSIONS (case-insensitive) and its recursive walk; and the split keywords of Hugging Face
datasets' data_files.py (`train-*`, `validation-*`/`val-*`/`dev-*`, `test-*`, words of a file or folder
name). tests/test_forms.py checks both against the libraries themselves.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import UserError

MANIFEST_NAME = "dataset.tsv"
PACKED_NAME = "packed.json"
PROGRESS_NAME = ".pack-progress.json"  # an unfinished pack's (pack.py): its shards are not yet a pack
# torchvision.datasets.folder.IMG_EXTENSIONS: what ImageFolder lists (matched case-insensitively). DALI decodes each
# of these formats; a file that does not hold what its name says is left to the scan.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Hugging Face datasets (data_files.SPLIT_KEYWORDS): the words that name a split in a file or folder name
SPLIT_KEYWORDS = {"train": ("train", "training"), "val": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
_SPLIT_OF = {w: split for split, words in SPLIT_KEYWORDS.items() for w in words}
URL_SCHEMES = ("s3://", "https://", "http://")  # the URLs --data may be (https:// ones name shards)
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # a shard file or object, as webdataset reads them (any case)
SHARD_FOLDERS = ("train", "training", "val", "valid", "validation", "test", "testing")  # looked into for shards
PAIR = {"train": "train", "val": "val", "validation": "val"}  # an ImageFolder pair: train/ and val/ (or validation/)
PAIR_ALSO = {"test"}  # a test/ beside them is left out (training reads train/ and val/)

def is_shard_name(name: str) -> bool:
    """A shard file or object: `.tar`, `.tar.gz` or `.tgz` (any case)."""
    return name.lower().endswith(SHARD_SUFFIXES)


def shard_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(the shard files of a folder: its own, else those of its train/val/test subfolders, sorted; the
    subfolders they came from). Only split-named subfolders are looked into, and names are matched before
    anything is stat'ed: a folder of a million images, or of class folders, costs one listing."""
    def shards(d: Path) -> list[Path]:
        return sorted(p for p in d.iterdir() if is_shard_name(p.name) and not p.name.startswith(".")
                      and (p.is_file() or p.is_symlink()))

    own = shards(folder)
    if own:
        return own, []
    subs = sorted(p for p in folder.iterdir() if p.name.lower() in SHARD_FOLDERS and p.is_dir())
    found = [(d, shards(d)) for d in subs]
    return [p for _, ps in found for p in ps], [d for d, ps in found if ps]


def url_problem(data: str) -> str | None:
    """Why --data, written as a URL, cannot be read; None for a path or a URL of URL_SCHEMES. Neither the
    command of a `pipe:` URL nor the rest of another URL is repeated (either may carry a secret)."""
    if data.startswith("pipe:"):
        return ("--data: a pipe: URL runs a shell command to read each shard, which is not done here; download the "
                "shards and pass their folder, or pass their s3:// or https:// URLs")
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", data)
    if m and not data.startswith(URL_SCHEMES):
        return (f"--data: {m.group(1)}:// URLs are not read; pass a local folder or file, s3://bucket/prefix, or "
                "https:// (http://) shard URLs")
    return None


FILE_SUFFIXES = (".parquet", ".arrow", ".tsv", ".csv", ".json", ".txt") + SHARD_SUFFIXES  # data files, not folders


def names_a_file(uri: str) -> str:
    """For an s3:// --data that holds no form: a hint where its last part names a data file or an image (an
    s3:// --data is a prefix, a folder, never one object); "" otherwise."""
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    if not name.lower().endswith(FILE_SUFFIXES + IMG_EXTENSIONS) or uri.rstrip("/").count("/") < 3:
        return ""
    return (f"; it names a file ({name}), and an s3:// --data is a prefix (a folder): pass "
            f"{uri.rstrip('/').rsplit('/', 1)[0]}, the prefix holding it")


def is_image_name(name: str) -> bool:
    """torchvision's `has_file_allowed_extension(name, IMG_EXTENSIONS)`."""
    return name.lower().endswith(IMG_EXTENSIONS)


def find_classes(directory: Path | str) -> list[str]:
    """torchvision's `find_classes`: the folders directly in `directory` (links to folders too, hidden ones
    too), sorted as strings; their positions are the class indices."""
    return sorted(e.name for e in os.scandir(directory) if _is_dir(e))


def _is_dir(entry: os.DirEntry) -> bool:
    """A folder, or a link to one (a link loop or a dangling link is not: predict's scan lists it)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def split_of(rel: str) -> str | None:
    """The split a Hugging Face data file's path names ("train", "val" or "test"), as datasets reads it: a
    keyword among the words of its file name (words are split at `-._ ` and digits), else of its folders
    (the nearest first); None when none names one."""
    parts = rel.replace("\\", "/").split("/")
    for part in [parts[-1].rsplit(".", 1)[0]] + parts[-2::-1]:
        for word in re.split(r"[-._ 0-9]+", part):
            if word in _SPLIT_OF:
                return _SPLIT_OF[word]
    return None


class LayoutError(UserError):
    """A folder that is almost one of the forms, where reading it as another would train on the wrong thing."""


def pair_val(dirs: set[str], where: str) -> str | None:
    """The name of the validation folder ("val" or "validation") where the folders `dirs` (the visible ones of
    `where`) are ImageNet's layout, train/ and val/ with at most a test/ beside them; None without train/ and
    val/. Any other folder beside them (holdout/, __MACOSX/ from a Mac zip) raises LayoutError: read as an
    ImageFolder of classes, the split names trained as classes, exit 0."""
    val = next((d for d in ("val", "validation") if d in dirs), None)
    if "train" not in dirs or val is None:
        splits = sorted(d for d in dirs if d.lower() in SHARD_FOLDERS)
        if len(splits) >= 2:  # train/ + test/, Train/ + Val/, train/ + valid/: split folders, never classes
            raise LayoutError(f"{where!r} holds the split folders {', '.join(f'{d}/' for d in splits)}, but not "
                              "ImageNet's layout, train/ and val/ (or validation/), lower case, of class folders; "
                              "rename them so, or write a dataset.tsv with a split column")
        return None
    extra = sorted(dirs - set(PAIR) - PAIR_ALSO)
    if {"val", "validation"} <= dirs:
        raise LayoutError(f"{where!r} holds train/ and both val/ and validation/: keep one of them as the "
                          "validation split, and move the other out")
    if extra:
        shown = ", ".join(f"{d}/" for d in extra[:5]) + (f" ... and {len(extra) - 5} more" if len(extra) > 5 else "")
        raise LayoutError(f"{where!r} holds train/ and {val}/ (ImageNet's layout) and beside them {shown}, "
                          f"which {'is' if len(extra) == 1 else 'are'} neither a split nor a class: move "
                          f"{'it' if len(extra) == 1 else 'them'} out of that folder (a test/ there is left out)")
    return val


def pair_folders(root: Path) -> dict[str, Path] | None:
    """{"train": root/train, "val": root/val} when root holds ImageNet's layout (pair_val: it raises on a folder
    beside them that is neither), each holding class folders; else None."""
    try:
        dirs = {e.name for e in os.scandir(root) if _is_dir(e) and not e.name.startswith(".")}
    except OSError:
        return None
    val = pair_val(dirs, str(root))
    if val is None:
        return None
    folders = {"train": root / "train", "val": root / val}
    flat = [name for name, p in folders.items() if not find_classes(p)]
    if flat:
        raise LayoutError(f"{str(root)!r} holds train/ and {val}/, but {', '.join(f'{folders[n].name}/' for n in flat)} "
                          "holds no class folders: ImageNet's layout is train/CLASS/*.jpg and val/CLASS/*.jpg")
    return folders


def parquet_files(root: Path) -> list[str]:
    """The .parquet files of a Hugging Face dataset under `root` (paths relative to it, sorted): in the folder
    itself, in its data/ (the Hub's layout), or in split folders (train/, data/validation/, ...)."""
    found = []

    def add(folder: Path, depth: int) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.name.endswith(".parquet") and os.path.isfile(e.path):
                found.append(os.path.relpath(e.path, root))
            elif depth and _is_dir(e) and (e.name == "data" or split_of(e.name) is not None):
                add(Path(e.path), depth - 1)

    add(root, 2)
    return found


ARROW_SHARD = re.compile(r"data-\d{5}-of-\d{5}\.arrow")  # the files save_to_disk writes, state.json listing them


def is_save_to_disk(root: Path) -> bool:
    """A `Dataset.save_to_disk` folder (state.json + dataset_info.json), or a DatasetDict's (dataset_dict.json). Its
    data files without state.json (a copy that left it out) are refused, naming it: they were called a folder
    holding none of the forms."""
    if (root / "dataset_dict.json").is_file() or ((root / "state.json").is_file() and
                                                  (root / "dataset_info.json").is_file()):
        return True
    if not (root / "state.json").exists():
        try:
            arrow = sorted(e.name for e in os.scandir(root) if ARROW_SHARD.fullmatch(e.name))
        except OSError:
            return False
        if arrow:
            raise LayoutError(
                f"{str(root)!r} holds {arrow[0]}{f' and {len(arrow) - 1} more' if len(arrow) > 1 else ''}, as "
                "Dataset.save_to_disk writes them, but no state.json, which lists them; copy the whole folder again "
                "(state.json and dataset_info.json are beside the .arrow files), or save the dataset again")
    return False


class UnfinishedPackError(UserError):
    """--data is a pack that was stopped before it finished."""


def unfinished_pack(path: Path) -> str | None:
    """Why the folder `path` is no data yet, where it is a stopped pack (its shards so far, no packed.json): read
    as plain shards it trained and evaluated on part of the data, exit 0."""
    if (path / PROGRESS_NAME).is_file() and not (path / PACKED_NAME).is_file():
        return (f"{str(path)!r} is an unfinished pack (its {PROGRESS_NAME} is there, its {PACKED_NAME} is not: the "
                "pack was stopped); rerun the pack command that wrote it, which continues where it stopped, or "
                "delete the folder")
    return None


def local_image_folder(path: Path) -> bool:
    """Whether the local folder `path` is an ImageFolder: ImageNet's train/ + val/ pair (pair_folders: it raises
    on a folder beside them that is neither), or a class folder holding an image at any depth."""
    return bool(pair_folders(path)) or _has_class_with_image(path)


def _has_class_with_image(root: Path) -> bool:
    """Whether a class folder of root holds an image at any depth (a quick look: it stops at the first). Each
    folder is looked into once: os.walk(followlinks=True) went round two links to "." about 2**40 times."""
    seen: set[tuple[int, int]] = set()
    for c in find_classes(root):
        todo = [root / c]
        while todo:
            folder = todo.pop()
            try:
                st = os.stat(folder)
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                entries = list(os.scandir(folder))
            except OSError:
                continue
            if any(is_image_name(e.name) and not _is_dir(e) for e in entries):
                return True
            todo += [Path(e.path) for e in entries if _is_dir(e)]
    return False
