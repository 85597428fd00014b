"""A dataset.tsv folder: DIR/dataset.tsv (image_path; label and split optional) beside the image files it names."""
from __future__ import annotations

from ..forms import MANIFEST_NAME
from ..manifest import Manifest, read_manifest
from ..sync import sync
from .form import Form, local_root


def read(data, *, labels: bool = True) -> Manifest:
    return read_manifest(local_root(data), val_fraction=data.val_fraction, seed=data.seed,
                         skip_missing=data.skip_missing, cache_dir=data.cache_dir)


def prepare(data, *, num_threads: int, workers: int, labels: bool = True) -> Manifest:
    if data.data.startswith("s3://"):  # dataset.tsv first, checked before the first image is fetched
        sync(data.data, local_root(data), workers=workers, skip_missing=data.skip_missing, rows=True)
    return read(data, labels=labels)


def download(uri: str, dest, *, workers: int, progress: bool = True):
    return sync(uri, dest, workers=workers, progress=progress)


FORM = Form(
    name="manifest", title="dataset.tsv folder", reader="files",
    example="DIR/dataset.tsv with an image_path column (label, split optional)",
    is_local=lambda p: (p / MANIFEST_NAME).is_file(),
    is_s3=lambda look: look.holds(MANIFEST_NAME),  # (asked by name: a listing's first page may not reach it)
    read=read, prepare=prepare, download=download, synced=True)
