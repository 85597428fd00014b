"""WebDataset shards written by others (webdataset's ShardWriter, img2dataset, any WebDataset tool): a folder
of .tar, .tar.gz or .tgz files (or its train/ and val/ subfolders of them), one shard file, a brace pattern,
an s3:// prefix of them, or https:// URLs."""
from __future__ import annotations

from pathlib import Path

from ..forms import SHARD_FOLDERS, is_shard_name, shard_files
from ..https import is_http
from ..shards.listing import CLASSES_NAME, is_brace_pattern
from ..shards.shardset import ShardSet
from ..shards.source import open_peer
from ..sync import sync_files
from .form import Form, S3Look


def is_path(data: str) -> bool:
    """https:// URLs (a server lists no folder), a brace pattern, or one shard file."""
    return is_http(data) or is_brace_pattern(data) or (
        not data.startswith("s3://") and is_shard_name(data) and Path(data).is_file())


def _shard(name: str) -> bool:
    return is_shard_name(name) and not name.startswith(".")  # (a hidden one is no shard: forms.shard_files)


def is_s3(look: S3Look) -> bool:
    if any(_shard(n) for n in look.names):
        return True
    return any(any(_shard(n) for n in look.names_in(sub))  # train/ and val/ sub-prefixes of shards
               for sub in look.folders if sub.lower() in SHARD_FOLDERS)


def read(data, *, labels: bool = True, num_threads: int = 1, progress: bool = False) -> ShardSet:
    return open_peer(data, num_threads=num_threads, progress=progress, labels=labels)


def prepare(data, *, num_threads: int, workers: int, labels: bool = True) -> ShardSet:
    return read(data, labels=labels, num_threads=num_threads, progress=True)  # indexed once, then cached


def _kept(key: str) -> bool:
    """The objects a local copy needs to be read as the prefix is: the shards (and classes.txt) directly under it
    or in its split-named sub-folders."""
    parts = key.split("/")
    name = parts[-1]
    return (is_shard_name(name) or name == CLASSES_NAME) and not name.startswith(".") and (
        len(parts) == 1 or len(parts) == 2 and parts[0].lower() in SHARD_FOLDERS)


def download(uri: str, dest, *, workers: int, progress: bool = True):
    return sync_files(uri, dest, keep=_kept, workers=workers, progress=progress)[0]


FORM = Form(
    name="shards", title="WebDataset shards", reader="shards",
    example="DIR/*.tar (.tar.gz, .tgz; or DIR/train/ + DIR/val/ of them), one shard file, a pattern such as "
            "DIR/train-{000000..000099}.tar, or https:// shard URLs",
    is_path=is_path, is_local=lambda p: bool(shard_files(p)[0]), is_s3=is_s3, read=read, prepare=prepare,
    download=download)
