"""`python -m dali_pipe pack SRC DST`: scan, then pack into shards (dali_pipe/pack.py); an s3://
DST is packed in the cache dir first and uploaded shard by shard, packed.json last."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from ..config import Settings, cores, resolve


def upload(local: Path, uri: str, *, workers: int) -> int:
    """Upload the finished pack: each file with parallel multipart PUTs (s3transfer), skipping those
    already there with the same size and sha256; packed.json last, so readers never see half a pack."""
    import json

    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    from ..pack import PACKED_NAME
    from ..sync import SyncError, explain, list_objects, make_client, parse_s3_uri

    bucket, prefix = parse_s3_uri(uri)
    base = f"{prefix}/" if prefix else ""
    client = make_client(workers)
    meta = json.loads((local / PACKED_NAME).read_text())
    shards = [s for split in meta["splits"].values() for s in split["shards"]]
    remote = list_objects(client, bucket, base)
    config = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20, max_concurrency=workers)
    sent = 0
    files = [(s["name"], s["sha256"]) for s in shards] + [(s["index"], None) for s in shards]
    files += [("bad_images.tsv", None), (PACKED_NAME, None)]
    for name, sha in files:
        path = local / name
        if not path.is_file():
            continue
        if name != PACKED_NAME and remote.get(name, (None,))[0] == path.stat().st_size:
            if sha is None or client.head_object(Bucket=bucket, Key=base + name).get("Metadata", {}).get(
                    "sha256") == sha:
                continue
        try:
            client.upload_file(str(path), bucket, base + name, Config=config,
                               ExtraArgs={"Metadata": {"sha256": sha}} if sha else None)
        except (BotoCoreError, ClientError, OSError) as e:
            raise SyncError(f"uploading {name}: {explain(e, bucket, base + name)} (rerun to finish)") from None
        sent += 1
    return sent


def run(s: Settings) -> dict:
    from ..config import SyncSettings
    from ..datamodule import missing_reasons, prepare
    from ..pack import PackError, pack_manifest
    from ..workdir import lock, unlock

    s = resolve(s)
    src, dst = s.pack.src, s.pack.dst
    data = dataclasses.replace(s.data, data=src)
    if not src.startswith("s3://") and not (Path(src) / "dataset.tsv").is_file():
        raise PackError(f"SRC {src!r} holds no dataset.tsv; pass the dataset root (or s3://bucket/prefix)")
    workers = s.pack.pack_workers or cores()
    staging = (Path(data.cache_dir) / "pack-staging" / dst[5:].strip("/")) if dst.startswith("s3://") else Path(dst)
    lock(staging, "pack", "wait for it to finish, or pack into another folder")
    try:
        manifest, result = prepare(data, staging, num_threads=max(1, workers - 1))  # sync, scan, report, bound
        stats = pack_manifest(manifest, staging, max_side=s.pack.max_side, quality=s.pack.quality,
                              shard_size=s.pack.shard_size, workers=workers, seed=data.seed,
                              bad={**result.bad, **missing_reasons(manifest)})
        if dst.startswith("s3://"):
            upload(staging, dst, workers=SyncSettings.workers)
    finally:
        unlock(staging)
    print(f"pack: {stats.packed['train']} train + {stats.packed['val']} val images in {stats.shards} shard(s) "
          f"({stats.skipped_shards} from an earlier run), {stats.bad} left out (listed in bad_images.tsv); "
          f"read it with --data {dst}", file=sys.stderr)
    return dataclasses.asdict(stats)
