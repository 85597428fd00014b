"""Shards: WebDataset tars as a data source, one concern per module.

    format.py   the bytes on disk: keys, tar members (which one is the image and the label), `.cls` labels,
                `json` metadata, gzipped tars, DALI's index files (v1.2), packed.json's format
    source.py   where shards come from (a pack, or shards written by others: a folder or its train/ and val/
                subfolders, one file, a brace pattern, an s3:// prefix, https:// URLs; .tar, .tar.gz, .tgz),
                their classes and split, and the check of every member before training
    plan.py     the epoch plan: which samples each rank reads, in which order
    reader.py   the external_source callable that reads them
    cache.py    shard bytes from S3 or HTTP(S): synced, or streamed through a bounded cache; every one checked
"""
