"""Objects named by `https://` (or `http://`) URLs: the URL helpers and the messages of their failures. The
requests themselves go through the transfer engine (dali_pipe/transfer.py), the one client S3 objects go
through: obstore's HTTPStore, with the engine's bounds (`s3.Bounds`: connect and read timeouts, tries per
request), its ranged parallel GETs, its stall watchdog and deadlines (shards/fetchers.py) and its streamed
body for indexing (shards/source.py); HEAD and the small GET of classes.txt too (shards/listing.py).

- `is_http`, `shown` (the URL as messages and files show it: a presigned URL's signature, a token
  parameter, `user:pass@` redacted), `base_name`, `cache_name` (a file name for a local copy);
- `basic_auth(url)`: `user:pass@` taken out of the URL, as the headers of HTTP basic authentication
  (what curl and requests send); the engine's store sends them on every request and reqwest drops them
  on a redirect to another host or port; they never reach a request line, a message or a file;
- `explain_http(err, url, bounds)`: a failure (the engine's TransferError) in one line naming the URL and what to do.

What obstore (0.12.1: object_store 0.14.2 on reqwest) does here, measured against http.server and the fault
proxy of tests/faultproxy.py:
- The whole object URL is the store's URL and the path is "", so the request is exactly the URL, query and all
  (a presigned one); a URL without a query whose last segment is a plain name shares one store per folder
  (`stores.locate`), so its connections are reused (a store costs about 3 ms to make).
- No Accept-Encoding is sent and a Content-Encoding is not decoded; the engine sends `Accept-Encoding:
  identity` anyway (without the header a server may compress), so the bytes are exactly as stored.
- A server without Range support answers a ranged GET with 200, which obstore refuses ("Range request not
  supported"): the engine learns it from one request and fetches whole objects from it, in one streamed GET.
- A body cut or silent (past the read timeout) mid-way is continued by obstore, within its tries, with a Range
  request from the byte where it stopped; from a server that ignores Range it cannot be, and the attempt fails:
  the fetcher's whole attempts (Bounds.attempts) read it again, the one retry layer above the client's.
- Every answer to a GET or HEAD must carry a Content-Length ("Content-Length Header missing from response"):
  a server that streams a shard chunked, without a length, cannot be read through obstore and is named with
  the fix (a HEAD without one is taken as no size, since the GET may carry it). Shards are static files,
  which servers send with their length; keeping a second client (urllib3) for that case alone was not
  worth its weight.
- Proxies from the environment (HTTPS_PROXY, HTTP_PROXY, NO_PROXY) are used by reqwest, as for S3.
"""
from __future__ import annotations

import base64
import hashlib
import re
from urllib.parse import unquote, urlsplit, urlunsplit

from .redact import redact
from .s3 import Bounds

SCHEMES = ("http://", "https://")
MISSING = (403, 404, 410)  # "no such object" as servers say it (S3's public endpoints answer 403)
RETRY_STATUS = (429, 500, 502, 503, 504)  # answers the engine retries (then they are the server's failure)
_STATUS = re.compile(r"status code: (\d{3})")


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


def basic_auth(url: str) -> tuple[str, dict[str, str]]:
    """(the URL without `user:pass@`, the headers that send them as HTTP basic authentication: {} without)."""
    u = urlsplit(url)
    if "@" not in u.netloc:
        return url, {}
    auth, host = u.netloc.rsplit("@", 1)
    user, _, password = auth.partition(":")
    token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
    return urlunsplit(u._replace(netloc=host)), {"Authorization": f"Basic {token}"}


def status_of(err) -> int | None:
    """The HTTP status a failed request got (obstore names a 405 'not found': the status in its text decides)."""
    found = _STATUS.search(getattr(err, "detail", "") or str(err))
    return int(found.group(1)) if found else getattr(err, "status", None)


def explain_http(err, url: str, bounds: Bounds) -> str:
    """One line for a failed request of the object at `url` (a TransferError of the engine, whose requests
    had `bounds`): the URL (redacted), what the server or the network did, and what to do."""
    status, code, tries = status_of(err), getattr(err, "code", ""), bounds.request_attempts
    if status in MISSING:
        what = f"HTTP {status}; the object is not there (or not readable without credentials); check the URL"
    elif status == 401:
        what = ("HTTP 401; the server asks for credentials: put user:pass@ in the URL (sent as basic "
                "authentication), or use a presigned URL")
    elif status in RETRY_STATUS:
        what = f"HTTP {status}; the server kept failing ({tries} tries); rerun later"
    elif status is not None:
        what = f"HTTP {status}; check the URL and the server"
    elif "Content-Length Header missing" in str(err):
        what = ("the server sends it without a Content-Length (chunked), which the transfer client cannot read; "
                "serve the shards as static files (any web server sends their length), or copy them to S3 or a "
                "local folder")
    elif code == "timeout":
        what = (f"no answer within {bounds.read_timeout:g} s ({tries} tries); check the URL, the server and the "
                "network")
    elif code == "connect":
        what = f"no connection to the server ({tries} tries); check the URL, the server and the network"
    elif "body error" in str(err):
        what = "the transfer broke off; check the server and the network"
    else:
        what = f"{redact(str(getattr(err, 'detail', err)))[:200]}; check the URL, the server and the network"
    return f"{shown(url)}: {what}"
