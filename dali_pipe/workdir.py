"""Directories a process works in: an exclusive lock that names its holder, a check that an
output directory can take what the run will write, and the clean-up of what dead writers left.

The lock is `flock` on a file that lives OUTSIDE the directory it guards, in the user's lock folder
(`locks/` under $DALI_PIPE_CACHE or ~/.cache/dali_pipe, whatever --cache-dir a run uses), named by a
hash of the directory's resolved path. So nothing of ours lands in a model folder, a pack DST or
anything uploaded from them. The kernel drops a flock when its holder dies (even by kill -9), so a
stale lock never blocks a rerun; the holder's PID and the path are written inside to name it. A
clean unlock removes the file (acquiring checks that the file it locked is still the one at that
name, so a removal racing with a new holder cannot give two holders).

Why not a library: `filelock` keeps its lock file beside the target (in the directory here) and
names no holder; `fcntl.flock` is the whole mechanism in a few lines.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from .config import default_cache_dir
from .errors import UserError
from .redact import redact

LEGACY_LOCK_NAME = ".dali_pipe.lock"  # where older versions kept the lock: inside the directory
_held: dict[str, tuple[int, Path]] = {}  # resolved directory -> (descriptor, lock file) this process holds


class BusyError(UserError):
    """Another live process holds the directory."""


class OutputError(UserError):
    """An output directory cannot take what the run writes."""


def lock_dir() -> Path:
    """The folder of lock files: locks/ under $DALI_PIPE_CACHE, else ~/.cache/dali_pipe."""
    return default_cache_dir() / "locks"


def lock_path(directory: Path | str) -> Path:
    """The lock file that guards `directory` (which need not exist yet): keyed by its resolved path."""
    resolved = str(Path(directory).resolve())
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:20]
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", redact(Path(resolved).name))[:40] or "root"  # a token in a path stays out
    return lock_dir() / f"{slug}-{digest}.lock"


def lock(directory: Path | str, what: str, hint: str) -> None:
    """Hold DIR exclusively for the rest of this process (or until unlock), or raise BusyError naming
    the holder. DIR is created if needed; the lock file lives outside it (see the module doc).

    `what` says what uses it ("training run", "sync", "demo run"), `hint` what to do instead."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = str(directory.resolve())
    if key in _held:
        return
    path = lock_path(directory)
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise OutputError(f"cannot write the lock file {path} that guards {directory} ({e.strerror or e}); set "
                              "DALI_PIPE_CACHE to a folder this user can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").split("\t")[0].strip() or "?"
            os.close(fd)
            raise BusyError(f"{directory} is in use by another {what} (PID {holder}); {hint}") from None
        try:  # the holder before us may have removed the file after we opened it: lock the one there now
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\t{redact(key)}\n".encode())
    except OSError as e:  # a full disk: no holder's name to give, so no lock
        path.unlink(missing_ok=True)
        os.close(fd)
        raise OutputError(f"cannot write the lock file {path} that guards {directory} ({e.strerror or e}); free "
                          "space there or set DALI_PIPE_CACHE to another folder") from None
    _held[key] = (fd, path)
    try:
        _remove_legacy_lock(directory, what, hint)
    except BusyError:
        unlock(directory)
        raise


def _remove_legacy_lock(directory: Path, what: str, hint: str) -> None:
    """Remove an older version's DIR/.dali_pipe.lock; a live process of that version holding it is
    refused like any other holder."""
    legacy = directory / LEGACY_LOCK_NAME
    try:
        fd = os.open(legacy, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise BusyError(f"{directory} is in use by another {what} (PID {holder}, an older version); {hint}") from None
    legacy.unlink(missing_ok=True)
    os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_PID = re.compile(r"-(\d+)(\.[0-9A-Za-z]+)?$")  # ...-PID, or ...-PID.suffix (s3transfer's own temp name)


def remove_dead_temps(directory: Path | str, pattern: str, *, recursive: bool = False,
                      include_own: bool = False) -> list[Path]:
    """Remove temporary files and folders matching `pattern` whose writer is dead: their names end
    in -PID. `include_own` also removes those named with this process's PID: at the start of a run
    (which has written nothing yet) they are another container's, restored with the folder."""
    removed = []
    directory = Path(directory)
    for tmp in (directory.rglob(pattern) if recursive else directory.glob(pattern)):
        m = _PID.search(tmp.name)
        if not m:
            continue
        pid = int(m.group(1))
        if (include_own and pid == os.getpid()) or (pid != os.getpid() and not pid_alive(pid)):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def unlock(directory: Path | str) -> None:
    """Release DIR's lock and remove the lock file (removal first, so a waiter never locks a dead name)."""
    held = _held.pop(str(Path(directory).resolve()), None)
    if held is not None:
        fd, path = held
        try:
            path.unlink()
        except OSError:
            pass
        os.close(fd)  # closing the descriptor releases the flock


def check_writable(directory: Path | str, flag: str, needed_bytes: int = 0,
                   what: str = "two checkpoints and the model") -> None:
    """DIR is (or can be made) a writable directory with `needed_bytes` (`what` the run writes) free; else
    one clear error."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"{flag} {directory} is a file, not a directory; pass a directory (it is created if "
                          "needed).")
    probe = directory / f".write-test-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"x")
    except OSError as e:
        if is_disk_full(e):
            raise OutputError(f"{flag} {directory} is full ({e.strerror}); free space there or pass another "
                              "directory.") from None
        raise OutputError(f"{flag} {directory} is not writable ({e.strerror or e}); pass a directory this user "
                          "can write to.") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    free = shutil.disk_usage(directory).free
    if needed_bytes and free < needed_bytes:
        raise OutputError(f"{flag} {directory} has {human_bytes(free)} free but the run writes about "
                          f"{human_bytes(needed_bytes)} there ({what}); free space or "
                          "pass another directory.")


def human_bytes(n: float) -> str:
    """A size in the unit that keeps it readable: '812 bytes', '3.4 MiB', '1.2 GiB' (never '0.0 GiB')."""
    if n < 1024:
        return f"{int(n)} bytes"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def is_disk_full(err: BaseException) -> bool:
    """A write failed for want of space (ENOSPC, or a quota), whichever library raised it."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return "No space left on device" in text or "Disk quota exceeded" in text or "StorageFull" in text


def write_failure(err: BaseException, directory: Path | str | None = None) -> str:
    """Why a write into `directory` failed, in a few words ('No space left on device'), from an
    OSError, safetensors' SafetensorError or torch's RuntimeError alike (torch.save names no cause
    for a full disk: "unexpected pos 576 vs 534"; a directory with under 1 MiB free explains it)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    if is_disk_full(err):
        return "No space left on device"
    if directory is not None:
        try:
            if shutil.disk_usage(directory).free < (1 << 20):
                return "No space left on device"
        except OSError:
            pass
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__


@contextmanager
def writing(path: Path | str, tmp: Path | str | None = None):
    """Around the write of `path` (through `tmp`): a failure removes `tmp`, and a full disk's OSError,
    which names no file when a write() fails, names `path` (the CLI prints it in one line)."""
    try:
        yield
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and is_disk_full(e) and not e.filename:
            e.filename = str(path)
        raise


@contextmanager
def no_empty_folders_on_failure(*directories, blank=lambda path: False):
    """Around a run that creates `directories` (and their missing parents): when it fails, each of them
    that this run created and that is still empty is removed, deepest first, so a failed run leaves no
    empty folder of ours (OUT/checkpoints/) behind. In those folders a file for which `blank(path)` holds
    (a report that lists nothing) counts as empty and goes too. A folder that holds anything else (a report
    that lists something, a checkpoint to resume from, a file of the user's) is kept; one that existed
    before is never touched."""
    created = []
    for d in directories:
        if d is None:
            continue
        p = Path(d).absolute()
        while not os.path.lexists(p) and p not in created:
            created.append(p)
            p = p.parent
    try:
        yield
    except BaseException:
        for p in sorted(created, key=lambda p: len(p.parts), reverse=True):
            try:
                for f in p.iterdir() if p.is_dir() and not p.is_symlink() else ():
                    if f.is_file() and not f.is_symlink() and blank(f):
                        f.unlink()
                p.rmdir()  # only an empty directory: anything else inside keeps it
            except OSError:
                pass
        raise
