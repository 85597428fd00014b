"""Shards: WebDataset tars as a data source, one concern per module.

    format.py   the bytes on disk: tar members, `.cls` labels, DALI's index files (v1.2), checksums
"""
