"""https:// (and http://) objects through the transfer engine (obstore's HTTPStore), against real local HTTP servers:
basic authentication sent and never leaked, a redirect to another host that drops it, a server without Range
support, the bytes exactly as stored, a missing object's message, and a stalled body named within the Bounds
passed (no constant patched)."""
from __future__ import annotations

import hashlib
import io
import re
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dali_pipe.s3 import Bounds
from dali_pipe.shards.fetchers import Fetcher, fetcher_for
from dali_pipe.shards.listing import list_peer
from dali_pipe.shards.shardset import ShardSourceError
from dali_pipe.shards.verdicts import Remote, ShardFetchError
from dali_pipe.stores import locate
from dali_pipe.transfer import PART

SECRET = "pw-s3cr3t"
QUICK = Bounds(connect_timeout=2.0, read_timeout=30.0, request_attempts=1, attempts=1, stall=2.0,
               attempt_deadline=20.0)  # a stalled body is named by the watchdog after 2 s, not the read timeout


class Site:
    """A threaded HTTP/1.1 server on 127.0.0.1 serving `files` {path: bytes}, recording (method, path, headers) of
    every request. `ranges`: answers Range requests with 206 (python's http.server does not); `auth`: the
    user:password every request must carry as basic authentication (401 without); `moved`: {path: URL} answered
    with a 302; `gzip_paths`: answered with `Content-Encoding: gzip` (the bytes as stored, not decoded); `head`:
    False answers HEAD with 405."""

    def __init__(self, files: dict[str, bytes], *, ranges: bool = False, auth: str | None = None,
                 moved: dict[str, str] | None = None, gzip_paths: tuple[str, ...] = (), head: bool = True):
        self.files, self.moved, self.requests = files, moved or {}, []
        site = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                if not head:
                    site.requests.append((self.command, self.path, {}))
                    return self.send(405, b"", True)
                self.answer(head=True)

            def do_GET(self):
                self.answer(head=False)

            def answer(self, head: bool):
                site.requests.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                path = self.path.split("?", 1)[0]
                if auth is not None:
                    import base64

                    if self.headers.get("Authorization") != "Basic " + base64.b64encode(auth.encode()).decode():
                        return self.send(401, b"who are you?\n", head)
                if path in site.moved:
                    self.send_response(302)
                    self.send_header("Location", site.moved[path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if path not in site.files:
                    return self.send(404, b"not here\n", head)
                body, status, extra = site.files[path], 200, {}
                asked = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
                if ranges and asked:
                    a, b = int(asked[1]), int(asked[2]) if asked[2] else len(body) - 1
                    extra["Content-Range"] = f"bytes {a}-{b}/{len(body)}"
                    body, status = body[a:b + 1], 206
                if path in gzip_paths:
                    extra["Content-Encoding"] = "gzip"
                self.send(status, body, head, extra)

            def send(self, status, body, head, extra=None):
                self.send_response(status)
                kind = "text/html" if body.startswith(b"<html>") else "application/x-tar"
                for k, v in {"Content-Length": str(len(body)), "Content-Type": kind,
                             "ETag": '"e1"', **(extra or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    try:
                        self.wfile.write(body)
                    except OSError:
                        pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1", userinfo: str = "") -> str:
        return f"http://{userinfo}{host}:{self.port}{path}"

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sites():
    made = []

    def make(*args, **kw):
        made.append(Site(*args, **kw))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def _shard(n: int = 3, size: int = 2000) -> bytes:
    """A small tar of n samples (a jpg-named and a cls member each)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(n):
            for ext, data in (("jpg", bytes([i]) * size), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"k{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _remote(url: str, body: bytes) -> Remote:
    return Remote(url, len(body), hashlib.sha256(body).hexdigest())


def _fetch(url: str, body: bytes, dest, bounds: Bounds = QUICK):
    fetcher = Fetcher(bounds=bounds)
    try:
        fetcher.fetch(_remote(url, body), dest)
        return fetcher.engine
    finally:
        fetcher.close()


def _everything_said(tmp_path, capsys, *texts) -> str:
    return " ".join([*texts, capsys.readouterr().err, *(str(p) for p in tmp_path.rglob("*"))])


def test_locate_requests_the_url_as_written(sites, tmp_path):
    """A plain name shares its folder's store; a presigned URL is requested exactly as written, query and all (no
    `//`, nothing re-encoded); a fragment is never sent."""
    body = _shard()
    site = sites({"/d/a.tar": body, "/d/b%20c.tar": body})
    plain, signed = site.url("/d/a.tar"), site.url("/d/a.tar?X-Amz-Signature=abc%2Fdef&x=1")
    assert locate(plain) == (site.url("/d"), "a.tar")
    assert locate(signed) == (signed, "")
    assert locate(site.url("/d/b%20c.tar#part")) == (site.url("/d/b%20c.tar"), "")
    assert locate("s3://bucket/k/a.tar") == ("bucket", "k/a.tar")
    for i, url in enumerate((plain, signed, site.url("/d/b%20c.tar#part"))):
        _fetch(url, body, tmp_path / f"{i}.tar")
        assert (tmp_path / f"{i}.tar").read_bytes() == body
    assert [p for _, p, _ in site.requests] == ["/d/a.tar", "/d/a.tar?X-Amz-Signature=abc%2Fdef&x=1", "/d/b%20c.tar"]


def test_basic_auth_is_sent_and_never_leaked(sites, tmp_path, capsys):
    """`user:pass@` in the URL is sent as basic authentication on every request (HEAD, the GETs of listing,
    indexing and fetching; the server answers 401 without it), never in the request line; it reaches no message
    and no file name, a failure's included."""
    body = _shard()
    site = sites({"/d/train-0.tar": body, "/d/classes.txt": b"zero\none\ntwo\n"}, auth=f"user:{SECRET}@x")
    data = site.url("/d/train-0.tar", userinfo=f"user:{SECRET.replace('-', '%2D')}%40x@")
    found = list_peer(data, tmp_path / "cache")
    assert [(it.size, it.reuse) for it in found.items] == [(len(body), True)] and found.classes_txt.startswith("zero")
    _fetch(data, body, tmp_path / "copy.tar")
    assert (tmp_path / "copy.tar").read_bytes() == body
    methods = [(m, p) for m, p, _ in site.requests]
    assert ("HEAD", "/d/train-0.tar") in methods and ("GET", "/d/classes.txt") in methods, methods
    assert ("GET", "/d/train-0.tar") in methods, methods
    assert all("authorization" in h for _, _, h in site.requests), site.requests
    assert not [r for r in site.requests if "s3cr3t" in r[1]]
    with pytest.raises(ShardFetchError, match=r"HTTP 404; the object is not there") as err:
        _fetch(data.replace("train-0", "train-9"), body, tmp_path / "nine.tar")
    shown = _everything_said(tmp_path, capsys, str(err.value))
    assert "s3cr3t" not in shown and "[redacted]" in str(err.value), shown
    bare = site.url("/d/train-0.tar")  # without the credentials: the server's 401, named with the fix
    with pytest.raises(ShardSourceError, match=r"HTTP 401; the server asks for credentials: put user:pass@"):
        list_peer(bare, tmp_path / "cache")


def test_a_redirect_to_another_host_drops_the_credentials(sites, tmp_path):
    """A server that redirects (a CDN, a presigned storage URL) to another host: the object is fetched from
    there, and the basic authentication meant for the first host is not sent to the second."""
    body = _shard()
    there = sites({"/blob/7": body})
    here = sites({}, auth=f"user:{SECRET}", moved={"/d/a.tar": there.url("/blob/7", host="localhost")})
    url = here.url("/d/a.tar", userinfo=f"user:{SECRET}@")
    _fetch(url, body, tmp_path / "a.tar")
    assert (tmp_path / "a.tar").read_bytes() == body
    assert here.requests and all("authorization" in h for _, _, h in here.requests)
    assert there.requests and not [h for _, _, h in there.requests if "authorization" in h], there.requests


def test_a_server_without_range_support_sends_whole_objects(sites, tmp_path):
    """A shard larger than a ranged part, at a server that answers a Range request with the whole object (as
    python's http.server does): one ranged GET finds it out, then each object comes in one streamed GET."""
    body = bytes(range(256)) * ((PART + (1 << 20)) // 256)
    site = sites({"/big.tar": body, "/big2.tar": body[::-1]})
    fetcher = fetcher_for([_remote(site.url("/big.tar"), body)], QUICK)
    try:
        for name, data in (("big", body), ("big2", body[::-1])):
            fetcher.fetch(_remote(site.url(f"/{name}.tar"), data), tmp_path / f"{name}.tar")
            assert (tmp_path / f"{name}.tar").read_bytes() == data
        assert fetcher.engine.ranges is False
    finally:
        fetcher.close()
    ranged = [h["range"] for _, _, h in site.requests if "range" in h]
    assert ranged == [f"bytes=0-{PART - 1}"], ranged  # asked once; big2.tar came whole at once

    with_ranges = sites({"/big.tar": body}, ranges=True)  # the control: a server that takes ranges gets parts
    engine = _fetch(with_ranges.url("/big.tar"), body, tmp_path / "ranged.tar")
    assert engine.ranges is True and (tmp_path / "ranged.tar").read_bytes() == body
    assert len([h for _, _, h in with_ranges.requests if "range" in h]) == 2


def test_the_bytes_come_as_stored(sites, tmp_path):
    """A server that labels an object gzip-encoded: the bytes land exactly as stored (not decoded), and the
    requests ask for them so (`Accept-Encoding: identity`)."""
    import gzip

    body = gzip.compress(_shard())
    site = sites({"/d/a.tar.gz": body}, gzip_paths=("/d/a.tar.gz",))
    _fetch(site.url("/d/a.tar.gz"), body, tmp_path / "a.tar.gz")
    assert (tmp_path / "a.tar.gz").read_bytes() == body
    assert [h.get("accept-encoding") for _, _, h in site.requests] == ["identity"]


def test_a_missing_object_and_a_page_for_classes_txt(sites, tmp_path, capsys):
    """A missing shard is named with its status and the fix (its presigned signature redacted), at once: no
    second attempt asks again; an HTML page answered for classes.txt (servers that answer every path with their
    index page) is no classes.txt."""
    body = _shard()
    site = sites({"/d/a.tar": body, "/d/classes.txt": b"<html>index</html>"})  # a page, as single-page apps answer
    signed = site.url("/d/gone.tar?X-Amz-Signature=0123secret4567")
    twice = Bounds(request_attempts=1, attempts=2, stall=5.0)
    with pytest.raises(ShardFetchError, match=r"gone.tar\?X-Amz-Signature=\[redacted\]: HTTP 404; the object is not "
                                              r"there \(or not readable without credentials\); check the URL") as err:
        _fetch(signed, body, tmp_path / "gone.tar", twice)
    assert len([p for _, p, _ in site.requests if "gone" in p]) == 1
    assert "secret" not in _everything_said(tmp_path, capsys, str(err.value))
    with pytest.raises(ShardSourceError, match=r"1 of its 2 shard\(s\) cannot be read, e.g. .*/d/gone.tar: HTTP 404; "
                                               r"the object is not there"):
        list_peer(site.url("/d/{a,gone}.tar"), tmp_path / "cache")

    found = list_peer(site.url("/d/a.tar"), tmp_path / "cache")
    assert found.classes_txt is None and [it.size for it in found.items] == [len(body)]
    site.files["/d/classes.txt"] = b"a\nb\n"
    assert list_peer(site.url("/d/a.tar"), tmp_path / "cache").classes_txt == "a\nb\n"
    del site.files["/d/classes.txt"]
    assert list_peer(site.url("/d/a.tar"), tmp_path / "cache").classes_txt is None  # 404: none


def test_a_stalled_body_is_named_within_the_bounds_passed(sites, tmp_path, capsys):
    """A server that sends half a shard and then nothing: the attempt is given up after the `stall` seconds of the
    Bounds passed (2 s here, 30 by default), named with the URL (redacted) and why; nothing is left behind."""
    from faultproxy import FaultProxy

    body = _shard(n=40, size=60_000)  # 2.4 MB: more than one chunk of the engine arrives before the silence
    site = sites({"/d/a.tar": body})
    proxy = FaultProxy(site.url("")).start()
    try:
        proxy.arm("stall", "/d/a.tar", stall_s=30)
        start = time.monotonic()
        with pytest.raises(ShardFetchError, match=r"a.tar\?token=\[redacted\] could not be fetched in 1 attempts "
                                                  r"\(no byte for 2 s\); check the server"):
            _fetch(f"{proxy.url}/d/a.tar?token=abc123", body, tmp_path / "copy" / "a.tar")
        assert time.monotonic() - start < 8
        assert proxy.applied("stall") == 1
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]
        assert "abc123" not in capsys.readouterr().err
    finally:
        proxy.stop()


def test_a_server_that_refuses_head_is_indexed_from_its_get(sites, tmp_path):
    """A server that answers HEAD with 405: its shards are listed without a size or validator (so indexed again
    on each run), and indexed from the GET, which carries the size."""
    from dali_pipe.shards import source

    body = _shard()
    site = sites({"/d/a.tar": body}, head=False)
    found = list_peer(site.url("/d/a.tar"), tmp_path / "cache")
    assert [(it.size, it.reuse) for it in found.items] == [(None, False)]
    indexed, stored = source._read_source(found.items[0], source.Collector("off", 10**8, 1))
    assert stored == len(body) and [e.key for e in indexed.entries] == ["k000", "k001", "k002"]
    assert [m for m, _, _ in site.requests] == ["HEAD", "GET", "GET"]  # the shard's HEAD, classes.txt, the shard


def test_a_tar_the_server_gzips_on_the_way_is_named_with_the_fix(sites, tmp_path):
    """A server that sends a .tar gzip-compressed (Content-Encoding: gzip, though asked for identity): the shard
    was 'not a readable tar (ReadError: invalid header); check the file'; now the gzip bytes are named, with the
    server setting to change, and the same bytes in a local .tar are told to be named .tar.gz."""
    import gzip

    from dali_pipe.config import DataSettings
    from dali_pipe.inputs import read

    body = gzip.compress(_shard())
    site = sites({"/d/a.tar": body}, gzip_paths=("/d/a.tar",))
    with pytest.raises(ShardSourceError) as e:
        read(DataSettings(data=site.url("/d/a.tar"), cache_dir=str(tmp_path / "cache")))
    said = str(e.value)
    assert "a.tar: not a tar but gzip-compressed bytes (they start with gzip's 1f 8b)" in said
    assert "Content-Encoding: gzip" in said and "name gzipped ones .tar.gz" in said and "invalid header" not in said
    (tmp_path / "local").mkdir()
    (tmp_path / "local/a.tar").write_bytes(body)
    with pytest.raises(ShardSourceError, match=r"a.tar: not a tar but gzip-compressed bytes .*; name it .tar.gz"):
        read(DataSettings(data=str(tmp_path / "local"), cache_dir=str(tmp_path / "cache")))
