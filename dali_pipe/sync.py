"""S3 -> local disk sync of a dataset: the manifest, then only the files it lists.

- Fast: one LIST pass gives every size and ETag (no per-file HEAD), then parallel GETs through the
  transfer engine (dali_pipe/transfer.py: obstore, Rust's object_store, on one event loop, --workers
  requests in flight); files already present with the same size and ETag (recorded in
  `.sync-state.json`) are skipped, so a rerun transfers nothing. The same road takes a pack's large
  objects (`sync_objects`: ranged GETs).
- Safe: each file is written under a temporary name (hidden, with the writer's PID) in its final folder
  and renamed when complete, so an interrupted sync leaves no partial file and a rerun finishes
  it; a later sync removes temporary files whose writer is dead. The manifest lands last. A row
  or key that would land outside the target is refused before any download starts. One sync at a
  time per target (a second stops at once, naming the PID that holds it).
- Bounded: connect and read timeouts and a small retry budget per request (throttling, cut and
  stalled bodies are retried), and one shared deadline for the whole sync: when no byte has arrived
  from any request for SYNC_BOUNDS.stall seconds, the sync stops (its requests are dropped, none is retried), so
  an endpoint that accepts connections but never answers fails in about a minute whatever the file
  count, with a message naming it. SIGTERM (or Ctrl-C) cancels the downloads, removes their
  temporary files and re-raises.
- Room: the files to fetch must fit in the target's free space before the first GET; a disk that
  fills anyway (another writer) stops the sync with one message, keeping the completed files.
- The standard AWS environment (credentials through botocore's chain, region, AWS_ENDPOINT_URL), so
  S3-compatible stores and the tests' local moto server work unchanged.

Hand-written here: choosing the files (from the manifest, skipping unchanged ones by size + ETag) and
landing them atomically in order with the manifest; the engine moves the bytes.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .landing import part_name
from .s3 import (
    SYNC_BOUNDS,
    Bounds,
    ManifestMissing,
    SyncError,
    TransferError,
    endpoint,
    engine_refuses,
    explain,
    parse_s3_uri,
)
from .stop import check, each
from .transfer import Engine
from .tsv import MANIFEST_NAME, ManifestError, check_columns, check_header, read_table, safe_relpath
from .workdir import (
    atomic,
    human_bytes,
    is_disk_full,
    lock,
    pid_alive,
    remove,
    remove_dead_temps,
    unlock,
    write_atomic,
    write_failure,
)

STATE_NAME = ".sync-state.json"
JOURNAL_NAME = ".sync-state.journal"  # the files fetched since the state was last written whole
POLL = 0.05  # seconds between looks at the downloads that finished


@dataclass
class SyncStats:
    listed: int = 0  # files the manifest lists
    downloaded: int = 0
    skipped: int = 0  # already present and unchanged
    missing: int = 0  # listed in the manifest but not in S3
    unrequestable: list[str] = field(default_factory=list)  # keys a listing chose that the engine cannot request
    bytes: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        mb = self.bytes / 1e6
        rate = mb / self.seconds if self.seconds > 0 else 0.0
        return (f"sync: {self.downloaded} downloaded ({mb:.1f} MB, {rate:.1f} MB/s), {self.skipped} unchanged, "
                f"{self.missing} missing in S3, {self.listed} listed, {self.seconds:.1f} s")


def make_engine(workers: int, bounds: Bounds = SYNC_BOUNDS) -> Engine:
    """The transfer engine for a sync: `workers` requests in flight, `bounds`' timeouts and tries."""
    return Engine(concurrency=workers, connect_timeout=bounds.connect_timeout, read_timeout=bounds.read_timeout,
                  attempts=bounds.request_attempts)


class Watch:
    """When a byte last arrived, from any request of the sync: the one deadline they share."""

    def __init__(self):
        self.last = time.monotonic()

    def tick(self, *_) -> None:
        self.last = time.monotonic()

    def silent_for(self) -> float:
        return time.monotonic() - self.last


def clean_after_dead_syncs(dest: Path) -> None:
    """A sync marks its target while it runs (`.sync-running-PID`); when a marker's process is
    dead, that sync did not end cleanly: remove the temporary files it left (a walk of the target)."""
    dead = [m for m in dest.glob(".sync-running-*") if not pid_alive(int(m.name.rsplit("-", 1)[1]))]
    if dead:
        remove_dead_temps(dest, ".*.part-*", recursive=True)
        remove_dead_temps(dest, f".{MANIFEST_NAME}.incoming-*")
        for m in dead:
            remove(m, dest)


@contextmanager
def holding(dest: Path):
    """Hold `dest` for one sync: its lock (a second sync stops at once, naming us), a marker that this
    sync is running (so the next one knows to clean up after a killed one), the clean-up itself."""
    lock(dest, "sync", "wait for it to finish")
    running = dest / f".sync-running-{os.getpid()}"
    try:
        try:
            clean_after_dead_syncs(dest)
            running.touch()
        except OSError as e:
            raise unwritable(dest, e) from None
        yield
    finally:  # a clean end, even a failed one: our temporary files are gone (a kill -9 never gets here)
        try:
            running.unlink(missing_ok=True)
        except OSError:  # a folder that never took it (read-only): nothing to remove
            pass
        unlock(dest)


def unwritable(dest: Path, err: OSError) -> SyncError:
    """The message for a target that does not take our files (read-only, full, not a folder)."""
    if is_disk_full(err):
        return disk_full(dest, SyncStats(), [])
    return SyncError(f"cannot write into {dest} ({write_failure(err)}); make it writable, or sync to another "
                     "folder (--cache-dir for training). Nothing was downloaded.")


def fetch_manifest(engine: Engine, bucket: str, base: str, dest: Path, rows: bool = False
                   ) -> tuple[Path, dict[str, int]]:
    """Download dataset.tsv to a staging name (with our PID) and check every row: {rel path: line}. With
    `rows`, also as training reads them (columns, labels, split, conflicting duplicates), so a manifest that
    training would refuse stops here, named by its S3 URI, before any file is fetched."""
    key = base + MANIFEST_NAME
    try:
        text = engine.run(engine.read(bucket, key))
    except TransferError as e:
        raise (ManifestMissing if e.code in ("NoSuchKey", "404") else SyncError)(explain(e, bucket, key)) from None
    staged = dest / f".{MANIFEST_NAME}.incoming-{os.getpid()}"
    write_atomic(staged, text, part_name(staged))
    try:
        df = read_table(staged)
        check_header(df, staged)  # no image_path column: a typo of it, a CSV file, or none at all
        wanted: dict[str, int] = {}
        refused = []
        for p, line in zip(df["image_path"], df["_line"]):
            try:
                wanted.setdefault(safe_relpath(p, dest), line)
            except ValueError as e:
                refused.append(f"line {line}: {e}")
        if refused:
            raise SyncError(f"s3://{bucket}/{key}: refused {len(refused)} row(s) that would land outside {dest}; "
                            "nothing was downloaded:\n  " + "\n  ".join(refused[:10]))
        if rows:
            from .manifest import parse_rows  # lazy: its columns take numpy, which a pack's sync never needs

            check_columns(df, f"s3://{bucket}/{key}")
            parse_rows(df, dest, f"s3://{bucket}/{key}")
    except ManifestError as e:
        staged.unlink(missing_ok=True)
        raise SyncError(str(e).replace(str(staged), f"s3://{bucket}/{key}")
                        + "\nNothing was downloaded: fix the manifest in S3, then rerun.") from None
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return staged, wanted


def read_object(uri: str, name: str, engine: Engine | None = None) -> bytes | None:
    """The bytes of the small object NAME under the s3:// prefix `uri` (a pack's packed.json), or None when
    there is none; any other failure is a SyncError naming the bucket and key. `engine`: the transfer engine
    to read it with (default: one made for this request)."""
    bucket, prefix = parse_s3_uri(uri)
    key = f"{prefix}/{name}" if prefix else name
    with engine_for(engine, 1) as engine:
        try:
            return engine.run(engine.read(bucket, key))
        except TransferError as e:
            if e.code in ("NoSuchKey", "404", "NotFound"):
                return None
            raise SyncError(explain(e, bucket, key)) from None


@dataclass(frozen=True)
class AskedListing:
    """A prefix's LIST, asked for ahead of need (ask_listing) and waited for by `listing`."""
    bucket: str
    base: str
    future: Future


def ask_listing(engine: Engine, uri: str) -> AskedListing:
    """The LIST of the s3:// prefix `uri`, started now on the engine. The sync command asks for it beside the
    manifest (or packed.json) it reads first, which the listing does not depend on: one round trip less
    before the first file, and a long paginated LIST (a million keys) runs while the manifest is checked."""
    bucket, prefix = parse_s3_uri(uri)
    base = f"{prefix}/" if prefix else ""
    return AskedListing(bucket, base, engine.submit(engine.list(bucket, base)))


@contextmanager
def listing_asked(engine: Engine, uri: str, asked: AskedListing | None):
    """`asked`, else the LIST of `uri` asked for now (ask_listing), dropped at the end if it still runs then (the
    manifest was refused, say)."""
    if asked is not None:
        yield asked
        return
    asked = ask_listing(engine, uri)
    try:
        yield asked
    finally:
        asked.future.cancel()


def listing(engine: Engine, bucket: str, base: str, asked: AskedListing | None = None) -> dict[str, tuple[int, str]]:
    """{key relative to the prefix: (size, ETag)} of every object under it, through the engine; `asked`: that
    LIST started already (ask_listing; another prefix's is not used), waited for instead of a new one."""
    try:
        if asked is not None and (asked.bucket, asked.base) == (bucket, base):
            return engine.wait(asked.future)  # SIGTERM, Ctrl-C while waiting: the request is dropped
        return engine.run(engine.list(bucket, base))
    except TransferError as e:
        raise SyncError(explain(e, bucket, base)) from None


class SyncState:
    """What was fetched, file by file (size and ETag): `.sync-state.json`, a snapshot written once at the end of a
    sync, and `.sync-state.journal`, one JSON line per file fetched since, appended every few seconds. The whole
    state was rewritten every 2 s before: 226 s of a 1 M-file sync's download phase, and a 65 MB file each time. A
    killed sync keeps what its journal had written (a torn last line is skipped); the next save folds it in."""

    def __init__(self, dest: Path, every_s: float = 2.0):
        self.path, self.journal, self.every_s = dest / STATE_NAME, dest / JOURNAL_NAME, every_s
        try:
            self.data = json.loads(self.path.read_text())
            if not isinstance(self.data, dict):
                self.data = {}
        except (OSError, ValueError):
            self.data = {}
        try:
            with open(self.journal, "rb") as f:
                for line in f:
                    try:
                        rel, size, etag = json.loads(line)
                    except (ValueError, TypeError):
                        continue  # a line a kill cut short
                    self.data[rel] = [size, etag]
        except OSError:
            pass
        self._lock, self._saved, self._lines = threading.Lock(), time.monotonic(), []
        self.error: OSError | None = None  # the last write failed (what was written before is kept)

    def unchanged(self, rel: str, size: int, etag: str, local: Path) -> bool:
        return self.data.get(rel) == [size, etag] and local.is_file() and local.stat().st_size == size

    def record(self, rel: str, size: int, etag: str) -> None:
        with self._lock:
            self.data[rel] = [size, etag]
            self._lines.append(json.dumps([rel, size, etag]) + "\n")
            if time.monotonic() - self._saved > self.every_s:
                self._append()

    def _append(self) -> None:
        """The files recorded since the last write, appended to the journal."""
        try:
            if self._lines:
                with open(self.journal, "a", encoding="utf-8") as f:
                    f.write("".join(self._lines))
                self._lines = []
            self.error = None
        except OSError as e:
            self.error = e
        self._saved = time.monotonic()

    def save(self) -> None:
        """Write the whole state (atomically: a failed save, a full disk, keeps the previous file and the
        journal, to which the files recorded since are appended if they can be), then drop the journal."""
        try:
            write_atomic(self.path, json.dumps(self.data), part_name(self.path))
            self._lines = []
            self.journal.unlink(missing_ok=True)
            self.error = None
        except OSError as e:
            self._append()
            self.error = e
        self._saved = time.monotonic()


def fetch_files(engine: Engine, bucket: str, base: str, dest: Path, todo: list[tuple[str, int, str]],
                state: SyncState, stats: SyncStats, *, progress: bool, stall: float = SYNC_BOUNDS.stall) -> list[str]:
    """Download `todo` (rel, size, ETag) through the engine, each file renamed into place as it lands;
    returns the failures. A BaseException in this thread (SIGTERM, Ctrl-C) cancels the rest: no request
    starts after it, running ones are dropped, their temporary files removed. A silent endpoint (no byte
    for `stall` seconds from any request) and a full disk stop the sync with one SyncError."""
    failures: list[str] = []
    watch, results, finished = Watch(), deque(), threading.Event()
    root = str(dest)
    jobs = [(base + rel, part_name(os.path.join(root, rel)), os.path.join(root, rel), size) for rel, size, _ in todo]
    try:
        for folder in {os.path.dirname(d) for _, _, d, _ in jobs}:
            os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise unwritable(dest, e) from None

    def done(i, n, etag, error=None):  # on the engine's loop; taken in batches here (no wake-up per file)
        watch.tick()
        results.append((i, n, etag, error))

    async def run():
        try:
            await engine.download_all(bucket, jobs, done, on_bytes=watch.tick)
        finally:
            finished.set()

    bar = byte_bar("sync", sum(s for _, s, _ in todo), progress and bool(todo))
    future = engine.submit(run()) if jobs else None
    try:
        pending = len(jobs)
        while pending:
            check()  # SIGTERM, Ctrl-C: the rest is cancelled (below)
            if not results:
                if future.done() and future.exception() is not None:
                    raise future.exception()
                if watch.silent_for() > stall:
                    raise SyncError(
                        f"{endpoint()} sent no data for {stall:.0f} s, so the sync stops: {stats.downloaded} "
                        f"of {len(todo)} file(s) fetched (completed files are kept; rerun the sync to finish). Check "
                        "AWS_ENDPOINT_URL, the region and the network.") from None
                finished.wait(POLL)  # the end of the last download wakes this at once
                continue
            i, n, etag, error = results.popleft()
            pending -= 1
            rel, size, listed_etag = todo[i]
            if error is not None:
                if isinstance(error, OSError) and is_disk_full(error):
                    raise disk_full(dest, stats, todo) from None
                failures.append(f"{rel}: {explain(error, bucket, base + rel)}")
                continue
            state.record(rel, size, etag or listed_etag)
            stats.downloaded += 1
            stats.bytes += n
            bar.update(n)
            bar.set_postfix_str(f"{stats.downloaded + stats.skipped}/{stats.listed} files", refresh=False)
            if state.error is not None and is_disk_full(state.error):
                raise disk_full(dest, stats, todo)
    finally:
        if future is not None and not future.done():
            future.cancel()  # no request starts after this; the running ones are dropped
        if future is not None:
            finished.wait(30)  # their temporary files are removed by then
        bar.close()
        state.save()
        if state.error is not None:
            print(f"sync: could not save {state.path} ({state.error.strerror}); the next sync fetches the files "
                  "again that it does not record", file=sys.stderr)
    return failures


class _NoBar:
    """What a sync calls on its bar, where none is shown."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def byte_bar(desc: str, total: int, show: bool):
    """A sync's progress bar in bytes on stderr (tqdm), or, where none is shown (--no-progress, nothing to
    fetch), one that draws nothing: tqdm's import alone is 50 ms of a 0.6-s sync."""
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr, mininterval=0.5)


def disk_full(dest: Path, stats: SyncStats, todo: list) -> SyncError:
    rest = sum(size for _, size, _ in todo) - stats.bytes
    return SyncError(f"the disk under {dest} is full (No space left on device) after {stats.downloaded} of {len(todo)} "
                     f"file(s); the completed files are kept. Free about {human_bytes(rest)} there "
                     f"({human_bytes(shutil.disk_usage(dest).free)} is free now), or sync to another disk "
                     "(--cache-dir), then rerun.")


def check_room(dest: Path, todo: list[tuple[str, int, str]]) -> None:
    """The files to fetch fit in the free space under `dest`, before the first GET."""
    need, free = sum(size for _, size, _ in todo), shutil.disk_usage(dest).free
    if need > free:
        raise SyncError(f"the {len(todo)} file(s) to download need {human_bytes(need)}, but {dest} has "
                        f"{human_bytes(free)} free; free space there, or sync to another disk (--cache-dir). "
                        "Nothing was downloaded.")


def folder_rows(missing: list[str], remote: dict) -> list[str]:
    """The rows absent from S3 that name a folder there (keys under `row/`), as a file system would see them
    (also rows whose object is a console's empty folder marker `row/`, which the engine lists as `row`)."""
    if not missing:
        return []
    folders = {k.rsplit("/", i)[0] for k in remote for i in range(1, k.count("/") + 1)}
    return [rel for rel in missing if rel in folders]


def sync(uri: str, dest: Path | str, *, workers: int, skip_missing: bool = False, progress: bool = True,
         engine: Engine | None = None, rows: bool = False, asked: AskedListing | None = None,
         bounds: Bounds = SYNC_BOUNDS) -> SyncStats:
    """Download s3://bucket/prefix/dataset.tsv and the files it lists into `dest`.

    Files listed but absent in S3 stop the sync (nothing is trained on a partial set) unless
    `skip_missing`, which reports them and lets training skip them (--skip-missing). `rows`: the
    manifest is for training, so its rows are checked as training reads them before any download.
    `engine`: the transfer engine to use (default: one with `workers` requests in flight); `asked`: the prefix's
    LIST, asked for on that engine already (ask_listing), else it is asked for here, beside the manifest."""
    start = time.perf_counter()
    bucket, prefix = parse_s3_uri(uri)
    dest = Path(dest)
    with holding(dest), engine_for(engine, workers, bounds) as engine, listing_asked(engine, uri, asked) as asked:
        base = f"{prefix}/" if prefix else ""
        if progress:
            print(f"sync: reading s3://{bucket}/{base}{MANIFEST_NAME} from {endpoint()}", file=sys.stderr, flush=True)
        try:
            staged, wanted = fetch_manifest(engine, bucket, base, dest, rows)
        except OSError as e:
            if is_disk_full(e):
                raise disk_full(dest, SyncStats(), []) from None
            raise
        with atomic(dest / MANIFEST_NAME, staged):  # the manifest lands last: a complete set
            remote = listing(engine, bucket, base, asked)
            state = SyncState(dest)
            stats = SyncStats(listed=len(wanted))
            todo, missing = [], []
            markers = set(folder_rows([r for r in wanted if remote.get(r, (1,))[0] == 0], remote))
            for rel in each(wanted):  # (a stat each: seconds at a million files)
                if rel not in remote or rel in markers:  # an empty object named like a folder: its marker
                    missing.append(rel)
                elif state.unchanged(rel, *remote[rel], dest / rel):
                    stats.skipped += 1
                else:
                    todo.append((rel, *remote[rel]))
            folders = folder_rows(missing, remote) if rows or not skip_missing else []  # predict lists them
            if folders:
                raise SyncError(f"s3://{bucket}/{base}{MANIFEST_NAME}: " + "; ".join(
                    f"line {wanted[rel]}: {rel!r} is a folder in s3://{bucket}/{base}, not a file" for rel in folders[:5])
                    + (f" ... and {len(folders) - 5} more" if len(folders) > 5 else "")
                    + "; list the image files, one per row. Nothing was downloaded.")
            stats.missing = len(missing)
            if missing and not skip_missing:
                raise SyncError(f"{len(missing)} file(s) listed in {MANIFEST_NAME} are not in s3://{bucket}/{base}, "
                                f"e.g. {missing[:3]}; upload them, fix the manifest, or pass --skip-missing to "
                                "train without them")
            if missing:
                print(f"sync: {len(missing)} file(s) listed in {MANIFEST_NAME} are not in s3://{bucket}/{base} "
                      f"(--skip-missing), e.g. {missing[:3]}", file=sys.stderr)
            check_room(dest, todo)
            failures = fetch_files(engine, bucket, base, dest, todo, state, stats, progress=progress,
                                   stall=bounds.stall)
            stats.seconds = time.perf_counter() - start
            if failures:
                raise SyncError(f"{len(failures)} of {len(todo)} download(s) failed (completed files are kept; "
                                "rerun the sync to finish):\n  " + "\n  ".join(failures[:5]))
    if progress:
        print(stats.summary(), file=sys.stderr)
    return stats


@contextmanager
def engine_for(engine: Engine | None, workers: int, bounds: Bounds = SYNC_BOUNDS):
    """The engine given, or one made (and closed) for this sync, with `bounds`' timeouts and tries."""
    if engine is not None:
        yield engine
        return
    engine = make_engine(workers, bounds)
    try:
        yield engine
    finally:
        engine.close()


def sync_objects(uri: str, dest: Path | str, names: list[str], *, workers: int, progress: bool = True,
                 engine: Engine | None = None, remote: dict[str, tuple[int, str]] | None = None,
                 bounds: Bounds = SYNC_BOUNDS) -> SyncStats:
    """Download the objects `names` under s3://bucket/prefix into `dest` (a pack's files, others' shards).
    The same road as `sync` (large objects in ranged GETs), the same lock, skip by size + ETag, room
    check, bounds and SIGTERM behaviour. `remote`: the prefix's listing, when the caller made it already."""
    start = time.perf_counter()
    bucket, prefix = parse_s3_uri(uri)
    dest = Path(dest)
    base = f"{prefix}/" if prefix else ""
    with holding(dest), engine_for(engine, workers, bounds) as engine:
        remote = listing(engine, bucket, base) if remote is None else remote
        missing = [n for n in names if n not in remote]
        if missing:
            raise SyncError(f"s3://{bucket}/{base} lacks {len(missing)} file(s) of the pack, e.g. {missing[:3]}; "
                            "upload the whole pack again")
        state = SyncState(dest)
        stats = SyncStats(listed=len(names))
        todo = [(n, *remote[n]) for n in each(names) if not state.unchanged(n, *remote[n], dest / n)]
        stats.skipped = len(names) - len(todo)
        check_room(dest, todo)
        failures = fetch_files(engine, bucket, base, dest, todo, state, stats, progress=progress, stall=bounds.stall)
        if failures:
            raise SyncError(f"{len(failures)} of {len(todo)} download(s) failed (completed files are kept; rerun "
                            "to finish):\n  " + "\n  ".join(failures[:5]))
    stats.seconds = time.perf_counter() - start
    if progress:
        print(stats.summary(), file=sys.stderr)
    return stats


def sync_files(uri: str, dest: Path | str, *, keep, workers: int, progress: bool = True,
               engine: Engine | None = None, bounds: Bounds = SYNC_BOUNDS) -> tuple[SyncStats, list[str]]:
    """Download the objects under s3://bucket/prefix whose key (relative to the prefix) `keep` accepts into
    `dest`, in parallel, as `sync` does the files of a manifest (an ImageFolder's images, which no manifest
    lists): one LIST, unchanged files (size + ETag) skipped, each file landed atomically, the same lock,
    room check, bounds and SIGTERM behaviour. Returns the stats and the kept keys, sorted. A key that would
    land outside `dest` is refused before any download."""
    start = time.perf_counter()
    bucket, prefix = parse_s3_uri(uri)
    dest = Path(dest)
    base = f"{prefix}/" if prefix else ""
    with holding(dest), engine_for(engine, workers, bounds) as engine:
        if progress:
            print(f"sync: listing s3://{bucket}/{base} from {endpoint()}", file=sys.stderr, flush=True)
        remote = listing(engine, bucket, base)
        names = sorted(k for k in remote if keep(k))
        unrequestable = [k for k in names if engine_refuses(k)]
        if unrequestable:  # one such key made the whole sync fail, as "S3 error http"
            names = [k for k in names if not engine_refuses(k)]
            print(f"sync: {len(unrequestable)} object(s) of s3://{bucket}/{base} not synced, so not read: "
                  f"{', '.join(map(repr, unrequestable[:5]))}{' ...' if len(unrequestable) > 5 else ''}: a key holding "
                  "a control character (a tab, a line break) cannot be requested by the transfer engine "
                  "(object_store); rename them in the bucket to include them", file=sys.stderr)
        refused = []
        for rel in names:
            try:
                if safe_relpath(rel, dest) != rel:
                    refused.append(rel)
            except ValueError:
                refused.append(rel)
        if refused:
            raise SyncError(f"s3://{bucket}/{base}: {len(refused)} key(s) would land outside {dest} or under another "
                            f"name, e.g. {refused[0]!r}; rename them. Nothing was downloaded.")
        state = SyncState(dest)
        stats = SyncStats(listed=len(names), unrequestable=unrequestable)
        todo = [(rel, *remote[rel]) for rel in each(names) if not state.unchanged(rel, *remote[rel], dest / rel)]
        stats.skipped = len(names) - len(todo)
        check_room(dest, todo)
        failures = fetch_files(engine, bucket, base, dest, todo, state, stats, progress=progress, stall=bounds.stall)
        stats.seconds = time.perf_counter() - start
        if failures:
            raise SyncError(f"{len(failures)} of {len(todo)} download(s) failed (completed files are kept; rerun to "
                            "finish):\n  " + "\n  ".join(failures[:5]))
    if progress:
        print(stats.summary(), file=sys.stderr)
    return stats, names
