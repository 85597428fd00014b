"""A packed dataset from S3: fetch what is needed into the cache dir (finding and reading a pack is
shards/source.py's).

`--data DIR` holding packed.json, or `--data s3://bucket/prefix` with packed.json there, is packed.
From S3, with `--packed-s3 auto` (the default), the shards are synced to the cache dir when its
disk has room for them (plus 1 GiB), with parallel ranged GETs; otherwise they are streamed: DALI
reads the tars from S3 itself (`readers.webdataset(paths=["s3://..."])`), and only the small index
files are fetched. `sync` and `stream` force one route.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .errors import UserError
from .shards.format import PACKED_NAME

HEADROOM = 1 << 30  # free space left on the cache disk after syncing a pack


class PackedError(UserError):
    """The packed dataset is unreadable or incomplete; the message names the file."""


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
    from .shards.format import PackedFormatError, parse_packed

    try:
        return parse_packed(raw, where)
    except PackedFormatError as e:
        raise PackedError(str(e)) from None
