"""S3 -> local disk sync of a dataset: the manifest, then only the files it lists.

- Fast: one LIST pass gives every size and ETag (no per-file HEAD), then parallel GETs on a
  shared connection pool; files already present with the same size and ETag (recorded in
  `.sync-state.json`) are skipped, so a rerun transfers nothing.
- Safe: each file is written under a temporary name in its final folder and renamed when
  complete, so an interrupted sync leaves no partial file and a rerun finishes it. Retries use
  botocore's backoff. A row or key that would land outside the target is refused before any
  download starts.
- boto3 reads the standard AWS environment (credentials, region, AWS_ENDPOINT_URL), so
  S3-compatible stores and the tests' local moto server work unchanged.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .manifest import MANIFEST_NAME, ManifestError, read_table, safe_relpath

STATE_NAME = ".sync-state.json"
CHUNK = 1 << 20


class SyncError(UserError):
    """The sync cannot proceed; the message names the bucket/key/row and what to do."""


@dataclass
class SyncStats:
    listed: int = 0  # files the manifest lists
    downloaded: int = 0
    skipped: int = 0  # already present and unchanged
    missing: int = 0  # listed in the manifest but not in S3
    bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        mb = self.bytes / 1e6
        rate = mb / self.seconds if self.seconds > 0 else 0.0
        return (f"sync: {self.downloaded} downloaded ({mb:.1f} MB, {rate:.1f} MB/s), {self.skipped} unchanged, "
                f"{self.missing} missing in S3, {self.listed} listed, {self.seconds:.1f} s")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise SyncError(f"{uri!r} is not an s3:// URI; use s3://bucket/prefix")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise SyncError(f"{uri!r} names no bucket; use s3://bucket/prefix")
    return bucket, prefix.strip("/")


def local_target(uri: str, cache_dir: Path) -> Path:
    """Where `uri` is synced under the cache dir: CACHE/s3/BUCKET/PREFIX."""
    bucket, prefix = parse_s3_uri(uri)
    return Path(cache_dir) / "s3" / bucket / prefix


def make_client(workers: int, max_attempts: int = 8, connect_timeout: float = 5.0, read_timeout: float = 30.0):
    import boto3
    from botocore.config import Config

    cfg = Config(max_pool_connections=max(10, workers), connect_timeout=connect_timeout, read_timeout=read_timeout,
                 retries={"max_attempts": max_attempts, "mode": "standard"}, tcp_keepalive=True)
    return boto3.session.Session().client("s3", config=cfg)


def _explain(err: Exception, bucket: str, key: str) -> str:
    """A message for a failed S3 call that names the bucket/key and the fix, never a secret."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, PartialCredentialsError

    if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return ("no usable AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, "
                "or run with an instance/SageMaker role that can read the bucket")
    if isinstance(err, EndpointConnectionError):
        return f"cannot reach the S3 endpoint ({err.kwargs.get('endpoint_url', '?')}); check AWS_ENDPOINT_URL, the region and the network"
    if isinstance(err, ClientError):
        code = err.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            return f"bucket {bucket!r} does not exist (or is in another account/endpoint); check the s3:// URI"
        if code in ("NoSuchKey", "404", "NotFound"):
            return f"s3://{bucket}/{key} does not exist; check the prefix (it must hold {MANIFEST_NAME})"
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return f"access to s3://{bucket}/{key} was denied ({code}); check the credentials and the bucket policy"
        return f"S3 error {code or '?'} on s3://{bucket}/{key}"
    return f"{type(err).__name__} on s3://{bucket}/{key}: {str(err)[:200]}"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.part-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _download(client, bucket: str, key: str, dest: Path, size: int) -> int:
    """GET one object into dest via a temporary name; return bytes written."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}-{threading.get_ident()}")
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"]
        n = 0
        with open(tmp, "wb") as f:
            for chunk in body.iter_chunks(CHUNK):
                f.write(chunk)
                n += len(chunk)
        if n != size:
            raise IOError(f"got {n} bytes, expected {size}")
        os.replace(tmp, dest)
        return n
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sync(uri: str, dest: Path | str, *, workers: int, progress: bool = True, client=None) -> SyncStats:
    """Download s3://bucket/prefix/dataset.tsv and the files it lists into `dest`."""
    from botocore.exceptions import BotoCoreError, ClientError
    from tqdm import tqdm

    start = time.perf_counter()
    bucket, prefix = parse_s3_uri(uri)
    dest = Path(dest)
    client = client or make_client(workers)
    base = f"{prefix}/" if prefix else ""
    manifest_key = base + MANIFEST_NAME
    try:
        text = client.get_object(Bucket=bucket, Key=manifest_key)["Body"].read()
    except (BotoCoreError, ClientError) as e:
        raise SyncError(_explain(e, bucket, manifest_key)) from None

    # Parse and check every row before writing anything.
    dest.mkdir(parents=True, exist_ok=True)
    staged = dest / f".{MANIFEST_NAME}.incoming"
    _atomic_write(staged, text)
    try:
        df = read_table(staged)
    except ManifestError as e:
        staged.unlink(missing_ok=True)
        raise SyncError(f"s3://{bucket}/{manifest_key}: {str(e).split(': ', 1)[-1]}") from None
    if "image_path" not in df.columns:
        staged.unlink(missing_ok=True)
        raise SyncError(f"s3://{bucket}/{manifest_key} has no 'image_path' column; add one (tab-separated header)")
    wanted: dict[str, int] = {}
    refused = []
    for p, line in zip(df["image_path"], df["_line"]):
        try:
            wanted.setdefault(safe_relpath(p, dest), line)
        except ValueError as e:
            refused.append(f"line {line}: {e}")
    if refused:
        staged.unlink(missing_ok=True)
        raise SyncError(f"s3://{bucket}/{manifest_key}: refused {len(refused)} row(s) that would land outside "
                        f"{dest}; nothing was downloaded:\n  " + "\n  ".join(refused[:10]))

    # One LIST pass for sizes and ETags.
    remote: dict[str, tuple[int, str]] = {}
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
            for obj in page.get("Contents", []):
                remote[obj["Key"][len(base):]] = (obj["Size"], obj["ETag"].strip('"'))
    except (BotoCoreError, ClientError) as e:
        staged.unlink(missing_ok=True)
        raise SyncError(_explain(e, bucket, base)) from None

    state_path = dest / STATE_NAME
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError):
        state = {}
    stats = SyncStats(listed=len(wanted))
    todo = []
    missing = []
    for rel in wanted:
        if rel not in remote:
            missing.append(rel)
            continue
        size, etag = remote[rel]
        local = dest / rel
        if state.get(rel) == [size, etag] and local.is_file() and local.stat().st_size == size:
            stats.skipped += 1
        else:
            todo.append((rel, size, etag))
    stats.missing = len(missing)
    if missing:
        print(f"sync: {len(missing)} file(s) listed in {MANIFEST_NAME} are not in s3://{bucket}/{base}, "
              f"e.g. {missing[:3]}", file=sys.stderr)

    lock = threading.Lock()
    last_save = [time.monotonic()]

    def save_state(force: bool = False):
        if force or time.monotonic() - last_save[0] > 2.0:
            _atomic_write(state_path, json.dumps(state).encode())
            last_save[0] = time.monotonic()

    failures = []
    bar = tqdm(total=sum(s for _, s, _ in todo), unit="B", unit_scale=True, unit_divisor=1024, desc="sync",
               disable=not progress or not todo, file=sys.stderr, mininterval=0.5)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futs = {pool.submit(_download, client, bucket, base + rel, dest / rel, size): (rel, size, etag)
                    for rel, size, etag in todo}
            for fut in as_completed(futs):
                rel, size, etag = futs[fut]
                try:
                    n = fut.result()
                except (BotoCoreError, ClientError, OSError) as e:
                    failures.append(f"{rel}: {_explain(e, bucket, base + rel)}")
                    continue
                with lock:
                    state[rel] = [size, etag]
                    stats.downloaded += 1
                    stats.bytes += n
                    save_state()
                bar.update(n)
                bar.set_postfix_str(f"{stats.downloaded + stats.skipped}/{stats.listed} files", refresh=False)
    finally:
        bar.close()
        save_state(force=True)
    stats.seconds = time.perf_counter() - start
    if failures:
        staged.unlink(missing_ok=True)
        raise SyncError(f"{len(failures)} of {len(todo)} download(s) failed (completed files are kept; rerun "
                        f"the sync to finish):\n  " + "\n  ".join(failures[:5]))
    os.replace(staged, dest / MANIFEST_NAME)  # the manifest lands last: a complete set
    if progress:
        print(stats.summary(), file=sys.stderr)
    return stats
