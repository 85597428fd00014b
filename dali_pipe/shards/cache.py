"""Shard bytes for training, always from local disk, always checked: a local pack verified once,
a pack on S3 synced whole, or streamed through a bounded local cache. This module is the streaming cache
(`StreamCache`); the checks and their verdicts are in shards/verdicts.py, one object's fetch in
shards/fetchers.py, a pack's sync in shards/packsync.py.

Every shard whose size and checksum are known (packed.json; peer shards as indexed) is checked
before its first use, and a mismatch names the shard and the way out; nothing unchecked is
decoded. The checksum is the fast one (format.FAST_SUM, XXH3-128, about 9 GB/s here) where known,
else the sha256 (packs made before it, at about 1.2 GB/s); a verdict records the checksum it checked.

- Local packs (`verify_local`): hashed once before training, with the verdict cached by (path,
  size, mtime) in CACHE_DIR/shard-verdicts.json, so reruns cost a stat per shard.
- Synced packs (`fetch`, `--packed-s3 sync`, or `auto` when they fit): every shard fetched with
  ranged parallel GETs (the transfer engine, dali_pipe/transfer.py), several at a time, checked as it
  lands (a mismatch is fetched once more, then named), its verdict recorded. The index files (small,
  one per shard) are fetched on every route the way `sync` fetches a dataset's files, skipped when
  their size and ETag are unchanged; packed.json last.
- Streamed packs (`StreamCache`, `--packed-s3 stream`, or `auto` when they do not fit): the
  shards are fetched in the order the epoch plan reads them, several at a time, into a folder
  bounded by `--stream-cache`; a read waits until its shard has landed and matched. Training
  starts once the first window of shards is local. Eviction follows the readers' plans: shards
  that a reader has in progress are never evicted; otherwise the one whose next use is farthest
  goes first (consumed shards, until the next epoch needs them), and only to make room for one
  needed sooner. The plans are known ahead (dali_pipe/shards/plan.py), so this is Belady's
  optimal rule, not a guess. DDP: each rank fetches the shards of its own share (the plan splits
  the data by rank), into its own folder, with bound / local ranks; ranks fetch disjoint data,
  so fetching once per node would save only the few shards cut by a rank boundary.
  The cache heals itself: a shard that is missing, shorter than its index or changed when a reader
  comes to it (its size and mtime are compared with those it landed with, and a changed one is hashed
  again) is removed and fetched again, through the same bound, order and fetch limits, at most
  HEALS times per shard and run; a rerun keeps every shard that landed whole (those the verdicts
  file, saved every few seconds, does not know yet are hashed again instead of fetched).
- Shards of others on S3 or at an https:// server are streamed the same way (their sizes and
  checksums from indexing); gzipped ones were decompressed into the cache dir while indexed
  (shards/source.py) and are local files here.

Faults: S3 throttling (503 SlowDown), a cut connection and a stalled body (read timeout) are
retried by the transfer engine (obstore), then by one more whole attempt here;
an attempt that moves no byte for `stall` seconds (s3.Bounds), or runs past its deadline, is cancelled, so a
silent endpoint is named after about a minute. HTTP(S) shards take the same road (the engine's HTTPStore,
shards/fetchers.py's `Fetcher`) with the same bounds: retries of refused connections, timeouts, 429 and 5xx
per request, a cut body continued with a Range request (or read again by the next attempt where the server
takes no ranges), an attempt given up after `stall` seconds without a byte or past its deadline, `attempts`
whole attempts, the size and checksum checked before the rename. What still fails is a ShardFetchError naming
the endpoint and the key (or the URL, redacted).

The bytes move through the same engine as a dataset's small files (ranged parallel GETs, retries,
temporary files removed on failure); what is ours here is the order (the plan), the bound, the
eviction and the checks.
"""
from __future__ import annotations

import hashlib
import math
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import parse_size
from ..errors import UserError
from ..https import cache_name, is_http
from ..s3 import Bounds, local_target
from ..workdir import free_bytes, lock, remove, remove_dead_temps, unlock
from .fetchers import SHARD_BOUNDS, fetcher_for, where
from .verdicts import (
    HASH_WORKERS,
    VERDICTS_NAME,
    Remote,
    ShardError,
    ShardFetchError,
    Verdicts,
    check_remote,
    is_remote,
)

FETCH_PARALLEL = 4  # shards fetched at once
STREAM_SHARE = 0.5  # default --stream-cache: this share of the cache disk's free space
HEALS = 2  # times one shard may be fetched again in a run after it went missing or changed in the cache


# -- the streaming cache -------------------------------------------------------------------------
class StreamCacheError(ShardError):
    """--stream-cache cannot hold what the epoch plan reads at once, or the disk cannot hold --stream-cache."""


def _mb(n: float, *, up: bool = False, down: bool = False) -> str:
    """A size in decimal units, as --stream-cache takes it ('812 bytes', '37.5 kB', '12.0 MB', '1.2 GB'; never
    '0.0 MB'); `up`: rounded up, for a size that must be enough; `down`: rounded down, for room there is."""
    if n < 1000:
        return f"{math.ceil(n) if up else int(n)} bytes"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if n < scale * 1000 or unit == "GB":
            v = n / scale
            v = math.ceil(round(v * 10, 6)) / 10 if up else math.floor(round(v * 10, 6)) / 10 if down else v
            return f"{v:.1f} {unit}"


def stream_room(folder: Path, local_ranks: int = 1) -> int:
    """The disk the node's stream caches could use: the free space of `folder`'s disk and what this rank's
    cache holds already (each rank's about as much)."""
    here = sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) if folder.is_dir() else 0
    return free_bytes(folder) + here * local_ranks  # (not created here: the pre-flight asks before torch loads)


def stream_folder(data: str, cache_dir: str | Path) -> Path:
    """Where the streaming cache of --data lives: CACHE/stream/BUCKET/PREFIX for s3://, CACHE/stream/http/
    DIGEST for https:// (a digest of --data: its query string may carry a secret)."""
    if is_http(data):
        return http_copies(data, Path(cache_dir) / "stream")
    return local_target(data, Path(cache_dir) / "stream")


def http_copies(data: str, cache_dir: str | Path) -> Path:
    """CACHE/http/DIGEST: where whole copies of --data's https:// shards are kept (pack reads them there)."""
    return Path(cache_dir) / "http" / hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def stream_bound(setting: int | None, folder: Path, local_ranks: int = 1) -> int:
    """This rank's cache bound: --stream-cache (or STREAM_SHARE of the free space) over the node's
    ranks; refused when the disk cannot hold it."""
    room = stream_room(folder, local_ranks)
    if setting is None:
        return max(1, int(room * STREAM_SHARE) // local_ranks)
    if setting > room:
        raise StreamCacheError(f"--stream-cache {_mb(setting)}: the disk of {folder} has {_mb(room, down=True)} free "
                               "for it; free space, pass a smaller --stream-cache, or another --cache-dir")
    return setting // local_ranks


def reader_need(plan, sizes, batch: int) -> int:
    """The most bytes of shards one reader has in use at once over its first two epochs (its shuffle window's
    shards and a batch read ahead): `plan(epoch)` its epoch plan, `sizes[shard]` in bytes."""
    return max(plan(e).in_use(sizes, extra=batch) for e in (0, 1))


def least(needs, largest: int, local_ranks: int) -> int:
    """The least --stream-cache (for a node of `local_ranks` processes) that holds what one process's readers
    (`needs`, each reader_need) have in use at once, and one more shard (the `largest`)."""
    return (sum(needs) + largest) * local_ranks


def too_small(bound: int, minimum: int, largest: int, folder: Path, local_ranks: int) -> StreamCacheError | None:
    """The refusal of a process's cache `bound` below `minimum` (least()), asking for a size that is enough
    for every reader (and saying so when the disk has less room than that); None when it holds."""
    total = -(-minimum // local_ranks)
    if total <= bound:
        return None
    enough = _mb(total * local_ranks, up=True)
    room = stream_room(folder, local_ranks)
    disk = (f"; the disk of {folder} has only {_mb(room, down=True)} free for it, so free space there or "
            "pass another --cache-dir" if parse_size(enough) > room else "")
    return StreamCacheError(
        f"--stream-cache gives this process {_mb(bound)}, but its readers (training and validation) have up "
        f"to {_mb(total)} of shards in use at once (their shuffle windows' shards, up to {_mb(largest)} each, "
        f"and one more); raise --stream-cache to at least {enough}{disk}, or pack with a smaller --shard-size")


class _Demand:
    """One reader's position and what it will read next, as the URLs of its remote shards."""

    def __init__(self, reader, urls: list[str], remote: set[str]):
        self._reader, self.urls = weakref.ref(reader), [u if u in remote else None for u in urls]
        self.epoch, self.position, self.started, self.need = 0, 0, False, 0
        self.batch = reader.batch

    @property
    def reader(self):
        """The ShardReader, while it lives (a loader that was dropped leaves nothing to protect)."""
        return self._reader()

    def _plan(self, epoch: int):
        reader = self.reader
        return reader.plan(epoch) if reader is not None else None

    def _state(self):
        plan = self._plan(self.epoch)
        if plan is None:
            import numpy as np  # here: `python -m dali_pipe sync` of a pack needs this module, not numpy (60 ms)

            empty = np.zeros(0, np.int64)
            return empty, empty, empty, 0
        shards, first, last = plan.uses
        return shards, first, last, int(first.searchsorted(self.position, side="left"))

    def in_progress(self) -> set[str]:
        """Shards started and not finished: never evicted."""
        shards, _, last, started = self._state()
        return {self.urls[int(s)] for s, end in zip(shards[:started], last[:started])
                if end >= self.position and self.urls[int(s)]}

    def upcoming(self, limit: int) -> list[str]:
        """URLs in the order this reader needs them: in progress, not started, then the next epoch."""
        shards, _, last, started = self._state()
        out = [self.urls[int(s)] for s, end in zip(shards[:started], last[:started]) if end >= self.position]
        out += [self.urls[int(s)] for s in shards[started:started + limit]]
        nxt = self._plan(self.epoch + 1) if len(out) < limit else None
        if nxt is not None:
            out += [self.urls[int(s)] for s in nxt.uses[0][:limit]]
        return [u for u in dict.fromkeys(out) if u][:limit]

    def next_event(self) -> int:
        """The position at which in_progress or upcoming changes (a shard starts or finishes)."""
        _, first, last, started = self._state()
        ahead = [int(first[started])] if started < len(first) else []
        ends = [int(e) + 1 for e in last[:started] if e >= self.position]
        return min(ahead + ends, default=1 << 62)


class StreamCache:
    """Shards of S3 fetched ahead into `folder`, at most `bound` bytes (resident + in flight)."""

    def __init__(self, folder: Path, remotes: list[Remote], bound: int, *, parallel: int = FETCH_PARALLEL,
                 local_ranks: int = 1, bounds: Bounds = SHARD_BOUNDS):
        self.folder, self.bound, self.local_ranks, self.bounds = Path(folder), bound, local_ranks, bounds
        self.folder.mkdir(parents=True, exist_ok=True)
        lock(self.folder, "run streaming these shards", "wait for it to finish, or pass another --cache-dir")
        remove_dead_temps(self.folder, ".*.part-*")
        self.fetcher = fetcher_for(remotes, bounds)
        self.remotes = {r.url: r for r in self.fetcher.listed(remotes)}
        self.names = _local_names(list(self.remotes))
        self.verdicts = Verdicts(self.folder)
        self.resident: dict[str, int] = {}
        self.inflight: dict[str, int] = {}
        self.failed: dict[str, Exception] = {}
        self.landed: set[str] = set()  # URLs fetched (and checked as they landed) in this run
        self.healed: dict[str, int] = {}  # URL -> times fetched again after it went missing or changed
        self.demands: dict[int, _Demand] = {}
        self.active: int | None = None
        self.waiting: str | None = None  # the URL a reader is blocked on
        self.peak = self.fetched = 0
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._event = 0  # position of the active reader's next change
        self._saved = time.monotonic()
        self._pool = ThreadPoolExecutor(parallel, thread_name_prefix="shard-fetch")
        self._parallel = parallel
        self._thread: threading.Thread | None = None
        self._adopt()
        total = sum(r.size for r in self.remotes.values())
        print(f"stream: {len(self.remotes)} shard(s), {_mb(total)}, fetched ahead of the reader into {self.folder} "
              f"(at most {_mb(bound)} there; {len(self.resident)} already there)", file=sys.stderr, flush=True)

    def _adopt(self) -> None:
        """Shards left by an earlier run that still match are kept (a resume refetches only the rest): by
        their verdict, or hashed again when a kill came before the verdicts file was saved (a shard lands
        under its name only once it has matched, so one of the right size is most likely whole)."""
        wanted = {self.names[u]: u for u in self.remotes}
        check = []
        for f in self.folder.iterdir():
            url = wanted.get(f.name)
            if url is None:  # not a shard of this pack (any more): it would only take room
                if f.is_file() and not f.name.startswith(".") and f.name != VERDICTS_NAME:
                    remove(f, self.folder)
                continue
            if f.is_file() and not f.is_symlink():
                check.append((url, f))

        def whole(item):
            url, f = item
            r = self.remotes[url]
            return url, f, check_remote(f, r, self.verdicts) is None

        with ThreadPoolExecutor(HASH_WORKERS) as pool:
            for url, f, ok in pool.map(whole, check):
                if ok:
                    self.resident[url] = self.remotes[url].size
                else:
                    remove(f, self.folder)
                    self.verdicts.forget(f)

    def local(self, url: str) -> Path:
        return self.folder / self.names[url]

    def view(self, shards) -> "CacheView":
        return CacheView(self, shards)

    # -- the reader side -------------------------------------------------------------------------
    def register(self, reader, urls: list[str], *, check: bool = True) -> None:
        """A reader (a ShardReader) whose plan drives the fetching; refused (`check`) when the bound cannot
        hold what its plans and those registered before have in use at once. Register every reader of a
        run with check=False, then call check() once: its refusal then asks for a size enough for all."""
        sizes = [self.remotes[u].size if u in self.remotes else 0 for u in urls]
        need = reader_need(reader.plan, sizes, reader.batch)
        with self._cv:
            self._forget_dead()
            d = _Demand(reader, urls, set(self.remotes))
            d.need, d.largest = need, max(sizes, default=0)
            self.demands[id(reader)] = d
        if check:
            self.check()

    def minimum(self) -> int:
        """The least --stream-cache (for the node's ranks) that holds what the registered readers have in
        use at once: their shuffle windows' shards and one more shard."""
        with self._cv:
            self._forget_dead()
            demands = list(self.demands.values())
        return least([d.need for d in demands], max((d.largest for d in demands), default=0), self.local_ranks)

    def check(self) -> None:
        """StreamCacheError when the bound is below minimum() (too_small)."""
        refusal = too_small(self.bound, self.minimum(), max((d.largest for d in self.demands.values()), default=0),
                            self.folder, self.local_ranks)
        if refusal is not None:
            raise refusal

    def _forget_dead(self) -> None:
        for key in [k for k, d in self.demands.items() if d.reader is None]:
            del self.demands[key]
            if self.active == key:
                self.active = None

    def advance(self, reader, epoch: int, position: int) -> None:
        d = self.demands.get(id(reader))
        if d is None or d.reader is not reader:
            return
        with self._cv:
            changed = epoch != d.epoch or not d.started
            d.epoch, d.position, d.started = epoch, position, True
            if self.active != id(reader):
                self.active, changed = id(reader), True
            if changed or position >= self._event:
                self._cv.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._schedule, name="shard-cache", daemon=True)
            self._thread.start()

    def path(self, url: str, reader) -> str:
        """The local path of `url` once it has landed and matched, checked again (a stat; a hash when its
        size or mtime changed) before it is handed out: a shard gone or changed is fetched again."""
        r = self.remotes[url]
        while True:
            local = self._landed(url, reader)
            problem = check_remote(local, r, self.verdicts)
            if problem is None:
                return local
            self.lost(url, problem)

    def lost(self, url: str, why: str) -> None:
        """`url`'s local copy is missing or damaged (`why`): remove it and fetch it again, HEALS times at most
        per run; then a ShardError (something else keeps changing the cache)."""
        with self._cv:
            if url not in self.resident:  # evicted meanwhile (not lost): fetched again when it is needed
                return
            n = self.healed.get(url, 0)
            if n >= HEALS:
                raise ShardError(f"{self.local(url)} (the cached copy of {url}) {why}, after it was fetched again "
                                 f"{n} time(s): something else removes or writes files in {self.folder}; give this "
                                 "run a --cache-dir of its own")
            self.healed[url] = n + 1
            self.resident.pop(url)
            remove(self.local(url), self.folder, quiet=True)
            self.verdicts.forget(self.local(url))
            self._cv.notify_all()
        print(f"stream: {self.local(url)} {why}; fetching {url} again", file=sys.stderr, flush=True)

    def _landed(self, url: str, reader) -> str:
        """Wait (bounded) until `url` is resident, then its local path."""
        r = self.remotes[url]
        limit = self.bounds.attempts * self.bounds.deadline(r.size) + 60
        start = time.monotonic()
        with self._cv:
            if url in self.resident:
                return str(self.local(url))
            self.active, self.waiting = id(reader), url
            self._cv.notify_all()
            while url not in self.resident:
                if url in self.failed:
                    raise self.failed[url]
                if self._stop.is_set():
                    raise ShardFetchError(f"{where(url)}: the streaming cache was closed")
                if time.monotonic() - start > limit:
                    raise ShardFetchError(f"{where(url)}: not fetched within {limit:.0f} s; check the endpoint "
                                          "and the network")
                self._cv.wait(0.5)
            if self.waiting == url:
                self.waiting = None
            return str(self.local(url))

    # -- the fetching side -----------------------------------------------------------------------
    def _limit(self) -> int:
        smallest = min((r.size for r in self.remotes.values() if r.size), default=1)
        return int(min(len(self.remotes) * 2 + 4, 2 * self.bound // max(1, smallest) + 64))

    def _schedule(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                try:
                    self._step()
                except Exception as e:  # never die silently: the blocked reader gets the error
                    if self.waiting is not None:
                        self.failed[self.waiting] = e
                    self._cv.notify_all()
                self._cv.wait(1.0)

    def _step(self) -> None:
        """Start what the plans need next, evicting what they need last (called holding the lock)."""
        self._forget_dead()
        active = self.demands.get(self.active)
        if active is None:
            return
        limit = self._limit()
        order = active.upcoming(limit)
        for d in self.demands.values():
            if d is not active and d.started:
                order += [u for u in d.upcoming(limit) if u not in order]
        rank = {u: i for i, u in enumerate(order)}
        protected = set().union(*(d.in_progress() for d in self.demands.values() if d.started))
        self._event = active.next_event()
        for url in order:
            if len(self.inflight) >= self._parallel:
                break
            if url in self.resident or url in self.inflight or url in self.failed:
                continue
            size = self.remotes[url].size
            free = self.bound - sum(self.resident.values()) - sum(self.inflight.values())
            if size > free:
                victims = sorted((u for u in self.resident if u not in protected and rank.get(u, 1 << 62) > rank[url]),
                                 key=lambda u: -rank.get(u, 1 << 62))
                for u in victims:
                    if size <= free:
                        break
                    free += self._evict(u)
                if size > free:
                    if url == self.waiting and not self.inflight:
                        self.failed[url] = StreamCacheError(
                            f"the streaming cache ({_mb(self.bound)}) is full of shards in use and cannot take "
                            f"{url} ({_mb(size)}); raise --stream-cache")
                        self._cv.notify_all()
                    break
            self.inflight[url] = size
            self.peak = max(self.peak, sum(self.resident.values()) + sum(self.inflight.values()))
            self._pool.submit(self._fetch, url)

    def _evict(self, url: str) -> int:
        size = self.resident.pop(url)
        path = self.local(url)
        remove(path, self.folder, quiet=True)
        self.verdicts.forget(path)
        return size

    def _fetch(self, url: str) -> None:
        try:
            self.fetcher.fetch(self.remotes[url], self.local(url), stop=self._stop, verdicts=self.verdicts)
        except Exception as e:
            with self._cv:
                self.inflight.pop(url, None)
                self.failed[url] = e if isinstance(e, UserError) else ShardFetchError(f"{where(url)}: {e}")
                self._cv.notify_all()
            return
        with self._cv:
            self.resident[url] = self.inflight.pop(url)
            self.landed.add(url)  # checked as it landed, in this run
            self.fetched += 1
            self._cv.notify_all()
            save = time.monotonic() - self._saved > 2.0
            if save:
                self._saved = time.monotonic()
        if save:  # so that a killed run's landed shards are kept by the next one
            self.verdicts.save()

    def close(self) -> None:
        """Stop fetching (in-flight transfers are cancelled); landed shards stay for the next run."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        self.fetcher.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.verdicts.save()
        unlock(self.folder)
        print(f"stream: fetched {self.fetched} shard(s); the cache held at most {_mb(self.peak)} of its "
              f"{_mb(self.bound)}", file=sys.stderr, flush=True)


class CacheView:
    """The store a ShardReader reads through: its shards' positions -> local paths, local files
    as they are, s3:// ones through the cache."""

    def __init__(self, cache: StreamCache, shards):
        self.cache, self.paths = cache, list(shards.paths)

    def register(self, reader, *, check: bool = True) -> None:
        self.cache.register(reader, self.paths, check=check)

    def path(self, shard: int, reader) -> str:
        p = self.paths[shard]
        return self.cache.path(p, reader) if is_remote(p) else p

    def checked(self, shard: int) -> bool:
        """A shard fetched in this run was checked as it landed; one an earlier run left (kept by its verdict:
        size and mtime) and a local one are not: the reader hashes those."""
        return self.paths[shard] in self.cache.landed

    def lost(self, shard: int, reader, why: str) -> bool:
        """The reader found shard's local file missing or short (`why`): True when it is fetched again (a
        streamed shard), False for a local file, which only the user can restore."""
        p = self.paths[shard]
        if not is_remote(p):
            return False
        self.cache.lost(p, why)
        return True

    def advance(self, reader, epoch: int, position: int) -> None:
        self.cache.advance(reader, epoch, position)


def local_name(url: str) -> str:
    """The file name of a shard's local copy: the key's base name (S3), or a digest and the base name
    without the query string, which may carry a signature (HTTP)."""
    return cache_name(url) if is_http(url) else (url.rsplit("/", 1)[-1] or "shard")


def _local_names(urls: list[str]) -> dict[str, str]:
    """A file name per URL (local_name), prefixed by a number where two share one."""
    names: dict[str, str] = {}
    seen: dict[str, int] = {}
    for u in urls:
        base = local_name(u)
        n = seen.get(base, 0)
        seen[base] = n + 1
        names[u] = base if n == 0 else f"{n}-{base}"
    return names
