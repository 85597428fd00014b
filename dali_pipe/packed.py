"""A packed dataset as a data source: find it (local or s3://), fetch what is needed, and describe
it to the pipeline as `Shards`.

`--data DIR` holding packed.json, or `--data s3://bucket/prefix` with packed.json there, is packed.
From S3, with `--packed-s3 auto` (the default), the shards are synced to the cache dir when its
disk has room for them (plus 1 GiB), with parallel ranged GETs; otherwise they are streamed: DALI
reads the tars from S3 itself (`readers.webdataset(paths=["s3://..."])`), and only the small index
files are fetched. `sync` and `stream` force one route.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError
from .pack import FORMAT, PACKED_NAME
from .pipeline import Shards

HEADROOM = 1 << 30  # free space left on the cache disk after syncing a pack


class PackedError(UserError):
    """The packed dataset is unreadable or incomplete; the message names the file."""


@dataclass
class PackedSet:
    """What a run reads from a pack (the same questions a Manifest answers)."""
    root: Path  # local folder holding packed.json and the index files
    classes: list[str]
    train: Shards
    val: Shards
    meta: dict
    missing: list[str] = field(default_factory=list)

    def digest(self) -> str:
        h = hashlib.sha256(json.dumps([self.classes, self.meta["splits"]], sort_keys=True).encode())
        return h.hexdigest()[:16]

    def without(self, bad) -> "PackedSet":
        return self  # bad images were left out when packing


def is_packed(data: str, cache_dir: str | Path | None = None) -> bool:
    """Whether --data is a pack (an s3:// prefix is asked once, then remembered in the cache dir)."""
    if data.startswith("s3://"):
        from .sync import local_target

        if cache_dir is not None:
            local = local_target(data, Path(cache_dir))
            if (local / PACKED_NAME).is_file():
                return True
            if (local / "dataset.tsv").is_file():  # synced as plain files before: no need to ask S3 again
                return False
        return _remote_packed_json(data) is not None
    return (Path(data) / PACKED_NAME).is_file()


def _remote_packed_json(uri: str) -> bytes | None:
    from botocore.exceptions import BotoCoreError, ClientError

    from .sync import explain, make_client, parse_s3_uri

    bucket, prefix = parse_s3_uri(uri)
    key = f"{prefix}/{PACKED_NAME}" if prefix else PACKED_NAME
    try:
        return make_client(1).get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return None
        from .sync import SyncError

        raise SyncError(explain(e, bucket, key)) from None
    except BotoCoreError as e:
        from .sync import SyncError

        raise SyncError(explain(e, bucket, key)) from None


def fetch(data: str, cache_dir: str | Path, *, mode: str, workers: int, progress: bool = True) -> Path:
    """Make the pack readable from local disk: its packed.json and index files always, its shards
    when `mode` (auto|sync|stream) says so. Returns the local folder."""
    if not data.startswith("s3://"):
        return Path(data)
    from .sync import local_target

    return fetch_to(data, local_target(data, Path(cache_dir)), mode=mode, workers=workers, progress=progress)


def fetch_to(data: str, local: Path, *, mode: str, workers: int, progress: bool = True) -> Path:
    """`fetch` into a given folder (`python -m dali_pipe sync` of a pack)."""
    from .sync import sync_objects

    local.mkdir(parents=True, exist_ok=True)
    raw = _remote_packed_json(data)
    if raw is None:
        raise PackedError(f"{data} has no {PACKED_NAME}; pack it first (python -m dali_pipe pack)")
    meta = _parse(raw, f"{data}/{PACKED_NAME}")
    shards = [s for split in meta["splits"].values() for s in split["shards"]]
    total = sum(s["size"] for s in shards)
    free = shutil.disk_usage(local).free + sum((local / s["name"]).stat().st_size for s in shards
                                               if (local / s["name"]).is_file())
    if mode == "auto":
        mode = "sync" if free >= total + HEADROOM else "stream"
        if progress and mode == "stream":
            print(f"packed data: {total / 1e9:.1f} GB of shards do not fit in {local} ({free / 1e9:.1f} GB free); "
                  "reading them from S3 as needed", file=sys.stderr)
    names = [s["index"] for s in shards] + ([s["name"] for s in shards] if mode == "sync" else [])
    sync_objects(data, local, names, workers=workers, progress=progress)
    (local / PACKED_NAME).write_bytes(raw)  # last: the local copy is complete
    return local


def _parse(raw: bytes, where: str) -> dict:
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise PackedError(f"{where} is not valid JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise PackedError(f"{where} is not a pack this version reads (format {meta.get('format')!r}, expected "
                          f"{FORMAT!r}); pack the data again")
    return meta


def open_packed(data: str, cache_dir: str | Path) -> PackedSet:
    """The pack at --data, read from local disk (after `fetch` for s3://). Shards missing locally are
    read from S3 (the streaming route)."""
    from .sync import local_target

    remote = data.startswith("s3://")
    root = local_target(data, Path(cache_dir)) if remote else Path(data)
    path = root / PACKED_NAME
    if not path.is_file():
        raise PackedError(f"{path} is missing; pack the data first (python -m dali_pipe pack)")
    meta = _parse(path.read_bytes(), str(path))
    prefix = data.rstrip("/")

    def shards(split: str) -> Shards:
        listed = meta["splits"].get(split, {"shards": []})["shards"]
        paths = []
        for s in listed:
            local = root / s["name"]
            if local.is_file() and local.stat().st_size == s["size"]:
                paths.append(str(local.resolve()))
            elif remote:
                paths.append(f"{prefix}/{s['name']}")
            else:
                raise PackedError(f"{local} is missing or incomplete ({s['size']} bytes expected); pack again or "
                                  "copy the whole pack")
        return Shards(tuple(paths), tuple(str((root / s["index"]).resolve()) for s in listed),
                      sum(s["samples"] for s in listed))

    return PackedSet(root, list(meta["classes"]), shards("train"), shards("val"), meta)
