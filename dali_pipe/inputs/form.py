"""What every input form answers (`Form`), and what the registry asks an s3:// prefix once for all of them
(`S3Look`): one form is one module (dali_pipe/inputs/<name>.py) holding one `Form`, registered in
dali_pipe/inputs/__init__.py."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

from ..config import DataSettings
from ..s3 import SyncError, TransferError, explain, local_target, make_client, parse_s3_uri
from ..shards.listing import list_top
from ..sync import make_engine, read_object


def never(_data: str) -> bool:
    return False


@dataclass(frozen=True)
class Form:
    """One input form, answering the questions every form answers (tests/test_inputs.py asks each one):

    - what it is called and looks like (`name`, `title`, `example`: the list every "what is this" message prints);
    - whether --data is one: `is_path` from the string alone (a URL, a pattern, one file), `is_local` for a local
      folder and `is_s3` for an s3:// prefix, each from names only (no image opened); `synced`: a prefix whose
      copy in the cache dir passes `is_local` is this form without asking S3 again;
    - how the pipeline reads its samples (`reader`): "files" (DALI's file reader opens each sample's path) or
      "shards" (the shard reader hands DALI each sample's encoded bytes);
    - `read(data, labels=)`: its samples as columns, listed and split (a Manifest, or a ShardSet: arrays of
      paths or shard offsets and labels, never an object per sample), from local disk or the copy `prepare`
      made; `labels` False: samples without a label are read too (predict);
    - `prepare(data, num_threads=, workers=, labels=)`: once per node, the same after syncing, fetching,
      indexing and checking what needs it;
    - `download(uri, dest, workers=, progress=)`: its files at an s3:// prefix copied into the local folder
      `dest`, which then holds the same form (`python -m dali_pipe sync`);
    - where a sample's bytes are for `pack`: in the file or tar member `read` names, or (`extract`) first
      unpacked into the cache dir (a Hugging Face table's image cells).
    Training, evaluate, predict and pack ask these and nothing else of a form."""
    name: str
    title: str
    example: str
    reader: str
    is_local: Callable[[Path], bool]
    is_s3: Callable[["S3Look"], bool]
    read: Callable[..., object]
    prepare: Callable[..., object]
    download: Callable[..., object]
    is_path: Callable[[str], bool] = never
    synced: bool = False
    extract: Callable | None = None

    def __post_init__(self):
        assert self.reader in ("files", "shards"), self.reader


class S3Look:
    """What the forms ask of an s3:// prefix to tell which one it holds, each asked once and only when a form
    asks: the first page of names directly under it (and its sub-folders), the first page of the keys below
    it, the top names of one sub-folder, whether a named object is there."""

    def __init__(self, uri: str):
        self.uri = uri
        self.bucket, prefix = parse_s3_uri(uri)
        self.base = f"{prefix}/" if prefix else ""

    @cached_property
    def _client(self):
        # boto3, for the one listing obstore cannot make: one page with a delimiter (object_store lists with a
        # delimiter only whole, every page: a million-image prefix would be listed in full to tell its form)
        return make_client(4)

    @cached_property
    def _engine(self):
        return make_engine(4)

    def close(self) -> None:
        if "_engine" in self.__dict__:
            self._engine.close()

    @cached_property
    def _top(self) -> tuple[dict, list[str]]:
        folders: list[str] = []
        names = list_top(self._client, self.bucket, self.base, pages=1, folders=folders)  # one page: enough to tell
        return names, folders

    @property
    def names(self) -> dict:
        """{name: (size, ETag)} of the first page of objects directly under the prefix."""
        return self._top[0]

    @property
    def folders(self) -> list[str]:
        """The sub-folders (common prefixes) of that page."""
        return self._top[1]

    @cached_property
    def keys(self) -> list[str]:
        """The first page of keys below the prefix, sub-folders included, relative to it."""
        try:
            return self._engine.run(self._engine.first_keys(self.bucket, self.base))
        except TransferError as e:
            raise SyncError(explain(e, self.bucket, self.base)) from None

    def names_in(self, folder: str) -> dict:
        return list_top(self._client, self.bucket, f"{self.base}{folder}/", pages=1)

    def holds(self, name: str) -> bool:
        """Whether the object NAME is directly under the prefix (asked with a GET of it: a small file)."""
        return read_object(self.uri, name, self._engine) is not None


def local_root(data: DataSettings) -> Path:
    """Where a form's files are on local disk: --data itself, or the copy of an s3:// prefix in the cache dir."""
    if data.data.startswith("s3://"):
        return local_target(data.data, Path(data.cache_dir))
    return Path(data.data)
