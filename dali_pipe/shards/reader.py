"""The shard reader: the encoded bytes and labels of the samples an epoch plan names, batch by
batch, for DALI's `fn.external_source` (decoding and augmentation stay in the DALI graph).

A new order every epoch, which this reader was first written for, DALI's own `readers.webdataset`
gives too since DALI 2.2 (`shuffle_after_epoch`: the shard order redrawn each epoch, each shard read
in order, with `random_shuffle`'s sample buffer on top); it also reads s3:// paths and takes a
pipeline checkpoint. This reader is kept for what DALI's does not do (docs/s3-and-packs.md, with the
two measured side by side by tools/bench_reader.py): shard bytes checked against their size and
checksum before they are read, single bad members left out (`Shards.excluded`), the `.cls` text parsed
to an integer label and remapped (DALI hands over the member's bytes), and an epoch plan that the
streaming cache fetches ahead by, into a bounded disk cache. `ShardReader` is the external_source
callable: it takes DALI's `BatchInfo` (epoch and iteration) and returns that batch of the rank's plan
(dali_pipe/shards/plan.py). It keeps no position of its own, so a DALI
pipeline checkpoint, which saves the epoch and iteration and re-asks the source from there
(external_source.py: "queries to sources that are single-argument callables ... will be resumed
from the epoch and iteration saved in the checkpoint"), is all an exact resume needs.

Bytes come from local files only, through a store: `LocalStore` for shards on disk (checked
against their checksum before training, dali_pipe/shards/cache.py), or the streaming cache, which
fetches shards ahead in plan order and blocks a read until its shard has landed and matched. A
shard file that cannot be opened, or ends before a sample its index lists, is reported to the store:
the streaming cache fetches it again and the read is retried once; a local file is named, with the
way out.

The source runs in the training process (DALI's serial mode): per sample it costs one `pread`
of the image and label members (adjacent in our tars), measured at about 10 us; DALI's parallel
mode (worker processes) was measured slower on the 2-core CPU path and would need the cache's
position across processes (see docs/s3-and-packs.md for the numbers).
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from .format import IndexFormatError, LabelFormatError, fast_digest, image_member, label_member, parse_cls, read_index
from .plan import Plan, epoch_plan

OPEN_FILES = 32  # shard files kept open at once (a window's worth and more)
VERIFY_CHUNK = 4 << 20  # bytes a shard is hashed in, as it is read once
ASKED_KEPT = 64  # batches whose epoch is remembered, to name a sample that failed to decode (DALI runs a few ahead)
OPEN_GROUPS = 24  # table groups kept in memory at once (the plan has at most plan.WINDOW of a rank in progress)


class ShardReadError(UserError):
    """A shard or its index cannot be read as the plan needs; the message names it and the fix."""


class _Short(Exception):
    """A shard file ended before a sample its index lists."""


@dataclass(frozen=True)
class ShardEntries:
    """One shard's samples as arrays (entry positions in its index file, or rows of its table group)."""
    keys: list[str]
    image: np.ndarray  # (entries, 2) int64: the image member's (offset, size); tables: unused
    label: np.ndarray  # (entries, 2) int64: the cls member's (offset, size); tables: unused
    usable: np.ndarray  # entry positions not excluded, in index order
    group: object = None  # tables: the shard's samples.TableGroup (labels known, bytes read per group)


def read_entries(shards) -> list[ShardEntries]:
    """Each shard's image and label members from its DALI index file (a table group: its rows), minus
    `shards.excluded`. A sample without an image or (unless `shards.labels` is False) a cls member stops
    here, naming its shard and key."""
    out = []
    excluded_by_shard: dict[int, set[int]] = {}
    for sh, entry in shards.excluded:
        excluded_by_shard.setdefault(sh, set()).add(entry)
    groups = shards.groups or (None,) * len(shards.paths)
    for s, (path, idx, group) in enumerate(zip(shards.paths, shards.index_paths, groups)):
        if group is not None:
            n, excluded = len(group.labels), excluded_by_shard.get(s, set())
            none = np.zeros((0, 2), np.int64)
            out.append(ShardEntries([str(i) for i in range(n)], none, none,
                                    np.array([i for i in range(n) if i not in excluded], np.int64), group))
            continue
        try:
            entries = read_index(idx)
        except (OSError, IndexFormatError) as e:
            raise ShardReadError(f"{idx} (index of {path}) cannot be read: {e}; pack the data again, or "
                                 "delete the cached index so that it is made again") from None
        image = np.zeros((len(entries), 2), np.int64)
        label = np.zeros((len(entries), 2), np.int64)
        excluded = excluded_by_shard.get(s, set())
        for i, e in enumerate(entries):
            if i in excluded:
                continue
            ext, cls = image_member(e.members), label_member(e.members) if shards.labels else None
            if ext is None or (cls is None and shards.labels):
                what = "an image (jpg, jpeg, png or webp)" if ext is None else "a cls member"
                raise ShardReadError(f"{path}: sample {e.key!r} has no {what}; pack the data again")
            image[i] = e.members[ext]
            label[i] = e.members[cls] if cls is not None else (e.members[ext][0], 0)  # no label: nothing to read
        usable = np.array([i for i in range(len(entries)) if i not in excluded], np.int64)
        out.append(ShardEntries([e.key for e in entries], image, label, usable))
    return out


class LocalStore:
    """Shards that are local files already (verified before training)."""

    def __init__(self, paths):
        self.paths = list(paths)

    def path(self, shard: int, reader=None) -> str:
        return self.paths[shard]

    def checked(self, shard: int) -> bool:
        """Whether this store checked the shard's bytes as it made them local (a local file: no)."""
        return False

    def advance(self, reader, epoch: int, position: int) -> None:
        """The reader has read up to `position` of `epoch` (nothing to do on local disk)."""

    def lost(self, shard: int, reader, why: str) -> bool:
        """A local shard is gone or short: nothing fetches it again (False); the reader names it."""
        return False


class ShardReader:
    """DALI external_source callable (batch mode, `batch_info=True`): BatchInfo -> (images, labels)."""

    def __init__(self, shards, *, batch: int, seed: int, rank: int, world: int, training: bool, store=None,
                 entries: list[ShardEntries] | None = None):
        self.shards, self.batch, self.seed, self.rank, self.world = shards, batch, seed, rank, world
        self.training = training
        self.entries = entries if entries is not None else read_entries(shards)
        self.store = store if store is not None else LocalStore(shards.paths)
        usable = sum(len(e.usable) for e in self.entries)
        if usable != shards.samples:
            raise ShardReadError(f"the index files list {usable} usable samples, but the pack says {shards.samples} "
                                 f"(packed.json, shard {shards.paths[0]} ...); pack the data again")
        self._plans: OrderedDict[int, Plan] = OrderedDict()
        self._lock = threading.Lock()  # plans are also asked for by the streaming cache's thread
        self._files: OrderedDict[int, int] = OrderedDict()
        self._groups: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # tables: (bytes, offsets)
        self._tables = TableFiles()
        self._verified: set[int] = set()  # shards whose bytes this reader hashed against their checksum
        self._verified_files: set[str] = set()  # table files (Parquet, Arrow) hashed so
        self._asked: dict[int, int] = {}  # batch -> the epoch it was last asked for (the last ASKED_KEPT batches)
        self.batches = self.plan(0).batches  # the same every epoch

    def plan(self, epoch: int) -> Plan:
        """This rank's plan for `epoch` (the last few kept)."""
        with self._lock:
            if epoch not in self._plans:
                self._plans[epoch] = epoch_plan([e.usable for e in self.entries], seed=self.seed, epoch=epoch,
                                                rank=self.rank, world=self.world, batch=self.batch,
                                                training=self.training)
                while len(self._plans) > 4:
                    self._plans.popitem(last=False)
            return self._plans[epoch]

    def valid(self, k: int) -> int:
        """Real samples in batch k of any epoch (the loader drops the rest: padding)."""
        return self.plan(0).valid(k)

    def member(self, k: int, i: int) -> tuple[int, int, str]:
        """(shard, entry, words naming it) of sample i of batch k of the epoch that batch was last asked for
        (a failed decode's sample)."""
        plan = self.plan(self._asked.get(k, 0))
        pos = max(0, min(k * self.batch + i, len(plan) - 1))
        shard, entry = int(plan.shard[pos]), int(plan.entry[pos])
        return shard, entry, f"sample {self.entries[shard].keys[entry]!r} of {self.shards.paths[shard]}"

    def __call__(self, info):
        plan = self.plan(info.epoch_idx)
        k = info.iteration
        self._asked[k] = info.epoch_idx
        while len(self._asked) > ASKED_KEPT:
            self._asked.pop(next(iter(self._asked)))
        if k >= plan.batches:
            raise StopIteration
        lo, hi = k * self.batch, min(len(plan), (k + 1) * self.batch)
        self.store.advance(self, info.epoch_idx, lo)  # where this batch starts (the cache fetches from here)
        positions = range(lo, hi) if hi > lo else [len(plan) - 1] if len(plan) else []
        images, labels = [], []
        for i in positions:
            image, label = self._sample(int(plan.shard[i]), int(plan.entry[i]))
            images.append(image)
            labels.append(label)
        if not images:  # a rank without samples (fewer samples than ranks): one padding sample, dropped
            shard = next(s for s, e in enumerate(self.entries) if len(e.usable))
            image, label = self._sample(shard, int(self.entries[shard].usable[0]))
            images, labels = [image], [label]
        self.store.advance(self, info.epoch_idx, hi)
        self._close_finished(plan, hi)
        return images, np.array(labels, np.int32)

    # -- bytes -------------------------------------------------------------------------------------
    def _fd(self, shard: int) -> int:
        fd = self._files.get(shard)
        if fd is None:
            while True:
                path = self.store.path(shard, self)
                try:
                    fd = os.open(path, os.O_RDONLY)
                    break
                except OSError as e:  # gone: the streaming cache fetches it again (bounded); a local file is named
                    if not isinstance(e, FileNotFoundError) or not self.store.lost(shard, self,
                                                                                   f"cannot be opened ({e.strerror})"):
                        raise ShardReadError(f"{self.shards.paths[shard]} cannot be opened ({e.strerror}); it was "
                                             "there when training started: restore it, or pack the data "
                                             "again") from None
            if shard not in self._verified and not self.store.checked(shard):
                try:
                    self._verify(shard, fd)
                except BaseException:
                    os.close(fd)
                    raise
                self._verified.add(shard)
            self._files[shard] = fd
            while len(self._files) > OPEN_FILES:
                os.close(self._files.popitem(last=False)[1])
        else:
            self._files.move_to_end(shard)
        return fd

    def _verify(self, shard: int, fd: int) -> None:
        """The shard's bytes against the checksum it was packed (or indexed) with, read once when this reader
        first opens it: the check before training trusts a verdict kept by size and mtime, which a shard
        changed in place with its mtime kept (cp -p, rsync -a, bit rot) keeps, so the bytes are hashed here,
        as the first epoch reads them anyway (XXH3 runs at about 9 GB/s: the read, not the hash, is the cost)."""
        sums = [(name, got[shard]) for name, got in (("xxh3", self.shards.xxh3), ("sha256", self.shards.sha256))
                if got is not None and got[shard]]
        if not sums:
            return
        name, expected = sums[0]
        digest = fast_digest() if name == "xxh3" else hashlib.sha256()
        offset = hash_fd(fd, digest)
        size = self.shards.sizes[shard] if self.shards.sizes is not None else None
        if (size is not None and offset != size) or digest.hexdigest() != expected:
            why = f"{offset} bytes where {size} were checked" if size is not None and offset != size else \
                f"its {name} is not the one it was checked with"
            raise ShardReadError(f"{self.shards.paths[shard]} changed after it was checked ({why}), though its size "
                                 "and modification time may not have (a copy that keeps them, or damage on disk): "
                                 "copy or sync the shards again, or pack the data again; shards of others are "
                                 "indexed again once the file's modification time changes (touch it)")

    def _verify_table(self, shard: int, path: str) -> None:
        """A table's bytes against their checksum, once per reader: a Parquet group's image bytes (the span of
        the file pyarrow reads for it, hashed as checked) before the group is first read, so a file of any size
        costs one more pass over what is read anyway; an Arrow file (memory-mapped whole) by its file checksum
        (_verify) when the first of its batches is read."""
        group = self.entries[shard].group
        if shard in self._verified if group.span is not None else path in self._verified_files:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            if group.span is None:
                self._verify(shard, fd)
            elif hash_span(fd, group.span[0], group.span[1]) != group.span[2]:
                raise _table_changed(path, f"the image bytes of row group {group.group} are not the ones checked")
        finally:
            os.close(fd)
        if group.span is not None:
            self._verified.add(shard)
        else:
            self._verified_files.add(path)

    def _close_finished(self, plan: Plan, position: int) -> None:
        """Close the shards this epoch has no more use for (the cache may then evict them)."""
        spans = plan.spans
        for shard in [s for s in self._files if s not in spans or spans[s][1] < position]:
            os.close(self._files.pop(shard))
        for shard in [s for s in self._groups if s not in spans or spans[s][1] < position]:
            del self._groups[shard]

    def _row(self, shard: int, entry: int) -> tuple[np.ndarray, int]:
        """A table row's image bytes (a view into its group, read whole on first use) and class index."""
        e = self.entries[shard]
        got = self._groups.get(shard)
        if got is None:
            path = self.store.path(shard, self)
            try:
                self._verify_table(shard, path)
                got = self._tables.read(path, e.group.fmt, e.group.group, e.group.column)
            except OSError as err:
                raise ShardReadError(f"{self.shards.paths[shard]} cannot be read ({err}); it was there when "
                                     "training started: restore it") from None
            if len(got[1]) - 1 != len(e.group.labels):  # (the footer, which the span's hash does not cover, changed)
                raise _table_changed(path, f"row group {e.group.group} holds {len(got[1]) - 1} rows, "
                                           f"{len(e.group.labels)} when checked")
            self._groups[shard] = got
            while len(self._groups) > OPEN_GROUPS:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(shard)
        data, offsets = got
        label = e.group.labels[entry]
        remap = self.shards.remap
        return data[offsets[entry]:offsets[entry + 1]], (label if remap is None else remap[label])

    def _sample(self, shard: int, entry: int) -> tuple[np.ndarray, int]:
        while True:
            try:
                return self._read_sample(shard, entry)
            except _Short:  # damaged (truncated) under us: fetched again when streamed, else named
                key = self.entries[shard].keys[entry]
                os.close(self._files.pop(shard))
                if not self.store.lost(shard, self, f"ends before sample {key!r} (shorter than its index says)"):
                    raise ShardReadError(f"{self.shards.paths[shard]} ends before sample {key!r}: the file is "
                                         "shorter than its index says (changed after it was checked); restore it or "
                                         "pack the data again") from None

    def _read_sample(self, shard: int, entry: int) -> tuple[np.ndarray, int]:
        e = self.entries[shard]
        if e.group is not None:
            return self._row(shard, entry)
        (ioff, isize), (coff, csize) = e.image[entry], e.label[entry]
        fd = self._fd(shard)
        start, end = min(ioff, coff), max(ioff + isize, coff + csize)
        if end - start <= isize + csize + 2048:  # adjacent members (our tars, most others): one read
            data = os.pread(fd, int(end - start), int(start))
            if len(data) != end - start:
                self._short(shard, e.keys[entry])
            view = memoryview(data)
            image, cls = view[ioff - start:ioff - start + isize], bytes(view[coff - start:coff - start + csize])
        else:
            image, cls = os.pread(fd, int(isize), int(ioff)), os.pread(fd, int(csize), int(coff))
            if len(image) != isize or len(cls) != csize:
                self._short(shard, e.keys[entry])
        if not self.shards.labels:
            return np.frombuffer(image, np.uint8), -1
        try:
            label = parse_cls(cls)
        except LabelFormatError as err:
            raise ShardReadError(f"{self.shards.paths[shard]}: sample {e.keys[entry]!r}: its cls member {err}; "
                                 "pack the data again") from None
        remap = self.shards.remap
        if remap is not None:
            if label >= len(remap) or remap[label] < 0:
                raise ShardReadError(f"{self.shards.paths[shard]}: sample {e.keys[entry]!r} has class index {label}, "
                                     "which the classes do not name; pack the data again")
            label = remap[label]
        return np.frombuffer(image, np.uint8), label

    def _short(self, shard: int, key: str):
        raise _Short()

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1])
        self._groups.clear()
        self._tables.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


# -- table groups (Hugging Face datasets) ---------------------------------------------------------------
def hash_fd(fd: int, digest, start: int = 0, end: int | None = None) -> int:
    """Feed `digest` the bytes [start, end) of the open file `fd` (to its end when `end` is None), VERIFY_CHUNK
    at a time; returns the offset reached (less than `end` when the file is shorter)."""
    offset = start
    while (end is None or offset < end) and (chunk := os.pread(
            fd, VERIFY_CHUNK if end is None else min(VERIFY_CHUNK, end - offset), offset)):
        digest.update(chunk)
        offset += len(chunk)
    return offset


def hash_span(fd: int, start: int, end: int) -> str:
    """XXH3-128 of bytes [start, end) of the open file `fd` (fewer when the file is shorter: its hash differs)."""
    digest = fast_digest()
    hash_fd(fd, digest, start, end)
    return digest.hexdigest()


def _table_changed(path: str, why: str) -> ShardReadError:
    return ShardReadError(f"{path} changed after it was checked ({why}), though its size and modification time may "
                          "not have (a copy that keeps them, or damage on disk): copy the file again; it is checked "
                          "again once its modification time changes (touch it)")


class TableFiles:
    """Open Parquet and Arrow files, a few at a time: a group is read whole (Parquet: its image column
    chunk, decompressed by pyarrow; Arrow: memory-mapped, no copy) and handed out as one byte array with
    per-row offsets, so a row is a view, not a copy."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self._open: OrderedDict[str, object] = OrderedDict()
        self.files_read: dict[str, tuple[int, int]] | None = None  # the table check sets it: the image files read
        # for rows that hold a path, with their (size, mtime) (the reader records none: a million would be kept)

    def handle(self, path: str, fmt: str):
        """The open file: a pyarrow ParquetFile, or an Arrow file's record batches (memory-mapped)."""
        f = self._open.get(path)
        if f is None:
            import pyarrow as pa
            import pyarrow.parquet as pq

            if fmt == "parquet":
                f = pq.ParquetFile(path, memory_map=True)
            else:  # save_to_disk writes Arrow IPC streams: their record batches, mapped
                f = list(pa.ipc.open_stream(pa.memory_map(path)))
            self._open[path] = f
            while len(self._open) > self.keep:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(path)
        return f

    def read(self, path: str, fmt: str, group: int, column: str) -> tuple[np.ndarray, np.ndarray]:
        """(the group's image bytes, int64 offsets: row i is bytes[offsets[i]:offsets[i + 1]])."""
        import pyarrow as pa

        try:
            f = self.handle(path, fmt)
            col = f.read_row_group(group, columns=[column]).column(0) if fmt == "parquet" else \
                f[group].column(column)
        except pa.ArrowException as e:
            raise OSError(f"pyarrow: {e}") from None
        return image_bytes(col, os.path.dirname(path), self.files_read)

    def close(self) -> None:
        self._open.clear()


def image_bytes(col, base: str, files_read: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, offsets) of an image column: datasets' Image struct ({bytes, path}) or a binary column. A row
    whose bytes are null but whose path names a file (`Dataset.to_parquet` of images loaded from files keeps
    their paths; relative ones are taken from `base`, the data file's folder) gets that file's bytes (and
    `files_read` its path's size and mtime); else it is an empty row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_struct(arr.type):
        paths = pc.struct_field(arr, "path") if arr.type.get_field_index("path") >= 0 else None
        arr = pc.struct_field(arr, "bytes")
        if paths is not None and arr.null_count:
            arr = _from_paths(arr, paths.to_pylist(), base, files_read)
    if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
        arr = arr.cast(pa.large_binary())
    if arr.null_count:
        arr = pc.if_else(arr.is_valid(), arr, pa.scalar(b"", arr.type))
    wide = pa.types.is_large_binary(arr.type)
    _, off, data = arr.buffers()
    offsets = np.frombuffer(off, np.int64 if wide else np.int32)[arr.offset:arr.offset + len(arr) + 1].astype(np.int64)
    return (np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)), offsets


def _from_paths(arr, paths: list, base: str, files_read: dict | None = None):
    """The bytes column with each null row that has a readable file at its path filled from that file."""
    import pyarrow as pa

    values = arr.to_pylist()
    for i, v in enumerate(values):
        if v is None and paths[i]:
            path = os.path.join(base, paths[i])
            try:
                with open(path, "rb") as f:
                    values[i] = f.read()
                    st = os.fstat(f.fileno())
            except OSError:
                continue
            if files_read is not None:
                files_read[path] = (st.st_size, st.st_mtime_ns)
    return pa.array(values, pa.large_binary())
