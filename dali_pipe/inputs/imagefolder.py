"""An ImageFolder: class subfolders of images as torchvision's ImageFolder reads them, or train/ and val/ of
them (ImageNet's layout)."""
from __future__ import annotations

from ..forms import is_image_name, local_image_folder
from ..imagefolder import read_image_folder, sync_image_folder
from ..manifest import Manifest
from .form import Form, local_root


def read(data, *, labels: bool = True) -> Manifest:
    return read_image_folder(local_root(data), val_fraction=data.val_fraction, seed=data.seed)


def prepare(data, *, num_threads: int, workers: int, labels: bool = True) -> Manifest:
    if data.data.startswith("s3://"):
        sync_image_folder(data.data, local_root(data), workers=workers)
    return read(data, labels=labels)


def download(uri: str, dest, *, workers: int, progress: bool = True):
    return sync_image_folder(uri, dest, workers=workers, progress=progress)[0]


FORM = Form(
    name="imagefolder", title="ImageFolder", reader="files",
    example="DIR/CLASS/*.jpg (torchvision's layout; train/ + val/ of them is ImageNet's)",
    is_local=local_image_folder,
    is_s3=lambda look: any("/" in k and is_image_name(k) for k in look.keys),  # PREFIX/CLASS/IMAGE
    read=read, prepare=prepare, download=download)
