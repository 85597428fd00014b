"""`python -m dali_pipe pack SRC DST`: scan, then pack into shards (dali_pipe/pack.py). SRC is a dataset
(dataset.tsv) or shards (a pack, or shards written by others), local or s3://.

An s3:// DST is packed in the cache dir first (CACHE/pack-staging/...) and uploaded shard by shard,
packed.json last, then the staging copy is removed. A rerun continues an interrupted pack or upload;
over a finished pack of the same input and settings it has nothing to do; with other settings it
replaces the pack in S3 (its packed.json goes first, so no reader sees a mix, and the objects of the
old pack that the new one does not name go last).
"""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import hashlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import Settings, SyncSettings, cores, resolve
from ..dataset import held_out_only, missing_reasons, prepare
from ..forms import PROGRESS_NAME
from ..https import is_http
from ..inputs import detect, form_problem, forms_text
from ..manifest import Manifest
from ..pack import PackError, finished, pack_manifest, pack_settings, pack_shards, read_progress, same_pack
from ..s3 import SyncError, TransferError, explain, local_target, make_client, parse_s3_uri
from ..shards.cache import http_copies, local_name
from ..shards.format import PACKED_NAME
from ..shards.packsync import sync_shards
from ..shards.verdicts import Remote
from ..sync import engine_for, listing, read_object, sync_objects
from ..workdir import lock, remove, unlock, write_atomic

REPLACED = ".replaced-packed.json"  # in the staging folder: the packed.json of the pack being replaced in S3


def upload(local: Path, uri: str, *, workers: int, previous: dict | None = None) -> int:
    """Upload the finished pack through the transfer engine: its files at once (`workers` requests in flight,
    large ones in parts), each with the pack's identity (a digest of its packed.json) and, for a shard, its
    sha256 as user metadata; an object already there with this pack's identity (and sha256) is skipped, any
    other is replaced (an index of another pack can have the same size). packed.json last, so readers never
    see half a pack. `previous`: the packed.json of another pack at `uri`, which is replaced."""
    bucket, prefix = parse_s3_uri(uri)
    base = f"{prefix}/" if prefix else ""
    ident = pack_identity((local / PACKED_NAME).read_bytes())
    meta = json.loads((local / PACKED_NAME).read_text())
    shards = [s for split in meta["splits"].values() for s in split["shards"]]
    with engine_for(None, workers) as engine:
        if previous is not None:  # no reader may trust the old packed.json while its shards are replaced
            write_atomic(local / REPLACED, json.dumps(previous))  # a rerun after a kill still knows it
            _ask(engine, engine.delete(bucket, base + PACKED_NAME), f"replacing the pack at {uri}", bucket,
                 base + PACKED_NAME)
        # until packed.json lands, the prefix says it is a pack being uploaded (forms.unfinished_pack's S3 twin)
        _ask(engine, engine.put_bytes(bucket, base + PROGRESS_NAME, b'{"uploading": true}\n'),
             f"uploading the pack to {uri}", bucket, base + PROGRESS_NAME)
        abort_open_uploads(bucket, base)  # what a killed upload left (billed, and no object)
        remote = listing(engine, bucket, base)
        files = [(s["name"], {k: v for k, v in {"pack": ident, "sha256": s.get("sha256")}.items() if v}) for s in shards]
        files += [(s["index"], {"pack": ident}) for s in shards] + [("bad_images.tsv", {"pack": ident})]
        files = [(n, m) for n, m in files if (local / n).is_file()]
        there = [n for n, _ in files if remote.get(n, (None,))[0] == (local / n).stat().st_size]
        with ThreadPoolExecutor(16) as pool:  # one HEAD each: its metadata
            recorded = dict(zip(there, pool.map(lambda n: _recorded(engine, bucket, base + n, uri), there)))
        todo = [(n, m) for n, m in files if recorded.get(n) != m]
        try:
            engine.run(_all([_named(engine.put(bucket, base + n, local / n, m), bucket, base + n) for n, m in todo]))
        except BaseException:
            abort_open_uploads(bucket, base)  # a failed or stopped part upload is not left open
            raise
        _ask(engine, engine.put(bucket, base + PACKED_NAME, local / PACKED_NAME), f"uploading {PACKED_NAME}",
             bucket, base + PACKED_NAME)
        if previous is not None:
            ours = {n for n, _ in files} | {PACKED_NAME}
            stale = sorted({n for split in previous.get("splits", {}).values() for s in split.get("shards", [])
                            for n in (s.get("name"), s.get("index")) if n} - ours)
            for name in stale:
                _ask(engine, engine.delete(bucket, base + name), f"removing {name} of the replaced pack", bucket,
                     base + name)
            (local / REPLACED).unlink(missing_ok=True)
        unmark(engine, bucket, base)
    return len(todo) + 1


def pack_identity(packed_json: bytes) -> str:
    """What every object of one pack carries as its `pack` metadata: a digest of its packed.json."""
    return hashlib.sha256(packed_json).hexdigest()[:32]


def abort_open_uploads(bucket: str, base: str) -> None:
    """Abort the multipart uploads left open under the prefix (by a killed or failed upload: S3 keeps their
    parts, billed and invisible, until they are aborted). boto3: object_store lists no open uploads."""
    try:
        client = make_client(4)
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=base):
            for u in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    except Exception as e:  # noqa: BLE001 - best effort: the pack itself is whole either way
        print(f"pack: could not abort the open uploads under s3://{bucket}/{base} ({type(e).__name__}); "
              "a bucket lifecycle rule for incomplete multipart uploads removes them", file=sys.stderr)


async def _all(coros: list) -> None:
    """Every coroutine run at once (the engine bounds how many requests are in flight); the first failure
    cancels the rest."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def _named(coro, bucket: str, key: str) -> None:
    """`coro`, its failure a SyncError naming the object it was uploading."""
    try:
        await coro
    except TransferError as e:
        raise SyncError(f"uploading {key.rsplit('/', 1)[-1]}: {explain(e, bucket, key)} (rerun to finish)") from None


def _ask(engine, coro, what: str, bucket: str, key: str):
    """engine.run(coro), its failure a SyncError saying `what` failed, naming the key and the fix."""
    try:
        return engine.run(coro)
    except TransferError as e:
        raise SyncError(f"{what}: {explain(e, bucket, key)} (rerun to finish)") from None


def _recorded(engine, bucket: str, key: str, uri: str) -> dict[str, str]:
    """The metadata an upload recorded on the object `key` (its pack's identity; a shard's sha256)."""
    return _ask(engine, engine.metadata(bucket, key), f"checking {uri}", bucket, key)


def unmark(engine, bucket: str, base: str) -> None:
    """Remove the upload's marker (packed.json is there: the pack is whole)."""
    _ask(engine, engine.delete(bucket, base + PROGRESS_NAME), "finishing the upload", bucket, base + PROGRESS_NAME)


def remote_pack(uri: str) -> dict | None:
    """The packed.json at an s3:// DST, or None."""
    raw = read_object(uri, PACKED_NAME)
    try:
        return json.loads(raw) if raw is not None else None
    except ValueError:
        return {}  # damaged: replaced like any other pack


def remote_complete(uri: str, meta: dict) -> bool:
    """Every shard and index that packed.json `meta` names is in S3, each carrying this pack's identity (and a
    shard its size and sha256) as `upload` recorded them (one HEAD each: an object replaced by other bytes, of
    another pack, or put there by another tool, is not this pack's)."""
    bucket, prefix = parse_s3_uri(uri)
    base = f"{prefix}/" if prefix else ""
    raw = read_object(uri, PACKED_NAME)
    if raw is None:
        return False
    ident = pack_identity(raw)
    with engine_for(None, 16) as engine:
        remote = listing(engine, bucket, base)
        shards = [s for split in meta["splits"].values() for s in split["shards"]]
        if not all(remote.get(s["name"], (None,))[0] == s["size"] and s["index"] in remote for s in shards):
            return False
        wanted = [(s["name"], {k: v for k, v in {"pack": ident, "sha256": s.get("sha256")}.items() if v}) for s in shards]
        wanted += [(s["index"], {"pack": ident}) for s in shards]
        with ThreadPoolExecutor(16) as pool:
            return all(pool.map(lambda w: _recorded(engine, bucket, base + w[0], uri) == w[1], wanted))


def _replaced(staging: Path) -> dict | None:
    """The packed.json of a pack whose replacement in S3 was stopped (see upload), or None."""
    try:
        return json.loads((staging / REPLACED).read_text())
    except (OSError, ValueError):
        return None


def _clear(staging: Path) -> None:
    """Empty our staging folder (its lock lives outside it, workdir.lock_path)."""
    for p in staging.iterdir() if staging.is_dir() else []:
        remove(p, staging)


def _finished_shards(staging: Path) -> int:
    prog = read_progress(staging)
    return sum(len(v) for v in prog["splits"].values()) if prog else 0


def run(s: Settings, manifest: Manifest | None = None) -> dict:
    """Pack SRC into DST; `manifest`: SRC's, read already (cli.described), so it is not read again."""
    s = resolve(s, machine=False)
    dst = s.pack.dst
    staging = (Path(s.data.cache_dir) / "pack-staging" / dst[5:].strip("/")) if dst.startswith("s3://") else Path(dst)
    try:
        return _run(s, staging, manifest)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise PackError(f"no space left on the disk of {e.filename or staging} ({e.strerror}); the "
                        f"{_finished_shards(staging)} finished shard(s) in {staging} are kept: free space and rerun "
                        "the same command to continue") from None


def _run(s: Settings, staging: Path, manifest: Manifest | None = None) -> dict:
    src, dst = s.pack.src, s.pack.dst
    data = dataclasses.replace(s.data, data=src, packed_s3="sync")  # packing reads every shard from local disk
    form = detect(src, data.cache_dir)
    if form is None and not src.startswith("s3://"):
        raise PackError(f"SRC {src!r} " + (form_problem(src) or "is not a folder").split(" ", 1)[1]
                        if Path(src).is_dir() else f"SRC {src!r} is not a folder; SRC may be:" + forms_text("\n    "))
    if not dst.startswith("s3://") and not src.startswith("s3://") and Path(dst).resolve() == Path(src).resolve():
        raise PackError(f"DST {dst!r} is SRC; pack into another folder")
    workers = s.pack.pack_workers or cores()
    opts = dict(max_side=s.pack.max_side, quality=s.pack.quality, shard_size=s.pack.shard_size, workers=workers,
                seed=data.seed)
    lock(staging, "pack", "wait for it to finish, or pack into another folder")
    try:
        source, result = prepare(data, staging, num_threads=max(1, workers - 1),  # sync, scan, report, bound
                                 manifest=manifest)
        held_out = held_out_only(src, source)
        if held_out:  # (it wrote a pack of 0 images)
            raise PackError(held_out.replace("--data", "SRC", 1))
        if form is not None and form.reader == "shards":
            _local_tars(source, data)
        digest = source.digest()
        previous = None
        if dst.startswith("s3://"):
            settings = pack_settings(digest=digest, **{k: opts[k] for k in ("max_side", "quality", "shard_size",
                                                                           "seed")})
            previous = remote_pack(dst)
            replaced = _replaced(staging)  # a replacing upload stopped after removing its packed.json from S3
            try:
                staged = finished(staging, settings, data.cache_dir)
            except PackError:  # our staging holds another pack: it is ours to replace
                _clear(staging)
                staged = None
            if staged is None and previous is not None and same_pack(previous, settings) and remote_complete(
                    dst, previous):
                bucket, prefix = parse_s3_uri(dst)
                with engine_for(None, 1) as engine:  # (a kill just after packed.json left the marker)
                    unmark(engine, bucket, f"{prefix}/" if prefix else "")
                _clear(staging)
                print(f"pack: {dst} already holds this pack ({_counts(previous)}); nothing to do", file=sys.stderr)
                return {"done_before": True}
        if form is not None and form.reader == "shards":
            stats = pack_shards(source, staging, **opts, cache_dir=data.cache_dir, extract=form.extract)
        else:
            stats = pack_manifest(source, staging, **opts, bad={**result.bad, **missing_reasons(source)},
                                  cache_dir=data.cache_dir)
        if dst.startswith("s3://"):
            upload(staging, dst, workers=SyncSettings.workers,
                   previous=next((p for p in (previous, replaced) if p is not None and not same_pack(p, settings)),
                                 None))
            _clear(staging)  # the pack lives in S3 now; a rerun finds it there
    finally:
        unlock(staging)
    if stats.done_before and not dst.startswith("s3://"):
        print(f"pack: {dst} already holds this pack ({stats.packed.get('train', 0)} train + "
              f"{stats.packed.get('val', 0)} val images); nothing to do", file=sys.stderr)
    else:
        print(f"pack: {stats.packed.get('train', 0)} train + {stats.packed.get('val', 0)} val images in {stats.shards} "
              f"shard(s) ({stats.skipped_shards} from an earlier run), {stats.bad} left out (listed in "
              f"bad_images.tsv); read it with --data {dst}", file=sys.stderr)
    return dataclasses.asdict(stats)


def _counts(meta: dict) -> str:
    return " + ".join(f"{v['samples']} {k}" for k, v in meta["splits"].items()) + " images"


def _local_tars(source, data) -> None:
    """Shards of others on S3 are read from a copy in the cache dir (CACHE/s3/...), fetched with ranged GETs,
    folder by folder (a brace pattern may span several); https:// ones from CACHE/http/DIGEST, each checked
    against the size and checksum it was indexed with."""
    web = [s for s in source.shards if is_http(s.path)]
    if web:
        local = http_copies(data.data, data.cache_dir)
        sync_shards([Remote(s.path, s.size, s.sha256, xxh3=s.xxh3) for s in web], local, cache_dir=data.cache_dir)
        for s in web:
            s.path = str((local / local_name(s.path)).resolve())
    folders: dict[str, list] = {}
    for s in source.shards:
        if s.path.startswith("s3://"):
            folders.setdefault(s.path.rsplit("/", 1)[0], []).append(s)
    for prefix, remote in folders.items():
        local = local_target(prefix, Path(data.cache_dir))
        sync_objects(prefix, local, [s.path.rsplit("/", 1)[1] for s in remote], workers=SyncSettings.workers)
        for s in remote:
            s.path = str((local / s.path.rsplit("/", 1)[1]).resolve())
