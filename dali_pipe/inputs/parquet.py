"""A Hugging Face dataset as Parquet files (`Dataset.to_parquet`, the Hub's data/train-00000-of-00004.parquet):
in the folder, its data/ or its split folders, or one such file; each row group is read as a shard."""
from __future__ import annotations

from pathlib import Path

from ..forms import parquet_files
from ..shards.listing import parquet_keys
from ..shards.tables import download_tables, extract, open_tables, prepare_tables
from .form import Form


def is_path(data: str) -> bool:
    """One local .parquet file (what a single `Dataset.to_parquet` call writes)."""
    return "://" not in data and data.lower().endswith(".parquet") and Path(data).is_file()


FORM = Form(
    name="parquet", title="Parquet (Hugging Face)", reader="shards",
    example="DIR/*.parquet or DIR/data/train-00000-of-00001.parquet (Dataset.to_parquet), or one .parquet file",
    is_path=is_path, is_local=lambda p: bool(parquet_files(p)), is_s3=lambda look: bool(parquet_keys(look.keys)),
    read=lambda data, *, labels=True: open_tables(data),
    prepare=lambda data, *, num_threads, workers, labels=True: prepare_tables(data, num_threads=num_threads,
                                                                              workers=workers),
    download=download_tables, extract=extract)
