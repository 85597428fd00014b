"""The transfer engine against moto's S3 server through a fault proxy: large objects in ranged GETs checked
against the listed ETag, faults on a part retried, a replaced object refused, a cancelled download leaving
nothing behind."""
from __future__ import annotations

import os
import time

import pytest
from faultproxy import FaultProxy

from dali_pipe import transfer
from dali_pipe.sync import make_client
from dali_pipe.transfer import Engine, TransferError, temp_path


@pytest.fixture
def big(s3, monkeypatch):
    """A 300 kB object of random bytes, served through a fault proxy; parts of 64 kB (so five ranged GETs)."""
    _, url = s3
    client = make_client(2)
    client.create_bucket(Bucket="data")
    body = os.urandom(300_000)
    etag = client.put_object(Bucket="data", Key="p/big.bin", Body=body)["ETag"].strip('"')
    proxy = FaultProxy(url).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setattr(transfer, "PART", 64 << 10)
    engine = Engine(concurrency=4, connect_timeout=1, read_timeout=1, attempts=3)
    yield engine, proxy, body, etag
    engine.close()
    proxy.stop()


def test_a_large_object_lands_whole_from_ranged_gets_through_faults(big, tmp_path):
    """Five ranged GETs; a 503 and a cut part are retried (the cut one resumed from where it broke); the
    digest asked for is that of the whole object, though its parts landed in any order."""
    import hashlib

    engine, proxy, body, etag = big
    proxy.arm("503", "big.bin")
    proxy.arm("cut", "big.bin")
    tmp = tmp_path / ".big.part"
    seen, digest = [], hashlib.sha256()
    n, _ = engine.run(engine.download("data", "p/big.bin", tmp, len(body), etag=etag, on_bytes=seen.append,
                                      digest=digest))
    assert n == len(body) and tmp.read_bytes() == body and sum(seen) >= len(body)
    assert digest.digest() == hashlib.sha256(body).digest() and engine.ranges is True
    gets = [{k.lower(): v for k, v in r[3].items()} for r in proxy.requests if r[0] == "GET"]
    parts = {f"bytes={s}-{min(s + (64 << 10), len(body)) - 1}" for s in range(0, len(body), 64 << 10)}
    ranges = {h["range"] for h in gets}
    assert parts <= ranges and len(ranges - parts) <= 1  # the cut part may be resumed where it broke
    assert proxy.applied("503") == 1 and proxy.applied("cut") == 1


def test_an_object_replaced_after_the_listing_is_refused_and_leaves_nothing(big, tmp_path):
    """Each part's ETag must be the one the listing gave: another object under the key fails the download
    instead of mixing two objects' bytes; the temporary file is removed."""
    engine, _, body, _ = big
    tmp = tmp_path / ".big.part"
    with pytest.raises(TransferError) as e:
        engine.run(engine.download("data", "p/big.bin", tmp, len(body), etag="0" * 32))
    assert e.value.code == "PreconditionFailed" and not tmp.exists()


def test_a_cancelled_download_stops_its_requests_and_removes_its_file(big, tmp_path):
    """Every GET hangs: cancelling the download (as SIGTERM or a deadline does) ends it at once, and its
    temporary file is gone."""
    engine, proxy, body, etag = big
    proxy.arm("hang", "big.bin", times=100)
    tmp = temp_path(tmp_path / "big.bin")
    future = engine.submit(engine.download("data", "p/big.bin", tmp, len(body), etag=etag))
    deadline = time.monotonic() + 10
    while not tmp.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    future.cancel()
    deadline = time.monotonic() + 5
    while tmp.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tmp.exists() and tmp.name.startswith(".big.bin.part-") and tmp.name.endswith(f"-{os.getpid()}")


@pytest.mark.parametrize("together", [False, True], ids=["one after another", "at once"])
def test_a_server_that_answers_ranges_with_the_whole_object_gets_whole_gets(tmp_path, monkeypatch, together):
    """rclone's `serve s3` answers a ranged GET with 200 (and a Content-Range) where S3 answers 206; the
    object HTTP layer refuses that, so the first large object is fetched in one streamed GET, and the
    objects after it go as whole GETs at once (no ranged attempt each): every byte lands, checked. Large
    objects started together wait for the one that asks: one ranged request in all. The digest of each is
    that of its streamed bytes."""
    import asyncio
    import hashlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from bench_sync import KEY, SECRET, rclone_server

    bucket = tmp_path / "served" / "data"
    bucket.mkdir(parents=True)
    bodies = {f"s/{i}.bin": os.urandom(200_000 + i) for i in range(3)}
    for key, body in bodies.items():
        (bucket / key).parent.mkdir(exist_ok=True)
        (bucket / key).write_bytes(body)
    server, url = rclone_server(tmp_path / "served")
    proxy = FaultProxy(url).start()
    for k, v in {"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(transfer, "PART", 64 << 10)
    engine = Engine(concurrency=4, connect_timeout=2, read_timeout=5, attempts=3)
    tmps = {key: tmp_path / f".{key.replace('/', '_')}.part" for key in bodies}
    digests = {key: hashlib.sha256() for key in bodies}

    def one(key):
        return engine.download("data", key, tmps[key], len(bodies[key]), digest=digests[key])

    async def all_at_once():
        return await asyncio.gather(*(one(key) for key in bodies))

    try:
        if together:
            engine.run(all_at_once())
        else:
            for key in bodies:  # one after the other: the first one finds out
                engine.run(one(key))
        ranged = [r[1].split("?")[0] for r in proxy.requests
                  if r[0] == "GET" and "range" in {k.lower() for k in r[3]}]
    finally:
        engine.close()
        proxy.stop()
        server.kill()
    for key, body in bodies.items():
        assert tmps[key].read_bytes() == body and digests[key].digest() == hashlib.sha256(body).digest()
    assert engine.ranges is False and len(ranged) == 1 and ranged[0] in {f"/data/{k}" for k in bodies}, ranged
