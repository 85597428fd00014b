"""Which obstore store an object URL names, and how it is made (the scheme registry of the transfer engine):
`locate` splits s3://BUCKET/KEY into (BUCKET, KEY) and an http(s):// URL into (a store URL, a path); the S3
store is made by the engine (it holds the credential chain), the HTTP store here; both take the same client
options and retries, one `s3.Bounds` handed down. What obstore's HTTPStore does and does not do, measured, is
in dali_pipe/https.py. `Chunks`: a store's streamed body as a file (what the engine's reader hands out).
"""
from __future__ import annotations

import io
import re
import time
from datetime import timedelta
from urllib.parse import urlsplit, urlunsplit

from .https import basic_auth, is_http
from .s3 import TransferError, classify, parse_s3_uri

RETRY_WINDOW = 60.0  # seconds after a request's first try during which obstore may retry it
HTTP_STORES = 256  # HTTP stores an engine keeps (one per folder of plain names, else per URL), the oldest dropped
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a last URL segment obstore's path sends as written


def locate(url: str) -> tuple[str, str]:
    """(the name of its store for Engine.store, its path there) of an object URL: s3://BUCKET/KEY is
    (BUCKET, KEY); an http(s):// URL whose last segment is a plain name and that has no query is (its
    folder's URL, that name), so a folder's objects share a store (and its connections); any other (a
    presigned URL) is (the whole URL, ""), which obstore requests exactly as written, query and all."""
    if not is_http(url):
        return parse_s3_uri(url)
    u = urlsplit(url)._replace(fragment="")
    folder, _, name = u.path.rpartition("/")
    if not u.query and _PLAIN_NAME.fullmatch(name) and name not in (".", ".."):
        return urlunsplit(u._replace(path=folder)), name
    return urlunsplit(u), ""


def client_options(connect_timeout: float, read_timeout: float, request_limit: float) -> dict:
    """obstore's client options of every store: the bounds of one request."""
    return {"allow_http": True, "connect_timeout": timedelta(seconds=connect_timeout),
            "read_timeout": timedelta(seconds=read_timeout), "timeout": timedelta(seconds=request_limit)}


def retry_config(attempts: int) -> dict:
    """obstore's retries of every store: `attempts` tries of a request, with backoff, within RETRY_WINDOW."""
    return {"max_retries": attempts - 1, "retry_timeout": timedelta(seconds=RETRY_WINDOW),
            "backoff": {"init_backoff": timedelta(milliseconds=200), "max_backoff": timedelta(seconds=10), "base": 2}}


def http_store(url: str, options: dict, retry: dict):
    """obstore's HTTPStore of a store URL: `user:pass@` sent as basic authentication (reqwest drops it on a
    redirect to another host), the bytes asked for as stored (`Accept-Encoding: identity`)."""
    from obstore.store import HTTPStore  # lazy: obstore loads its Rust extension; importing this module must not

    url, headers = basic_auth(url)
    return HTTPStore.from_url(url, client_options={**options, "default_headers": {
        "Accept-Encoding": "identity", **headers}}, retry_config=retry)


class Chunks(io.RawIOBase):
    """obstore's stream of an object's body (chunks of bytes) as a raw file (`readinto`), so io.BufferedReader
    serves `read(n)`; obstore's errors while streaming come out as TransferError, and so does a chunk asked for
    past `deadline` (time.monotonic() seconds)."""

    def __init__(self, chunks, deadline: float | None = None):
        self._chunks, self._left, self._deadline = chunks, memoryview(b""), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._left:
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise TransferError("deadline", "no complete copy within its deadline")
            try:
                self._left = memoryview(bytes(next(self._chunks)))
            except StopIteration:
                return 0
            except Exception as e:
                raise classify(e) from None
        n = min(len(b), len(self._left))
        b[:n] = self._left[:n]
        self._left = self._left[n:]
        return n
