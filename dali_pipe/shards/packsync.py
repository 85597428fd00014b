"""A pack on S3 brought to local disk: synced whole (`fetch`, `fetch_to`: packed.json, the index files as a
dataset's files are synced, the shards fetched and checked as they land), or made ready for streaming
(its index files local, the shards left to the stream cache); `sync_shards` for shards of others.
"""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import default_cache_dir
from ..s3 import SyncError, local_target, parse_s3_uri
from ..stop import check, completed
from ..sync import AskedListing, SyncStats, byte_bar, engine_for, listing, listing_asked, read_object, sync_objects
from ..transfer import Engine
from ..workdir import free_bytes, human_bytes, lock, remove_dead_temps, unlock, write_atomic
from .cache import FETCH_PARALLEL, local_name
from .fetchers import fetcher_for, listed
from .format import FAST_SUM, PACKED_NAME, PackedFormatError, parse_packed
from .verdicts import (
    Remote,
    Verdicts,
    check_remote,
)

HEADROOM = 1 << 30  # free space left on the cache disk after syncing a pack


def fetch(data: str, cache_dir: str | Path, *, mode: str, workers: int, progress: bool = True) -> Path:
    """Make the pack at --data readable from local disk: its packed.json and index files always, its
    shards when `mode` (auto|sync|stream) says so (checked as they land). Returns the local folder."""
    if not data.startswith("s3://"):
        return Path(data)

    return fetch_to(data, local_target(data, Path(cache_dir)), mode=mode, workers=workers, progress=progress,
                    cache_dir=cache_dir)


def fetch_to(data: str, local: Path, *, mode: str, workers: int, progress: bool = True,
             cache_dir: str | Path | None = None, engine: Engine | None = None, raw: bytes | None = None,
             stats: SyncStats | None = None, asked: AskedListing | None = None) -> Path:
    """`fetch` into a given folder (`python -m dali_pipe sync` of a pack); verdicts of the shards that
    land go to `cache_dir` (default: the default cache dir). `engine`: the transfer engine for packed.json, the
    LIST and the index files (default: one made here; the shards have their own: Fetcher); `raw`: packed.json's
    bytes, when the caller read them already; `asked`: the prefix's LIST, asked for on `engine` already
    (ask_listing).
    `stats`, when given, is filled in as a dataset's sync fills it: the pack's index and shard files listed,
    downloaded (their bytes) and unchanged, and the seconds."""
    start = time.perf_counter()
    local.mkdir(parents=True, exist_ok=True)
    prefix = data.rstrip("/")
    bucket, key = parse_s3_uri(prefix)
    # one engine for packed.json, the LIST (asked for beside it) and the index files; the LIST serves the shards too
    with engine_for(engine, workers) as engine, listing_asked(engine, prefix, asked) as asked:
        if raw is None:
            raw = read_object(data, PACKED_NAME, engine)
        if raw is None:
            raise PackedFormatError(f"{data} has no {PACKED_NAME}; pack it first (python -m dali_pipe pack)")
        meta = parse_packed(raw, f"{data}/{PACKED_NAME}")
        shards = [s for split in meta["splits"].values() for s in split["shards"]]
        total, free = room(shards, local)
        if mode == "auto":
            mode = auto_mode(total, free)
            if progress and mode == "stream":
                print(f"packed data: {total / 1e9:.1f} GB of shards do not fit in {local} ({free / 1e9:.1f} GB free); "
                      "streaming them through a bounded cache (--stream-cache)", file=sys.stderr)
        if mode == "sync" and free < total:
            raise SyncError(f"{data}: the pack's {len(shards)} shard(s) need {human_bytes(total)} in {local}, which "
                            f"has {human_bytes(free)} free (counting the shards already there); free space there, or "
                            "sync to another disk (another LOCAL_DIR; for training, --cache-dir, or --packed-s3 "
                            "stream). Nothing was downloaded.")
        remote = listing(engine, bucket, f"{key}/" if key else "", asked)
        got = sync_objects(data, local, [s["index"] for s in shards], workers=workers, progress=False, engine=engine,
                           remote=remote)
        if mode == "sync":
            found = {f"{prefix}/{rel}": meta for rel, meta in remote.items()}
            ready = listed([Remote(f"{prefix}/{s['name']}", s["size"], s.get("sha256"), xxh3=s.get(FAST_SUM))
                            for s in shards], engine, found)
    if mode == "sync":
        fetched, size = sync_shards(ready, local, cache_dir=cache_dir or default_cache_dir(), progress=progress,
                                    listed_already=True)
        got.listed += len(shards)
        got.downloaded += fetched
        got.skipped += len(shards) - fetched
        got.bytes += size
    write_atomic(local / PACKED_NAME, raw)  # last: the local copy is complete
    if stats is not None:
        got.seconds = time.perf_counter() - start
        stats.__dict__.update(got.__dict__)
    return local


def room(shards: list[dict], local: Path) -> tuple[int, int]:
    """(the bytes of packed.json's `shards`, the room for them in `local`: its disk's free space and the
    shards there already); `local` is not created (the stream pre-flight asks, before anything is decided)."""
    free = free_bytes(local) + sum((local / s["name"]).stat().st_size for s in shards if (local / s["name"]).is_file())
    return sum(s["size"] for s in shards), free


def auto_mode(total: int, free: int) -> str:
    """--packed-s3 auto: sync the shards when they fit with HEADROOM to spare, else stream them."""
    return "sync" if free >= total + HEADROOM else "stream"


def sync_shards(remotes: list[Remote], local: Path, *, cache_dir: str | Path, progress: bool = True,
                listed_already: bool = False) -> tuple[int, int]:
    """Fetch every shard into `local` (ranged parallel GETs, FETCH_PARALLEL shards at a time), each
    checked as it lands; shards already there and matching are kept. Returns the shards fetched and their
    bytes. `listed_already`: the remotes carry their sizes and ETags from S3 (`listed`), so no LIST again."""

    verdicts = Verdicts(cache_dir)
    lock(local, "sync", "wait for it to finish")
    try:
        remove_dead_temps(local, ".*.part-*")
        todo = []
        for r in remotes:
            check()  # SIGTERM, Ctrl-C (stop.py): a shard already there may be hashed (seconds a GB)
            dest = local / local_name(r.url)
            if dest.is_file() and check_remote(dest, r, verdicts) is None:
                continue
            todo.append((r, dest))
        bar = byte_bar("sync shards", sum(r.size or 0 for r, _ in todo), progress and bool(todo))
        fetcher, stop = fetcher_for([r for r, _ in todo] or remotes), threading.Event()
        if todo and not listed_already:
            todo = list(zip(fetcher.listed([r for r, _ in todo]), [d for _, d in todo]))
        pool = ThreadPoolExecutor(FETCH_PARALLEL, thread_name_prefix="shard-sync")
        done = 0
        try:
            futures = [pool.submit(fetcher.fetch, r, dest, stop=stop, verdicts=verdicts, on_bytes=bar.update)
                       for r, dest in todo]
            for fut in completed(futures):  # SIGTERM, Ctrl-C: raised here (stop.py), the rest stopped below
                done += fut.result()  # the first failure stops the rest
        except BaseException:
            stop.set()
            fetcher.close()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            fetcher.close()
            bar.close()
            verdicts.save()
        return len(todo), done
    finally:
        unlock(local)
