"""Bytes landing in files, for the transfers: a download's temporary name (hidden, in its final folder, ending in
our PID so a later run can tell a dead writer's leftovers), positional writes (parts of one file land in any
order), and a file's checksums in one read.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

serial = itertools.count()


def land(fd: int, chunk, offset: int, digest) -> int:
    """A streamed chunk written at `offset` (and fed to `digest`); returns its length."""
    view = memoryview(chunk)
    n = write_at(fd, view, offset)
    if digest is not None:
        digest.update(view)
    return n


def create_file(path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)


def remove_quietly(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_at(fd: int, data: memoryview, offset: int) -> int:
    """Write `data` at `offset` (pwrite: parts of one file land in any order); returns its length."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    return done


def temp_path(dest: Path) -> Path:
    """A download's temporary name: hidden, in the final folder, unique, ending in our PID (so that a
    later run can tell a dead writer's leftovers: workdir.remove_dead_temps)."""
    return Path(part_name(str(dest)))


def part_name(dest: str) -> str:
    """`temp_path` for a str path (the sync makes one per file: pathlib's cost shows at a million)."""
    folder, name = os.path.split(dest)
    return os.path.join(folder, f".{name}.part-{next(serial)}-{os.getpid()}")


def hash_file(path: str | Path, *digests):
    """Each of `digests` (hashlib-like objects) fed the bytes of the file at `path`, read once in 1 MiB
    blocks; the first returned."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            for d in digests:
                d.update(chunk)
    return digests[0]
