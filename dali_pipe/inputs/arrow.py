"""A Hugging Face dataset as `Dataset.save_to_disk` writes it: state.json + data-*.arrow, or dataset_dict.json and
one such folder per split; each record batch is read as a shard."""
from __future__ import annotations

from ..forms import is_save_to_disk
from ..shards.tables import download_tables, extract, open_tables, prepare_tables
from .form import Form

FORM = Form(
    name="arrow", title="save_to_disk (Hugging Face)", reader="shards",
    example="DIR/state.json + data-*.arrow, or DIR/dataset_dict.json (Dataset.save_to_disk)",
    is_local=is_save_to_disk,
    is_s3=lambda look: "dataset_dict.json" in look.keys or {"state.json", "dataset_info.json"} <= set(look.keys),
    read=lambda data, *, labels=True: open_tables(data),
    prepare=lambda data, *, num_threads, workers, labels=True: prepare_tables(data, num_threads=num_threads,
                                                                              workers=workers),
    download=download_tables, extract=extract)
