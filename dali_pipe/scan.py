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
size and mtime; a rerun re-checks only what changed.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .config import SCAN_MODES
from .redact import redact
from .workdir import writing

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


def unreadable(path: str, err: OSError) -> str:
    """Why a file cannot be opened, naming a dangling symbolic link or a link loop as such."""
    if os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        if err.errno == errno.ELOOP:
            return f"symbolic link loop (-> {target})"
        return f"dangling symbolic link (-> {target})"
    return f"unreadable ({err.strerror})"


def check_header(path: str, max_pixels: int) -> str | None:
    """The fast checks. Returns the reason the file is bad, or None."""
    from PIL import Image

    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty file"
        with open(path, "rb") as f:
            head = f.read(64)
            f.seek(max(0, size - 64))
            tail = f.read()
    except OSError as e:
        return unreadable(path, e)
    return _check(head, tail, lambda: Image.open(path), max_pixels)


def check_bytes(data: bytes, max_pixels: int) -> str | None:
    """The fast checks on an image held in memory (a shard member). Returns the reason, or None."""
    from PIL import Image

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


def _entry(path: str) -> str:
    """The cache's key for a file: a digest of its absolute path."""
    return hashlib.blake2b(path.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()


def _load_cache(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache is only a slower scan
    # entries keyed by a path (older versions) are dropped: they are re-checked once, then keyed by digest
    return {k: v for k, v in data.items() if len(k) == 32 and not k.strip("0123456789abcdef")}


def _save_cache(path: Path | None, cache: dict) -> None:
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, path)
    except OSError as e:  # only the next scan is slower: say so, and go on
        tmp.unlink(missing_ok=True)
        print(f"scan: could not save the scan cache {path} ({e.strerror}); the next run checks every file again",
              file=sys.stderr)


def scan(paths: list[str], mode: str, *, max_pixels: int, num_threads: int = 1,
         cache_path: Path | None = None, progress: bool = True) -> ScanResult:
    """Check `paths` (absolute) and return which are bad and why."""
    if mode not in SCAN_MODES:
        raise ValueError(f"--scan must be one of {SCAN_MODES}, got {mode!r}")
    result = ScanResult(total=len(paths))
    if not paths:
        return result
    from tqdm import tqdm

    level = _LEVEL.get(mode, 0)
    cache = _load_cache(cache_path) if level else {}
    todo = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError as e:
            result.bad[p] = unreadable(p, e)
            continue
        if not level:
            continue
        key = [st.st_size, st.st_mtime_ns, max_pixels]
        hit = cache.get(_entry(p))
        if hit and hit["key"] == key and (hit["level"] >= level or hit["reason"]):
            if hit["reason"]:
                result.bad[p] = hit["reason"]
            continue
        todo.append((p, key))

    bar = tqdm(total=len(todo), desc=f"scan ({mode})", unit="img", disable=not progress or not todo,
               file=sys.stderr, mininterval=1.0)
    decoder = DaliDecoder(num_threads) if level == 2 else None
    batch: list[tuple[str, list]] = []

    def flush():
        if not batch:
            return
        bad = decoder([p for p, _ in batch])
        for p, key in batch:
            cache[_entry(p)] = {"key": key, "level": 2, "reason": bad.get(p)}
            if p in bad:
                result.bad[p] = bad[p]
        result.decoded += len(batch)
        bar.update(len(batch))
        batch.clear()

    for p, key in todo:
        reason = check_header(p, max_pixels)
        result.checked += 1
        if reason or decoder is None:
            cache[_entry(p)] = {"key": key, "level": 1, "reason": reason}
            if reason:
                result.bad[p] = reason
            bar.update(1)
            continue
        batch.append((p, key))
        if len(batch) >= decoder.batch_size:
            flush()
    if decoder is not None:
        flush()
    bar.close()
    if todo:
        _save_cache(cache_path, cache)
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
    tmp = report.with_name(f".{REPORT_NAME}.tmp-{os.getpid()}")
    with writing(report, tmp), open(tmp, "w", encoding="utf-8") as f:
        f.write(REPORT_HEADER)
        for p in sorted(bad):
            rel = os.path.relpath(p, root) if p.startswith(str(root)) else p
            f.write(f"{rel}\t{redact(bad[p])}\n")
    os.replace(tmp, report)
    return report
