"""One shard object fetched into a local file, bounded and checked: from S3 with ranged parallel GETs through
the transfer engine (`Fetcher`), or from an https:// server through dali_pipe/https.py (`HttpFetcher`), each
attempt given a stall bound and a deadline, ATTEMPTS whole attempts, the size and checksum checked before the
rename.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import CancelledError, wait
from pathlib import Path

from ..https import HttpError, Stopped, download, is_http, shown
from ..landing import temp_path
from ..redact import redact
from ..s3 import Bounds, SyncError, TransferError, explain, parse_s3_uri
from ..sync import endpoint, listing
from ..transfer import Engine
from ..workdir import atomic, is_write_failure
from .verdicts import (
    Remote,
    ShardError,
    ShardFetchError,
    Verdicts,
    check_file,
    check_remote,
)

PART_CONCURRENCY = 8  # ranged GETs at once (transfer.PART bytes each), across the shards in flight


SHARD_BOUNDS = Bounds()  # a shard's timeouts and retries (s3.Bounds' defaults)


class Mismatch(Exception):
    """A fetched copy that is not the object it should be (its size or checksum): it does not land."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem

    @classmethod
    def check(cls, problem: str | None) -> None:
        if problem is not None:
            raise cls(problem)


def split_url(url: str) -> tuple[str, str]:
    return parse_s3_uri(url)


def where(url: str) -> str:
    return shown(url) if is_http(url) else f"{url} (endpoint {endpoint()})"


class Fetcher:
    """Shards through the transfer engine (dali_pipe/transfer.py: ranged GETs, PART_CONCURRENCY in flight
    across the shards being fetched), each attempt bounded by its own watchdog."""

    def __init__(self, concurrency: int = PART_CONCURRENCY, bounds: Bounds = SHARD_BOUNDS):
        # an engine of its own, never a caller's: its request bound keeps every attempt of FETCH_PARALLEL under way
        # (with a caller's `--workers 1`, a shard queued behind another counted as silent and was cancelled), and
        # its read timeout is the one a stalled shard body is retried after
        self.bounds = bounds
        self.engine = Engine(concurrency=concurrency, connect_timeout=bounds.connect_timeout,
                             read_timeout=bounds.read_timeout, attempts=bounds.request_attempts)
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
        bucket, key = split_url(url)
        try:
            return self.engine.run(self.engine.size(bucket, key))
        except TransferError as e:
            raise ShardFetchError(f"{where(url)}: {explain(e, bucket, key)}") from None

    def fetch(self, remote: Remote, dest: Path, *, stop: threading.Event | None = None,
              verdicts: Verdicts | None = None, on_bytes=None) -> int:
        """Download `remote` to `dest` through a temporary name; its size and checksum checked before the
        rename (a mismatch is fetched once more). Returns the bytes. Raises ShardError / ShardFetchError."""
        bucket, key = split_url(remote.url)
        size = remote.size if remote.size is not None else self.size_of(remote.url)
        mismatch, failure = None, None
        for attempt in range(self.bounds.attempts):
            if stop is not None and stop.is_set():
                raise ShardFetchError(f"{where(remote.url)}: the fetch was stopped")
            tmp = temp_path(dest)
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)  # each time: a cache folder removed meanwhile comes back
                with atomic(dest, tmp):
                    digest = self._one(bucket, key, tmp, size, on_bytes, remote.etag, digest=remote.digest())
                    Mismatch.check(check_file(tmp, size, remote.sha256, xxh3=remote.xxh3, digest=digest))
                if verdicts is not None and remote.verdict is not None:
                    verdicts.record(dest, remote.verdict)
                return size
            except Mismatch as e:
                mismatch = e.problem
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
                    raise ShardFetchError(f"{where(remote.url)}: {explain(e, bucket, key)}") from None
                failure, mismatch = f"{e.code}: {e.detail}", None
        if mismatch is not None and failure is None:
            raise ShardError(f"{where(remote.url)} does not match its size and checksum ({mismatch}), twice: the "
                             "object in S3 is damaged or was replaced after packing (or the network damages data); "
                             "upload the pack again")

        raise ShardFetchError(redact(f"{where(remote.url)} could not be fetched in {self.bounds.attempts} attempts "
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

        deadline, stall = self.bounds.deadline(size), self.bounds.stall
        if self._closed:
            raise TimeoutError("the run is ending")
        future = self.engine.submit(self.engine.download(bucket, key, tmp, size, etag=etag, on_bytes=progress,
                                                         digest=digest))
        self._futures.add(future)
        start = time.monotonic()
        try:
            while not future.done():  # a watchdog: nothing for `stall` seconds, or past the deadline
                wait([future], timeout=0.2)  # returns as soon as the download ends
                if self._closed:
                    future.cancel()
                    raise TimeoutError("the run is ending")
                now = time.monotonic()
                if now - last[0] > stall or now - start > deadline:
                    future.cancel()  # its requests are dropped and its temporary file removed on the loop
                    raise TimeoutError(f"no byte for {stall:.0f} s" if now - last[0] > stall else
                                       f"no complete copy within {deadline:.0f} s")
            future.result()
        except CancelledError:
            raise TimeoutError("the run is ending") from None
        finally:
            self._futures.discard(future)
        return None if digest is None else digest.hexdigest()


class HttpFetcher:
    """https:// (and http://) shards, with the bounds of Fetcher: one streaming GET per attempt into a
    temporary name, continued with a Range request where a connection is cut (https.download), `attempts`
    whole attempts, each cancelled past its deadline (Bounds.deadline) or when the run ends (a stalled body
    fails within the read timeout); size and checksum checked before the rename."""

    def __init__(self, bounds: Bounds = SHARD_BOUNDS):
        self.bounds = bounds
        self._stop = threading.Event()

    def listed(self, remotes: list[Remote]) -> list[Remote]:
        """The shards as indexed (their sizes and checksums are known: each fetch checks them)."""
        return list(remotes)

    def close(self) -> None:
        self._stop.set()

    def fetch(self, remote: Remote, dest: Path, *, stop: threading.Event | None = None,
              verdicts: Verdicts | None = None, on_bytes=None) -> int:
        deadline_s = self.bounds.deadline(remote.size)
        mismatch, failure = None, None
        for _ in range(self.bounds.attempts):
            if (stop is not None and stop.is_set()) or self._stop.is_set():
                raise ShardFetchError(f"{where(remote.url)}: the fetch was stopped")
            tmp = temp_path(dest)
            stopping = _Either(stop, self._stop)
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)  # each time: a cache folder removed meanwhile comes back
                with atomic(dest, tmp):
                    with open(tmp, "wb") as f:
                        download(remote.url, f, size=remote.size, deadline=time.monotonic() + deadline_s,
                                 stop=stopping, on_bytes=on_bytes)
                    Mismatch.check(check_remote(tmp, remote))
                if verdicts is not None and remote.verdict is not None:
                    verdicts.record(dest, remote.verdict)
                return os.stat(dest).st_size
            except Mismatch as e:
                mismatch = e.problem
            except Stopped as e:
                if stopping.is_set():
                    raise ShardFetchError(f"{where(remote.url)}: the fetch was stopped") from None
                failure = e.reason
            except HttpError as e:
                if e.status is not None:  # the server answered: 404, 403, ...; asking again changes nothing
                    raise ShardFetchError(str(e)) from None
                failure = e.reason
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ShardError(f"the disk of {dest.parent} is full ({where(remote.url)} did not fit); free "
                                     "space, or lower --stream-cache, or pass another --cache-dir") from None
                if is_write_failure(e):  # a read-only cache, or not ours
                    raise ShardError(f"cannot write {where(remote.url)} into {dest.parent} ({e.strerror}); make "
                                     "that folder writable, or pass another --cache-dir") from None
                raise
        if mismatch is not None and failure is None:
            raise ShardError(f"{where(remote.url)} {mismatch}, twice: the object at the server changed after it "
                             "was indexed (or the network damages data); rerun to index it again")
        raise ShardFetchError(redact(f"{where(remote.url)} could not be fetched in {self.bounds.attempts} attempts "
                                     f"({failure or mismatch}); check the server and the network, then rerun"))


class _Either:
    """is_set() of either of two events (the caller's and the fetcher's own)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def is_set(self) -> bool:
        return (self.a is not None and self.a.is_set()) or self.b.is_set()


def fetcher_for(remotes: list[Remote], bounds: Bounds = SHARD_BOUNDS):
    """The fetcher of these shards' scheme (S3, or HTTP(S)); one scheme per run."""
    schemes = {"http" if is_http(r.url) else "s3" for r in remotes}
    if len(schemes) > 1:
        raise ShardFetchError("these shards are partly on S3 and partly at an HTTP(S) server; give them one "
                              "source (copy them to one place)")
    return HttpFetcher(bounds) if schemes == {"http"} else Fetcher(bounds=bounds)


def listed(remotes: list[Remote], engine: Engine, found: dict[str, tuple[int, str]] | None = None) -> list[Remote]:
    """The shards with their sizes and ETags from one LIST per prefix (or `found`, {url: (size, ETag)}, a
    listing the caller made): no HEAD per shard, and a shard whose size in S3 differs from what packed.json
    says is named before anything is fetched."""
    if found is None:
        found = {}
        for base in sorted({r.url.rsplit("/", 1)[0] for r in remotes}):
            bucket, prefix = split_url(base + "/x")
            try:
                for rel, meta in listing(engine, bucket, prefix[:-1]).items():
                    found[f"{base}/{rel}"] = meta
            except SyncError as e:
                raise ShardFetchError(str(e)) from None
    out = []
    for r in remotes:
        if r.url not in found:
            raise ShardFetchError(f"{where(r.url)}: the shard is not in S3; check the prefix, or upload the pack "
                                  "again")
        size, etag = found[r.url]
        if r.size is not None and size != r.size:
            raise ShardError(f"{r.url} has {size} bytes in S3, {r.size} expected (packed.json): it was replaced after "
                             "packing; upload the pack again")
        out.append(Remote(r.url, size, r.sha256, f'"{etag}"', r.xxh3))
    return out
