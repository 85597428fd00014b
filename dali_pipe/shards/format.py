"""The on-disk shard format, shared by the writer (pack.py) and every reader.

A shard is a WebDataset tar: the members of one sample share a key (`KEY.jpg`, `KEY.cls`, `KEY.json`),
grouped consecutively, the key being the member name up to the first dot of its last path segment
(webdataset's `base_plus_ext`, DALI's `split_name`), so `KEY.image.jpg` is the member `image.jpg`
(`pick_member` says which member a reader takes as the image, the label and the metadata). Shards of
others may be gzipped (`.tar.gz`, `.tgz`): `Gunzip` gives their tar. What this project writes per
sample:

- `KEY.jpg`: the image;
- `KEY.cls`: the class index as plain decimal ASCII (`b"7"`), as webdataset, img2dataset and timm
  write it (packs of the first format wrote six digits, `b"000007"`; `parse_cls` reads both);
- `KEY.json`: `{"image_path": ..., "label": ...}`, the row of dataset.tsv it came from (webdataset's
  convention for metadata).

Keys are safe by construction (`sample_keys`): ASCII letters, digits, `_`, `-` and `/` only, so no key
holds a dot or a space, and a path that needed changing (or that shares its key with another path) gets
a hash of the whole path, so two paths never share a key.

Beside each tar, a DALI index file (the format of DALI's `wds2idx` tool, version 1.2) lists, per sample,
each member's extension, data offset, size and file name:

    v1.2 N
    jpg 512 10349 KEY.jpg cls 11264 1 KEY.cls
    ...

`read_index` parses it into `IndexEntry`s; `format_index` writes it back. DALI splits these lines at
whitespace and uses the file name only to name a sample in its messages, so a name holding whitespace
(which peer shards may have) is written with that whitespace and `%` percent-encoded. `index_tar` makes
an index from a tar stream in one pass, the way `wds2idx` does (regular files, grouped by key, hidden
names skipped), and hands each member's bytes to the caller on the way (labels, checks).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import posixpath
import re
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import xxhash

from ..errors import UserError
from ..landing import hash_file

INDEX_VERSION = "v1.2"
PACKED_NAME = "packed.json"
FORMAT = "dali_pipe-packed/2"  # plain-decimal .cls, a json member per sample, image_paths per shard
READABLE_FORMATS = ("dali_pipe-packed/1", FORMAT)  # /1: six-digit .cls, keys with dots replaced, no json
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")  # a sample's image: the first of these present (any case; pick_member)
LABEL_EXT = "cls"
META_EXT = "json"
CLS_MAX_BYTES = 9  # the widest .cls today's DALI reader parses (an int32 holds any 9-digit index)
FAST_SUM = "xxh3_128"  # packed.json's key of a shard's fast checksum (xxHash's XXH3, 128 bits), beside its sha256
KEY_MAX = 90  # longest key: KEY.json still fits a plain (ustar) tar name without a prefix field
MEMBER_MAX = 256 << 20  # a member larger than this (bytes) is listed bad and never read into memory


class Oversized(bytes):
    """Stands for a member over MEMBER_MAX that was not read (empty bytes, with the member's size): a tar header
    claiming 8 GiB, or a 1.5 GiB member of a 1.5 MB .tar.gz, took 5.2 GB of RAM and a minute before the scan
    called it "not an image"."""

    size: int

    def __new__(cls, size: int):
        self = super().__new__(cls)
        self.size = size
        return self

    def reason(self) -> str:
        return f"a member of {self.size} bytes, over the {MEMBER_MAX >> 20} MiB a member may hold (not read)"


def member_bytes(read, size: int, max_member: int = MEMBER_MAX) -> bytes:
    """`read(size)` of a member, or Oversized(size) unread where it is larger than `max_member`."""
    return Oversized(size) if size > max_member else read(size)


class IndexFormatError(ValueError):
    """An index file that is not DALI's v1.2 format; the message names the file and line."""


class LabelFormatError(ValueError):
    """A `.cls` member that is not a non-negative decimal integer."""


class PackedFormatError(UserError):
    """A packed.json this version cannot read (or none where a pack was expected); the message names it and
    says what to do."""


# -- keys ------------------------------------------------------------------------------------------
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-]")


def _stem(rel: str) -> str:
    """The path without its last extension (`a/b.c.jpg` -> `a/b.c`; a hidden name keeps its dot)."""
    head, name = posixpath.split(rel)
    stem, _ = posixpath.splitext(name)
    return posixpath.join(head, stem) if head else stem


def _digest(rel: str, n: int) -> str:
    return hashlib.sha256(rel.encode("utf-8", "surrogatepass")).hexdigest()[:n]


def sample_keys(paths: list[str]) -> dict[str, str]:
    """{relative path: key} for every path, each key unique and safe by construction.

    A key is the path without its extension, every character outside `A-Za-z0-9_-` (per folder
    segment) replaced by `_`. When that changed the path, made it longer than KEY_MAX, or when two paths
    give the same key (`a.jpg` and `a.png`; `my photo.jpg` and `my_photo.jpg`), the key ends in `-` and
    a hash of the whole path, so it stays unique and stable whatever other files the dataset holds."""
    candidate = {}
    for rel in paths:
        stem = _stem(rel)
        safe = "/".join(_UNSAFE.sub("_", seg) or "_" for seg in stem.split("/"))
        candidate[rel] = (safe, safe != stem or len(safe) > KEY_MAX)
    taken: dict[str, int] = {}
    for safe, _ in candidate.values():
        taken[safe] = taken.get(safe, 0) + 1
    keys, seen = {}, set()
    for rel, (safe, changed) in candidate.items():
        key = safe
        if changed or taken[safe] > 1:
            for n in (10, 20, 40, 64):
                key = f"{safe[:KEY_MAX - n - 1].rstrip('/')}-{_digest(rel, n)}"
                if key not in seen and key not in taken:
                    break
        if key in seen:  # only a hash collision of 64 hex digits could get here
            raise ValueError(f"no unique key for {rel!r}")
        seen.add(key)
        keys[rel] = key
    return keys


def split_name(name: str) -> tuple[str | None, str | None]:
    """(key, extension) of a tar member name, as webdataset and DALI split it: at the first dot of the
    last path segment. (None, None) for a name with no such dot or a hidden one (`dir/.x.jpg`)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:
        return None, None
    return name[:dot], name[dot + 1:]


# -- members ---------------------------------------------------------------------------------------
def cls_bytes(label: int) -> bytes:
    """A `.cls` member: the class index as plain decimal ASCII."""
    return str(int(label)).encode()


def parse_cls(raw: bytes) -> int:
    """The class index in a `.cls` member: decimal ASCII, as webdataset writes it (`b"7"`); surrounding
    whitespace and zero padding (`b"000007"`, this project's first format) are accepted."""
    text = raw.strip()
    if not text.isdigit():
        raise LabelFormatError(f"{raw[:20]!r} is not a class index (a non-negative decimal integer)")
    return int(text)


def cls_problem(raw: bytes | None) -> str | None:
    """Why a sample's `.cls` cannot be trained on, or None. Beyond `parse_cls`, today's DALI reader
    (pipeline.py) reads at most CLS_MAX_BYTES and no leading whitespace."""
    if raw is None:
        return "no .cls member (the class index)"
    if isinstance(raw, Oversized):
        return f"cls: {raw.reason()}"
    try:
        parse_cls(raw)
    except LabelFormatError:
        return f"cls {raw[:20]!r} is not an integer class index"
    if len(raw) > CLS_MAX_BYTES or raw != raw.lstrip():
        return f"cls {raw[:20]!r} is longer than {CLS_MAX_BYTES} bytes or starts with spaces"
    return None


def json_bytes(image_path: str, label: str) -> bytes:
    """The `json` member of a packed sample: the dataset.tsv row it came from."""
    return json.dumps({"image_path": image_path, "label": label}, ensure_ascii=False, sort_keys=True).encode()


def json_label(raw: bytes | None) -> str | None:
    """The label name in a sample's json member (`label`, else `class_name`), or None."""
    if not raw:
        return None
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(meta, dict):
        return None
    for name in ("label", "class_name"):
        if isinstance(meta.get(name), (str, int)) and not isinstance(meta.get(name), bool):
            return str(meta[name])
    return None


def json_image_path(raw: bytes | None) -> str | None:
    """The `image_path` a packed sample's json member records (json_bytes), or None."""
    try:
        meta = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError):
        return None
    return meta["image_path"] if isinstance(meta, dict) and isinstance(meta.get("image_path"), str) else None


def _last(ext: str) -> str:
    """The last part of a member's extension, lower case (`image.JPG` -> `jpg`)."""
    return ext.rsplit(".", 1)[-1].lower()


def used_member(ext: str) -> bool:
    """Whether a member with this extension is one a reader may use (image, label or metadata), plain
    (`jpg`) or compound (`image.jpg`)."""
    return _last(ext) in IMAGE_EXTS or _last(ext) in (LABEL_EXT, META_EXT)


def pick_member(members, exts: tuple[str, ...], names: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """(the member extension a sample's image, label or metadata is read from, or None; the compound
    candidates). webdataset names a member by everything after the key's first dot, so `KEY.image.jpg`
    is member `image.jpg` (`to_tuple('image.jpg', 'label.cls')`). The rule, in this order:

    1. a plain member: the first of `exts` present, in any case (`jpg` before `png`), as before;
    2. else the one compound member whose last part is one of `exts` (`image.jpg`, `label.cls`);
    3. else, of several, the one whose first part is one of `names` (`image.jpg` beside `mask.png`);
    4. else none: the sample is ambiguous (`left.jpg` and `right.jpg`) and left out, naming them."""
    lower: dict[str, str] = {}
    for ext in members:
        lower.setdefault(ext.lower(), ext)  # the first member of each spelling wins
    plain = next((lower[w] for w in exts if w in lower), None)
    if plain is not None:
        return plain, []
    compound = [ext for low, ext in lower.items() if "." in low and _last(low) in exts]
    if len(compound) == 1:
        return compound[0], compound
    named = [ext for ext in compound if ext.lower().split(".", 1)[0] in names]
    return (named[0] if len(named) == 1 else None), compound


IMAGE_NAMES = ("image", "img")  # the first part that picks the image among compound members (rule 3)
LABEL_NAMES = ("label", "cls", "class")
META_NAMES = ("json", "meta", "metadata")


def image_member(members) -> str | None:
    """The extension of a sample's image member (pick_member): plain jpg, jpeg, png or webp first."""
    return pick_member(members, IMAGE_EXTS, IMAGE_NAMES)[0]


def label_member(members) -> str | None:
    return pick_member(members, (LABEL_EXT,), LABEL_NAMES)[0]


def meta_member(members) -> str | None:
    return pick_member(members, (META_EXT,), META_NAMES)[0]


# -- tar members -----------------------------------------------------------------------------------
_BLOCK = 512
_RECORD = 20 * _BLOCK  # tarfile pads a closed archive to whole records of this size


def tar_member(name: str, data: bytes) -> bytes:
    """One regular file of a ustar tar, written as tarfile writes `TarInfo(name)` with mode 0o644, uid, gid and
    mtime 0 (a test compares the bytes): its header block, the data, zeros to the next block. Built here rather
    than through tarfile's addfile, which costs about 50 us a member in TarInfo copies, field encoders and small
    writes: a pack writes three members a sample, and this was most of its main process's time."""
    raw = name.encode("ascii")  # keys are ASCII by construction (sample_keys), extensions too
    if len(raw) > 100 or len(data) >= 8 ** 11:  # a prefix field or a base-256 size: tarfile's own rules
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), 0o644
        head = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    else:
        head = b"".join((raw.ljust(100, b"\0"), b"0000644\0", b"0000000\0", b"0000000\0", b"%011o\0" % len(data),
                         b"00000000000\0", b"        ", tarfile.REGTYPE, bytes(100), tarfile.POSIX_MAGIC, bytes(247)))
        head = head[:148] + b"%06o\0 " % sum(head) + head[156:]
    return b"".join((head, data, bytes(-len(data) % _BLOCK)))


def tar_end(size: int) -> bytes:
    """What closes a tar of `size` bytes as tarfile closes one: two zero blocks, then zeros to a whole record."""
    return bytes(2 * _BLOCK + (-(size + 2 * _BLOCK) % _RECORD))


# -- index files -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class IndexEntry:
    """One sample of a shard: its key and, per member extension, (data offset, size) in the tar."""
    key: str
    members: dict[str, tuple[int, int]]


_NEEDS_ESCAPE = re.compile(r"[%\s]")  # re's \s is str.isspace's set (a test checks every code point)


def _token(text: str) -> str:
    """A file name as one whitespace-free token: whitespace and `%` percent-encoded (UTF-8)."""
    if not _NEEDS_ESCAPE.search(text):
        return text
    return "".join("".join(f"%{b:02X}" for b in c.encode()) if c == "%" or c.isspace() else c for c in text)


def read_index(path: str | Path) -> list[IndexEntry]:
    """The samples of a DALI v1.2 index file, in order."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8", errors="surrogateescape").splitlines()  # keys as the tar names them
    head = lines[0].split() if lines else []
    if len(head) != 2 or head[0] != INDEX_VERSION or not head[1].isdigit():
        raise IndexFormatError(f"{path}: line 1 is not '{INDEX_VERSION} COUNT'")
    entries = []
    for n, line in enumerate(lines[1:], start=2):
        tokens = line.split()
        if not tokens:
            continue
        if len(tokens) % 4:
            raise IndexFormatError(f"{path}: line {n} does not hold 'ext offset size name' groups")
        members, key = {}, None
        for i in range(0, len(tokens), 4):
            ext, offset, size, name = tokens[i:i + 4]
            if not (offset.isdigit() and size.isdigit()):
                raise IndexFormatError(f"{path}: line {n}: offset and size must be integers")
            if int(offset) % 512:
                raise IndexFormatError(f"{path}: line {n}: offset {offset} is not at a tar block (512 bytes)")
            members.setdefault(ext, (int(offset), int(size)))
            if key is None:
                name = unquote(name, errors="surrogateescape") if "%" in name else name
                key = name[: -len(ext) - 1] if name.endswith("." + ext) else name
        entries.append(IndexEntry(key, members))
    if len(entries) != int(head[1]):
        raise IndexFormatError(f"{path}: line 1 announces {head[1]} samples, the file lists {len(entries)}")
    return entries


def format_index(entries: list[IndexEntry]) -> str:
    """The text of a DALI v1.2 index file for `entries` (extensions hold no whitespace)."""
    lines = [f"{INDEX_VERSION} {len(entries)}"]
    for e in entries:
        lines.append(" ".join(f"{ext} {off} {size} {_token(e.key + '.' + ext)}"
                              for ext, (off, size) in e.members.items()))
    return "\n".join(lines) + "\n"


# -- indexing a tar ---------------------------------------------------------------------------------
class _Hashing:
    """A read-only stream that hashes (sha256 and the fast checksum) and counts what passes through it (and
    writes it to `copy`)."""

    def __init__(self, raw, copy=None):
        self.raw, self.h, self.fast, self.n, self.copy = raw, hashlib.sha256(), fast_digest(), 0, copy
        self.head = b""  # the first bytes (what the stream is, where tarfile cannot tell)

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n) if n is not None and n >= 0 else self.raw.read()
        if len(self.head) < 2:
            self.head += data[:2 - len(self.head)]
        self.h.update(data)
        self.fast.update(data)
        self.n += len(data)
        if self.copy is not None:
            self.copy.write(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


class TarFormatError(ValueError):
    """A shard that is not a readable tar (or gzip); the message says what is wrong."""


class GzippedTarError(TarFormatError):
    """A shard named .tar whose bytes are gzip's: a .tar.gz renamed, or a web server's on-the-fly compression."""


class Counting:
    """A read-only stream that counts the bytes read from it (a compressed shard's own size)."""

    def __init__(self, raw):
        self.raw, self.n = raw, 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n) if n is not None and n >= 0 else self.raw.read()
        self.n += len(data)
        return data


class Gunzip:
    """The decompressed bytes of a gzip stream (`.tar.gz`, `.tgz`, several members too, as gzip writes
    them), a damaged one as TarFormatError. The stdlib's gzip: what tarfile and webdataset use."""

    def __init__(self, raw):
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")

    def read(self, n: int = -1) -> bytes:
        try:
            return self._gz.read(n)
        except (gzip.BadGzipFile, zlib.error, EOFError) as e:
            raise TarFormatError(f"not a readable gzip ({type(e).__name__}: {str(e)[:100]})") from None


@dataclass
class IndexedTar:
    entries: list[IndexEntry]
    size: int
    sha256: str
    xxh3: str  # the fast checksum (FAST_SUM) of the same bytes
    duplicates: dict[int, str]  # entry position -> the member extension that appeared twice in it
    scattered: dict[str, tuple[int, int]] = field(default_factory=dict)  # a key whose members are not consecutive
    # -> (its first entry's position, the position where it came back)


def index_tar(stream, on_member=None, wanted=lambda ext: True, copy_to=None, max_member: int = MEMBER_MAX) -> IndexedTar:
    """Index a tar read once from `stream` (a local file, an S3 or HTTP body, or a Gunzip of one), as
    DALI's `wds2idx` does: regular files only, consecutive members with the same key make one sample,
    names whose last segment has no dot or starts with one are skipped. `on_member(position, key, ext,
    data)` sees every member: its bytes as they pass when its extension is `wanted` (Oversized, unread, above
    `max_member` bytes), else None (the bytes skipped unread). Memory stays bounded by `max_member` whatever the
    stream holds: skipped bytes stream through in blocks. Every byte of the stream is written to `copy_to` (a
    binary file) when given. Returns the entries with the size, sha256 and fast checksum of the whole stream."""
    src = _Hashing(stream, copy_to)
    entries: list[IndexEntry] = []
    duplicates: dict[int, str] = {}
    try:
        with tarfile.open(fileobj=src, mode="r|") as tar:
            for m in tar:
                if not m.isreg():
                    continue
                key, ext = split_name(m.name)
                if key is None or any(c.isspace() for c in ext):
                    continue
                if not entries or entries[-1].key != key:
                    entries.append(IndexEntry(key, {}))
                members = entries[-1].members
                if ext in members:
                    duplicates.setdefault(len(entries) - 1, ext)
                else:
                    members[ext] = (m.offset_data, m.size)
                if on_member is not None:
                    data = member_bytes(tar.extractfile(m).read, m.size, max_member) if wanted(ext) else None
                    on_member(len(entries) - 1, key, ext, data)
        src.drain()
    except (tarfile.TarError, EOFError) as e:
        if src.head == b"\x1f\x8b":
            raise GzippedTarError("not a tar but gzip-compressed bytes (they start with gzip's 1f 8b)") from None
        raise TarFormatError(f"not a readable tar ({type(e).__name__}: {str(e)[:100]})") from None
    return IndexedTar(entries, src.n, src.h.hexdigest(), src.fast.hexdigest(), duplicates,
                      find_scattered([e.key for e in entries]))


def find_scattered(keys: list[str]) -> dict[str, tuple[int, int]]:
    """Keys of a tar's samples (in order, one per run of consecutive members) that come back after another key:
    key -> (its first sample's position, the position where it came back)."""
    first: dict[str, int] = {}
    scattered: dict[str, tuple[int, int]] = {}
    for i, key in enumerate(keys):
        if key in first:
            scattered.setdefault(key, (first[key], i))
        else:
            first[key] = i
    return scattered


# -- packed.json -----------------------------------------------------------------------------------
def parse_packed(raw: bytes, where: str) -> dict:
    """packed.json's content, refused with a message naming `where` unless this version reads it."""
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise PackedFormatError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise PackedFormatError(f"{where} is not a pack this version reads (format {fmt!r}, expected one of "
                                f"{', '.join(READABLE_FORMATS)}); pack the data again")
    problem = _schema_problem(meta)
    if problem:
        raise PackedFormatError(f"{where}: {problem}; packed.json was edited or damaged: pack the data again")
    return meta


def _plain_name(name) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def _schema_problem(meta: dict) -> str | None:
    """What is missing or malformed in packed.json (the contract's fields), or None. Shard and index names
    must be plain file names: a reader joins them to the pack's folder."""
    if not isinstance(meta.get("classes"), list) or not all(isinstance(c, str) for c in meta["classes"]):
        return "'classes' is not a list of class names"
    if not isinstance(meta.get("splits"), dict):
        return "'splits' is not a mapping of split names"
    for split, info in meta["splits"].items():
        if not isinstance(info, dict) or not isinstance(info.get("samples"), int) or not isinstance(
                info.get("shards"), list):
            return f"splits.{split} lacks 'samples' (an integer) or 'shards' (a list)"
        for n, shard in enumerate(info["shards"]):
            where = f"splits.{split}.shards[{n}]"
            if not isinstance(shard, dict) or not all(_plain_name(shard.get(k)) for k in ("name", "index")):
                return f"{where}: 'name' and 'index' must be file names in the pack's folder"
            if not all(isinstance(shard.get(k), int) and shard[k] >= 0 for k in ("samples", "size")):
                return f"{where}: 'samples' and 'size' must be non-negative integers"
            if FAST_SUM in shard and not (isinstance(shard[FAST_SUM], str) and re.fullmatch(r"[0-9a-f]{32}",
                                                                                            shard[FAST_SUM])):
                return f"{where}: '{FAST_SUM}' is not 32 hexadecimal digits"
            if "image_paths" in shard and not (isinstance(shard["image_paths"], list) and all(
                    isinstance(x, str) for x in shard["image_paths"])):
                return f"{where}: 'image_paths' is not a list of paths"
    return None


def fast_digest():
    """A new FAST_SUM digest: XXH3-128 runs at about 9 GB/s where sha256 (with the CPU's SHA extensions)
    runs at about 1.2, so the shard syncs and the checks before training verify each byte for an eighth of
    the CPU. A checksum against damage (a flipped bit, a cut or mixed copy), as S3's own CRC64 is: whoever
    can write a shard can write the packed.json beside it, so a cryptographic hash adds nothing here."""
    return xxhash.xxh3_128()


def file_sha256(path: str | Path) -> str:
    return hash_file(path, hashlib.sha256()).hexdigest()


def file_xxh3(path: str | Path) -> str:
    return hash_file(path, fast_digest()).hexdigest()


def file_sums(path: str | Path) -> tuple[str, str]:
    """(sha256, fast checksum) of the file at `path`, from one read."""
    sha, fast = hashlib.sha256(), fast_digest()
    hash_file(path, sha, fast)
    return sha.hexdigest(), fast.hexdigest()
