"""A packed dataset on S3: its packed.json, read and parsed (finding and reading a pack is
shards/source.py's; fetching its shards, synced or streamed, is shards/cache.py's).

`--data DIR` holding packed.json, or `--data s3://bucket/prefix` with packed.json there, is packed.
"""
from __future__ import annotations

from .errors import UserError
from .shards.format import PACKED_NAME


class PackedError(UserError):
    """The packed dataset is unreadable or incomplete; the message names the file."""


def _remote_packed_json(uri: str) -> bytes | None:
    from botocore.exceptions import BotoCoreError, ClientError

    from .sync import explain, make_client, parse_s3_uri

    bucket, prefix = parse_s3_uri(uri)
    key = f"{prefix}/{PACKED_NAME}" if prefix else PACKED_NAME
    try:
        return make_client(1).get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return None
        from .sync import SyncError

        raise SyncError(explain(e, bucket, key)) from None
    except BotoCoreError as e:
        from .sync import SyncError

        raise SyncError(explain(e, bucket, key)) from None


def _parse(raw: bytes, where: str) -> dict:
    from .shards.format import PackedFormatError, parse_packed

    try:
        return parse_packed(raw, where)
    except PackedFormatError as e:
        raise PackedError(str(e)) from None
