"""Shard bytes for training, always from local disk, always checked: a local pack verified once,
a pack on S3 synced whole, or streamed through a bounded local cache.

Every shard whose size and checksum are known (packed.json; peer shards as indexed) is checked
before its first use, and a mismatch names the shard and the way out; nothing unchecked is
decoded. The checksum is the fast one (format.FAST_SUM, XXH3-128, about 9 GB/s here) where known,
else the sha256 (packs made before it, at about 1.2 GB/s); a verdict records the checksum it checked.

- Local packs (`verify_local`): hashed once before training, with the verdict cached by (path,
  size, mtime) in CACHE_DIR/shard-verdicts.json, so reruns cost a stat per shard.
- Synced packs (`fetch`, `--packed-s3 sync`, or `auto` when they fit): every shard fetched with
  ranged parallel GETs (the transfer engine, dali_pipe/transfer.py), several at a time, checked as it
  lands (a mismatch is fetched once more, then named), its verdict recorded. The index files (small,
  one per shard) are fetched on every route the way `sync` fetches a dataset's files, skipped when
  their size and ETag are unchanged; packed.json last.
- Streamed packs (`StreamCache`, `--packed-s3 stream`, or `auto` when they do not fit): the
  shards are fetched in the order the epoch plan reads them, several at a time, into a folder
  bounded by `--stream-cache`; a read waits until its shard has landed and matched. Training
  starts once the first window of shards is local. Eviction follows the readers' plans: shards
  that a reader has in progress are never evicted; otherwise the one whose next use is farthest
  goes first (consumed shards, until the next epoch needs them), and only to make room for one
  needed sooner. The plans are known ahead (dali_pipe/shards/plan.py), so this is Belady's
  optimal rule, not a guess. DDP: each rank fetches the shards of its own share (the plan splits
  the data by rank), into its own folder, with bound / local ranks; ranks fetch disjoint data,
  so fetching once per node would save only the few shards cut by a rank boundary.
  The cache heals itself: a shard that is missing, shorter than its index or changed when a reader
  comes to it (its size and mtime are compared with those it landed with, and a changed one is hashed
  again) is removed and fetched again, through the same bound, order and fetch limits, at most
  HEALS times per shard and run; a rerun keeps every shard that landed whole (those the verdicts
  file, saved every few seconds, does not know yet are hashed again instead of fetched).
- Shards of others on S3 or at an https:// server are streamed the same way (their sizes and
  checksums from indexing); gzipped ones were decompressed into the cache dir while indexed
  (shards/source.py) and are local files here.

Faults: S3 throttling (503 SlowDown), a cut connection and a stalled body (read timeout) are
retried by the transfer engine (obstore), then by one more whole attempt here;
an attempt that moves no byte for STALL seconds, or runs past its deadline, is cancelled, so a
silent endpoint is named after about a minute. HTTP(S) (`HttpFetcher`, over dali_pipe/https.py)
has the same bounds: retries of refused connections, timeouts, 429 and 5xx per request, a cut
body continued with a Range request (or read again where the server takes no ranges), an attempt
given up after STALL seconds without a byte or past its deadline, ATTEMPTS whole attempts, the
size and checksum checked before the rename. What still fails is a ShardFetchError naming the
endpoint and the key (or the URL, redacted).

The bytes move through the same engine as a dataset's small files (ranged parallel GETs, retries,
temporary files removed on failure); what is ours here is the order (the plan), the bound, the
eviction and the checks.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
import sys
import threading
import time
import weakref
from concurrent.futures import CancelledError, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass
from pathlib import Path

from ..config import default_cache_dir, parse_size
from ..errors import UserError
from ..https import HttpError, Stopped, cache_name, download, is_http, shown
from ..redact import redact
from ..sync import (
    AskedListing,
    SyncError,
    SyncStats,
    byte_bar,
    endpoint,
    engine_for,
    explain,
    listing,
    listing_asked,
    local_target,
    parse_s3_uri,
    read_object,
    sync_objects,
)
from ..transfer import Engine, TransferError, temp_path
from ..workdir import human_bytes, is_write_failure, lock, remove, remove_dead_temps, unlock
from .format import FAST_SUM, PACKED_NAME, PackedFormatError, fast_digest, file_sha256, file_xxh3, parse_packed

VERDICTS_NAME = "shard-verdicts.json"
FETCH_PARALLEL = 4  # shards fetched at once
PART_CONCURRENCY = 8  # ranged GETs at once (transfer.PART bytes each), across the shards in flight
CONNECT_TIMEOUT, READ_TIMEOUT = 5.0, 10.0  # a stalled body is retried after READ_TIMEOUT
REQUEST_ATTEMPTS = 3  # tries of one request (the engine retries throttling, cut and stalled bodies)
ATTEMPTS = 2  # whole-object attempts (each with the engine's own retries of its requests)
STALL = 30.0  # seconds without a byte after which an attempt is cancelled (a silent endpoint: 2 x STALL)
ATTEMPT_DEADLINE = 120.0  # seconds an attempt may take at most, plus the time to move its bytes at MIN_RATE
MIN_RATE = 2e6  # bytes/s: the slowest transfer an attempt is given time for
STREAM_SHARE = 0.5  # default --stream-cache: this share of the cache disk's free space
HASH_WORKERS = 4
HEALS = 2  # times one shard may be fetched again in a run after it went missing or changed in the cache


class ShardError(UserError):
    """A shard failed its size or checksum check, or cannot be fetched; the message names it and the fix."""


class ShardFetchError(ShardError):
    """A shard could not be fetched from S3 within the time allowed; names the endpoint and the key."""


@dataclass(frozen=True)
class Remote:
    """A shard in S3 and what it must be once local."""
    url: str  # s3://bucket/key
    size: int | None
    sha256: str | None
    etag: str | None = None  # from the LIST (then no HEAD is needed, and each ranged GET asks If-Match)
    xxh3: str | None = None  # the fast checksum (format.FAST_SUM), checked instead of the sha256 where known

    @property
    def verdict(self) -> str | None:
        return verdict_key(self.sha256, self.xxh3)

    def digest(self):
        """A new digest of what this shard's bytes are checked with (the fast checksum where known), or None."""
        return fast_digest() if self.xxh3 else hashlib.sha256() if self.sha256 else None


# -- verdicts: (path, size, mtime) -> checksum, so an unchanged shard is hashed once ---------------
class Verdicts:
    """CACHE_DIR/shard-verdicts.json: {digest of the real path: [size, mtime_ns, checksum (verdict_key)]} of
    shards that matched (digests, so no secret a path may carry, an hf_ token say, is written)."""

    def __init__(self, cache_dir: str | Path):
        self.path = Path(cache_dir) / VERDICTS_NAME
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self._lock = threading.Lock()

    def matches(self, path: str | Path, sha256: str) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return self.data.get(_path_key(path)) == [st.st_size, st.st_mtime_ns, sha256]

    def record(self, path: str | Path, sha256: str) -> None:
        st = os.stat(path)
        with self._lock:
            self.data[_path_key(path)] = [st.st_size, st.st_mtime_ns, sha256]

    def forget(self, path: str | Path) -> None:
        with self._lock:
            self.data.pop(_path_key(path), None)

    def save(self) -> None:
        with self._lock:
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(self.data))
                os.replace(tmp, self.path)
            except OSError:  # a full or read-only disk: the verdicts are only a cache; the next run hashes again
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)


def _path_key(path: str | Path) -> str:
    return hashlib.sha256(os.path.realpath(path).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def verdict_key(sha256: str | None, xxh3: str | None) -> str | None:
    """What a verdict records for a shard: the checksum that was checked, the fast one where known
    ("xxh3_128:HEX"), else the sha256. A verdict holds only for the checksum a check would compute now: a
    sha256 verdict (of an earlier version) does not vouch for a pack's xxh3_128, which is checked once more."""
    return f"{FAST_SUM}:{xxh3}" if xxh3 else sha256


def check_remote(path: str | Path, r: Remote, verdicts: Verdicts | None = None, *,
                 digest: str | None = None) -> str | None:
    """check_file of a local copy of `r`."""
    return check_file(path, r.size, r.sha256, verdicts, xxh3=r.xxh3, digest=digest)


def check_file(path: str | Path, size: int | None, sha256: str | None, verdicts: Verdicts | None = None, *,
               xxh3: str | None = None, digest: str | None = None) -> str | None:
    """None when the file has the size and checksum expected (any may be unknown), else what differs. The
    checksum is the fast one (`xxh3`, format.FAST_SUM) where known, else the sha256; a verdict is cached
    under the checksum checked (verdict_key). `digest`: that checksum of the file when it is known already (hashed from
    its bytes as they streamed in), so the file is not read again."""
    try:
        actual = os.stat(path).st_size
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if size is not None and actual != size:
        return f"has {actual} bytes, {size} expected"
    verdict = verdict_key(sha256, xxh3)
    if verdict is None or (verdicts is not None and verdicts.matches(path, verdict)):
        return None
    name, want = (FAST_SUM, xxh3) if xxh3 else ("sha256", sha256)
    got = digest or (file_xxh3(path) if xxh3 else file_sha256(path))
    if got != want:
        return f"has {name} {got[:12]}..., {want[:12]}... expected"
    if verdicts is not None:
        verdicts.record(path, verdict)
    return None


def verify_local(shards, cache_dir: str | Path, *, progress: bool = True) -> None:
    """Check every local shard of `shards` (a samples.Shards) against its size and checksum (check_file)
    before training: hashed once, then cached by (path, size, mtime). Raises ShardError naming them."""
    from tqdm import tqdm

    n = len(shards.paths)
    sizes, sums, fast = shards.sizes or (None,) * n, shards.sha256 or (None,) * n, shards.xxh3 or (None,) * n
    todo = list(dict.fromkeys((p, z, h, x) for p, z, h, x in zip(shards.paths, sizes, sums, fast)
                              if not is_remote(p)))
    # (once per file: the row groups of one Parquet file are shards of one path)
    if not todo:
        return
    verdicts = Verdicts(cache_dir)
    unknown = [t for t in todo if (v := verdict_key(t[2], t[3])) is None or not verdicts.matches(t[0], v)]
    total = sum(os.stat(p).st_size for p, _, h, x in unknown if (h or x) and os.path.exists(p))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="check shards", file=sys.stderr, mininterval=1.0,
               disable=not progress or total < (256 << 20))
    bad = []

    def one(t):
        path, size, sha, xxh3 = t
        problem = check_file(path, size, sha, verdicts, xxh3=xxh3)
        if (sha or xxh3) and os.path.exists(path):
            bar.update(os.stat(path).st_size)
        return path, problem

    try:
        with ThreadPoolExecutor(HASH_WORKERS) as pool:
            bad = [(p, why) for p, why in pool.map(one, unknown) if why]
    finally:
        bar.close()
        verdicts.save()
    if bad:
        lines = "\n  ".join(f"{p} {why}" for p, why in bad[:5])
        raise ShardError(f"{len(bad)} shard(s) do not match packed.json, so they were changed or damaged after "
                         f"packing:\n  {lines}\nCopy or sync the pack again (python -m dali_pipe sync), or pack the "
                         "data again.")


# -- one object: ranged parallel GETs through the engine, bounded, checked --------------------
def _split(url: str) -> tuple[str, str]:
    return parse_s3_uri(url)


def is_remote(path: str) -> bool:
    """Whether a shard path is an object to fetch (s3://, https://, http://) rather than a local file."""
    return path.startswith("s3://") or is_http(path)


def _where(url: str) -> str:
    return shown(url) if is_http(url) else f"{url} (endpoint {endpoint()})"


class Fetcher:
    """Shards through the transfer engine (dali_pipe/transfer.py: ranged GETs, PART_CONCURRENCY in flight
    across the shards being fetched), each attempt bounded by its own watchdog."""

    def __init__(self, concurrency: int = PART_CONCURRENCY):
        # an engine of its own, never a caller's: its request bound keeps every attempt of FETCH_PARALLEL under way
        # (with a caller's `--workers 1`, a shard queued behind another counted as silent and was cancelled), and
        # its READ_TIMEOUT is the one a stalled shard body is retried after
        self.engine = Engine(concurrency=concurrency, connect_timeout=CONNECT_TIMEOUT, read_timeout=READ_TIMEOUT,
                             attempts=REQUEST_ATTEMPTS)
        self._futures: set = set()
        self._closed = False
        register = getattr(threading, "_register_atexit", None)  # before the executors' threads are joined
        if register is not None:
            try:
                register(self.close)
            except RuntimeError:  # interpreter shutting down
                pass

    def close(self) -> None:
        """Cancel the transfers in flight (their temporary files are removed) and stop the engine."""
        if not self._closed:
            self._closed = True
            for future in list(self._futures):
                future.cancel()
            self.engine.close()

    def listed(self, remotes: list["Remote"]) -> list["Remote"]:
        """The shards with their sizes and ETags from S3 (`listed`)."""
        return listed(remotes, self.engine)

    def size_of(self, url: str) -> int:
        bucket, key = _split(url)
        try:
            return self.engine.run(self.engine.size(bucket, key))
        except TransferError as e:
            raise ShardFetchError(f"{_where(url)}: {explain(e, bucket, key)}") from None

    def fetch(self, remote: Remote, dest: Path, *, stop: threading.Event | None = None,
              verdicts: Verdicts | None = None, on_bytes=None) -> int:
        """Download `remote` to `dest` through a temporary name; its size and checksum checked before the
        rename (a mismatch is fetched once more). Returns the bytes. Raises ShardError / ShardFetchError."""
        bucket, key = _split(remote.url)
        size = remote.size if remote.size is not None else self.size_of(remote.url)
        mismatch, failure = None, None
        for attempt in range(ATTEMPTS):
            if stop is not None and stop.is_set():
                raise ShardFetchError(f"{_where(remote.url)}: the fetch was stopped")
            tmp = temp_path(dest)
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)  # each time: a cache folder removed meanwhile comes back
                digest = self._one(bucket, key, tmp, size, on_bytes, remote.etag, digest=remote.digest())
                problem = check_file(tmp, size, remote.sha256, xxh3=remote.xxh3, digest=digest)
                if problem is None:
                    os.replace(tmp, dest)
                    if verdicts is not None and remote.verdict is not None:
                        verdicts.record(dest, remote.verdict)
                    return size
                mismatch = problem
            except TimeoutError as e:
                failure = str(e)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise ShardError(f"the disk of {dest.parent} is full ({remote.url} did not fit); free space, or "
                                     "lower --stream-cache, or pass another --cache-dir") from None
                if is_write_failure(e):  # a read-only cache, or not ours
                    raise ShardError(f"cannot write {remote.url} into {dest.parent} ({e.strerror}); make that "
                                     "folder writable, or pass another --cache-dir") from None
                failure, mismatch = f"{type(e).__name__}: {redact(str(e))[:200]}", None
            except TransferError as e:
                if e.code in ("NoSuchKey", "404", "NotFound", "NoSuchBucket", "AccessDenied", "403", "credentials"):
                    raise ShardFetchError(f"{_where(remote.url)}: {explain(e, bucket, key)}") from None
                failure, mismatch = f"{e.code}: {e.detail}", None
            finally:
                tmp.unlink(missing_ok=True)
        if mismatch is not None and failure is None:
            raise ShardError(f"{_where(remote.url)} does not match its size and checksum ({mismatch}), twice: the "
                             "object in S3 is damaged or was replaced after packing (or the network damages data); "
                             "upload the pack again")

        raise ShardFetchError(redact(f"{_where(remote.url)} could not be fetched in {ATTEMPTS} attempts "
                                     f"({failure or mismatch}); check the endpoint and the network, then rerun "
                                     "(finished shards are kept)"))

    def _one(self, bucket: str, key: str, tmp: Path, size: int, on_bytes, etag: str | None = None, *,
             digest=None) -> str | None:
        """One download through the engine, cancelled when it stalls or runs past its deadline; with `digest`
        (Remote.digest), returns its hexdigest of the bytes it wrote (computed as they landed)."""
        last = [time.monotonic()]  # when the last bytes arrived

        def progress(n: int) -> None:  # on the engine's loop
            last[0] = time.monotonic()
            if on_bytes is not None:
                on_bytes(n)

        deadline = ATTEMPT_DEADLINE + size / MIN_RATE
        if self._closed:
            raise TimeoutError("the run is ending")
        future = self.engine.submit(self.engine.download(bucket, key, tmp, size, etag=etag, on_bytes=progress,
                                                         digest=digest))
        self._futures.add(future)
        start = time.monotonic()
        try:
            while not future.done():  # a watchdog: nothing for STALL seconds, or past the deadline
                wait([future], timeout=0.2)  # returns as soon as the download ends
                if self._closed:
                    future.cancel()
                    raise TimeoutError("the run is ending")
                now = time.monotonic()
                if now - last[0] > STALL or now - start > deadline:
                    future.cancel()  # its requests are dropped and its temporary file removed on the loop
                    raise TimeoutError(f"no byte for {STALL:.0f} s" if now - last[0] > STALL else
                                       f"no complete copy within {deadline:.0f} s")
            future.result()
        except CancelledError:
            raise TimeoutError("the run is ending") from None
        finally:
            self._futures.discard(future)
        return None if digest is None else digest.hexdigest()


class HttpFetcher:
    """https:// (and http://) shards, with the bounds of Fetcher: one streaming GET per attempt into a
    temporary name, continued with a Range request where a connection is cut (https.download), ATTEMPTS
    whole attempts, each cancelled past ATTEMPT_DEADLINE + size / MIN_RATE or when the run ends (a stalled
    body fails within the read timeout); size and checksum checked before the rename."""

    def __init__(self):
        self._stop = threading.Event()

    def listed(self, remotes: list[Remote]) -> list[Remote]:
        """The shards as indexed (their sizes and checksums are known: each fetch checks them)."""
        return list(remotes)

    def close(self) -> None:
        self._stop.set()

    def fetch(self, remote: Remote, dest: Path, *, stop: threading.Event | None = None,
              verdicts: Verdicts | None = None, on_bytes=None) -> int:
        deadline_s = ATTEMPT_DEADLINE + (remote.size or 0) / MIN_RATE
        mismatch, failure = None, None
        for _ in range(ATTEMPTS):
            if (stop is not None and stop.is_set()) or self._stop.is_set():
                raise ShardFetchError(f"{_where(remote.url)}: the fetch was stopped")
            tmp = temp_path(dest)
            stopping = _Either(stop, self._stop)
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)  # each time: a cache folder removed meanwhile comes back
                with open(tmp, "wb") as f:
                    download(remote.url, f, size=remote.size, deadline=time.monotonic() + deadline_s, stop=stopping,
                             on_bytes=on_bytes)
                problem = check_remote(tmp, remote)
                if problem is None:
                    os.replace(tmp, dest)
                    if verdicts is not None and remote.verdict is not None:
                        verdicts.record(dest, remote.verdict)
                    return os.stat(dest).st_size
                mismatch = problem
            except Stopped as e:
                if stopping.is_set():
                    raise ShardFetchError(f"{_where(remote.url)}: the fetch was stopped") from None
                failure = e.reason
            except HttpError as e:
                if e.status is not None:  # the server answered: 404, 403, ...; asking again changes nothing
                    raise ShardFetchError(str(e)) from None
                failure = e.reason
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ShardError(f"the disk of {dest.parent} is full ({_where(remote.url)} did not fit); free "
                                     "space, or lower --stream-cache, or pass another --cache-dir") from None
                if is_write_failure(e):  # a read-only cache, or not ours
                    raise ShardError(f"cannot write {_where(remote.url)} into {dest.parent} ({e.strerror}); make "
                                     "that folder writable, or pass another --cache-dir") from None
                raise
            finally:
                tmp.unlink(missing_ok=True)
        if mismatch is not None and failure is None:
            raise ShardError(f"{_where(remote.url)} {mismatch}, twice: the object at the server changed after it "
                             "was indexed (or the network damages data); rerun to index it again")
        raise ShardFetchError(redact(f"{_where(remote.url)} could not be fetched in {ATTEMPTS} attempts "
                                     f"({failure or mismatch}); check the server and the network, then rerun"))


class _Either:
    """is_set() of either of two events (the caller's and the fetcher's own)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def is_set(self) -> bool:
        return (self.a is not None and self.a.is_set()) or self.b.is_set()


def fetcher_for(remotes: list[Remote]):
    """The fetcher of these shards' scheme (S3, or HTTP(S)); one scheme per run."""
    schemes = {"http" if is_http(r.url) else "s3" for r in remotes}
    if len(schemes) > 1:
        raise ShardFetchError("these shards are partly on S3 and partly at an HTTP(S) server; give them one "
                              "source (copy them to one place)")
    return HttpFetcher() if schemes == {"http"} else Fetcher()


# -- the streaming cache -------------------------------------------------------------------------
class StreamCacheError(ShardError):
    """--stream-cache cannot hold what the epoch plan reads at once, or the disk cannot hold --stream-cache."""


def _mb(n: float, *, up: bool = False, down: bool = False) -> str:
    """A size in decimal units, as --stream-cache takes it ('812 bytes', '37.5 kB', '12.0 MB', '1.2 GB'; never
    '0.0 MB'); `up`: rounded up, for a size that must be enough; `down`: rounded down, for room there is."""
    if n < 1000:
        return f"{math.ceil(n) if up else int(n)} bytes"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if n < scale * 1000 or unit == "GB":
            v = n / scale
            v = math.ceil(round(v * 10, 6)) / 10 if up else math.floor(round(v * 10, 6)) / 10 if down else v
            return f"{v:.1f} {unit}"


def stream_room(folder: Path, local_ranks: int = 1) -> int:
    """The disk the node's stream caches could use: the free space of `folder`'s disk and what this rank's
    cache holds already (each rank's about as much)."""
    folder.mkdir(parents=True, exist_ok=True)
    here = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return shutil.disk_usage(folder).free + here * local_ranks


def stream_folder(data: str, cache_dir: str | Path) -> Path:
    """Where the streaming cache of --data lives: CACHE/stream/BUCKET/PREFIX for s3://, CACHE/stream/http/
    DIGEST for https:// (a digest of --data: its query string may carry a secret)."""
    if is_http(data):
        return http_copies(data, Path(cache_dir) / "stream")
    return local_target(data, Path(cache_dir) / "stream")


def http_copies(data: str, cache_dir: str | Path) -> Path:
    """CACHE/http/DIGEST: where whole copies of --data's https:// shards are kept (pack reads them there)."""
    return Path(cache_dir) / "http" / hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def stream_bound(setting: int | None, folder: Path, local_ranks: int = 1) -> int:
    """This rank's cache bound: --stream-cache (or STREAM_SHARE of the free space) over the node's
    ranks; refused when the disk cannot hold it."""
    room = stream_room(folder, local_ranks)
    if setting is None:
        return max(1, int(room * STREAM_SHARE) // local_ranks)
    if setting > room:
        raise StreamCacheError(f"--stream-cache {_mb(setting)}: the disk of {folder} has {_mb(room, down=True)} free "
                               "for it; free space, pass a smaller --stream-cache, or another --cache-dir")
    return setting // local_ranks


class _Demand:
    """One reader's position and what it will read next, as the URLs of its remote shards."""

    def __init__(self, reader, urls: list[str], remote: set[str]):
        self._reader, self.urls = weakref.ref(reader), [u if u in remote else None for u in urls]
        self.epoch, self.position, self.started, self.need = 0, 0, False, 0
        self.batch = reader.batch

    @property
    def reader(self):
        """The ShardReader, while it lives (a loader that was dropped leaves nothing to protect)."""
        return self._reader()

    def _plan(self, epoch: int):
        reader = self.reader
        return reader.plan(epoch) if reader is not None else None

    def _state(self):
        plan = self._plan(self.epoch)
        if plan is None:
            import numpy as np  # here: `python -m dali_pipe sync` of a pack needs this module, not numpy (60 ms)

            empty = np.zeros(0, np.int64)
            return empty, empty, empty, 0
        shards, first, last = plan.uses
        return shards, first, last, int(first.searchsorted(self.position, side="left"))

    def in_progress(self) -> set[str]:
        """Shards started and not finished: never evicted."""
        shards, _, last, started = self._state()
        return {self.urls[int(s)] for s, end in zip(shards[:started], last[:started])
                if end >= self.position and self.urls[int(s)]}

    def upcoming(self, limit: int) -> list[str]:
        """URLs in the order this reader needs them: in progress, not started, then the next epoch."""
        shards, _, last, started = self._state()
        out = [self.urls[int(s)] for s, end in zip(shards[:started], last[:started]) if end >= self.position]
        out += [self.urls[int(s)] for s in shards[started:started + limit]]
        nxt = self._plan(self.epoch + 1) if len(out) < limit else None
        if nxt is not None:
            out += [self.urls[int(s)] for s in nxt.uses[0][:limit]]
        return [u for u in dict.fromkeys(out) if u][:limit]

    def next_event(self) -> int:
        """The position at which in_progress or upcoming changes (a shard starts or finishes)."""
        _, first, last, started = self._state()
        ahead = [int(first[started])] if started < len(first) else []
        ends = [int(e) + 1 for e in last[:started] if e >= self.position]
        return min(ahead + ends, default=1 << 62)


class StreamCache:
    """Shards of S3 fetched ahead into `folder`, at most `bound` bytes (resident + in flight)."""

    def __init__(self, folder: Path, remotes: list[Remote], bound: int, *, parallel: int = FETCH_PARALLEL,
                 local_ranks: int = 1):
        self.folder, self.bound, self.local_ranks = Path(folder), bound, local_ranks
        self.folder.mkdir(parents=True, exist_ok=True)
        lock(self.folder, "run streaming these shards", "wait for it to finish, or pass another --cache-dir")
        remove_dead_temps(self.folder, ".*.part-*")
        self.fetcher = fetcher_for(remotes)
        self.remotes = {r.url: r for r in self.fetcher.listed(remotes)}
        self.names = _local_names(list(self.remotes))
        self.verdicts = Verdicts(self.folder)
        self.resident: dict[str, int] = {}
        self.inflight: dict[str, int] = {}
        self.failed: dict[str, Exception] = {}
        self.healed: dict[str, int] = {}  # URL -> times fetched again after it went missing or changed
        self.demands: dict[int, _Demand] = {}
        self.active: int | None = None
        self.waiting: str | None = None  # the URL a reader is blocked on
        self.peak = self.fetched = 0
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._event = 0  # position of the active reader's next change
        self._saved = time.monotonic()
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="shard-fetch")
        self._parallel = parallel
        self._thread: threading.Thread | None = None
        self._adopt()
        total = sum(r.size for r in self.remotes.values())
        print(f"stream: {len(self.remotes)} shard(s), {_mb(total)}, fetched ahead of the reader into {self.folder} "
              f"(at most {_mb(bound)} there; {len(self.resident)} already there)", file=sys.stderr, flush=True)

    def _adopt(self) -> None:
        """Shards left by an earlier run that still match are kept (a resume refetches only the rest): by
        their verdict, or hashed again when a kill came before the verdicts file was saved (a shard lands
        under its name only once it has matched, so one of the right size is most likely whole)."""
        wanted = {self.names[u]: u for u in self.remotes}
        check = []
        for f in self.folder.iterdir():
            url = wanted.get(f.name)
            if url is None:  # not a shard of this pack (any more): it would only take room
                if f.is_file() and not f.name.startswith(".") and f.name != VERDICTS_NAME:
                    remove(f, self.folder)
                continue
            if f.is_file() and not f.is_symlink():
                check.append((url, f))

        def whole(item):
            url, f = item
            r = self.remotes[url]
            return url, f, check_remote(f, r, self.verdicts) is None

        with ThreadPoolExecutor(HASH_WORKERS) as pool:
            for url, f, ok in pool.map(whole, check):
                if ok:
                    self.resident[url] = self.remotes[url].size
                else:
                    remove(f, self.folder)
                    self.verdicts.forget(f)

    def local(self, url: str) -> Path:
        return self.folder / self.names[url]

    def view(self, shards) -> "CacheView":
        return CacheView(self, shards)

    # -- the reader side -------------------------------------------------------------------------
    def register(self, reader, urls: list[str], *, check: bool = True) -> None:
        """A reader (a ShardReader) whose plan drives the fetching; refused (`check`) when the bound cannot
        hold what its plans and those registered before have in use at once. Register every reader of a
        run with check=False, then call check() once: its refusal then asks for a size enough for all."""
        sizes = [self.remotes[u].size if u in self.remotes else 0 for u in urls]
        need = max(reader.plan(e).in_use(sizes, extra=reader.batch) for e in (0, 1))
        with self._cv:
            self._forget_dead()
            d = _Demand(reader, urls, set(self.remotes))
            d.need, d.largest = need, max(sizes, default=0)
            self.demands[id(reader)] = d
        if check:
            self.check()

    def minimum(self) -> int:
        """The least --stream-cache (for the node's ranks) that holds what the registered readers have in
        use at once: their shuffle windows' shards and one more shard."""
        with self._cv:
            self._forget_dead()
            demands = list(self.demands.values())
        return (sum(d.need for d in demands) + max((d.largest for d in demands), default=0)) * self.local_ranks

    def check(self) -> None:
        """StreamCacheError when the bound is below minimum(), asking for a size that is enough for every
        registered reader (and saying so when the disk has less room than that)."""
        total = -(-self.minimum() // self.local_ranks)
        if total <= self.bound:
            return
        largest = max((d.largest for d in self.demands.values()), default=0)
        enough = _mb(total * self.local_ranks, up=True)
        room = stream_room(self.folder, self.local_ranks)
        disk = (f"; the disk of {self.folder} has only {_mb(room, down=True)} free for it, so free space there or "
                "pass another --cache-dir" if parse_size(enough) > room else "")
        raise StreamCacheError(
            f"--stream-cache gives this process {_mb(self.bound)}, but its readers (training and validation) have up "
            f"to {_mb(total)} of shards in use at once (their shuffle windows' shards, up to {_mb(largest)} each, "
            f"and one more); raise --stream-cache to at least {enough}{disk}, or pack with a smaller --shard-size")

    def _forget_dead(self) -> None:
        for key in [k for k, d in self.demands.items() if d.reader is None]:
            del self.demands[key]
            if self.active == key:
                self.active = None

    def advance(self, reader, epoch: int, position: int) -> None:
        d = self.demands.get(id(reader))
        if d is None or d.reader is not reader:
            return
        with self._cv:
            changed = epoch != d.epoch or not d.started
            d.epoch, d.position, d.started = epoch, position, True
            if self.active != id(reader):
                self.active, changed = id(reader), True
            if changed or position >= self._event:
                self._cv.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._schedule, name="shard-cache", daemon=True)
            self._thread.start()

    def path(self, url: str, reader) -> str:
        """The local path of `url` once it has landed and matched, checked again (a stat; a hash when its
        size or mtime changed) before it is handed out: a shard gone or changed is fetched again."""
        r = self.remotes[url]
        while True:
            local = self._landed(url, reader)
            problem = check_remote(local, r, self.verdicts)
            if problem is None:
                return local
            self.lost(url, problem)

    def lost(self, url: str, why: str) -> None:
        """`url`'s local copy is missing or damaged (`why`): remove it and fetch it again, HEALS times at most
        per run; then a ShardError (something else keeps changing the cache)."""
        with self._cv:
            if url not in self.resident:  # evicted meanwhile (not lost): fetched again when it is needed
                return
            n = self.healed.get(url, 0)
            if n >= HEALS:
                raise ShardError(f"{self.local(url)} (the cached copy of {url}) {why}, after it was fetched again "
                                 f"{n} time(s): something else removes or writes files in {self.folder}; give this "
                                 "run a --cache-dir of its own")
            self.healed[url] = n + 1
            self.resident.pop(url)
            remove(self.local(url), self.folder, quiet=True)
            self.verdicts.forget(self.local(url))
            self._cv.notify_all()
        print(f"stream: {self.local(url)} {why}; fetching {url} again", file=sys.stderr, flush=True)

    def _landed(self, url: str, reader) -> str:
        """Wait (bounded) until `url` is resident, then its local path."""
        r = self.remotes[url]
        limit = ATTEMPTS * (ATTEMPT_DEADLINE + (r.size or 0) / MIN_RATE) + 60
        start = time.monotonic()
        with self._cv:
            if url in self.resident:
                return str(self.local(url))
            self.active, self.waiting = id(reader), url
            self._cv.notify_all()
            while url not in self.resident:
                if url in self.failed:
                    raise self.failed[url]
                if self._stop.is_set():
                    raise ShardFetchError(f"{_where(url)}: the streaming cache was closed")
                if time.monotonic() - start > limit:
                    raise ShardFetchError(f"{_where(url)}: not fetched within {limit:.0f} s; check the endpoint "
                                          "and the network")
                self._cv.wait(0.5)
            if self.waiting == url:
                self.waiting = None
            return str(self.local(url))

    # -- the fetching side -----------------------------------------------------------------------
    def _limit(self) -> int:
        smallest = min((r.size for r in self.remotes.values() if r.size), default=1)
        return int(min(len(self.remotes) * 2 + 4, 2 * self.bound // max(1, smallest) + 64))

    def _schedule(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                try:
                    self._step()
                except Exception as e:  # never die silently: the blocked reader gets the error
                    if self.waiting is not None:
                        self.failed[self.waiting] = e
                    self._cv.notify_all()
                self._cv.wait(1.0)

    def _step(self) -> None:
        """Start what the plans need next, evicting what they need last (called holding the lock)."""
        self._forget_dead()
        active = self.demands.get(self.active)
        if active is None:
            return
        limit = self._limit()
        order = active.upcoming(limit)
        for d in self.demands.values():
            if d is not active and d.started:
                order += [u for u in d.upcoming(limit) if u not in order]
        rank = {u: i for i, u in enumerate(order)}
        protected = set().union(*(d.in_progress() for d in self.demands.values() if d.started))
        self._event = active.next_event()
        for url in order:
            if len(self.inflight) >= self._parallel:
                break
            if url in self.resident or url in self.inflight or url in self.failed:
                continue
            size = self.remotes[url].size
            free = self.bound - sum(self.resident.values()) - sum(self.inflight.values())
            if size > free:
                victims = sorted((u for u in self.resident if u not in protected and rank.get(u, 1 << 62) > rank[url]),
                                 key=lambda u: -rank.get(u, 1 << 62))
                for u in victims:
                    if size <= free:
                        break
                    free += self._evict(u)
                if size > free:
                    if url == self.waiting and not self.inflight:
                        self.failed[url] = StreamCacheError(
                            f"the streaming cache ({_mb(self.bound)}) is full of shards in use and cannot take "
                            f"{url} ({_mb(size)}); raise --stream-cache")
                        self._cv.notify_all()
                    break
            self.inflight[url] = size
            self.peak = max(self.peak, sum(self.resident.values()) + sum(self.inflight.values()))
            self._pool.submit(self._fetch, url)

    def _evict(self, url: str) -> int:
        size = self.resident.pop(url)
        path = self.local(url)
        remove(path, self.folder, quiet=True)
        self.verdicts.forget(path)
        return size

    def _fetch(self, url: str) -> None:
        try:
            self.fetcher.fetch(self.remotes[url], self.local(url), stop=self._stop, verdicts=self.verdicts)
        except Exception as e:
            with self._cv:
                self.inflight.pop(url, None)
                self.failed[url] = e if isinstance(e, UserError) else ShardFetchError(f"{_where(url)}: {e}")
                self._cv.notify_all()
            return
        with self._cv:
            self.resident[url] = self.inflight.pop(url)
            self.fetched += 1
            self._cv.notify_all()
            save = time.monotonic() - self._saved > 2.0
            if save:
                self._saved = time.monotonic()
        if save:  # so that a killed run's landed shards are kept by the next one
            self.verdicts.save()

    def close(self) -> None:
        """Stop fetching (in-flight transfers are cancelled); landed shards stay for the next run."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self.fetcher.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.verdicts.save()
        unlock(self.folder)
        print(f"stream: fetched {self.fetched} shard(s); the cache held at most {_mb(self.peak)} of its "
              f"{_mb(self.bound)}", file=sys.stderr, flush=True)


class CacheView:
    """The store a ShardReader reads through: its shards' positions -> local paths, local files
    as they are, s3:// ones through the cache."""

    def __init__(self, cache: StreamCache, shards):
        self.cache, self.paths = cache, list(shards.paths)

    def register(self, reader, *, check: bool = True) -> None:
        self.cache.register(reader, self.paths, check=check)

    def path(self, shard: int, reader) -> str:
        p = self.paths[shard]
        return self.cache.path(p, reader) if is_remote(p) else p

    def lost(self, shard: int, reader, why: str) -> bool:
        """The reader found shard's local file missing or short (`why`): True when it is fetched again (a
        streamed shard), False for a local file, which only the user can restore."""
        p = self.paths[shard]
        if not is_remote(p):
            return False
        self.cache.lost(p, why)
        return True

    def advance(self, reader, epoch: int, position: int) -> None:
        self.cache.advance(reader, epoch, position)


def listed(remotes: list[Remote], engine: Engine, found: dict[str, tuple[int, str]] | None = None) -> list[Remote]:
    """The shards with their sizes and ETags from one LIST per prefix (or `found`, {url: (size, ETag)}, a
    listing the caller made): no HEAD per shard, and a shard whose size in S3 differs from what packed.json
    says is named before anything is fetched."""
    if found is None:
        found = {}
        for base in sorted({r.url.rsplit("/", 1)[0] for r in remotes}):
            bucket, prefix = _split(base + "/x")
            try:
                for rel, meta in listing(engine, bucket, prefix[:-1]).items():
                    found[f"{base}/{rel}"] = meta
            except SyncError as e:
                raise ShardFetchError(str(e)) from None
    out = []
    for r in remotes:
        if r.url not in found:
            raise ShardFetchError(f"{_where(r.url)}: the shard is not in S3; check the prefix, or upload the pack "
                                  "again")
        size, etag = found[r.url]
        if r.size is not None and size != r.size:
            raise ShardError(f"{r.url} has {size} bytes in S3, {r.size} expected (packed.json): it was replaced after "
                             "packing; upload the pack again")
        out.append(Remote(r.url, size, r.sha256, f'"{etag}"', r.xxh3))
    return out


def local_name(url: str) -> str:
    """The file name of a shard's local copy: the key's base name (S3), or a digest and the base name
    without the query string, which may carry a signature (HTTP)."""
    return cache_name(url) if is_http(url) else (url.rsplit("/", 1)[-1] or "shard")


def _local_names(urls: list[str]) -> dict[str, str]:
    """A file name per URL (local_name), prefixed by a number where two share one."""
    names: dict[str, str] = {}
    seen: dict[str, int] = {}
    for u in urls:
        base = local_name(u)
        n = seen.get(base, 0)
        seen[base] = n + 1
        names[u] = base if n == 0 else f"{n}-{base}"
    return names


# -- a pack on S3: synced whole, or made ready for streaming -------------------------------------
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
        total = sum(s["size"] for s in shards)
        free = shutil.disk_usage(local).free + sum((local / s["name"]).stat().st_size for s in shards
                                                   if (local / s["name"]).is_file())
        if mode == "auto":
            mode = "sync" if free >= total + HEADROOM else "stream"
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
    (local / PACKED_NAME).write_bytes(raw)  # last: the local copy is complete
    if stats is not None:
        got.seconds = time.perf_counter() - start
        stats.__dict__.update(got.__dict__)
    return local


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
            for fut in as_completed(futures):
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
