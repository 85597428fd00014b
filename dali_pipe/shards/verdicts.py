"""Every shard checked against its size and checksum before its first use, the verdict kept by (path, size,
mtime) in CACHE_DIR/shard-verdicts.json so an unchanged shard is hashed once: `Verdicts`, `check_file`,
`check_remote`, and `verify_local` for the local shards of a run.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..https import is_http
from ..stop import result
from ..workdir import write_atomic
from .format import FAST_SUM, fast_digest, file_sha256, file_xxh3

VERDICTS_NAME = "shard-verdicts.json"


HASH_WORKERS = 4


class ShardError(UserError):
    """A shard failed its size or checksum check, or cannot be fetched; the message names it and the fix."""


class ShardFetchError(ShardError):
    """A shard could not be fetched from S3 within the time allowed; names the endpoint and the key."""


@dataclass(frozen=True)
class Remote:
    """A shard in S3 and what it must be once local."""
    url: str  # s3://bucket/key
    size: int | None
    sha256: str | None
    etag: str | None = None  # from the LIST (then no HEAD is needed, and each ranged GET asks If-Match)
    xxh3: str | None = None  # the fast checksum (format.FAST_SUM), checked instead of the sha256 where known

    @property
    def verdict(self) -> str | None:
        return verdict_key(self.sha256, self.xxh3)

    def digest(self):
        """A new digest of what this shard's bytes are checked with (the fast checksum where known), or None."""
        return fast_digest() if self.xxh3 else hashlib.sha256() if self.sha256 else None


class Verdicts:
    """CACHE_DIR/shard-verdicts.json: {digest of the real path: [size, mtime_ns, checksum (verdict_key)]} of
    shards that matched (digests, so no secret a path may carry, an hf_ token say, is written)."""

    def __init__(self, cache_dir: str | Path):
        self.path = Path(cache_dir) / VERDICTS_NAME
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}
        if not isinstance(self.data, dict):  # not what we write: a cache, so it is only made again
            self.data = {}
        self._lock = threading.Lock()

    def matches(self, path: str | Path, sha256: str) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return self.data.get(_path_key(path)) == [st.st_size, st.st_mtime_ns, sha256]

    def record(self, path: str | Path, sha256: str) -> None:
        st = os.stat(path)
        with self._lock:
            self.data[_path_key(path)] = [st.st_size, st.st_mtime_ns, sha256]

    def forget(self, path: str | Path) -> None:
        with self._lock:
            self.data.pop(_path_key(path), None)

    def save(self) -> None:
        with self._lock:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(self.path, json.dumps(self.data))
            except OSError:  # a full or read-only disk: the verdicts are only a cache; the next run hashes again
                pass


def _path_key(path: str | Path) -> str:
    return hashlib.sha256(os.path.realpath(path).encode("utf-8", "surrogatepass")).hexdigest()[:32]


def verdict_key(sha256: str | None, xxh3: str | None) -> str | None:
    """What a verdict records for a shard: the checksum that was checked, the fast one where known
    ("xxh3_128:HEX"), else the sha256. A verdict holds only for the checksum a check would compute now: a
    sha256 verdict (of an earlier version) does not vouch for a pack's xxh3_128, which is checked once more."""
    return f"{FAST_SUM}:{xxh3}" if xxh3 else sha256


def check_remote(path: str | Path, r: Remote, verdicts: Verdicts | None = None, *,
                 digest: str | None = None) -> str | None:
    """check_file of a local copy of `r`."""
    return check_file(path, r.size, r.sha256, verdicts, xxh3=r.xxh3, digest=digest)


def check_file(path: str | Path, size: int | None, sha256: str | None, verdicts: Verdicts | None = None, *,
               xxh3: str | None = None, digest: str | None = None) -> str | None:
    """None when the file has the size and checksum expected (any may be unknown), else what differs. The
    checksum is the fast one (`xxh3`, format.FAST_SUM) where known, else the sha256; a verdict is cached
    under the checksum checked (verdict_key). `digest`: that checksum of the file when it is known already (hashed from
    its bytes as they streamed in), so the file is not read again."""
    try:
        actual = os.stat(path).st_size
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if size is not None and actual != size:
        return f"has {actual} bytes, {size} expected"
    verdict = verdict_key(sha256, xxh3)
    if verdict is None or (verdicts is not None and verdicts.matches(path, verdict)):
        return None
    name, want = (FAST_SUM, xxh3) if xxh3 else ("sha256", sha256)
    got = digest or (file_xxh3(path) if xxh3 else file_sha256(path))
    if got != want:
        return f"has {name} {got[:12]}..., {want[:12]}... expected"
    if verdicts is not None:
        verdicts.record(path, verdict)
    return None


def verify_local(shards, cache_dir: str | Path, *, progress: bool = True) -> None:
    """Check every local shard of `shards` (a samples.Shards) against its size and checksum (check_file)
    before training: hashed once, then cached by (path, size, mtime). Raises ShardError naming them."""
    from tqdm import tqdm

    n = len(shards.paths)
    sizes, sums, fast = shards.sizes or (None,) * n, shards.sha256 or (None,) * n, shards.xxh3 or (None,) * n
    todo = list(dict.fromkeys((p, z, h, x) for p, z, h, x in zip(shards.paths, sizes, sums, fast)
                              if not is_remote(p)))
    # (once per file: the row groups of one Parquet file are shards of one path)
    if not todo:
        return
    verdicts = Verdicts(cache_dir)
    unknown = [t for t in todo if (v := verdict_key(t[2], t[3])) is None or not verdicts.matches(t[0], v)]
    total = sum(os.stat(p).st_size for p, _, h, x in unknown if (h or x) and os.path.exists(p))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="check shards", file=sys.stderr, mininterval=1.0,
               disable=not progress or total < (256 << 20))
    bad = []

    def one(t):
        path, size, sha, xxh3 = t
        problem = check_file(path, size, sha, verdicts, xxh3=xxh3)
        if (sha or xxh3) and os.path.exists(path):
            bar.update(os.stat(path).st_size)
        return path, problem

    pool = ThreadPoolExecutor(HASH_WORKERS)
    try:
        futures = [pool.submit(one, t) for t in unknown]
        bad = [(p, why) for p, why in (result(f) for f in futures) if why]  # SIGTERM, Ctrl-C: looked at (stop.py)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # a stop: the shards being hashed finish, no other starts
        bar.close()
        verdicts.save()
    if bad:
        lines = "\n  ".join(f"{p} {why}" for p, why in bad[:5])
        raise ShardError(f"{len(bad)} shard(s) do not match packed.json, so they were changed or damaged after "
                         f"packing:\n  {lines}\nCopy or sync the pack again (python -m dali_pipe sync), or pack the "
                         "data again.")


def is_remote(path: str) -> bool:
    """Whether a shard path is an object to fetch (s3://, https://, http://) rather than a local file."""
    return path.startswith("s3://") or is_http(path)
