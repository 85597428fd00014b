"""Shards: WebDataset tars as a data source, one concern per module.

    format.py   the bytes on disk: keys, tar members, `.cls` labels, `json` metadata, DALI's index files (v1.2),
                packed.json's format
    source.py   where shards come from (a pack, or shards written by others: a folder, a brace pattern, an
                s3:// prefix), their classes and split, and the check of every member before training
"""
