"""The on-disk shard format, shared by the writer (pack.py) and every reader.

A shard is a WebDataset tar: the members of one sample share a key (`KEY.jpg`, `KEY.cls`, ...).
Beside it, a DALI index file (the format of DALI's `wds2idx` tool, version 1.2) lists, per sample,
each member's extension, data offset, size and file name:

    v1.2 N
    jpg 512 10349 KEY.jpg cls 11264 1 KEY.cls
    ...

`read_index` parses it into `IndexEntry`s; `format_index` writes it back. A `.cls` member holds the
class index as decimal ASCII (`parse_cls`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

INDEX_VERSION = "v1.2"


class IndexFormatError(ValueError):
    """An index file that is not DALI's v1.2 format; the message names the file and line."""


@dataclass(frozen=True)
class IndexEntry:
    """One sample of a shard: its key and, per member extension, (data offset, size) in the tar."""
    key: str
    members: dict[str, tuple[int, int]]


def read_index(path: str | Path) -> list[IndexEntry]:
    """The samples of a DALI v1.2 index file, in order."""
    path = Path(path)
    lines = path.read_text().splitlines()
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
            members[ext] = (int(offset), int(size))
            if key is None:
                key = name[: -len(ext) - 1] if name.endswith("." + ext) else name
        entries.append(IndexEntry(key, members))
    if len(entries) != int(head[1]):
        raise IndexFormatError(f"{path}: line 1 announces {head[1]} samples, the file lists {len(entries)}")
    return entries


def format_index(entries: list[IndexEntry]) -> str:
    """The text of a DALI v1.2 index file for `entries` (keys and extensions hold no whitespace)."""
    lines = [f"{INDEX_VERSION} {len(entries)}"]
    for e in entries:
        lines.append(" ".join(f"{ext} {off} {size} {e.key}.{ext}" for ext, (off, size) in e.members.items()))
    return "\n".join(lines) + "\n"


class LabelFormatError(ValueError):
    """A `.cls` member that is not a non-negative decimal integer."""


def parse_cls(raw: bytes) -> int:
    """The class index in a `.cls` member: decimal ASCII, as webdataset writes it (`b"7"`); surrounding
    whitespace and zero padding (`b"000007"`, this project's first format) are accepted."""
    text = raw.strip()
    if not text.isdigit():
        raise LabelFormatError(f"{raw[:20]!r} is not a class index (a non-negative decimal integer)")
    return int(text)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
