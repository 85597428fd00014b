"""Pre-flight scan: keep files that would kill the DALI pipeline out of it.

DALI has no skip for corrupt files: one bad JPEG ends the run mid-epoch with an error that does
not name the file. The scan runs before any pipeline is built:

- `fast`: header checks only: non-empty, a known image signature, readable dimensions under
  `--max-pixels` (decompression bombs), and an end marker for JPEG/PNG (truncation).
- `full`: the fast checks, then a decode of every file with DALI's own CPU decoder (the family
  the pipeline uses), in parallel on DALI's threads, so what passes the scan passes the pipeline.
- `off`: only a stat of each file, so that a dangling symbolic link, a link loop or a file that
  vanished is listed rather than stopping the pipeline.

Verdicts are cached by path (a digest of it: the cache holds no path, so no secret one carries),
size and mtime, as columns (`Verdicts`); a rerun re-checks only what changed, and the fast checks of many
files run in a process per core.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import stat
import string
import subprocess
import sys
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import SCAN_MODES
from .fanout import fan_out
from .redact import redact
from .stop import each, join
from .tsv import row as tsv_row
from .workdir import atomic

_LEVEL = {"fast": 1, "full": 2}
DECODABLE = {"JPEG", "PNG", "BMP", "TIFF", "WEBP", "PNM", "JPEG2000"}


@dataclass
class ScanResult:
    bad: dict[str, str] = field(default_factory=dict)  # absolute path -> reason a person understands
    checked: int = 0  # files checked in this run (not answered from the cache)
    decoded: int = 0  # files decoded in this run (full mode)
    total: int = 0


def sniff(head: bytes) -> str | None:
    """Name the image format from the first bytes, or None."""
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"BM"):
        return "BMP"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:2] in (b"P1", b"P2", b"P3", b"P4", b"P5", b"P6") and head[2:3].isspace():
        return "PNM"
    if head.startswith(b"\x00\x00\x00\x0cjP  ") or head.startswith(b"\xff\x4f\xff\x51"):
        return "JPEG2000"
    if head[4:8] == b"ftyp" and head[8:12] in (b"heic", b"heix", b"mif1", b"avif"):
        return "HEIF/AVIF"
    return None


_TEXT = set(string.printable.encode())


NOT_REGULAR = "not a regular file (a FIFO, socket or device)"


def unreadable(path: str, err: OSError) -> str:
    """Why a file cannot be opened, naming a dangling symbolic link (its target missing), a link loop and a link
    to a socket or device as such."""
    if err.errno == errno.ENXIO:  # (a socket, or a device without its driver: open() says "no such device")
        return NOT_REGULAR
    if os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        if err.errno == errno.ELOOP:
            return f"symbolic link loop (-> {target})"
        if err.errno == errno.ENOENT:
            return f"dangling symbolic link (-> {target})"
        return f"unreadable ({err.strerror}; a symbolic link -> {target})"
    return f"unreadable ({err.strerror})"


def environmental(reason: str | None) -> bool:
    """A verdict about the file's place rather than its bytes (unreadable now, a missing or looping link target, not
    a regular file): not kept in the scan cache, whose key (size, mtime) would not see it mended (a chmod, a file
    back in place with its mtime kept)."""
    return bool(reason) and reason.startswith(("unreadable (", "dangling symbolic link", "symbolic link loop",
                                               NOT_REGULAR))


def check_header(path: str, max_pixels: int) -> str | None:
    """The fast checks. Returns the reason the file is bad, or None."""
    from PIL import Image

    try:  # (non-blocking: a link to a FIFO must not hang the scan)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return unreadable(path, e)
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        return unreadable(path, e)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return "unreadable (Is a directory)" if stat.S_ISDIR(st.st_mode) else NOT_REGULAR
    with open(fd, "rb") as f:  # one open for the size, the ends and PIL's header parse (by path twice: 15% slower)
        try:
            size = st.st_size
            if size == 0:
                return "empty file"
            head = f.read(64)
            f.seek(max(0, size - 64))
            tail = f.read()
            f.seek(0)
        except OSError as e:
            return unreadable(path, e)
        return _check(head, tail, lambda: Image.open(f), max_pixels)


def check_bytes(data: bytes, max_pixels: int) -> str | None:
    """The fast checks on an image held in memory (a shard member). Returns the reason, or None."""
    from PIL import Image

    if hasattr(data, "reason"):  # a member too large to read (shards.format.Oversized)
        return data.reason()
    if not data:
        return "empty file"
    return _check(data[:64], data[-64:], lambda: Image.open(io.BytesIO(data)), max_pixels)


def _check(head: bytes, tail: bytes, open_image, max_pixels: int) -> str | None:
    from PIL import Image

    fmt = sniff(head)
    if fmt is None:
        if all(b in _TEXT for b in head):
            return "not an image (text)"
        return "not an image (unrecognised bytes)"
    if fmt not in DECODABLE:
        return f"unsupported format {fmt}"
    if fmt == "JPEG" and b"\xff\xd9" not in tail:
        return "truncated JPEG"
    if fmt == "PNG" and b"IEND" not in tail:
        return "truncated PNG"
    cap, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # our own cap applies, below
    try:
        with open_image() as im:
            w, h = im.size
    except Image.UnidentifiedImageError:  # (its text names the file object: a descriptor number, an address)
        return f"unreadable {fmt} header (UnidentifiedImageError: cannot identify image file)"
    except Exception as e:  # PIL raises many kinds for broken headers
        return f"unreadable {fmt} header ({type(e).__name__}: {str(e)[:80]})"
    finally:
        Image.MAX_IMAGE_PIXELS = cap
    if w <= 0 or h <= 0:
        return f"{fmt} with no pixels ({w}x{h})"
    if w * h > max_pixels:
        return f"{w}x{h} exceeds --max-pixels ({max_pixels})"
    return None


def _decode_reason(path: str | bytes) -> str:
    """DALI names neither the file nor the cause; PIL's decoder usually says what is wrong.
    `path` is a file, or the image's bytes."""
    from PIL import Image

    if isinstance(path, bytes):
        fmt, source = sniff(path[:64]) or "image", io.BytesIO(path)
    else:
        with open(path, "rb") as f:
            fmt, source = sniff(f.read(64)) or "image", path
    try:
        with Image.open(source) as im:
            im.load()
    except Exception as e:
        msg = str(e).strip() or type(e).__name__
        if "truncated" in msg.lower():
            return f"truncated {fmt}"
        return f"corrupt {fmt} data ({msg[:100]})"
    return f"corrupt {fmt} data (DALI's decoder rejects it, although PIL reads it)"


class DaliDecoder:
    """Decodes batches of encoded files with DALI's CPU decoder; isolates failures per file."""

    def __init__(self, num_threads: int, batch_size: int = 16):
        self.num_threads, self.batch_size = num_threads, batch_size
        self._pipe = None

    def _build(self, batch_size: int):
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def
        def decode():
            enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
            return fn.decoders.image(enc, device="cpu", output_type=types.RGB)

        pipe = decode(batch_size=batch_size, num_threads=self.num_threads, device_id=None,
                      prefetch_queue_depth=1, exec_async=False, exec_pipelined=False)
        pipe.build()
        return pipe

    def _run(self, items: list) -> None:
        import numpy as np

        if self._pipe is None or self._pipe.max_batch_size < len(items):
            self._pipe = self._build(max(len(items), self.batch_size))
        data = [np.frombuffer(x, dtype=np.uint8) if isinstance(x, bytes) else np.fromfile(x, dtype=np.uint8)
                for x in items]
        self._pipe.feed_input("enc", data)
        self._pipe.run()

    def __call__(self, paths: list[str]) -> dict[str, str]:
        """Decode `paths`; return {path: reason} for those that fail."""
        return self.decode(dict(zip(paths, paths)))

    def decode(self, items: dict) -> dict:
        """Decode each value of `items` (a file path or the encoded bytes); {its key: reason} for those
        that fail."""
        try:
            self._run(list(items.values()))
            return {}
        except Exception:
            self._pipe = None  # a failed DALI pipeline cannot be reused
        bad = {}
        for k, x in items.items():  # find the culprit(s) one by one
            try:
                self._run([x])
            except Exception:
                self._pipe = None
                bad[k] = _decode_reason(x)
        return bad


CACHE_NAME = "scan-cache.npz"  # in the cache dir: the verdicts, as columns
_COLUMNS = {"hi": np.uint64, "lo": np.uint64, "size": np.int64, "mtime": np.int64, "max_pixels": np.int64,
            "level": np.int8, "reason": np.int32}  # the scan cache's columns and their types
PARALLEL_FROM = 20_000  # header checks of more files than this run in a process per core


KEYS_PARALLEL_FROM = 100_000  # paths from which their digests are shared with worker interpreters (fanout.py)
_KEYS_WORKER = r"""
import hashlib, sys
blake = hashlib.blake2b
sys.stdout.buffer.write(b"".join(blake(p, digest_size=16).digest() for p in sys.stdin.buffer.read().split(b"\0")))
"""


def _keys(paths: list[str], parallel_from: int = KEYS_PARALLEL_FROM) -> np.ndarray:
    """The cache's key for each file: a 16-byte digest of its absolute path (the cache holds no path, so no
    secret one carries), as a pair of integers (hi, lo) that sort; from `parallel_from` paths with a worker
    interpreter per further core (1 M digests: 0.87 s in one process)."""
    blake = hashlib.blake2b

    def here(names: list[str]) -> bytes:
        return b"".join(blake(p.encode("utf-8", "surrogateescape"), digest_size=16).digest() for p in names)

    raw = fan_out(paths, _KEYS_WORKER, [], 16, here, parallel_from=parallel_from)
    pairs = np.frombuffer(raw, dtype=">u8").reshape(-1, 2).astype(np.uint64)
    out = np.empty(len(paths), dtype=[("hi", np.uint64), ("lo", np.uint64)])
    out["hi"], out["lo"] = pairs[:, 0], pairs[:, 1]
    return out


class Verdicts:
    """The scan cache: per file (by the digest of its path), the size, mtime and --max-pixels it was checked
    with, how far (1: headers, 2: decoded) and its reason (an index into `reasons`; -1: good). Sorted by key, so
    that a million files are looked up at once (np.searchsorted), and saved as one .npz (columns of numbers, a
    few bytes a file; the JSON it replaces took 112 MB at 1 M files and 13 s to check a warm scan)."""

    def __init__(self, columns: dict | None = None, reasons: list[str] | None = None):
        self.c = columns or {k: np.empty(0, dtype=t) for k, t in _COLUMNS.items()}
        self.reasons = reasons or []

    @classmethod
    def load(cls, path: Path | None) -> "Verdicts":
        if path is None or not path.exists():
            return cls()
        try:
            with np.load(path, allow_pickle=False) as z:
                columns = {k: z[k] for k in _COLUMNS}
                reasons = json.loads(z["reasons"].tobytes().decode())
            n = len(columns["hi"])
            if any(v.ndim != 1 or len(v) != n for v in columns.values()) or not isinstance(reasons, list) or \
                    (n and int(columns["reason"].max()) >= len(reasons)):
                return cls()
            return cls(columns, [str(r) for r in reasons])
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError, EOFError, zipfile.BadZipFile):
            return cls()  # a damaged cache is only a slower scan

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The row of each key in the cache, -1 where it has none."""
        c = self.c
        if not len(c["hi"]):
            return np.full(len(keys), -1, dtype=np.int64)
        # by the first half alone (numpy's searchsorted on the pair took 2.9 s for 1 M keys, on a uint64 0.1 s): two
        # paths whose digests share it (one chance in 10**7 among a million) are told apart by the second half, and
        # the one found second is checked again, which costs a check, never a wrong verdict
        # the keys looked up in their sorted order (a million searches in random order: 0.51 s; sorted, with the sort:
        # 0.12 s, as each search starts near the one before)
        order = np.argsort(keys["hi"])
        at = np.empty(len(keys), dtype=np.intp)
        at[order] = np.minimum(np.searchsorted(c["hi"], keys["hi"][order]), len(c["hi"]) - 1)
        return np.where((c["hi"][at] == keys["hi"]) & (c["lo"][at] == keys["lo"]), at, -1)

    def add(self, keys: np.ndarray, sizes, mtimes, max_pixels: int, levels, reasons: list[str | None]) -> None:
        """Record these verdicts (a file's new verdict replaces its old one)."""
        if not len(keys):
            return
        table = {r: i for i, r in enumerate(self.reasons)}
        idx = np.array([-1 if r is None else table.setdefault(r, len(table)) for r in reasons], dtype=np.int32)
        self.reasons = list(table)
        new = {"hi": keys["hi"], "lo": keys["lo"], "size": np.asarray(sizes, np.int64),
               "mtime": np.asarray(mtimes, np.int64), "max_pixels": np.full(len(keys), max_pixels, np.int64),
               "level": np.asarray(levels, np.int8), "reason": idx}
        both = {k: np.concatenate([new[k], self.c[k]]) for k in _COLUMNS}
        age = np.r_[np.zeros(len(keys), np.int8), np.ones(len(self.c["hi"]), np.int8)]
        order = np.lexsort((age, both["lo"], both["hi"]))  # by key, the new verdict first (a sort of the pairs
        hi, lo = both["hi"][order], both["lo"][order]  # as records, np.unique's, is ten times slower)
        first = order[np.r_[True, (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])]]
        self.c = {k: v[first] for k, v in both.items()}

    def save(self, path: Path | None) -> None:
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic(path) as tmp, open(tmp, "wb") as f:
                np.savez(f, **self.c, reasons=np.frombuffer(json.dumps(self.reasons).encode(), dtype=np.uint8))
        except OSError as e:  # only the next scan is slower: say so, and go on
            print(f"scan: could not save the scan cache {path} ({e.strerror}); the next run checks every file again",
                  file=sys.stderr)


def serve_checks() -> None:
    """A worker of the parallel scan (run as its own interpreter): NUL-separated paths on stdin, one JSON line per
    path on stdout, its reason or null, in order. argv[1]: --max-pixels."""
    max_pixels = int(sys.argv[1])
    out, lines = sys.stdout.buffer, []
    for raw in sys.stdin.buffer.read().split(b"\0"):
        if raw:
            lines.append(json.dumps(check_header(os.fsdecode(raw), max_pixels)).encode() + b"\n")
            if len(lines) == 1000:  # a write of a thousand lines (a write a line, as PYTHONUNBUFFERED=1 makes
                out.write(b"".join(lines))  # sys.stdout, made each check 60% dearer: a syscall, the reader woken)
                out.flush()
                lines = []
    out.write(b"".join(lines))
    out.flush()


def _headers(paths: list[str], max_pixels: int, bar, parallel_from: int) -> list[str | None]:
    """The fast checks of `paths`, in an interpreter per core when there are at least `parallel_from` (each file
    costs a PIL open: about 65 µs, 65 s for a million on one core; a worker costs about 0.3 s to start). Workers are
    fresh interpreters (subprocess), not multiprocessing's: fork would copy a training process's threads (DALI's,
    torch's), and spawn re-runs the user's own script's top level (a Lightning script without a main guard)."""
    workers = min(len(os.sched_getaffinity(0)), 8)
    if len(paths) < parallel_from or workers < 2:
        out = []
        for p in each(paths):
            out.append(check_header(p, max_pixels))
            bar.update(1)
        return out
    package = str(Path(__file__).resolve().parents[1])
    code = f"import sys; sys.path.insert(0, {package!r}); from dali_pipe.scan import serve_checks; serve_checks()"
    parts = [paths[i * len(paths) // workers:(i + 1) * len(paths) // workers] for i in range(workers)]
    results: list[list] = [[] for _ in parts]
    lock = threading.Lock()

    procs = []

    def run(i: int) -> None:
        proc = subprocess.Popen([sys.executable, "-c", code, str(max_pixels)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        procs.append(proc)
        feed = threading.Thread(target=_feed, args=(proc.stdin, parts[i]), daemon=True)
        feed.start()
        done = 0
        try:
            for line in proc.stdout:
                results[i].append(json.loads(line))
                done += 1
                if done % 1000 == 0:
                    with lock:
                        bar.update(1000)
        except ValueError:  # a line a dying worker cut short: the caller checks the rest itself
            proc.kill()
        finally:
            proc.wait()
            feed.join()
        with lock:
            bar.update(done % 1000)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(parts))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            join(t)  # SIGTERM, Ctrl-C: the workers are stopped (below)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    out = []
    for part, got in zip(parts, results):
        if len(got) != len(part):  # a worker that died (killed, out of memory): its files are checked here
            got = got + [check_header(p, max_pixels) for p in part[len(got):]]
        out += got
    return out


def _feed(pipe, paths: list[str]) -> None:
    try:
        for i in range(0, len(paths), 10_000):
            pipe.write(b"\0".join(os.fsencode(p) for p in paths[i:i + 10_000]) + b"\0")
        pipe.close()
    except OSError:  # the worker ended early: the caller checks what it did not
        pass


def scan(paths, mode: str, *, max_pixels: int, num_threads: int = 1, cache_path: Path | None = None,
         progress: bool = True, stats: tuple[np.ndarray, np.ndarray] | None = None,
         parallel_from: int = PARALLEL_FROM) -> ScanResult:
    """Check `paths` (absolute; a list, or a column of Samples) and return which are bad and why. `stats`: each
    file's (size, mtime_ns) where the listing stat()ed it already (-1: not), so it is not stat()ed again;
    `parallel_from`: the files to check from which the header checks run in a process per core."""
    if mode not in SCAN_MODES:
        raise ValueError(f"--scan must be one of {SCAN_MODES}, got {mode!r}")
    paths = paths.tolist() if isinstance(paths, np.ndarray) else list(paths)
    result = ScanResult(total=len(paths))
    if not paths:
        return result
    from tqdm import tqdm

    level = _LEVEL.get(mode, 0)
    n = len(paths)
    sizes = np.full(n, -1, np.int64) if stats is None else np.array(stats[0], dtype=np.int64)
    mtimes = np.full(n, -1, np.int64) if stats is None else np.array(stats[1], dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    for i in np.flatnonzero(sizes < 0).tolist():  # not stat()ed by the listing (links, another caller)
        p = paths[i]
        try:
            st = os.stat(p)
        except OSError as e:
            result.bad[p] = unreadable(p, e)
            alive[i] = False
            continue
        sizes[i], mtimes[i] = st.st_size, st.st_mtime_ns
    if not level:
        return result
    cache = Verdicts.load(cache_path)
    keys = _keys(paths)
    row = cache.lookup(keys)
    c = cache.c
    hit = alive & (row >= 0)
    r = np.where(hit, row, 0)
    if len(c["hi"]):
        hit &= (c["size"][r] == sizes) & (c["mtime"][r] == mtimes) & (c["max_pixels"][r] == max_pixels)
        hit &= (c["level"][r] >= level) | (c["reason"][r] >= 0)
        for i in np.flatnonzero(hit & (c["reason"][r] >= 0)).tolist():
            result.bad[paths[i]] = cache.reasons[c["reason"][r[i]]]
    todo = np.flatnonzero(alive & ~hit)
    if not len(todo):
        return result
    todo_paths = [paths[i] for i in todo.tolist()]
    bar = tqdm(total=len(todo), desc=f"scan ({mode})", unit="img", disable=not progress, file=sys.stderr,
               mininterval=1.0)
    reasons = _headers(todo_paths, max_pixels, bar, parallel_from)
    result.checked += len(todo_paths)
    levels = np.ones(len(todo_paths), np.int8)
    if level == 2:
        bar.reset(total=len(todo_paths))
        bar.set_description("scan (full): decoding")
        decoder = DaliDecoder(num_threads)
        good = [j for j, why in enumerate(reasons) if why is None]
        for start in range(0, len(good), decoder.batch_size):
            batch = good[start:start + decoder.batch_size]
            bad = decoder([todo_paths[j] for j in batch])
            for j in batch:
                reasons[j] = bad.get(todo_paths[j])
                levels[j] = 2
            result.decoded += len(batch)
            bar.update(len(batch))
    bar.close()
    for p, why in zip(todo_paths, reasons):
        if why:
            result.bad[p] = why
    kept = np.array([not environmental(r) for r in reasons], dtype=bool)
    cache.add(keys[todo][kept], sizes[todo][kept], mtimes[todo][kept], max_pixels, np.asarray(levels)[kept],
              [r for r, k in zip(reasons, kept) if k])
    cache.save(cache_path)
    return result


REPORT_NAME, REPORT_HEADER = "bad_images.tsv", "image_path\treason\n"


def is_empty_report(path: Path) -> bool:
    """`path` is a report of ours that lists no file (its header alone)."""
    try:
        return path.name == REPORT_NAME and path.stat().st_size == len(REPORT_HEADER) and \
            path.read_text(encoding="utf-8") == REPORT_HEADER
    except (OSError, UnicodeDecodeError):
        return False


def write_report(bad: dict[str, str], root: Path, out: Path) -> Path:
    """Write OUT/bad_images.tsv: one row per excluded file, its path and the reason. The reason is redacted
    (a link's target may hold a token); the path stays as the manifest wrote it, to join back to it."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / REPORT_NAME
    with atomic(report) as tmp, open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
        f.write(REPORT_HEADER)
        for p in sorted(bad):
            rel = os.path.relpath(p, root) if p.startswith(str(root)) else p
            f.write(tsv_row((rel, redact(bad[p]))))
    return report
