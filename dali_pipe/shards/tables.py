"""Hugging Face datasets as a data source: Parquet files and save_to_disk folders, read as shards.

`--data` holds a dataset as Hugging Face `datasets` writes it:

- Parquet: `Dataset.to_parquet(...)`, or a Hub repository's `data/train-00000-of-00004.parquet`, ... (found
  where `forms.parquet_files` looks: the folder, its data/, its split folders), or one such file;
- save_to_disk: `state.json` + `dataset_info.json` + `data-00000-of-00001.arrow` (Arrow IPC streams), or a
  DatasetDict's `dataset_dict.json` with one such folder per split;
- the same on s3://bucket/prefix: the files are synced to the cache dir first (ranged parallel GETs,
  skipped when unchanged), then read from there.

Each Parquet row group, and each record batch of an Arrow file, is one shard of the epoch plan
(dali_pipe/shards/plan.py): the shard reader reads a group's image column whole when the plan first
needs it and hands DALI each row's encoded bytes undecoded, as it does a tar member's, so the plan's
order, the exact resume and the checks are the shards' own (`samples.TableGroup`). `datasets` writes
100 images per row group; a file written with far larger groups costs their size in memory, times the
plan's window (16 groups in progress).

Columns. The image column: --image-column, else the one column of datasets' `Image` type (a struct of
`bytes` and `path`; the schema's `huggingface` metadata says so), else the one such struct. The label
column: --label-column, else the one `ClassLabel` column, else the one named `label` or `labels`. Several
candidates are an error naming them and the setting. Classes: the ClassLabel's names (all of them, in
their order, so indices are the dataset's), else the label values (integers in numeric order, text as
dataset.tsv orders labels).

Split: from the file names, with the keywords datasets itself uses (`forms.split_of`: train-*,
validation-*/val-*/dev-*, test-*; or the split folders of a DatasetDict). Training reads train and
validation; test files are held out (evaluate --split test). With no validation file, --val-fraction of
the training rows go to validation by a hash of each row's key (FILE:ROW) and --seed, as for shards.

Checked before training, verdicts cached by file (path, size, mtime) in CACHE_DIR/shards: each file's
sha256 and XXH3-128 (so the run's fingerprint covers the bytes and `cache.verify_local` checks them again
cheaply), and of a Parquet file the XXH3-128 of each row group's image bytes, which the shard reader hashes again
before it first reads the group (an Arrow file: the whole file, at its first batch), so a file changed in place
with its size and mtime kept cannot dodge the check,
each row's label (null or -1: left out) and image (no bytes, or the scan's fast checks; with --scan full
a decode with DALI's CPU decoder). Bad rows are left out through `Shards.excluded` and listed in
bad_images.tsv (image_path: the image's path field, else FILE:ROW), under --max-bad-fraction.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..forms import is_save_to_disk, parquet_files, split_of
from ..manifest import sort_classes
from ..s3 import local_target, parse_s3_uri
from ..samples import TableGroup
from ..scan import DaliDecoder, check_bytes
from ..sync import engine_for, listing, sync_objects
from ..tsv import safe_relpath
from ..workdir import atomic, remove_dead_temps
from .format import file_sums
from .listing import parquet_keys
from .members import LEVELS, cache_file, load_json
from .reader import TableFiles, hash_span
from .shardset import Shard, ShardSet, progress_bar, write_file
from .source import unit_hash
from .verdicts import Verdicts, verdict_key

CHECK_VERSION = 4  # bump when what the check records changes (2: row groups bounded by GROUP_MAX; 3: xxh3;
# 4: each Parquet group's image bytes hashed)
GROUP_MAX = 1 << 30  # bytes: a Parquet row group larger than this (uncompressed) is refused before it is read


class TableSourceError(UserError):
    """A Hugging Face dataset that cannot be read as it is; the message names the file or column and the fix."""


@dataclass
class TableFile:
    rel: str  # relative to the dataset root (messages, keys)
    path: str  # absolute local path
    fmt: str  # "parquet" or "arrow"
    split: str | None  # "train", "val" or "test" as its name says; None: unnamed


# -- which files -----------------------------------------------------------------------------------
def list_tables(root: Path) -> list[TableFile]:
    """The data files of the Hugging Face dataset at the local folder `root` (or the one Parquet file), in order."""
    if root.is_file():
        return [TableFile(root.name, str(root.resolve()), "parquet", split_of(root.name))]
    if is_save_to_disk(root):
        if (root / "dataset_dict.json").is_file():
            splits = _json(root / "dataset_dict.json").get("splits") or []
            parts = [(root / name, name, split_of(name) or ("train" if len(splits) == 1 else None)) for name in splits]
        else:
            parts = [(root, "", None)]
        out = []
        for folder, name, split in parts:
            if name and not (folder / "state.json").is_file():  # (it said "cannot be read as JSON ([Errno 2] ...")
                raise TableSourceError(
                    f"{folder / 'state.json'} is missing: {root / 'dataset_dict.json'} lists the split {name!r}, "
                    f"whose folder save_to_disk writes with a state.json listing its .arrow files; copy the whole "
                    f"{root} again, or save the dataset again (DatasetDict.save_to_disk)")
            state = _json(folder / "state.json")
            files = [f.get("filename") for f in state.get("_data_files") or []]
            if not files or not all(isinstance(f, str) for f in files):
                raise TableSourceError(f"{folder / 'state.json'} lists no data files (_data_files); save the dataset "
                                       "again (Dataset.save_to_disk)")
            for f in files:
                rel = f"{name}/{f}" if name else f
                if not (folder / f).is_file():
                    raise TableSourceError(f"{folder / f} is missing (state.json lists it); copy the whole "
                                           "save_to_disk folder again")
                out.append(TableFile(rel, str((folder / f).resolve()), "arrow", split))
        return out
    return [TableFile(rel, str((root / rel).resolve()), "parquet", split_of(rel)) for rel in parquet_files(root)]


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TableSourceError(f"{path} cannot be read as JSON ({e}); save the dataset again") from None
    return value if isinstance(value, dict) else {}


def sync_tables(uri: str, cache_dir: str | Path, *, workers: int) -> Path:
    """Bring the Hugging Face dataset at an s3:// prefix into the cache dir; returns the local folder."""
    local = local_target(uri, Path(cache_dir))
    download_tables(uri, local, workers=workers)
    return local


def download_tables(uri: str, dest: str | Path, *, workers: int, progress: bool = True):
    """Download the Hugging Face dataset at an s3:// prefix into `dest`: its data files and the JSON beside
    them (what `list_tables` reads)."""
    bucket, prefix = parse_s3_uri(uri)
    base = f"{prefix}/" if prefix else ""
    dest = Path(dest)
    with engine_for(None, workers) as engine:  # one LIST serves both: what to fetch, and their sizes and ETags
        remote = listing(engine, bucket, base)
        keys = list(remote)
        meta = [k for k in keys if k.rsplit("/", 1)[-1] in ("dataset_dict.json", "state.json", "dataset_info.json")]
        saved = "dataset_dict.json" in keys or {"state.json", "dataset_info.json"} <= set(keys)  # (is_save_to_disk)
        names = meta + [k for k in keys if k.endswith(".arrow")] if saved else parquet_keys(keys) + meta
        if not names:
            raise TableSourceError(f"{uri} holds no .parquet files and no save_to_disk files")
        for name in names:
            try:
                outside = safe_relpath(name, dest) != name
            except ValueError:
                outside = True
            if outside:  # ('..', '.' or '//' in its key)
                raise TableSourceError(f"{uri}: the key {name!r} would land outside {dest} or under another name; "
                                       "rename it. Nothing was downloaded.")
        for name in names:  # the Hub's data/ and a DatasetDict's split folders
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
        return sync_objects(uri, dest, names, workers=workers, progress=progress, engine=engine, remote=remote)


# -- columns and classes ---------------------------------------------------------------------------
def _features(schema, root: Path, f: TableFile) -> dict:
    """datasets' features of a file: its schema's `huggingface` metadata, else dataset_info.json beside it."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw:
        try:
            info = json.loads(raw).get("info") or {}
            if isinstance(info.get("features"), dict):
                return info["features"]
        except ValueError:
            pass
    beside = Path(f.path).parent / "dataset_info.json"
    if beside.is_file():
        features = _json(beside).get("features")
        if isinstance(features, dict):
            return features
    return {}


def _kind(feature) -> str | None:
    return feature.get("_type") if isinstance(feature, dict) else None


def choose_columns(schema, features: dict, image_column: str | None, label_column: str | None, where: str):
    """(image column, label column, ClassLabel names or None)."""
    import pyarrow as pa

    names = list(schema.names)

    def imageish(n: str) -> bool:
        t = schema.field(n).type
        return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0

    if image_column is not None:
        if image_column not in names:
            raise TableSourceError(f"{where}: --image-column {image_column!r} is not a column (columns: {names})")
        t = schema.field(image_column).type
        if not (imageish(image_column) or pa.types.is_binary(t) or pa.types.is_large_binary(t)):
            raise TableSourceError(f"{where}: --image-column {image_column!r} holds {t}, not images (datasets' Image: "
                                   "a struct of bytes and path, or binary)")
        image = image_column
    else:
        typed = [n for n in names if _kind(features.get(n)) == "Image"] or [n for n in names if imageish(n)]
        if len(typed) != 1:
            what = f"several image columns ({', '.join(typed)})" if typed else "no image column (datasets' Image type)"
            raise TableSourceError(f"{where} (a Hugging Face dataset) has {what}; pass --image-column NAME "
                                   f"(columns: {', '.join(names)})")
        image = typed[0]
    if label_column is not None:
        if label_column not in names:
            raise TableSourceError(f"{where}: --label-column {label_column!r} is not a column (columns: {names})")
        label = label_column
    else:
        typed = [n for n in names if _kind(features.get(n)) == "ClassLabel"]
        named = [n for n in names if n in ("label", "labels")]
        found = typed or named
        if len(found) != 1:
            what = (f"several label columns ({', '.join(found)})" if found else
                    "no label column (no ClassLabel, none named label or labels)")
            raise TableSourceError(f"{where} (a Hugging Face dataset) has {what}; pass --label-column NAME "
                                   f"(columns: {', '.join(n for n in names if n != image)})")
        label = found[0]
    feature = features.get(label)
    class_names = feature.get("names") if _kind(feature) == "ClassLabel" else None
    return image, label, (list(map(str, class_names)) if isinstance(class_names, list) else None)


# -- the check of one file (cached) ------------------------------------------------------------------
def _schema(f: TableFile):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if f.fmt == "parquet":
            return pq.read_schema(f.path)
        with pa.memory_map(f.path) as source:
            return pa.ipc.open_stream(source).schema
    except (pa.ArrowException, OSError) as e:
        raise TableSourceError(f"{f.rel}: not a readable {'Parquet' if f.fmt == 'parquet' else 'Arrow'} file ({e}); "
                               "check the file, or leave it out") from None


def _groups(f: TableFile, files: TableFiles) -> int:
    if f.fmt == "parquet":
        return check_row_groups(files.handle(f.path, "parquet").metadata, f.rel)
    return len(files.handle(f.path, "arrow"))  # memory-mapped: a batch is read where it lies, never copied


def check_row_groups(metadata, rel: str, most: int = GROUP_MAX) -> int:
    """The number of row groups of a Parquet file, each of which is read whole into memory (its label and image
    columns): one whose metadata says it holds more than `most` bytes uncompressed is refused before it is read,
    naming the file, the group and the fix. (Each page of a group is bounded by the format itself: 2 GiB.)"""
    for g in range(metadata.num_row_groups):
        size = metadata.row_group(g).total_byte_size
        if size > most:
            raise TableSourceError(
                f"{rel}: row group {g} holds {size} bytes uncompressed (as its metadata says), over the "
                f"{most >> 20} MiB a row group may hold in memory; write the file with smaller row groups "
                "(pyarrow.parquet.write_table(table, path, row_group_size=1000), or datasets' to_parquet(path, "
                "batch_size=1000))")
    return metadata.num_row_groups


def _labels_and_paths(f: TableFile, files: TableFiles, group: int, image: str, label: str):
    """(raw label values, the image path field per row) of one group."""
    import pyarrow as pa
    import pyarrow.compute as pc

    handle = files.handle(f.path, f.fmt)
    if f.fmt == "parquet":
        t = handle.read_row_group(group, columns=[label, image])
        lab, img = t.column(label), t.column(image)
    else:
        lab, img = handle[group].column(label), handle[group].column(image)
    lab = lab.combine_chunks() if isinstance(lab, pa.ChunkedArray) else lab
    if not (pa.types.is_integer(lab.type) or pa.types.is_string(lab.type) or pa.types.is_large_string(lab.type)):
        raise TableSourceError(f"{f.rel}: the label column {label!r} holds {lab.type}; labels are integers or text "
                               "(pass another --label-column)")
    img = img.combine_chunks() if isinstance(img, pa.ChunkedArray) else img
    paths = (pc.struct_field(img, "path").to_pylist() if pa.types.is_struct(img.type) and
             img.type.get_field_index("path") >= 0 else [None] * len(img))
    return lab.to_pylist(), paths


def check_file(f: TableFile, root: Path, data, files: TableFiles, decoder) -> dict:
    """The check of one file, cached by (path, size, mtime, columns, level): its sha256, groups, per row the
    raw label, the image path field and problems."""
    st = os.stat(f.path)
    level = "fast" if data.scan == "off" else data.scan
    identity = f"table\0{f.path}\0{st.st_size}\0{st.st_mtime_ns}"
    cache = cache_file(Path(data.cache_dir), identity, ".table.json")
    schema = _schema(f)
    image, label, class_names = choose_columns(schema, _features(schema, root, f), data.image_column,
                                               data.label_column, f.rel)
    checked = load_json(cache)
    if (checked and checked.get("version") == CHECK_VERSION and checked.get("columns") == [image, label]
            and LEVELS[checked["level"]] >= LEVELS[level] and checked["max_pixels"] == data.max_pixels
            and not _files_changed(checked.get("files_read", {}))):
        return checked
    files.files_read = {}
    try:
        checked = _check_groups(f, files, decoder, data, image, label)
    except (OSError, pa_errors()) as e:
        raise TableSourceError(f"{f.rel} (a Hugging Face dataset's {'Parquet' if f.fmt == 'parquet' else 'Arrow'} "
                               f"file) cannot be read: {str(e).strip()[:200]}; it is damaged: download or write it "
                               "again, or leave it out of --data") from None
    sha256, fast = file_sums(f.path)
    checked.update(version=CHECK_VERSION, columns=[image, label], class_names=class_names, level=level,
                   max_pixels=data.max_pixels, sha256=sha256, xxh3=fast, size=st.st_size,
                   files_read={k: list(v) for k, v in files.files_read.items()})
    write_file(cache, json.dumps(checked))
    return checked


def _files_changed(files_read: dict) -> bool:
    """Whether an image file that rows of a table name by path (read by the check) is gone or has another size
    or mtime since: the table is then checked again (as a folder's images are)."""
    for path, (size, mtime) in files_read.items():
        try:
            st = os.stat(path)
        except OSError:
            return True
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            return True
    return False


def pa_errors():
    import pyarrow as pa

    return pa.ArrowException


def image_span(metadata, group: int, image: str) -> tuple[int, int]:
    """(start, end) in the file of the column chunks of `image` (a struct's leaves too) in row group `group`:
    what pyarrow reads to give the reader that group's image bytes."""
    rg = metadata.row_group(group)
    spans = []
    for j in range(rg.num_columns):
        c = rg.column(j)
        if c.path_in_schema == image or c.path_in_schema.startswith(f"{image}."):
            start = c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else \
                c.data_page_offset
            spans.append((start, start + c.total_compressed_size))
    return min(a for a, _ in spans), max(b for _, b in spans)


def _check_groups(f: TableFile, files: TableFiles, decoder, data, image: str, label: str) -> dict:
    """Each group's rows, raw labels, image path fields and problems; a Parquet group's image span, hashed."""
    rows, labels, paths, problems, spans = [], [], [], {}, []
    if f.fmt == "parquet":
        metadata = files.handle(f.path, "parquet").metadata
        with open(f.path, "rb") as raw:
            for g in range(metadata.num_row_groups):
                start, end = image_span(metadata, g, image)
                spans.append([start, end, hash_span(raw.fileno(), start, end)])
    for g in range(_groups(f, files)):
        values, names = _labels_and_paths(f, files, g, image, label)
        data_bytes, offsets = files.read(f.path, f.fmt, g, image)
        start = len(labels)
        batch = {}
        for i in range(len(values)):
            blob = data_bytes[offsets[i]:offsets[i + 1]].tobytes()
            row = start + i
            if not blob:
                problems[row] = (f"no image bytes in column {image!r}" +
                                 (f" and no file at its path {names[i]!r}" if names[i] else ""))
                continue
            reason = check_bytes(blob, data.max_pixels)
            if reason:
                problems[row] = reason
            elif decoder is not None:
                batch[row] = blob
        if batch:
            problems.update(decoder.decode(batch))
        rows.append(len(values))
        labels += values
        paths += names
    return {"groups": rows, "labels": labels, "paths": paths, "problems": {str(k): v for k, v in problems.items()},
            "spans": spans or None}


# -- opening ---------------------------------------------------------------------------------------
def open_tables(data, *, num_threads: int = 1, progress: bool = False) -> ShardSet:
    """The Hugging Face dataset at --data (local, or an s3:// prefix already synced by `prepare_tables`), checked."""
    root = local_target(data.data, Path(data.cache_dir)) if data.data.startswith("s3://") else Path(data.data)
    listed = list_tables(root)
    kind = "arrow" if listed and listed[0].fmt == "arrow" else "parquet"
    if not listed:
        raise TableSourceError(f"--data {data.data!r} (a Hugging Face dataset) holds no .parquet or .arrow files")
    remove_dead_temps(Path(data.cache_dir) / "shards", ".*.tmp-*")
    files = TableFiles()
    decoder = DaliDecoder(num_threads) if data.scan == "full" else None
    bar = progress_bar(len(listed), "check tables", progress)
    checks = []
    for f in listed:
        checks.append(check_file(f, root, data, files, decoder))
        bar.update(1)
    bar.close()
    files.close()
    verdicts = Verdicts(data.cache_dir)  # the check hashed each file: verify_local needs only a stat
    for f, c in zip(listed, checks):
        if os.stat(f.path).st_size == c["size"]:
            verdicts.record(f.path, verdict_key(c["sha256"], c["xxh3"]))
    verdicts.save()
    same_labels(data.data, listed, checks)
    named = {tuple(c["class_names"]) for c in checks if c["class_names"] is not None}
    classes, index = _classes(listed, checks, named)
    shards = []
    for f, c in zip(listed, checks):
        problems = {int(k): v for k, v in c["problems"].items()}
        start = 0
        for g, n in enumerate(c["groups"]):
            keys = [f"{f.rel}:{start + i}" for i in range(n)]
            cls, bad = [], {}
            for i in range(n):
                row = start + i
                value = c["labels"][row]
                position = index.get(value) if value is not None else None
                if position is None:
                    bad[i] = ("no label (ClassLabel -1)" if value == -1 else "no label" if value is None else
                              f"label {value!r} is not one of the ClassLabel's {len(classes)} names")
                elif row in problems:
                    bad[i] = problems[row]
                cls.append(position)
            group = TableGroup(f.fmt, g, c["columns"][0], tuple(-1 if x is None else x for x in cls),
                               span=tuple(c["spans"][g]) if c.get("spans") else None)
            shards.append(Shard(f"{f.rel} ({'row group' if f.fmt == 'parquet' else 'batch'} {g})", f.path,
                                f"{f.path}#{g}", c["size"], c["sha256"], keys,
                                [c["paths"][start + i] or keys[i] for i in range(n)], cls, bad, group=group,
                                xxh3=c["xxh3"]))
            start += n
    note = _split(shards, listed, data)
    how = "classes named by the ClassLabel" if named else "classes are the label values"
    rule = "names" if any(f.split == "val" for f in listed) else "hash"  # as _split made it
    return ShardSet(data.data, kind, classes, shards, note=f"{how}; {note}", split_rule=rule)


def _label_kind(check: dict) -> tuple:
    if check["class_names"] is not None:
        return ("ClassLabel", *check["class_names"])
    return ("text",) if any(isinstance(v, str) for v in check["labels"]) else ("integers",)


def _said(kind: tuple, check: dict) -> str:
    names = kind[1:]
    if kind[0] == "ClassLabel":
        return f"a ClassLabel of {len(names)} names ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
    if kind[0] == "text":
        values = [repr(v) for v in dict.fromkeys(check["labels"]) if v is not None][:3]
        return f"text labels ({', '.join(values)}, ...)"
    return "integer labels without a ClassLabel"


def same_labels(data: str, listed: list[TableFile], checks: list[dict]) -> None:
    """The files' labels must be one dataset's: one ClassLabel (integers without one are its indices), or text
    alone, or integers alone. Files written from two Datasets were trained on with their labels mixed (text with
    integers as classes '0'..'3' beside 'cat') or listed every row of one file as bad ("label 'cat' is not one of
    the ClassLabel's names", where 'cat' was one); refused here, naming the files of each kind."""
    kinds: dict[tuple, list[int]] = {}
    for i, c in enumerate(checks):
        kinds.setdefault(_label_kind(c), []).append(i)
    named = [k for k in kinds if k[0] == "ClassLabel"]  # (integers beside one: its indices)
    if len(named) <= 1 and len(kinds) - (("integers",) in kinds and bool(named)) <= 1:
        return
    parts = [f"{listed[files[0]].rel}{f' (and {len(files) - 1} more)' if len(files) > 1 else ''}: "
             f"{_said(kind, checks[files[0]])}" for kind, files in kinds.items()]
    raise TableSourceError(f"--data {data!r}: its files hold the labels of different datasets; " + "; ".join(parts)
                           + ". Write them again from one Dataset, its label column cast to one ClassLabel "
                           f"(ds.cast_column({checks[0]['columns'][1]!r}, ClassLabel(names=[...])) in datasets), or "
                           "pass --data the files of one dataset")


def _classes(listed, checks, named) -> tuple[list[str], dict]:
    """(class names, raw label value -> class position)."""
    if named:
        names = list(next(iter(named)))
        return names, {i: i for i in range(len(names))}
    values = {v for c in checks for v in c["labels"] if v is not None}
    if any(isinstance(v, str) for v in values):
        classes = sort_classes(str(v) for v in values)
        position = {c: i for i, c in enumerate(classes)}
        return classes, {v: position[str(v)] for v in values}
    ordered = sorted(values)
    return [str(v) for v in ordered], {v: i for i, v in enumerate(ordered)}


def _split(shards: list[Shard], listed: list[TableFile], data) -> str:
    """Set each shard's split from its file's name; the hash rule where no file names validation. Returns
    the note the start-up summary prints."""
    by_path = {f.path: f for f in listed}
    has_val = any(f.split == "val" for f in listed)
    for s in shards:
        split = by_path[s.path].split
        if split in ("val", "test"):
            s.split = [split] * len(s.keys)
        elif has_val:
            s.split = ["train"] * len(s.keys)
        else:
            s.split = ["val" if unit_hash(k, data.seed) < data.val_fraction else "train" for k in s.keys]
    test = " (test files held out)" if any(f.split == "test" for f in listed) else ""
    if has_val:
        return f"split: the files' names (train, validation){test}"
    return f"split: {data.val_fraction:g} of the training rows by a hash of FILE:ROW and --seed{test}"


def prepare_tables(data, *, num_threads: int, workers: int) -> ShardSet:
    """Once per node: sync an s3:// dataset to the cache dir, then check every file."""
    if data.data.startswith("s3://"):
        sync_tables(data.data, data.cache_dir, workers=workers)
    return open_tables(data, num_threads=num_threads, progress=True)


def extract(shards: ShardSet, cache_dir: str | Path) -> dict[tuple[int, int], tuple[str, int, int]]:
    """For `pack`: the usable images of a table ShardSet written once into flat files in CACHE_DIR/shards (one
    per data file), so that each can be read as (path, offset, size) like a tar member, in any order.
    Returns {(shard position, entry): (path, offset, size)}."""
    out, files = {}, TableFiles()
    by_file: dict[str, list[int]] = {}
    for i, s in enumerate(shards.shards):
        by_file.setdefault(s.path, []).append(i)
    for path, positions in by_file.items():
        st = os.stat(path)
        blob = cache_file(Path(cache_dir), f"blob\0{path}\0{st.st_size}\0{st.st_mtime_ns}", ".bin")
        spans, offset = {}, 0
        with atomic(blob) as tmp:
            with open(tmp, "wb") as out_f:
                for i in positions:
                    s = shards.shards[i]
                    data, offsets = files.read(s.path, s.group.fmt, s.group.group, s.group.column)
                    for e in range(len(s.keys)):
                        if e in s.bad:
                            continue
                        chunk = data[offsets[e]:offsets[e + 1]]
                        out_f.write(chunk.tobytes())
                        spans[(i, e)] = (offset, len(chunk))
                        offset += len(chunk)
        out.update({k: (str(blob), off, size) for k, (off, size) in spans.items()})
    files.close()
    print(f"pack: the images of {len(by_file)} table file(s) unpacked into {Path(cache_dir) / 'shards'} for "
          "packing", file=sys.stderr)
    return out
