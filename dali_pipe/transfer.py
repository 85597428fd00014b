"""The transfer engine: objects from S3, or from an http(s):// server, into local files, many small ones and
large ones alike, through obstore (Python bindings of Rust's `object_store`) on one event loop thread.

- One client for every object store: `Engine.store(name)` makes the store a name stands for, an S3 bucket's
  S3Store or an http(s):// URL's HTTPStore (dali_pipe/stores.py: `locate`, the options both take). Local
  paths are read as files (nothing to transfer).

- One path: every object is one GET (objects above PART bytes: ranged GETs of PART bytes, up to
  the engine's concurrency at once, each written at its offset, each answer's ETag checked against
  the listed one) into a temporary file that the
  caller names; a failed or cancelled download removes it. A server that answers a ranged GET with status
  200, which object_store refuses (one that ignores Range, or rclone's serve s3, which sends the range as a
  200), is found out by one request, the first part of the first large object, asked alone: then that
  object and the ones after it come in one streamed GET each.
  Streamed bodies are written (and, when asked, hashed: `digest`) on worker threads, in chunks of CHUNK,
  so the loop stays free for the other requests and a shard's checksum costs no second read. The requests of a whole sync share one
  bound (`concurrency`): a dataset of 1.2 M JPEGs and a pack of 150 MB shards take the same road.
- Bounded: connect and read timeouts and `attempts` tries per request (obstore retries 5xx answers
  such as S3's 503 SlowDown, cut connections and stalled bodies, with exponential backoff); the
  callers add their own deadlines (a whole sync stops after a silence, SYNC_BOUNDS.stall; a shard
  attempt after its own, shards/cache.py). Cancelling a download (SIGTERM, Ctrl-C, a deadline) drops
  its requests and removes its temporary file.
- The standard AWS environment: credentials from botocore's chain (keys, AWS_PROFILE and the config
  files, SSO, web identity, the container credentials that SageMaker and ECS hand out, the instance
  role), refreshed as they expire; keys in the environment (the chain's first link) are read without
  botocore, and so is AWS_DEFAULT_REGION with them; the region and AWS_ENDPOINT_URL_S3 /
  AWS_ENDPOINT_URL, which may carry KEY:SECRET@ (then those sign the requests and are never sent or
  printed). An endpoint of our own (moto, rclone, MinIO) is addressed path-style, AWS virtual-hosted,
  in the bucket's region.
- Memory: in our commands (own_process; never in a user's own process) an engine has glibc's malloc keep
  what a transfer frees for the next chunk (keep_freed_memory),
  which cuts a large pack's page faults by more than half; left alone where the user tunes malloc.

Why obstore: side by side with AWS's Common Runtime (awscrt through s3transfer's CRT transfer manager,
and awscrt's S3 client driven directly) and with s5cmd on 5120 ImageNet-size JPEGs, obstore listed
and fetched as fast as s5cmd with the least CPU per file; the CRT paths spent more Python per request
(docs/s3-and-packs.md has the numbers). object_store refuses keys with an empty or a `.`/`..` path
segment (`a//b.jpg`): a prefix holding one is listed by boto3 instead (slower; such keys are never a
manifest row, which is normalised).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import io
import os
import threading
from concurrent.futures import Future
from datetime import datetime, timedelta, timezone
from pathlib import Path

from .https import is_http
from .landing import create_file, hash_file, land, remove_quietly, write_at
from .limits import requests_room, tune_for_transfers
from .s3 import (
    TransferError,
    botocore_credentials,
    bucket_region,
    classify,
    endpoint_credentials,
    endpoint_url,
    env_keys,
    from_botocore,
    list_with_boto3,
)
from .stop import result
from .stores import HTTP_STORES, Chunks, client_options, http_store, retry_config
from .workdir import atomic

PART = 8 << 20  # objects above this size are fetched in ranged GETs of this size
PUT_PARTS = 4  # parts of one upload in flight at once
CHUNK = 1 << 20  # a streamed body is written (hashed, counted as progress) in chunks of about this size
WRITERS = 4  # threads that write (and hash) streamed bodies
IN_FLIGHT_BYTES = 256 << 20  # body bytes held in memory at once, across all requests: a whole object read up
# to PART, or two CHUNKs per streamed body; so memory is bounded whatever --workers (256 objects of up to
# PART in flight would otherwise hold 2 GB)
REQUEST_LIMIT = 300.0  # seconds one request may take at most (a part of PART bytes at under 30 kB/s)
CREDENTIALS_TTL = timedelta(minutes=5)  # how long obstore keeps a set of credentials before asking again
_abandoned = [False]  # whether a request was cancelled while obstore's runtime may still be running it


def abandoned() -> bool:
    """Whether this process cancelled a request that obstore's own (tokio) threads may still be finishing. Such a
    thread hands its result back to Python when it ends, and one that does so after the interpreter has finalized
    crashes the process (SIGSEGV in PyGILState_Ensure, seen in 3 of 118 syncs stopped by SIGTERM while
    dataset.tsv, packed.json and the LIST were in flight): a command that did so ends without finalization
    (cli.end_command)."""
    return _abandoned[0]


def _note_cancelled(future: Future) -> None:
    if future.cancelled():
        _abandoned[0] = True


class Engine:
    """obstore's stores (one per S3 bucket; per folder or URL of an http(s):// server) and the event loop that
    drives them, on a thread of its own.

    `concurrency`: requests in flight at once, across everything the engine does. The timeouts and
    `attempts` bound each request."""

    def __init__(self, *, concurrency: int, connect_timeout: float, read_timeout: float, attempts: int,
                 request_limit: float = REQUEST_LIMIT):
        self.concurrency, self.attempts = requests_room(max(1, concurrency)), max(1, attempts)
        self.ranges: bool | None = None  # whether the server answers ranged GETs with 206; None: not asked yet
        self._asking: asyncio.Event | None = None  # set when the download that asks has its answer
        self.connect_timeout, self.read_timeout, self.request_limit = connect_timeout, read_timeout, request_limit
        self._stores: dict[str, object] = {}
        self._lock = threading.Lock()
        tune_for_transfers()  # process-wide, so only in our commands (limits.own_process), never a user's
        self._loop = asyncio.new_event_loop()
        self._slots: asyncio.Semaphore | None = None
        self._waiting: collections.deque = collections.deque()  # (bytes, future) of requests waiting, in turn
        self.held = self.held_peak = 0  # body bytes held now (IN_FLIGHT_BYTES at most), and the most at once
        self._writers = concurrent.futures.ThreadPoolExecutor(WRITERS, thread_name_prefix="s3-writes")
        self._thread = threading.Thread(target=self._loop.run_forever, name="s3-transfers", daemon=True)
        self._thread.start()
        self._closed = False

    # -- configuration -------------------------------------------------------------------------
    def store(self, bucket: str):
        """The obstore store of `bucket` (made once): an S3 bucket's S3Store (endpoint, region, credentials,
        bounds), or for an http(s):// URL (a store name from `locate`) an HTTPStore with the same bounds."""
        with self._lock:
            if bucket not in self._stores:
                if is_http(bucket):
                    made = [name for name in self._stores if is_http(name)]
                    if len(made) >= HTTP_STORES:  # (a store in use stays alive while its request runs)
                        del self._stores[made[0]]
                    self._stores[bucket] = http_store(bucket, client_options(self.connect_timeout, self.read_timeout, self.request_limit), retry_config(self.attempts))
                else:
                    self._stores[bucket] = self._make_store(bucket)
            return self._stores[bucket]

    def _make_store(self, bucket: str):
        from obstore.store import S3Store

        given = endpoint_credentials()
        url = given.get("endpoint_url") or endpoint_url()
        keys = (given["aws_access_key_id"], given["aws_secret_access_key"], None) if given else env_keys()
        if keys:
            def credentials():
                return {"access_key_id": keys[0], "secret_access_key": keys[1], "token": keys[2],
                        "expires_at": datetime.now(timezone.utc) + CREDENTIALS_TTL}
        else:
            creds = botocore_credentials()  # botocore's chain: profiles, SSO, container, instance role

            def credentials():
                frozen = creds.get_frozen_credentials()  # refreshed by botocore before it expires
                return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                        "token": frozen.token, "expires_at": datetime.now(timezone.utc) + CREDENTIALS_TTL}
        region = os.environ.get("AWS_DEFAULT_REGION") if keys else None
        region = region or from_botocore(lambda session: session.get_config_variable("region")) or "us-east-1"
        if url is None:
            region = from_botocore(lambda session: bucket_region(session, bucket)) or region
        return S3Store(
            bucket, endpoint=url, region=region, virtual_hosted_style_request=url is None,
            credential_provider=credentials, client_options=client_options(self.connect_timeout, self.read_timeout, self.request_limit),
            retry_config=retry_config(self.attempts))

    # -- running coroutines from other threads ---------------------------------------------------
    def submit(self, coro) -> Future:
        """Run `coro` on the engine's loop; cancelling the returned future cancels it."""
        if self._closed:
            coro.close()
            raise RuntimeError("the transfer engine is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        future.add_done_callback(_note_cancelled)
        return future

    def run(self, coro, timeout: float | None = None):
        """Run `coro` on the engine's loop and wait for its result here (cancelled if this thread is
        interrupted: SIGTERM, Ctrl-C)."""
        return self.wait(self.submit(coro), timeout)

    @staticmethod
    def wait(fut: Future, timeout: float | None = None):
        """The result of `fut` (a coroutine submitted to the engine), waited for here; cancelled if this thread is
        interrupted (SIGTERM, Ctrl-C) or the wait times out."""
        return result(fut, timeout)  # the stop's flag looked at while waiting (stop.py)

    def close(self) -> None:
        """Cancel what still runs and stop the loop's thread."""
        if self._closed:
            return
        self._closed = True

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            _abandoned[0] = _abandoned[0] or bool(tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(10)
        except Exception:  # noqa: S110 - best effort at shutdown
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()  # its selector's descriptors go now, not at a later collection
        self._writers.shutdown(wait=True)  # idle by now: every download waits for its writes, even cancelled

    # -- requests (coroutines, run on the loop) ---------------------------------------------------
    def _slot(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrency)
        return self._slots

    @contextlib.asynccontextmanager
    async def _holding(self, n: int):
        """Hold `n` bytes of the engine's IN_FLIGHT_BYTES for the block. Requests wait in turn (first come, first
        served, so large ones are not starved by small ones) and each release wakes only those that now fit; a
        request larger than the whole budget waits for all of it. Taken before a request slot, so a slot is never
        held while its request waits for memory; given back without awaiting anything, so a cancelled holder
        cannot keep its bytes."""
        n = min(n, IN_FLIGHT_BYTES)
        if self._waiting or self.held + n > IN_FLIGHT_BYTES:
            granted = asyncio.get_running_loop().create_future()
            self._waiting.append((n, granted))
            try:
                await granted  # _grant counted the bytes as held before it resolved this
            except BaseException:
                if granted.done() and not granted.cancelled():  # granted, then cancelled before it could run
                    self._give_back(n)
                else:
                    self._grant()  # those queued behind it may fit now
                raise
        else:
            self.held += n
            self.held_peak = max(self.held_peak, self.held)
        try:
            yield
        finally:
            self._give_back(n)

    def _give_back(self, n: int) -> None:
        self.held -= n
        self._grant()

    def _grant(self) -> None:
        """Let the waiting requests at the head of the queue go, as long as they fit."""
        while self._waiting:
            n, granted = self._waiting[0]
            if granted.done():  # cancelled while it waited
                self._waiting.popleft()
                continue
            if self.held + n > IN_FLIGHT_BYTES:
                return
            self._waiting.popleft()
            self.held += n
            self.held_peak = max(self.held_peak, self.held)
            granted.set_result(None)

    async def list(self, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
        """{key relative to `prefix`: (size, ETag without quotes)} of every object under `prefix`."""
        import obstore
        from obstore.exceptions import InvalidPathError

        store = self.store(bucket)
        found: dict[str, tuple[int, str]] = {}
        try:
            async with self._slot():
                async for batch in obstore.list(store, prefix or None, chunk_size=1000):
                    for obj in batch:
                        found[obj["path"][len(prefix):]] = (obj["size"], (obj["e_tag"] or "").strip('"'))
        except InvalidPathError:  # a key object_store cannot name (an empty or dot segment): boto3 lists it
            return await asyncio.to_thread(self._boto3_listing, bucket, prefix)
        except Exception as e:
            raise classify(e) from None
        return found

    def _boto3_listing(self, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
        return list_with_boto3(bucket, prefix, connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                               attempts=self.attempts)

    async def read(self, bucket: str, key: str) -> bytes:
        """The bytes of one (small) object."""
        import obstore

        try:
            async with self._slot():
                result = await obstore.get_async(self.store(bucket), key)
                return bytes(await result.bytes_async())
        except Exception as e:
            raise classify(e) from None

    async def first_keys(self, bucket: str, prefix: str) -> list[str]:
        """The first page (1000) of the keys below `prefix`, sub-folders included, relative to it: enough to
        tell what a prefix holds without listing a million keys."""
        import obstore
        from obstore.exceptions import InvalidPathError

        try:
            async with self._slot():
                async for batch in obstore.list(self.store(bucket), prefix or None, chunk_size=1000):
                    return [obj["path"][len(prefix):] for obj in batch]
        except InvalidPathError:  # a key object_store cannot name: the full listing (boto3's) tells
            return sorted(await asyncio.to_thread(self._boto3_listing, bucket, prefix))[:1000]
        except Exception as e:
            raise classify(e) from None
        return []

    async def put(self, bucket: str, key: str, path: Path, metadata: dict[str, str] | None = None) -> None:
        """Upload the file at `path` as one object (in PART-sized parts above PART bytes, as S3 needs for large
        ones, PUT_PARTS at once), with `metadata` as its user metadata (x-amz-meta-*); the object appears whole
        or not at all. The parts it holds in memory count against IN_FLIGHT_BYTES, as a download's do."""
        import obstore

        held = min(os.path.getsize(path), PUT_PARTS * PART)
        try:
            async with self._holding(held), self._slot():
                await obstore.put_async(self.store(bucket), key, Path(path), attributes=metadata or None,
                                        chunk_size=PART, max_concurrency=PUT_PARTS)
        except Exception as e:
            raise classify(e) from None

    async def put_bytes(self, bucket: str, key: str, data: bytes) -> None:
        import obstore

        try:
            async with self._slot():
                await obstore.put_async(self.store(bucket), key, data)
        except Exception as e:
            raise classify(e) from None

    async def delete(self, bucket: str, key: str) -> None:
        """Remove one object (gone already is done)."""
        import obstore

        try:
            async with self._slot():
                await obstore.delete_async(self.store(bucket), key)
        except FileNotFoundError:
            return
        except Exception as e:
            raise classify(e) from None

    async def metadata(self, bucket: str, key: str) -> dict[str, str]:
        """The user metadata of one object (a HEAD): what `put` was given."""
        import obstore

        try:
            async with self._slot():
                result = await obstore.get_async(self.store(bucket), key, options={"head": True})
                return {k: v for k, v in result.attributes.items() if k not in STANDARD_ATTRIBUTES}
        except Exception as e:
            raise classify(e) from None

    def reader(self, bucket: str, key: str, deadline: float | None = None):
        """One object's body as a binary file read front to back (`read(n)`), for a caller on its own thread
        that parses as it reads (a shard indexed in one pass); a failure while reading raises TransferError, and
        so does a read past `deadline` (time.monotonic() seconds; code 'deadline'): a body that never ends."""
        import obstore

        try:
            result = obstore.get(self.store(bucket), key)
        except Exception as e:
            raise classify(e) from None
        return io.BufferedReader(Chunks(iter(result.stream(min_chunk_size=CHUNK)), deadline), buffer_size=CHUNK)

    async def head(self, bucket: str, key: str) -> tuple[int, str | None]:
        """(size, validator) of one object (a HEAD): its ETag, else its Last-Modified, else None (what a cached
        index of it is valid for)."""
        import obstore

        try:
            async with self._slot():
                meta = await obstore.head_async(self.store(bucket), key)
        except Exception as e:
            raise classify(e) from None
        modified = meta.get("last_modified")
        stamp = modified.isoformat() if modified is not None and modified.timestamp() > 0 else None  # 0: none sent
        return int(meta["size"]), meta.get("e_tag") or stamp

    async def read_small(self, bucket: str, key: str, limit: int) -> tuple[bytes, str]:
        """(the bytes, the Content-Type) of a small object; TransferError('size') when it holds more than `limit`
        bytes (its body is then not read)."""
        import obstore

        try:
            async with self._slot():
                result = await obstore.get_async(self.store(bucket), key)
                kind = str(result.attributes.get("Content-Type") or "")
                if result.meta["size"] > limit:
                    raise TransferError("size", f"{result.meta['size']} bytes, more than the {limit} expected")
                if "text/html" in kind.lower():  # a page, not the object: its body is not wanted
                    return b"", kind
                return bytes(await result.bytes_async()), kind
        except Exception as e:
            raise classify(e) from None

    async def size(self, bucket: str, key: str) -> int:
        """The size of one object (a HEAD)."""
        import obstore

        try:
            async with self._slot():
                return int((await obstore.head_async(self.store(bucket), key))["size"])
        except Exception as e:
            raise classify(e) from None

    async def download(self, bucket: str, key: str, tmp: Path, size: int | None, *, etag: str | None = None,
                       on_bytes=None, digest=None) -> tuple[int, str | None]:
        """Fetch the object into `tmp` (created, or truncated); returns (bytes, ETag). Objects above PART
        bytes come in ranged GETs (each answer's ETag must be the listed one, so a replaced object fails
        instead of mixing two). `on_bytes(n)` is called on the loop as bytes land. `digest` (a hashlib
        object) is fed the object's bytes in order: from the body as it streams in, or, after ranged parts
        (they land in any order), read back from the file. Raises TransferError for what S3 (or the
        network) did, OSError for the local disk; on any failure or cancellation `tmp` is removed."""
        store = self.store(bucket)
        fd = None  # opened once there are bytes to write: a download waiting for its turn holds no file
        try:
            if size is None or size <= PART:
                async with self._holding(PART if size is None else size):  # until its bytes are written
                    async with self._slot():
                        data, got_etag = await _whole(store, key)
                    fd = create_file(tmp)
                    n = write_at(fd, memoryview(data), 0)
                    if digest is not None:
                        digest.update(data)
                    del data
                if on_bytes is not None:
                    on_bytes(n)
            else:
                fd = create_file(tmp)
                got_etag, n = etag, await self._ranged(store, key, fd, size, etag, on_bytes)
                if n is None:  # the server ignores Range (it answers 200): one GET of the whole object, streamed
                    # no part was written (the refused first one, or none asked): a truncation to 0 of the new file
                    # would have ext4's auto_da_alloc write each object back at its close, on this loop's thread
                    # (a 238 MB pack's sync: 508 -> 472 ms without it)
                    if os.fstat(fd).st_size:
                        os.ftruncate(fd, 0)
                    async with self._holding(2 * CHUNK), self._slot():
                        n, got_etag = await _stream_to(store, key, fd, etag, on_bytes, pool=self._writers,
                                                       digest=digest)
                elif digest is not None:
                    await _on_thread(self._writers, hash_file, tmp, digest)  # parts land in any order
            if size is not None and n != size:
                raise TransferError("size", f"got {n} bytes of {key}, {size} expected")
        except BaseException:
            if fd is not None:
                os.close(fd)
            remove_quietly(tmp)
            raise
        os.close(fd)
        return n, (got_etag or "").strip('"') or None

    async def _ranged(self, store, key: str, fd: int, size: int, etag: str | None, on_bytes) -> int | None:
        """The object in ranged GETs of PART bytes, up to the engine's concurrency at once; None (nothing
        written) when the server answers a ranged GET with status 200. That is learnt once per engine:
        until then, the first part of the first large object asks alone (its 206 lets the other parts go,
        a refused 200 sends every large object to one whole GET), and other large objects wait for it."""
        while self.ranges is None and self._asking is not None:
            asking = self._asking
            await asking.wait()
            if asking is self._asking and self.ranges is None:
                await asyncio.sleep(0)  # never spin without yielding: the asking download must get to run
        if self.ranges is False:
            return None
        spans = [(start, min(start + PART, size)) for start in range(0, size, PART)]
        if self.ranges:
            return await _all_or_none([self._part(store, key, fd, a, b, etag, on_bytes) for a, b in spans])
        self._asking = asking = asyncio.Event()

        def partial() -> None:  # the first part's 206 came: ranges work (set before the waiters wake, or they spin)
            self.ranges = True
            asking.set()

        first = asyncio.ensure_future(self._part(store, key, fd, *spans[0], etag, on_bytes, opened=partial))
        try:
            answered = asyncio.ensure_future(asking.wait())
            try:
                await asyncio.wait([first, answered], return_when=asyncio.FIRST_COMPLETED)
            finally:
                answered.cancel()
            if not asking.is_set():  # the first part failed before its answer came
                e = first.exception()
                if isinstance(e, TransferError) and e.code == "NotPartial":
                    self.ranges = False  # rclone's serve s3: this object and the others in one streamed GET each
                    return None
                raise e
            self.ranges = True
        except BaseException:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            raise
        finally:
            if self._asking is asking:
                self._asking = None
            asking.set()  # the waiting downloads go on (and ask again if this one found nothing out)
        return await _all_or_none([first] + [self._part(store, key, fd, a, b, etag, on_bytes) for a, b in spans[1:]])

    async def _part(self, store, key: str, fd: int, start: int, end: int, etag: str | None, on_bytes,
                    opened=None) -> int:
        async with self._holding(2 * CHUNK), self._slot():  # a chunk being written, the next one coming
            n, _ = await _stream_to(store, key, fd, etag, on_bytes, (start, end), pool=self._writers, opened=opened)
        return n

    async def download_all(self, bucket: str, jobs: list, done, on_bytes=None) -> None:
        """Each job (key, tmp, dest, size; paths as str) downloaded into tmp, then renamed to dest (its folder must
        exist); `done(i, bytes, etag, error)` is called on the loop for job i, with the TransferError or
        OSError that ended it. `concurrency` workers take the jobs in order, so memory does not grow with
        their number. Cancelling stops them all; no temporary file stays."""
        todo = iter(enumerate(jobs))

        async def worker():
            for i, (key, tmp, dest, size) in todo:
                try:
                    with atomic(dest, tmp):
                        n, etag = await self.download(bucket, key, tmp, size, on_bytes=on_bytes)
                except (TransferError, OSError) as e:
                    done(i, 0, None, e)
                else:
                    done(i, n, etag)

        await asyncio.gather(*(worker() for _ in range(min(self.concurrency, len(jobs)))))


async def _all_or_none(coros: list) -> int:
    """The sum of the coroutines' (or tasks') results, run at once; the first failure cancels the others and
    is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return sum(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _stream_to(store, key: str, fd: int, etag: str | None, on_bytes,
                     byte_range: tuple[int, int] | None = None, *, pool, digest=None,
                     opened=None) -> tuple[int, str | None]:
    """One GET of an object, or of its `byte_range` [start, end), written to `fd` at the object's offsets as
    it comes (on a thread of `pool`, chunk after chunk, `digest` fed the same bytes): (bytes written, its
    ETag); a replaced object (another ETag than the listed one) fails. (The ETag check covers servers that
    ignore If-Match with a Range too.) `opened()` is called once the answer's headers passed."""
    import obstore

    try:
        result = await obstore.get_async(store, key, **({"options": {"range": byte_range}} if byte_range else {}))
        stream = result.stream(min_chunk_size=CHUNK)
        got = (result.meta.get("e_tag") or "").strip('"')
    except Exception as e:
        if "Range request not supported" in str(e):  # HTTPStore's word for a ranged GET answered with 200
            raise TransferError("NotPartial", "the server answers ranged GETs whole") from None
        raise classify(e) from None
    if etag and got and got != etag.strip('"'):
        raise TransferError("PreconditionFailed", f"{key} changed during the download (ETag {got}, "
                            f"{etag.strip(chr(34))} listed)", 412)
    if opened is not None:
        opened()
    start = offset = byte_range[0] if byte_range else 0
    while True:
        try:
            chunk = await stream.__anext__()
        except StopAsyncIteration:
            break
        except Exception as e:
            raise classify(e) from None
        offset += await _on_thread(pool, land, fd, chunk, offset, digest)
        if on_bytes is not None:
            on_bytes(len(chunk))
    return offset - start, got or None


async def _on_thread(pool, fn, *args):
    """`fn(*args)` on a thread of `pool`, awaited; a cancelled caller still waits for it to end (its file
    descriptor must not be closed, and its number perhaps reused, under a write in flight)."""
    job = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        while not job.done():
            try:
                await asyncio.wait([job])
            except asyncio.CancelledError:
                continue
        raise


async def _whole(store, key: str):
    """One GET of a whole object: (its bytes, its ETag)."""
    import obstore

    try:
        result = await obstore.get_async(store, key)
        return await result.bytes_async(), result.meta.get("e_tag")
    except Exception as e:
        raise classify(e) from None


STANDARD_ATTRIBUTES = {"Content-Disposition", "Content-Encoding", "Content-Language", "Content-Type", "Cache-Control",
                       "Storage-Class"}  # obstore's own attributes: the rest of an object's are its user metadata
