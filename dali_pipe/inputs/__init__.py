"""The input forms --data may be, registered in one place: one module each (dali_pipe/inputs/<name>.py, holding
one `Form`), tried in the order below, the first that matches deciding. Everything that reads data asks the
registry (`detect`) and then the form; nothing else names a form. docs/code.md walks through adding one.

A sample stays a row of columns all the way: a form's `read` gives a Manifest (numpy arrays of paths and
labels) or a ShardSet (per shard, arrays of offsets and labels), so a million samples are listed, split and
fingerprinted without a Python object each.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..forms import LayoutError, UnfinishedPackError, is_shard_name, names_a_file, url_problem
from ..s3 import local_target
from ..shards.shardset import ShardSourceError
from . import arrow, imagefolder, manifest, pack, parquet, shards
from .form import Form, S3Look, local_root

__all__ = ["FORMS", "Form", "S3Look", "by_name", "data_problem", "detect", "form_problem", "form_of", "forms_text", "local_root",
           "object_hint", "read"]

FORMS: tuple[Form, ...] = (manifest.FORM, pack.FORM, shards.FORM, arrow.FORM, parquet.FORM, imagefolder.FORM)


def by_name(name: str) -> Form:
    return next(f for f in FORMS if f.name == name)


def forms_text(indent: str = "\n  ") -> str:
    """Every input form, one per line: what --data may be."""
    return "".join(f"{indent}{f.title}: {f.example}" for f in FORMS) + f"{indent}or s3://bucket/prefix of any"


def local_form(path: Path) -> Form | None:
    """The form of the local folder `path`, or None. A folder that is almost a form, where reading it as
    another would train on the wrong thing, raises (LayoutError, UnfinishedPackError)."""
    return next((f for f in FORMS if f.is_local(path)), None)


def detect(data: str, cache_dir: str | None = None) -> Form | None:
    """The form --data holds, or None: a path that is none of them (for predict: an image, a list file, a folder
    of images), or does not exist. An s3:// prefix is asked what the forms need (S3Look); one synced before
    (its copy in the cache dir holds a `synced` form) is not asked again. A URL of another scheme (`pipe:`,
    `gs://`, ...) is refused."""
    problem = url_problem(data)
    if problem:
        raise ShardSourceError(problem)
    path_form = next((f for f in FORMS if f.is_path(data)), None)
    if path_form is not None:
        return path_form
    if data.startswith("s3://"):
        if cache_dir is not None:
            local = local_target(data, Path(cache_dir))
            known = next((f for f in FORMS if f.synced and f.is_local(local)), None)
            if known is not None:
                return known
        look = S3Look(data)
        try:
            return next((f for f in FORMS if f.is_s3(look)), None)
        finally:
            look.close()
    p = Path(data)
    return local_form(p) if p.is_dir() else None


def object_hint(uri: str) -> str:
    """For an s3:// --data that holds no form: `forms.names_a_file`'s hint (pass the prefix holding the object it
    names), where nothing is under it as a prefix; "" otherwise: a prefix named like a file that holds objects
    (Spark's or pyarrow's partitioned out.parquet/) is a folder, and its parent no better --data."""
    hint = names_a_file(uri)
    if not hint:
        return ""
    look = S3Look(uri)
    try:
        return "" if look.names or look.folders else hint
    finally:
        look.close()


def form_of(data) -> Form:
    """The form at --data (DataSettings) for training, evaluate and pack: a dataset.tsv folder when it is none of
    the forms, whose reader then names what is missing."""
    return detect(data.data, data.cache_dir) or manifest.FORM


def read(data, *, labels: bool = True):
    """The samples at --data as its form reads them."""
    return form_of(data).read(data, labels=labels)


def form_problem(data: str) -> str | None:
    """What is wrong with a local --data folder (None when it holds a form)."""
    p = Path(data)
    if not p.is_dir():
        return None
    try:
        if local_form(p) is not None:
            return None
    except (UnfinishedPackError, LayoutError) as e:
        return str(e)
    except OSError as e:
        return f"{data!r} cannot be read ({e.strerror}); check its permissions"
    return f"{data!r} holds none of the input forms. --data may be:" + forms_text("\n    ")


def data_problem(data: str) -> str | None:
    """What is wrong with --data as a user wrote it, told before anything is read: a URL of a scheme not read,
    a local path that does not exist or holds none of the forms; None when nothing is (s3:// and https://
    data are asked as they are read)."""
    if not data.strip():
        return (f"--data: {data!r} is empty; pass a dataset folder or s3://bucket/prefix, or leave --data out for "
                "the demo set")
    problem = url_problem(data)
    if problem:
        return problem
    if "://" in data or ("{" in data and is_shard_name(data)):  # (a brace pattern: its shards are checked when read)
        return None
    if any(f.is_path(data) for f in FORMS):  # one shard or Parquet file
        return None
    if not os.path.isdir(data):
        what = "is not a directory" if os.path.lexists(data) else "does not exist"
        return f"--data: {data!r} {what}; --data may be:" + forms_text("\n    ")
    problem = form_problem(data)
    return f"--data: {problem}" if problem else None
