"""Directories a process works in: an exclusive lock that names its holder, and a check that an
output directory can take what the run will write.

The lock is `flock` on DIR/.dali_pipe.lock: the kernel drops it when the holder dies (even by
kill -9), so a stale lock never blocks a rerun; the holder's PID is written inside to name it.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path

from .errors import UserError

LOCK_NAME = ".dali_pipe.lock"
_held: dict[str, int] = {}  # directory -> file descriptor of the lock this process holds


class BusyError(UserError):
    """Another live process holds the directory."""


class OutputError(UserError):
    """An output directory cannot take what the run writes."""


def lock(directory: Path | str, what: str, hint: str) -> None:
    """Hold DIR exclusively for the rest of this process, or raise BusyError naming the holder.

    `what` says what uses it ("run", "sync", "demo data"), `hint` what to do instead."""
    directory = Path(directory)
    key = str(directory.resolve())
    if key in _held:
        return
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise BusyError(f"{directory} is in use by another {what} (PID {holder}); {hint}") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _held[key] = fd


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_PID = re.compile(r"-(\d+)(\.[0-9A-Za-z]+)?$")  # ...-PID, or ...-PID.suffix (s3transfer's own temp name)


def remove_dead_temps(directory: Path | str, pattern: str, *, recursive: bool = False) -> list[Path]:
    """Remove temporary files matching `pattern` whose writer is dead: their names end in -PID."""
    removed = []
    directory = Path(directory)
    for tmp in (directory.rglob(pattern) if recursive else directory.glob(pattern)):
        m = _PID.search(tmp.name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and not pid_alive(pid):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def unlock(directory: Path | str) -> None:
    fd = _held.pop(str(Path(directory).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def check_writable(directory: Path | str, flag: str, needed_bytes: int = 0) -> None:
    """DIR is (or can be made) a writable directory with `needed_bytes` free; else one clear error."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"{flag} {directory} is a file, not a directory; pass a directory (it is created if "
                          "needed).")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        raise OutputError(f"{flag} {directory} is not writable ({e.strerror or e}); pass a directory this user "
                          "can write to.") from None
    free = shutil.disk_usage(directory).free
    if needed_bytes and free < needed_bytes:
        raise OutputError(f"{flag} {directory} has {free / 2**30:.1f} GiB free but the run writes about "
                          f"{needed_bytes / 2**30:.1f} GiB there (two checkpoints and the model); free space or "
                          "pass another directory.")
