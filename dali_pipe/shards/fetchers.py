"""One shard object fetched into a local file, bounded and checked: from S3 or from an http(s):// server,
through the transfer engine (`Fetcher`: ranged parallel GETs, or one streamed GET from a server that answers
ranges whole), each attempt given a stall bound and a deadline, `Bounds.attempts` whole attempts, the size and
checksum checked before the rename.
"""
from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import CancelledError, wait
from pathlib import Path

from ..https import explain_http, is_http, shown, status_of
from ..landing import temp_path
from ..redact import redact
from ..s3 import Bounds, SyncError, TransferError, explain, parse_s3_uri
from ..stop import check
from ..stores import locate
from ..sync import endpoint, listing
from ..transfer import REQUEST_LIMIT, Engine
from ..workdir import atomic, is_write_failure
from .verdicts import (
    Remote,
    ShardError,
    ShardFetchError,
    Verdicts,
    check_file,
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
    """Shards of S3 or of an http(s):// server through the transfer engine (dali_pipe/transfer.py: ranged GETs,
    PART_CONCURRENCY in flight across the shards being fetched), each attempt bounded by its own watchdog.
    `request_limit`: the most one request may take (a whole shard's GET, from a server that answers ranges
    whole: fetcher_for gives the largest shard's attempt deadline)."""

    def __init__(self, concurrency: int = PART_CONCURRENCY, bounds: Bounds = SHARD_BOUNDS,
                 request_limit: float = REQUEST_LIMIT):
        # an engine of its own, never a caller's: its request bound keeps every attempt of FETCH_PARALLEL under way
        # (with a caller's `--workers 1`, a shard queued behind another counted as silent and was cancelled), and
        # its read timeout is the one a stalled shard body is retried after
        self.bounds = bounds
        self.engine = Engine(concurrency=concurrency, connect_timeout=bounds.connect_timeout,
                             read_timeout=bounds.read_timeout, attempts=bounds.request_attempts,
                             request_limit=request_limit)
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
        """The shards with their sizes and ETags from S3 (`listed`); https:// ones as indexed (their sizes and
        checksums are known: each fetch checks them)."""
        if remotes and is_http(remotes[0].url):
            return list(remotes)
        return listed(remotes, self.engine)

    def size_of(self, url: str) -> int:
        bucket, key = locate(url)
        try:
            return self.engine.run(self.engine.size(bucket, key))
        except TransferError as e:
            raise ShardFetchError(self._explain(e, url)) from None

    def _explain(self, e: TransferError, url: str) -> str:
        if is_http(url):
            return explain_http(e, url, self.bounds)
        return f"{where(url)}: {explain(e, *split_url(url))}"

    def fetch(self, remote: Remote, dest: Path, *, stop: threading.Event | None = None,
              verdicts: Verdicts | None = None, on_bytes=None) -> int:
        """Download `remote` to `dest` through a temporary name; its size and checksum checked before the
        rename (a mismatch is fetched once more). Returns the bytes. Raises ShardError / ShardFetchError."""
        bucket, key = locate(remote.url)
        size = remote.size if remote.size is not None else self.size_of(remote.url)
        mismatch, failure = None, None
        for attempt in range(self.bounds.attempts):
            if stop is not None and stop.is_set():
                raise ShardFetchError(f"{where(remote.url)}: the fetch was stopped")
            tmp = temp_path(dest)
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)  # each time: a cache folder removed meanwhile comes back
                with atomic(dest, tmp):
                    digest = self._one(bucket, key, tmp, size, on_bytes, remote.etag, digest=remote.digest(), stop=stop)
                    Mismatch.check(check_file(tmp, size, remote.sha256, xxh3=remote.xxh3, digest=digest))
                if verdicts is not None and remote.verdict is not None:
                    verdicts.record(dest, remote.verdict)
                return size
            except Mismatch as e:
                mismatch = e.problem
            except TimeoutError as e:
                failure = str(e)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise ShardError(f"the disk of {dest.parent} is full ({shown(remote.url)} did not fit); free "
                                     "space, or lower --stream-cache, or pass another --cache-dir") from None
                if is_write_failure(e):  # a read-only cache, or not ours
                    raise ShardError(f"cannot write {shown(remote.url)} into {dest.parent} ({e.strerror}); make "
                                     "that folder writable, or pass another --cache-dir") from None
                failure, mismatch = f"{type(e).__name__}: {redact(str(e))[:200]}", None
            except TransferError as e:
                if self._final(e, remote.url):  # asking again changes nothing
                    raise ShardFetchError(self._explain(e, remote.url)) from None
                failure, mismatch = f"{e.code}: {e.detail}", None
        if mismatch is not None and failure is None:
            if is_http(remote.url):
                raise ShardError(f"{where(remote.url)} {mismatch}, twice: the object at the server changed after it "
                                 "was indexed (or the network damages data); rerun to index it again")
            raise ShardError(f"{where(remote.url)} does not match its size and checksum ({mismatch}), twice: the "
                             "object in S3 is damaged or was replaced after packing (or the network damages data); "
                             "upload the pack again")
        source = "the server" if is_http(remote.url) else "the endpoint"
        raise ShardFetchError(redact(f"{where(remote.url)} could not be fetched in {self.bounds.attempts} attempts "
                                     f"({failure or mismatch}); check {source} and the network, then rerun "
                                     "(finished shards are kept)"))

    @staticmethod
    def _final(e: TransferError, url: str) -> bool:
        """Whether a failed attempt is final: the object is not there or not ours to read (an http(s):// server's
        answer of any status, as the engine retried 429 and 5xx already)."""
        if is_http(url):
            return e.status is not None or status_of(e) is not None or "Content-Length Header missing" in e.detail
        return e.code in ("NoSuchKey", "404", "NotFound", "NoSuchBucket", "AccessDenied", "403", "credentials")

    def _one(self, bucket: str, key: str, tmp: Path, size: int, on_bytes, etag: str | None = None, *,
             digest=None, stop: threading.Event | None = None) -> str | None:
        """One download through the engine, cancelled when it stalls, runs past its deadline or `stop` is set;
        with `digest` (Remote.digest), returns its hexdigest of the bytes it wrote (computed as they landed)."""
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
                check()  # in the main thread (a sync), SIGTERM and Ctrl-C are acted on here (stop.py)
                if self._closed or (stop is not None and stop.is_set()):
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


def fetcher_for(remotes: list[Remote], bounds: Bounds = SHARD_BOUNDS) -> Fetcher:
    """The fetcher of these shards: one source per run (an engine learns once whether its server answers ranged
    GETs, and a server that does not sends each shard in one GET, bounded by the largest shard's deadline)."""
    schemes = {"http" if is_http(r.url) else "s3" for r in remotes}
    if len(schemes) > 1:
        raise ShardFetchError("these shards are partly on S3 and partly at an HTTP(S) server; give them one "
                              "source (copy them to one place)")
    longest = max((bounds.deadline(r.size) for r in remotes), default=0.0)
    return Fetcher(bounds=bounds, request_limit=max(REQUEST_LIMIT, longest))


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
