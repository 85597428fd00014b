#!/usr/bin/env python3
"""The least a Python client of obstore does to copy an S3 prefix: a floor for `python -m dali_pipe sync`.

    python tools/sync_floor.py asyncio s3://bucket/prefix DEST [--at-once N]   # one event loop, as our engine
    python tools/sync_floor.py threads s3://bucket/prefix DEST [--at-once N]   # obstore's blocking calls

Each lists the prefix, then GETs every object into DEST, N at a time (default 8; on threads, N threads taking
the objects in turn), as the sync's engine (dali_pipe/transfer.py) does: an object up to 8 MiB in one GET and
one write, a larger one streamed in 1 MiB chunks written at their offsets (the engine's ranged GETs are not
done: the benchmark's server answers a Range with 200). Malloc is tuned as the sync tunes it
(limits.keep_freed_memory). Nothing else: no manifest or packed.json, no checksum, no temporary names, no
deadlines of its own, no progress; folder markers of folders that hold objects are skipped (a marker of an empty
folder fails the run: its name, as obstore lists it, finds nothing). It ends with os._exit, skipping the
interpreter's teardown. The endpoint and keys come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY (AWS_DEFAULT_REGION, else us-east-1).

`tools/bench_sync.py --compare s5cmd --packed --floors` times both kinds beside s5cmd. Whatever our sync adds to
the floor of its kind is ours to cut; what the floor itself costs is the engine's and the interpreter's. Each
kind imports only what it needs, so its start-up is the least that kind can have.
"""
import ctypes
import os
import sys

import obstore
from obstore.store import S3Store

# transfer.CHUNK and transfer.PART (tests/test_transfer.py checks they agree), copied: importing dali_pipe.transfer
# loads asyncio and the engine's modules (~50 ms), which the threads kind must not pay
CHUNK, PART = 1 << 20, 8 << 20


def usage(problem: str) -> SystemExit:
    return SystemExit(f"sync_floor.py: {problem}\n" + __doc__.split("\n\n")[1])


def write_all(fd: int, data, offset: int) -> int:
    """All of `data` written at `offset` (a write may take less than it is given, as landing.write_at knows)."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def main() -> None:
    args = sys.argv[1:]  # by hand: argparse's import would count in the floor's start-up
    if len(args) not in (3, 5) or args[0] not in ("asyncio", "threads") or not args[1].startswith("s3://"):
        raise usage("give the kind (asyncio or threads), an s3:// prefix and a folder")
    if len(args) == 5 and (args[3] != "--at-once" or not args[4].isdigit() or int(args[4]) < 1):
        raise usage(f"--at-once takes a number of objects, 1 or more, not {args[3:]}")
    missing = [k for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not os.environ.get(k)]
    if missing:
        raise usage(f"set {', '.join(missing)} (the endpoint and keys are taken from the environment only)")
    mode, uri, dest = args[:3]
    at_once = int(args[4]) if len(args) == 5 else 8
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""

    mallopt = ctypes.CDLL(None).mallopt  # limits.keep_freed_memory(one_arena=True), without its module's imports
    mallopt(-3, 32 << 20), mallopt(-1, 64 << 20), mallopt(-8, 1)
    store = S3Store(bucket, endpoint=os.environ["AWS_ENDPOINT_URL"],
                    region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                    access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                    secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"], client_options={"allow_http": True})

    def target(key: str) -> int:
        path = os.path.join(dest, key[len(prefix):])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def objects(pages) -> list[tuple[str, int]]:
        """(key, size) of each listed object but folder markers: empty objects named like the prefix or a folder
        that holds objects (obstore lists `p/c/` as `p/c`, and a GET of that name finds nothing)."""
        listed = [(meta["path"], meta["size"]) for page in pages for meta in page]
        folders = {key[:i] for key, _ in listed for i, c in enumerate(key) if c == "/"} | {prefix.rstrip("/")}
        return [(key, size) for key, size in listed if not (size == 0 and key in folders)]

    if mode == "threads":
        import threading  # each kind loads only what it needs: its start-up is the least its kind can have

        todo = iter(objects(obstore.list(store, prefix)))
        lock, failed = threading.Lock(), []

        def worker() -> None:
            try:
                while True:
                    with lock:
                        key, size = next(todo, (None, 0))
                    if key is None:
                        return
                    result = obstore.get(store, key)
                    fd, offset = target(key), 0
                    for chunk in [result.bytes()] if size <= PART else result.stream(min_chunk_size=CHUNK):
                        offset += write_all(fd, chunk, offset)
                    os.close(fd)
            except BaseException as e:  # a thread's exception does not fail the process by itself
                failed.append(e)
                raise

        threads = [threading.Thread(target=worker) for _ in range(at_once)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise SystemExit(f"sync_floor.py: {len(failed)} thread(s) failed, the first with {failed[0]!r}")
    else:
        import asyncio  # as above

        async def copy() -> None:
            todo = iter(objects([page async for page in obstore.list(store, prefix)]))

            async def worker() -> None:
                for key, size in todo:
                    result = await obstore.get_async(store, key)
                    if size <= PART:  # written on the loop, as the engine writes a small object
                        data = await result.bytes_async()
                        fd = target(key)
                        write_all(fd, data, 0)
                    else:  # chunks written on threads, as the engine writes a streamed body
                        fd, offset = target(key), 0
                        async for chunk in result.stream(min_chunk_size=CHUNK):
                            offset += await asyncio.to_thread(write_all, fd, chunk, offset)
                    os.close(fd)

            await asyncio.gather(*(worker() for _ in range(at_once)))

        asyncio.run(copy())


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # obstore's runtime sometimes aborted the interpreter's teardown after an asyncio.run (SIGABRT in 3-8 of 40
    # runs against moto, after every file had landed); the floor skips that teardown
    os._exit(0)
