"""A pack: DIR/packed.json and its shards (python -m dali_pipe pack), pre-resized, checked by checksum."""
from __future__ import annotations

from pathlib import Path

from ..forms import PACKED_NAME, PROGRESS_NAME, UnfinishedPackError, unfinished_pack
from ..shards.packs import open_pack
from ..shards.packsync import fetch, fetch_to
from ..shards.shardset import ShardSet
from .form import Form, S3Look


def is_local(path: Path) -> bool:
    """A finished pack; a stopped one (its shards so far, no packed.json) is refused, naming the fix."""
    if (path / PACKED_NAME).is_file():
        return True
    problem = unfinished_pack(path)
    if problem:
        raise UnfinishedPackError(problem)
    return False


def is_s3(look: S3Look) -> bool:
    if look.holds(PACKED_NAME):
        return True
    if PROGRESS_NAME in look.names:  # the marker an upload puts first and removes after packed.json
        raise UnfinishedPackError(f"{look.uri!r} is a pack whose upload was stopped (its {PROGRESS_NAME} is there, its "
                                  f"{PACKED_NAME} is not); rerun the pack command that wrote it, which finishes the "
                                  "upload, or delete the prefix")
    return False


def read(data, *, labels: bool = True, num_threads: int = 1, progress: bool = False) -> ShardSet:
    return open_pack(data, members=True, num_threads=num_threads, progress=progress)


def prepare(data, *, num_threads: int, workers: int, labels: bool = True) -> ShardSet:
    if data.data.startswith("s3://"):
        fetch(data.data, data.cache_dir, mode=data.packed_s3, workers=workers)
    return read(data, num_threads=num_threads, progress=True)


def download(uri: str, dest, *, workers: int, progress: bool = True):
    return fetch_to(uri, Path(dest), mode="sync", workers=workers, progress=progress)


FORM = Form(
    name="pack", title="pack", reader="shards", example="DIR/packed.json and its shards (python -m dali_pipe pack)",
    is_local=is_local, is_s3=is_s3, read=read, prepare=prepare, download=download, synced=True)
