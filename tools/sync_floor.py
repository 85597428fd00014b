#!/usr/bin/env python3
"""The least a Python client of obstore does to copy an S3 prefix: a floor for `python -m dali_pipe sync`.

    python tools/sync_floor.py asyncio s3://bucket/prefix DEST   # one event loop, as dali_pipe/transfer.py's engine
    python tools/sync_floor.py threads s3://bucket/prefix DEST   # obstore's blocking calls, one thread per object
    (either with --at-once N: objects at a time, default 8)

Each lists the prefix, then GETs every object into DEST, up to --at-once objects at a time, as the sync's engine
does: one GET and one write of an object up to 8 MiB, a larger one streamed in 1 MiB chunks written at their offsets
(the engine's ranged GETs are not done: the benchmark's server answers a Range with 200), with malloc tuned as the sync tunes it (transfer.keep_freed_memory). Nothing else:
no manifest or packed.json, no checksum, no temporary names, no deadlines of its own, no progress. The endpoint
and keys come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (AWS_DEFAULT_REGION, else
us-east-1). `tools/bench_sync.py --compare s5cmd --packed --floors` times both beside s5cmd: whatever our sync
adds to the floor of its kind is ours to cut; what the floor itself costs is the engine's and the interpreter's.
Its imports are only what the mode needs, so its start-up is the least either kind can have.
"""
import ctypes
import os
import sys

import obstore
from obstore.store import S3Store

CHUNK, PART = 1 << 20, 8 << 20  # transfer.CHUNK, transfer.PART


def main() -> None:
    args = sys.argv[1:]  # by hand: argparse's import would count in the floor's start-up
    if len(args) not in (3, 5) or args[0] not in ("asyncio", "threads") or not args[1].startswith("s3://") or (
            len(args) == 5 and (args[3] != "--at-once" or not args[4].isdigit())):
        raise SystemExit(__doc__.split("\n\n")[1])
    mode, uri, dest = args[:3]
    at_once = int(args[4]) if len(args) == 5 else 8
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/") + "/" if prefix else ""

    mallopt = ctypes.CDLL(None).mallopt  # transfer.keep_freed_memory(one_arena=True), without its module's imports
    mallopt(-3, 32 << 20), mallopt(-1, 64 << 20), mallopt(-8, 1)
    store = S3Store(bucket, endpoint=os.environ["AWS_ENDPOINT_URL"],
                    region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
                    access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                    secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"], client_options={"allow_http": True})

    def target(key: str) -> int:
        path = os.path.join(dest, key[len(prefix):])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def keys(pages) -> list[tuple[str, int]]:
        return [(meta["path"], meta["size"]) for page in pages for meta in page]

    if mode == "threads":
        import threading  # each mode loads only what it needs: its start-up is the least its kind can have

        todo = iter(keys(obstore.list(store, prefix)))
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    key, size = next(todo, (None, 0))
                if key is None:
                    return
                result = obstore.get(store, key)
                fd, offset = target(key), 0
                for chunk in [result.bytes()] if size <= PART else result.stream(min_chunk_size=CHUNK):
                    offset += os.pwrite(fd, chunk, offset)
                os.close(fd)

        threads = [threading.Thread(target=worker) for _ in range(at_once)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        import asyncio  # as above

        async def copy() -> None:
            todo = iter(keys([page async for page in obstore.list(store, prefix)]))

            async def worker() -> None:
                for key, size in todo:
                    result = await obstore.get_async(store, key)
                    if size <= PART:  # written on the loop, as the engine writes a small object
                        data = await result.bytes_async()
                        fd = target(key)
                        os.write(fd, data)
                    else:  # chunks written on threads, as the engine writes a streamed body
                        fd, offset = target(key), 0
                        async for chunk in result.stream(min_chunk_size=CHUNK):
                            offset += await asyncio.to_thread(os.pwrite, fd, chunk, offset)
                    os.close(fd)

            await asyncio.gather(*(worker() for _ in range(at_once)))

        asyncio.run(copy())


if __name__ == "__main__":
    main()
