"""Where shards written by others are: listed from a local folder (its own shards, else those of its split
folders), one file, a brace pattern, an s3:// prefix (or its train/ and val/ sub-prefixes) or https:// URLs,
with the files beside them that are not read named; a gzipped shard's decompressed copy in the cache dir.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from braceexpand import UnbalancedBracesError, braceexpand

from ..forms import (
    SHARD_FOLDERS,
    SHARD_SUFFIXES,
    UnfinishedPackError,
    is_shard_name,
    shard_files,
    split_of,
    unfinished_pack,
)
from ..https import MISSING, explain_http, is_http, shown, status_of
from ..s3 import Bounds, SyncError, TransferError, explain, make_client, parse_s3_uri
from ..stores import locate
from ..transfer import Engine
from .fetchers import SHARD_BOUNDS
from .format import (
    PACKED_NAME,
)
from .shardset import ShardSourceError


@dataclass
class Listed:
    name: str  # file name or URL (redacted), for messages
    path: str  # local absolute path, s3:// or https:// URL
    identity: str  # what the cached index is valid for
    size: int | None  # of the file or object as stored (compressed, for a .tar.gz)
    copy: Path | None = None  # a gzipped shard: where its decompressed tar is kept (CACHE/gunzip)
    reuse: bool = True  # False: indexed again on every run (a server that gives no ETag or Last-Modified)


@dataclass
class Found:
    """What --data names: its shards, the text of its classes.txt, and the files beside them that are not read."""
    items: list[Listed]
    classes_txt: str | None = None
    unused: list[str] = field(default_factory=list)


def gunzip_copy(cache_dir: Path, item: Listed) -> Listed:
    """A gzipped shard's decompressed tar lives at one place per source (a digest of its path or URL), so a
    shard that changed replaces its own copy and the folder holds one copy per shard ever read."""
    if is_gzip(item.path.split("?", 1)[0]):
        digest = hashlib.sha256(item.path.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        base = shard_stem(item.path.split("?", 1)[0].rsplit("/", 1)[-1])
        item.copy = cache_dir / GUNZIP_DIR / f"{digest}-{_UNSAFE_NAME.sub('_', base)[:80]}.tar"
    return item


def list_peer(data: str, cache_dir: Path) -> Found:
    """The shards --data names, in order, with their classes.txt and the unread files beside them."""
    if is_http(data):
        found = _list_http(data)
    elif data.startswith("s3://"):
        found = _list_s3(data)
    else:
        found = _list_local(data)
    found.items = [gunzip_copy(cache_dir, it) for it in found.items]
    return found


def _list_local(data: str) -> Found:
    folders: list[Path] = []
    if is_brace_pattern(data):
        paths = [Path(p) for p in expand_braces(data)]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ShardSourceError(f"--data {data!r}: {len(missing)} of its {len(paths)} shard(s) do not exist, e.g. "
                                   f"{missing[0]}; fix the pattern or the files")
        folder = Path(posixpath.commonpath([str(p.parent) for p in paths])) if len(paths) > 1 else paths[0].parent
    elif Path(data).is_file():
        paths, folder = [Path(data)], Path(data).parent
    else:
        folder = Path(data)
        paths, folders = shard_files(folder)
    stopped = unfinished_pack(folder)  # (a shard or a pattern inside a stopped pack's folder names part of it)
    if stopped:
        raise UnfinishedPackError(stopped)
    dangling = [p for p in paths if p.is_symlink() and not p.exists()]
    if dangling:
        raise ShardSourceError(f"{dangling[0]} is a dangling symbolic link (-> {os.readlink(dangling[0])}); "
                               f"{len(dangling)} shard link(s) in {dangling[0].parent} point nowhere: fix or remove them")
    listed = []
    for p in paths:
        st = p.stat()
        path = str(p.resolve())
        listed.append(Listed(str(p.relative_to(folder)), path,  # `val/part-0.tar` beside `train/part-0.tar`
                              f"file\0{path}\0{st.st_size}\0{st.st_mtime_ns}", st.st_size))
    unused = _unread_local(folder, paths, folders) if Path(data).is_dir() else []
    classes = folder / CLASSES_NAME
    return Found(listed, classes.read_text(encoding="utf-8-sig") if classes.is_file() else None,  # -sig: a BOM
                  unused)


def _unread(names: list[tuple[str, bool]], used: set[str], stems: set[str], prefix: str = "") -> list[str]:
    """Of (name, is a folder) in a folder, those neither used nor a sidecar (hidden names aside), as
    `prefix + name` with why where it helps."""
    out = []
    for name, is_dir in names:
        if name.startswith(".") or name in used:
            continue
        low = name.lower()
        if not is_dir and (low in SIDECAR_NAMES or low.endswith(SIDECAR_SUFFIXES)
                           or name.split(".", 1)[0].removesuffix("_stats") in stems):
            continue
        if is_dir:
            out.append(f"{prefix}{name}/ (a folder)")
        elif re.search(r"\.(tar\.(bz2|xz|zst|lz4)|tbz2?|txz|zip|7z|rar)$", low):
            out.append(f"{prefix}{name} (only .tar, .tar.gz and .tgz shards are read)")
        else:
            out.append(prefix + name)
    return out


def _unread_local(folder: Path, paths: list[Path], subfolders: list[Path]) -> list[str]:
    stems = {shard_stem(p.name) for p in paths}
    used = {p.name for p in paths} | {d.name for d in subfolders}
    out = _unread([(p.name, p.is_dir()) for p in sorted(folder.iterdir())], used, stems)
    for d in subfolders:
        out += _unread([(p.name, p.is_dir()) for p in sorted(d.iterdir())], used | {CLASSES_NAME}, stems,
                       prefix=f"{d.name}/")
        if (d / CLASSES_NAME).is_file() and not (folder / CLASSES_NAME).is_file():
            out.append(f"{d.name}/{CLASSES_NAME} (classes.txt is read beside the subfolders: move it up)")
    return out


def _list_s3(data: str) -> Found:
    from botocore.exceptions import BotoCoreError, ClientError

    client = make_client(4)
    unused: list[str] = []
    if is_brace_pattern(data):  # its shards may lie in several folders (`{train,val}/part-0.tar`): each listed once
        urls = expand_braces(data)
        folders: dict[str, dict] = {}
        for u in urls:
            folder = u.rsplit("/", 1)[0]
            if folder not in folders:
                b, p = parse_s3_uri(folder)
                folders[folder] = list_top(client, b, f"{p}/" if p else "")
        missing = [u for u in urls if u.rsplit("/", 1)[1] not in folders[u.rsplit("/", 1)[0]]]
        if missing:
            raise ShardSourceError(f"--data {data!r}: {len(missing)} of its {len(urls)} shard(s) are not in S3, e.g. "
                                   f"{missing[0]}; fix the pattern or upload them")
        bucket, prefix = parse_s3_uri(urls[0].rsplit("/", 1)[0])
        base = f"{prefix}/" if prefix else ""
        remote = folders[urls[0].rsplit("/", 1)[0]]
        found = [(u, folders[u.rsplit("/", 1)[0]][u.rsplit("/", 1)[1]]) for u in urls]
        names = [u.rsplit("/", 1)[1] for u in urls]
    else:
        bucket, prefix = parse_s3_uri(data)
        base = f"{prefix}/" if prefix else ""
        subs: list[str] = []
        remote = list_top(client, bucket, base, folders=subs)
        names = sorted(n for n in remote if is_shard_name(n) and not n.startswith("."))  # (as shard_files)
        found = [(f"s3://{bucket}/{base}{n}", remote[n]) for n in names]
        used_subs = []
        if not found:  # train/ and val/ sub-prefixes of shards
            for sub in sorted(f for f in subs if f.lower() in SHARD_FOLDERS):
                inside = list_top(client, bucket, f"{base}{sub}/")
                shard_names = sorted(n for n in inside if is_shard_name(n) and not n.startswith("."))
                if shard_names:
                    used_subs.append(sub)
                    found += [(f"s3://{bucket}/{base}{sub}/{n}", inside[n]) for n in shard_names]
                    names += [f"{sub}/{n}" for n in shard_names]
                    unused += _unread([(n, False) for n in sorted(inside)], set(shard_names) | {CLASSES_NAME},
                                      {shard_stem(n) for n in shard_names}, prefix=f"{sub}/")
        unused = _unread([(n, False) for n in sorted(remote)] + [(f, True) for f in sorted(subs)],
                         set(names) | set(used_subs), {shard_stem(n.rsplit("/", 1)[-1]) for n in names}) + unused
    listed = []
    for url, (size, etag) in found:
        b, key = parse_s3_uri(url)
        listed.append(Listed(url, url, f"s3\0{b}\0{key}\0{size}\0{etag}", size))
    classes = None
    if CLASSES_NAME in remote:
        try:
            classes = client.get_object(Bucket=bucket, Key=base + CLASSES_NAME)["Body"].read().decode("utf-8-sig")
        except (BotoCoreError, ClientError) as e:
            raise SyncError(explain(e, bucket, base + CLASSES_NAME)) from None
    return Found(listed, classes, unused)


def _list_http(data: str, bounds: Bounds = SHARD_BOUNDS) -> Found:
    """https:// shards: one URL or a brace pattern of them (a server lists no folder). One HEAD each gives
    the size and validator a cached index is kept for; classes.txt is looked for beside the first shard.
    Both through the transfer engine, with `bounds`."""
    urls = expand_braces(data) if is_brace_pattern(data) else [data]
    if not all(is_http(u) for u in urls):
        raise ShardSourceError(f"--data {shown(data)!r}: a pattern names shards of one source: all https:// (or "
                               "http://) URLs, or all local, or all s3://")
    named = [u for u in urls if not is_shard_name(urlsplit(u).path)]
    if named:
        raise ShardSourceError(f"--data {shown(named[0])!r} names no shard: https:// URLs are read as WebDataset "
                               "shards (.tar, .tar.gz, .tgz), one URL or a brace pattern (a server lists no folder); "
                               "sync other data to a folder or S3 first")
    parts = [urlsplit(u) for u in urls]
    common = posixpath.commonpath([posixpath.dirname(p.path) for p in parts]) if all(
        p.netloc == parts[0].netloc for p in parts) else posixpath.dirname(parts[0].path)
    classes_url = parts[0]._replace(path=posixpath.join(common, CLASSES_NAME), query="", fragment="").geturl()
    engine = Engine(concurrency=8, connect_timeout=bounds.connect_timeout, read_timeout=bounds.read_timeout,
                    attempts=bounds.request_attempts)
    try:
        heads = engine.run(_heads(engine, urls, bounds))
        missing = [m for m in heads if isinstance(m, str)]
        if missing:
            raise ShardSourceError(f"--data {shown(data)!r}: {len(missing)} of its {len(urls)} shard(s) cannot be "
                                   f"read, e.g. {missing[0]}")
        raw = engine.run(_read_small(engine, classes_url, bounds))
    finally:
        engine.close()
    listed = [Listed(shown(u), u, f"http\0{u}\0{size}\0{validator}", size, reuse=validator is not None)
              for u, (size, validator) in zip(urls, heads)]
    return Found(listed, raw.decode("utf-8-sig") if raw is not None else None)


async def _heads(engine: Engine, urls: list[str], bounds: Bounds) -> list:
    """(size, validator) of each URL (None, None where the server refuses HEAD or sends no length), or the
    message of its failure."""
    async def one(url: str):
        try:
            return await engine.head(*locate(url))
        except TransferError as e:
            if status_of(e) in (405, 501) or "Content-Length Header missing" in e.detail:
                return None, None  # the GET that indexes it tells
            return explain_http(e, url, bounds)

    return await asyncio.gather(*(one(u) for u in urls))


async def _read_small(engine: Engine, url: str, bounds: Bounds, limit: int = 16 << 20) -> bytes | None:
    """The bytes of a small object (classes.txt), or None when the server has none (403, 404, 410; or an HTML
    page, which servers that answer every path with their index page send for a file they do not have)."""
    try:
        data, kind = await engine.read_small(*locate(url), limit)
    except TransferError as e:
        if status_of(e) in MISSING:
            return None
        raise ShardSourceError(explain_http(e, url, bounds) if e.code != "size" else
                               f"{shown(url)}: larger than {limit} bytes; is this the right URL?") from None
    return None if "text/html" in kind.lower() else data


CLASSES_NAME = "classes.txt"


GZIP_SUFFIXES = (".tar.gz", ".tgz")


GUNZIP_DIR = "gunzip"  # CACHE/gunzip: the decompressed copies of gzipped shards


_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")


MANIFEST_NAME = "dataset.tsv"


# files beside shards that are not data and not worth a word (lower case): what others' tools write next to
# their shards (indexes, img2dataset's NNNNN.parquet and NNNNN_stats.json, named after a shard), docs
SIDECAR_NAMES = {CLASSES_NAME, PACKED_NAME, MANIFEST_NAME, "bad_images.tsv", "stats.json", "readme", "readme.md",
                 "readme.txt", "license", "license.txt", "license.md", "dataset_info.json"}


SIDECAR_SUFFIXES = (".idx", ".index", ".wids.json")


def is_brace_pattern(data: str) -> bool:
    """Whether --data is a brace pattern (`shards-{000..099}.tar`, nested too) that names several shards."""
    if "{" not in data:
        return False
    try:
        return _expand(data) != [data]
    except UnbalancedBracesError:
        return True  # taken as a pattern, so that expand_braces names what is wrong with it


def expand_braces(pattern: str) -> list[str]:
    """The shards a brace pattern names, in order, exactly as webdataset expands them (it uses braceexpand:
    `{000..099}` keeps the zero padding, `{a,b}`, nested groups, several groups). Unbalanced braces are
    refused, naming the pattern."""
    try:
        return _expand(pattern)
    except UnbalancedBracesError:
        raise ShardSourceError(f"--data {shown(pattern)!r}: its braces do not balance; write a pattern such as "
                               "shards/train-{000000..000099}.tar") from None


def _expand(pattern: str) -> list[str]:
    return list(braceexpand(pattern))


def is_gzip(name: str) -> bool:
    return name.lower().endswith(GZIP_SUFFIXES)


def shard_stem(name: str) -> str:
    """A shard's name without its suffix (`val-000000.tar.gz` -> `val-000000`)."""
    low = name.lower()
    return name[: -len(next(x for x in SHARD_SUFFIXES if low.endswith(x)))] if is_shard_name(name) else name


def parquet_keys(keys) -> list[str]:
    """The .parquet files among object keys (relative to the prefix), where `forms.parquet_files` finds them
    in a folder: at the top, in data/, or in split folders."""
    def found(k: str) -> bool:
        parts = k.split("/")
        return k.endswith(".parquet") and not any(p.startswith(".") for p in parts) and len(parts) <= 3 and all(
            p == "data" or split_of(p) is not None for p in parts[:-1])

    return sorted(k for k in keys if found(k))


def list_top(client, bucket: str, base: str, pages: int | None = None,
              folders: list | None = None) -> dict[str, tuple[int, str]]:
    """{name: (size, ETag)} of the objects directly under s3://bucket/base (not in its sub-folders); the
    sub-folders' names are appended to `folders` when given."""
    from botocore.exceptions import BotoCoreError, ClientError

    out: dict[str, tuple[int, str]] = {}
    try:
        for n, page in enumerate(client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base,
                                                                                 Delimiter="/")):
            for obj in page.get("Contents", []):
                out[obj["Key"][len(base):]] = (obj["Size"], obj["ETag"].strip('"'))
            if folders is not None:
                folders += [p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", [])]
            if pages is not None and n + 1 >= pages:
                break
    except (BotoCoreError, ClientError) as e:
        raise SyncError(explain(e, bucket, base)) from None
    return out
