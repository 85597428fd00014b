"""Directories a process works in: an exclusive lock that names its holder, a check that an
output directory can take what the run will write, the one checked way to delete, and the clean-up
of what dead writers left.

The lock is `flock` on a file that lives OUTSIDE the directory it guards, in the user's lock folder
(`locks/` under $DALI_PIPE_CACHE or ~/.cache/dali_pipe, whatever --cache-dir a run uses), named by a
hash of the directory's resolved path. So nothing of ours lands in a model folder, a pack DST or
anything uploaded from them. The kernel drops a flock when its holder dies (even by kill -9), so a
stale lock never blocks a rerun; the holder's PID and the path are written inside to name it. A
clean unlock removes the file (acquiring checks that the file it locked is still the one at that
name, so a removal racing with a new holder cannot give two holders).

Why not a library: `filelock` keeps its lock file beside the target (in the directory here) and
names no holder; `fcntl.flock` is the whole mechanism in a few lines.

Deleting: whatever a run deletes or moves whose name it did not build in the same breath (a listing
of a folder, a glob, a name read from a record such as the previous metrics.json, a folder of
ours) goes through `remove(path, owner)` / `move(src, dst, owner)`, which refuse (OutsideError) a
path that does not lie inside `owner`, the folder the run owns: its parent's real path, joined with
its own name (a symlink is removed as itself, never followed; a folder's contents are removed by
`shutil.rmtree`, which does not follow the links inside). Only a temporary file that a function
names beside its own target (`.NAME.part-TID-PID`) and removes when its write fails is unlinked
directly. A name read from a record is first checked with `plain_name`.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import shutil
from contextlib import contextmanager, suppress
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


class OutsideError(UserError):
    """A path to delete or move lies outside the folder the run owns (a crafted record, or a bug): refused."""


def plain_name(name) -> bool:
    """`name` is one file name: a non-empty string without a separator, not '.' or '..' (so, joined to a
    folder, it names an entry of that folder and nothing else)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def inside(path: Path | str, owner: Path | str) -> Path:
    """`path` as it lies in `owner`: its parent's real path joined with its own name (a symlink there is the
    link itself, not its target). OutsideError unless that lies strictly inside `owner`'s real path."""
    path, base = Path(path), Path(os.path.realpath(owner))
    where = Path(os.path.realpath(path.parent)) / path.name if path.name not in ("", ".", "..") else None
    if where is None or base not in where.parents:
        raise OutsideError(f"refused to delete or move {redact(str(path))}: it lies outside "
                           f"{redact(str(owner))}, the folder this run owns")
    return where


def remove(path: Path | str, owner: Path | str, *, quiet: bool = False) -> bool:
    """Delete `path` (a file, a symlink, or a folder with all it holds) once `inside(path, owner)` has
    checked it. False when nothing was there; other OSErrors are raised unless `quiet`. OutsideError always."""
    where = inside(path, owner)
    try:
        if where.is_dir() and not where.is_symlink():
            shutil.rmtree(where)
        else:
            where.unlink()
    except FileNotFoundError:
        return False
    except OSError:
        if not quiet:
            raise
        return False
    return True


def move(src: Path | str, dst: Path | str, owner: Path | str) -> None:
    """os.replace(src, dst), both checked to lie inside `owner`."""
    os.replace(inside(src, owner), inside(dst, owner))


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
            remove(tmp, directory, quiet=True)
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


def free_bytes(path: Path | str) -> int:
    """The free space of the disk `path` would be on: its own, or its nearest existing parent's (a check before
    anything is written creates no folder, so a refusal leaves none behind)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


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


WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}  # a write that the disk refused, whoever asked
DENIED_ERRNOS = {errno.EACCES, errno.EPERM}  # a write refused to this user (or a read: only ours count)
GONE_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.ESTALE}  # the folder written to is no longer there


def is_write_failure(err: BaseException) -> bool:
    """An OSError of a write that the disk refused (full, a quota, read-only) or that was denied."""
    return (isinstance(err, OSError) and err.errno in WRITE_ERRNOS | DENIED_ERRNOS) or is_disk_full(err)


def chain(err: BaseException):
    """`err`, then the exceptions it was raised from or while handling (a library that wraps an OSError in
    its own error, as Lightning's logger does in a ValueError)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def output_failure(err: BaseException, folders=()) -> tuple[Path, str] | None:
    """(the path, why) when `err` or an error in its chain is a write the disk refused (full, read-only), or,
    for a path in one of `folders` (the run's outputs), a write denied to this user or a path that is gone
    (the folder was removed while the run wrote to it); else None. The path is the OSError's file name, else
    the first of `folders` that is gone or refuses writes."""
    for e in chain(err):
        if not isinstance(e, OSError) or e.errno is None:
            continue
        name = os.fsdecode(e.filename) if e.filename is not None else None
        ours = name is None or _under(name, folders)
        if e.errno in WRITE_ERRNOS or (e.errno in DENIED_ERRNOS and ours and folders):
            where = name or _first_unwritable(folders)
            return (Path(where) if where else None), e.strerror or str(e)
        if e.errno in GONE_ERRNOS and ours and folders:
            gone = next((Path(f) for f in folders if not Path(f).is_dir()), None)
            if gone is not None or name is not None:
                return gone or Path(name), f"{e.strerror}: removed while the run wrote there"
    return None


def _under(name, folders) -> bool:
    path = os.path.abspath(name)
    return any(path == os.path.abspath(f) or path.startswith(os.path.abspath(f).rstrip("/") + "/") for f in folders)


def _first_unwritable(folders) -> str | None:
    for f in folders:
        if not os.access(f, os.W_OK):
            return str(f)
    return None


def fix_for(why: str, path: Path | str | None) -> str:
    """What to do about a refused write of `path` (a file, or a folder), from its reason, in a few words."""
    folder = Path(path) if path is not None else None
    while folder is not None and not folder.is_dir() and folder.parent != folder and "removed" not in why:
        folder = folder.parent  # the folder that holds the file (or the deepest one that is left)
    if folder is None:
        return "free space, or make the output writable"
    if "No space" in why or "quota" in why:
        return f"free space on the disk of {folder}"
    if "removed" in why:
        return f"find what removed {folder}"
    return f"make {folder} writable for this user"


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


def temp_name(path: Path | str) -> Path:
    """Where `path` is written whole before it lands: `.NAME.tmp-PID` beside it (hidden; remove_dead_temps knows
    it once this process is gone). A download's parts land under landing.temp_path's names instead."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def atomic(path: Path | str, tmp: Path | str | None = None):
    """The one way a file lands here: the block writes the path it is given (`tmp`, else temp_name(path)),
    which is renamed onto `path` when the block ends, so a reader sees the old file or the new one, never
    part of one. When anything fails the temporary file is removed and the error raised as it is, except
    that a full disk's OSError, which names no file when a write() fails, names `path` (the CLI prints it
    in one line)."""
    tmp = tmp if tmp is not None else temp_name(path)  # as given (str or Path): a sync lands a million
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
        if isinstance(e, OSError) and is_disk_full(e) and not e.filename:
            e.filename = str(path)
        raise


def write_atomic(path: Path | str, data: bytes | str, tmp: Path | None = None) -> None:
    """`data` as the whole of `path`, through atomic(): text as UTF-8, a name that is not UTF-8 as its
    bytes."""
    with atomic(path, tmp) as t, open(t, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8", "surrogateescape"))


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
