"""Opening a pack (`python -m dali_pipe pack`'s output: packed.json and its shards): its classes, split and
shards as packed.json records them, checked against its structure, and its members checked as others' are
(shards/members.py), the labels within the pack's classes.
"""
from __future__ import annotations

from pathlib import Path

from ..config import DataSettings
from ..s3 import local_target
from ..workdir import remove_dead_temps
from .format import (
    FAST_SUM,
    PACKED_NAME,
    IndexFormatError,
    PackedFormatError,
    parse_packed,
    read_index,
)
from .members import cached_check
from .shardset import Shard, ShardSet, ShardSourceError, progress_bar


def open_packed(data: str, cache_dir: str | Path) -> ShardSet:
    """The pack at --data read from local disk (after `shards.packsync.fetch` for s3://), with its structural
    checks but no check of its members (that is `open_pack(members=True)`)."""
    return open_pack(DataSettings(data=data, cache_dir=str(cache_dir), scan="off"), members=False)


def _pack_root(data: str, cache_dir) -> Path:
    if data.startswith("s3://"):
        return local_target(data, Path(cache_dir))
    return Path(data)


def open_pack(data, *, members: bool, num_threads: int = 1, progress: bool = False) -> ShardSet:
    root = _pack_root(data.data, data.cache_dir)
    remote = data.data.startswith("s3://")
    path = root / PACKED_NAME
    if not path.is_file():
        raise ShardSourceError(f"{path} is missing; pack the data first (python -m dali_pipe pack)")
    try:
        meta = parse_packed(path.read_bytes(), str(path))
    except PackedFormatError as e:
        raise ShardSourceError(str(e)) from None
    classes = list(meta["classes"])
    shards = []
    for split, info in meta["splits"].items():
        listed = info.get("shards", [])
        for s in listed:
            shards.append(_pack_shard(root, s, split, path, data.data.rstrip("/") if remote else None))
        if sum(s["samples"] for s in listed) != info.get("samples"):
            raise ShardSourceError(f"{path}: splits.{split}.samples is {info.get('samples')}, its shards hold "
                                   f"{sum(s['samples'] for s in listed)}; packed.json was edited or damaged: pack "
                                   "the data again")
    if members:
        _check_pack_members(shards, classes, data, num_threads=num_threads, progress=progress)
    unscanned = sum(1 for s in shards if s.path.startswith("s3://"))
    return ShardSet(data.data, "pack", classes, shards, root=root, meta=meta, unscanned=unscanned, split_rule="pack")


def has_local_copy(root: Path, s: dict) -> bool:
    """Whether packed.json's shard `s` lies whole in the pack's folder `root` (for an s3:// pack, what an earlier
    sync left in its local copy): it is then read from there, not fetched."""
    local = root / s["name"]
    return local.is_file() and local.stat().st_size == s["size"]


def _pack_shard(root: Path, s: dict, split: str, packed: Path, prefix: str | None) -> Shard:
    idx = root / s["index"]
    if not idx.is_file():
        raise ShardSourceError(f"{idx} is missing (packed.json lists it for {s['name']}); copy the whole pack "
                               "again, or pack the data again")
    try:
        entries = read_index(idx)
    except (IndexFormatError, UnicodeDecodeError) as e:
        raise ShardSourceError(f"{e}; copy the whole pack again, or pack the data again") from None
    if len(entries) != s["samples"]:
        raise ShardSourceError(f"{packed}: {s['name']} holds {s['samples']} samples by packed.json, but its index "
                               f"{idx.name} lists {len(entries)}; packed.json was edited or damaged: pack the data "
                               "again")
    local = root / s["name"]
    if has_local_copy(root, s):
        where = str(local.resolve())
    elif prefix is not None:
        where = f"{prefix}/{s['name']}"
    else:
        raise ShardSourceError(f"{local} is missing or incomplete ({s['size']} bytes expected); pack again or copy "
                               "the whole pack")
    keys = [e.key for e in entries]
    paths = s.get("image_paths") or keys
    if len(paths) != len(keys):
        raise ShardSourceError(f"{packed}: {s['name']} lists {len(paths)} image_paths for {len(keys)} samples; "
                               "pack the data again")
    end = max((off + size for e in entries for off, size in e.members.values()), default=0)
    if local.is_file() and end > local.stat().st_size:
        raise ShardSourceError(f"{idx} points past the end of {local.name} ({end} > {local.stat().st_size} bytes); "
                               "the index does not belong to this shard: copy the whole pack again")
    return Shard(s["name"], where, str(idx.resolve()), s.get("size"), s.get("sha256"), keys, list(paths),
                 [None] * len(keys), split=[split] * len(keys), xxh3=s.get(FAST_SUM))


def _check_pack_members(shards: list[Shard], classes: list[str], data, *, num_threads: int, progress: bool) -> None:
    """Each local shard's .cls (an error when outside the classes) and, with --scan, its images."""
    level = data.scan
    remove_dead_temps(Path(data.cache_dir) / "shards", ".*.tmp-*")  # what a writer killed with -9 left half written
    bar = progress_bar(len(shards), "check pack", progress)
    for s in shards:
        if s.path.startswith("s3://"):
            bar.update(1)
            continue
        checked = cached_check(s, Path(data.cache_dir), level, data.max_pixels, num_threads)
        for e, raw_problem in {**checked["labels"], **checked["problems"]}.items():
            raise ShardSourceError(f"{s.name}: sample {s.keys[int(e)]!r} {raw_problem} (in {s.index_path}); the pack "
                                   "is damaged: pack the data again")
        recorded = s.image_paths if s.image_paths != s.keys else [None] * len(s.keys)  # packed/1: no image_paths
        for e, (said, listed) in enumerate(zip(checked.get("paths") or [None] * len(s.keys), recorded)):
            if said is not None and listed is not None and said != listed:
                raise ShardSourceError(
                    f"{s.name}: sample {e + 1} of its index {s.index_path} is {said!r} by its json member, but "
                    f"packed.json lists {listed!r} there; the index or packed.json does not belong to this shard: copy "
                    "the whole pack again, or pack the data again")
        for e, c in enumerate(checked["cls"]):
            if c is not None and c >= len(classes):
                raise ShardSourceError(
                    f"{s.name}: sample {s.keys[e]!r} has class {c}, but packed.json lists {len(classes)} classes "
                    f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''}); packed.json does not belong "
                    "to these shards: pack the data again")
        s.cls = checked["cls"]
        if level != "off":
            s.bad = {int(e): r for e, r in checked["images"].items()}
        bar.update(1)
    bar.close()
