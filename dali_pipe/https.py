"""Objects over HTTP(S): shards named by `https://` (or `http://`) URLs, read with the bounds S3 reads have.

- `head(url)`: an object's size and validator (its ETag, else Last-Modified): what a cached index of it
  is valid for;
- `open_stream(url)`: a streaming GET, the body read as it arrives and never held whole, the bytes
  exactly as stored (`Accept-Encoding: identity`, nothing decoded), `start` bytes on with a Range request;
- `read_small(url)`: a small object (classes.txt beside the shards), or None where the server has none;
- `download(url, dest, ...)`: a whole object to a file, continued with a Range request where a
  connection is cut and the server takes ranges, bounded by a deadline and a stop event;
- `HttpError` (a UserError): names the URL, redacted (a presigned URL's signature, a token parameter,
  `user:pass@` never reach a message), what the server said, and what to do.

Bounds, as for S3 (dali_pipe/sync.py, dali_pipe/shards/cache.py): connect timeout CONNECT_TIMEOUT and
read timeout READ_TIMEOUT per read, so a stalled body fails within it; TRIES tries per request with
backoff for refused connections, timeouts, 429 and 5xx, as botocore's standard mode (a Retry-After is
not waited for: it can ask for an hour); a download given up after STALL seconds without a byte, so a
server that accepts connections and never answers is named within about half a minute per attempt.
`user:pass@` in a URL is sent as HTTP basic authentication, never in the request line.

The client is urllib3: the HTTP library botocore itself runs on (so it is always installed), with
thread-safe connection pools, per-request timeouts and a Retry policy with backoff. `requests` would add
a session layer over the same pools and nothing needed here. Proxies from the environment
(HTTPS_PROXY) are not read.
"""
from __future__ import annotations

import hashlib
import threading
import time
from urllib.parse import unquote, urlsplit

from .errors import UserError
from .redact import redact

SCHEMES = ("http://", "https://")
CONNECT_TIMEOUT, READ_TIMEOUT = 5.0, 10.0
TRIES = 3  # per request, for connection errors, timeouts, 429 and 5xx (botocore's standard mode: 3)
STALL = 30.0  # a download without a byte for this long is given up (a request retried inside it included)
RETRY_STATUS = (429, 500, 502, 503, 504)
MISSING = (403, 404, 410)  # "no such object" as servers say it (S3's public endpoints answer 403)
CHUNK = 1 << 20
_POOL = None
_POOL_LOCK = threading.Lock()


class HttpError(UserError):
    """An HTTP(S) object that cannot be read; the message names the URL (redacted) and what to do."""

    def __init__(self, message: str, status: int | None = None, reason: str | None = None):
        super().__init__(message)
        self.status, self.reason = status, reason or message  # reason: what went wrong, without the URL and fix


class Stopped(HttpError):
    """A transfer given up on purpose: the stop event was set, or its deadline passed."""


def is_http(path: str) -> bool:
    return path.startswith(SCHEMES)


def shown(url: str) -> str:
    """The URL as messages and files show it: secrets redacted."""
    return redact(url)


def base_name(url: str) -> str:
    """The last path segment of the URL, without its query or fragment (which may carry a signature)."""
    return urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1]


def cache_name(url: str) -> str:
    """A file name for a local copy of `url`: a digest of the whole URL and its base name (no secret of
    the query string is written)."""
    digest = hashlib.sha256(url.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{digest}-{base_name(url) or 'object'}"


def _pool():
    global _POOL
    import urllib3

    with _POOL_LOCK:
        if _POOL is None:
            retry = urllib3.Retry(total=TRIES - 1, connect=TRIES - 1, read=TRIES - 1, status=TRIES - 1,
                                  other=TRIES - 1, backoff_factor=0.5, backoff_max=8.0, status_forcelist=RETRY_STATUS,
                                  allowed_methods=frozenset({"HEAD", "GET"}), respect_retry_after_header=False,
                                  raise_on_status=False, redirect=5)
            _POOL = urllib3.PoolManager(num_pools=16, maxsize=16, retries=retry,
                                        timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT, read=READ_TIMEOUT))
        return _POOL


def _request(method: str, url: str, headers: dict | None = None):
    """One request (retried within the bounds above), the body left unread; failures as HttpError."""
    import urllib3

    headers = {"Accept-Encoding": "identity", **(headers or {})}
    u = urllib3.util.parse_url(url)
    if u.auth:  # user:pass@host: basic authentication, as curl and requests send it
        headers.update(urllib3.util.make_headers(basic_auth=unquote(u.auth)))
        url = u._replace(auth=None).url
    try:
        return _pool().request(method, url, headers=headers, preload_content=False, decode_content=False)
    except urllib3.exceptions.HTTPError as e:
        reason = _reason(e)
        raise HttpError(f"{shown(url)}: {reason}; check the URL, the server and the network", reason=reason) from None


def _reason(e: Exception) -> str:
    import urllib3

    cause = getattr(e, "reason", None) or e
    if isinstance(cause, urllib3.exceptions.NewConnectionError) or "refused" in str(cause).lower():
        return f"no connection to the server ({TRIES} tries: connection refused or unreachable)"
    if isinstance(cause, urllib3.exceptions.ConnectTimeoutError):
        return f"no connection within {CONNECT_TIMEOUT:.0f} s ({TRIES} tries)"
    if isinstance(cause, (urllib3.exceptions.ReadTimeoutError, TimeoutError)):
        return f"no answer within {READ_TIMEOUT:.0f} s ({TRIES} tries)"
    if isinstance(cause, urllib3.exceptions.SSLError):
        return f"TLS failed ({str(cause)[:120]})"
    return redact(f"{type(cause).__name__}: {str(cause)[:160]}")


def _status_error(url: str, status: int, what: str = "") -> HttpError:
    if status in MISSING:
        fix = "the object is not there (or not readable without credentials); check the URL"
    elif status in RETRY_STATUS:
        fix = f"the server kept failing ({TRIES} tries); rerun later"
    else:
        fix = "check the URL and the server"
    return HttpError(f"{shown(url)}: HTTP {status}{what}; {fix}", status)


def head(url: str) -> tuple[int | None, str | None]:
    """(size, validator) of the object at `url`: Content-Length, and ETag or else Last-Modified (None where
    the server gives none; a server that refuses HEAD gives neither)."""
    r = _request("HEAD", url)
    try:
        if r.status in (405, 501):
            return None, None
        if r.status >= 400:
            raise _status_error(url, r.status)
        length = r.headers.get("Content-Length")
        validator = r.headers.get("ETag") or r.headers.get("Last-Modified")
        return (int(length) if length and length.isdigit() else None), validator
    finally:
        r.release_conn()


def read_small(url: str, limit: int = 16 << 20) -> bytes | None:
    """The bytes of a small object, or None when the server has none (403, 404, 410; or an HTML page, which
    servers that answer every path with their index page send for a file they do not have)."""
    r = _request("GET", url)
    try:
        if r.status in MISSING or "text/html" in (r.headers.get("Content-Type") or "").lower():
            return None
        if r.status >= 400:
            raise _status_error(url, r.status)
        return Body(r, url).read_all(limit)
    finally:
        r.release_conn()


class Body:
    """A response body as a read-only stream (what tarfile reads), its errors as HttpError; `deadline`
    (monotonic seconds) and `stop` (an Event) end it between reads."""

    def __init__(self, response, url: str, deadline: float | None = None, stop: threading.Event | None = None):
        self.response, self.url, self.deadline, self.stop = response, url, deadline, stop

    def read(self, n: int = -1) -> bytes:
        import urllib3

        if self.stop is not None and self.stop.is_set():
            raise Stopped(f"{shown(self.url)}: the transfer was stopped", reason="stopped")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise Stopped(f"{shown(self.url)}: no complete copy within its deadline",
                          reason="no complete copy within its deadline")
        try:
            return self.response.read(None if n is None or n < 0 else n, decode_content=False)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            reason = f"the transfer broke off ({_reason(e)})"
            raise HttpError(f"{shown(self.url)}: {reason}", reason=reason) from None

    def read_all(self, limit: int) -> bytes:
        out = bytearray()
        while chunk := self.read(CHUNK):
            out += chunk
            if len(out) > limit:
                raise HttpError(f"{shown(self.url)}: larger than {limit} bytes; is this the right URL?")
        return bytes(out)

    def close(self) -> None:
        self.response.release_conn()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_stream(url: str, *, start: int = 0, validator: str | None = None, deadline: float | None = None,
                stop: threading.Event | None = None) -> tuple[Body, int, bool]:
    """(the body, its length or -1, whether it starts at `start`): a streaming GET, from byte `start` with a
    Range request (If-Range: `validator`); a server that ignores the range sends the whole object again."""
    headers = {}
    if start:
        headers["Range"] = f"bytes={start}-"
        if validator:
            headers["If-Range"] = validator
    r = _request("GET", url, headers)
    if r.status >= 400:
        r.release_conn()
        raise _status_error(url, r.status)
    length = r.headers.get("Content-Length")
    ranged = start > 0 and r.status == 206
    return Body(r, url, deadline, stop), int(length) if length and length.isdigit() else -1, ranged or not start


def download(url: str, f, *, size: int | None, deadline: float, stop: threading.Event | None = None,
             on_bytes=None, attempts: int = TRIES) -> int:
    """Write the object at `url` into the open binary file `f`; a connection cut mid-body is continued
    from where it stopped with a Range request (or read again from the start where the server takes no
    ranges), `attempts` times at most, and not after STALL seconds without a byte. Returns the bytes
    written."""
    got, failure, validator = 0, None, None
    last = time.monotonic()  # when the last byte arrived
    for _ in range(attempts):
        if failure is not None and time.monotonic() - last > STALL:
            reason = f"no byte for {STALL:.0f} s: {failure.reason}"
            raise Stopped(f"{shown(url)}: {reason}", reason=reason)
        try:
            body, length, continued = open_stream(url, start=got, validator=validator, deadline=deadline, stop=stop)
        except Stopped:
            raise
        except HttpError as e:
            if e.status is not None:
                raise
            failure = e
            continue
        with body:
            validator = validator or body.response.headers.get("ETag") or body.response.headers.get("Last-Modified")
            if not continued:
                f.seek(0)
                f.truncate()
                got = 0
            try:
                while chunk := body.read(CHUNK):
                    f.write(chunk)
                    got += len(chunk)
                    last = time.monotonic()
                    if on_bytes is not None:
                        on_bytes(len(chunk))
            except Stopped:
                raise
            except HttpError as e:
                failure = e
                continue
        if size is None or got >= size:
            return got
        reason = f"the body ended after {got} of {size} bytes"
        failure = HttpError(f"{shown(url)}: {reason}", reason=reason)
    raise failure or HttpError(f"{shown(url)}: could not be read")
