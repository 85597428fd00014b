"""The transfer engine against moto's S3 server through a fault proxy: large objects in ranged GETs checked
against the listed ETag, faults on a part retried, a replaced object refused, a cancelled download leaving
nothing behind."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultproxy import FaultProxy

from dali_pipe import limits, transfer
from dali_pipe.landing import temp_path
from dali_pipe.s3 import TransferError, make_client
from dali_pipe.transfer import Engine

TOOLS = Path(__file__).resolve().parents[1] / "tools"


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


def test_large_objects_fetched_at_once_from_a_server_that_answers_ranges(s3, tmp_path, monkeypatch):
    """Three large objects at once against moto (206 to a ranged GET, as S3): the first part of the first asks
    alone, the others wait for its answer, then all go in parts and land whole (the waiting ones once spun on
    the loop forever, so the asker never ran)."""
    import asyncio

    client = make_client(2)
    client.create_bucket(Bucket="data")
    bodies = {f"p/big{i}.bin": os.urandom(300_000) for i in range(3)}
    for key, body in bodies.items():
        client.put_object(Bucket="data", Key=key, Body=body)
    monkeypatch.setattr(transfer, "PART", 64 << 10)
    engine = Engine(concurrency=4, connect_timeout=1, read_timeout=1, attempts=3)
    tmps = {key: tmp_path / f".{i}.part" for i, key in enumerate(bodies)}

    async def all_at_once():
        return await asyncio.gather(*(engine.download("data", k, tmps[k], len(b)) for k, b in bodies.items()))

    try:
        got = engine.run(all_at_once(), timeout=20)
    finally:
        engine.close()
    assert [n for n, _ in got] == [300_000] * 3 and engine.ranges is True
    assert all(tmps[k].read_bytes() == b for k, b in bodies.items())


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
    that of its streamed bytes. The empty file the refused part left is not truncated (ext4 would write
    the object back at its close)."""
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
    truncated, ftruncate = [], os.ftruncate
    monkeypatch.setattr(os, "ftruncate", lambda fd, n: (truncated.append((fd, n)), ftruncate(fd, n))[1])
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
    assert not truncated


@pytest.mark.parametrize("budget", [300_000, 1 << 30], ids=["three objects", "unbounded"])
def test_the_bytes_held_in_flight_stay_within_the_budget_whatever_the_workers(s3, tmp_path, monkeypatch, budget):
    """32 workers, 40 objects of 100 kB, each read whole and held while it is written (slowed here, as a far
    bucket's bodies come slowly): with room for three, never more than three GETs in flight and 300 kB held,
    every file whole; with room for all, many more at once (the bound is the budget's, not the workers')."""
    import asyncio

    client = make_client(4)
    client.create_bucket(Bucket="data")
    bodies = {f"p/{i:02d}.bin": os.urandom(100_000) for i in range(40)}
    for key, body in bodies.items():
        client.put_object(Bucket="data", Key=key, Body=body)
    monkeypatch.setattr(transfer, "IN_FLIGHT_BYTES", budget)
    now, most = [0], [0]
    real = transfer._whole

    async def slow_whole(store, key):
        now[0] += 1
        most[0] = max(most[0], now[0])
        try:
            got = await real(store, key)
            await asyncio.sleep(0.02)
            return got
        finally:
            now[0] -= 1

    monkeypatch.setattr(transfer, "_whole", slow_whole)
    engine = Engine(concurrency=32, connect_timeout=2, read_timeout=5, attempts=3)
    jobs = [(key, str(tmp_path / f".{i}.part"), str(tmp_path / f"{i}.bin"), 100_000) for i, key in enumerate(bodies)]
    failed = []
    try:
        engine.run(engine.download_all("data", jobs, lambda i, n, etag, error=None: error and failed.append(error)))
    finally:
        engine.close()
    assert not failed and all((tmp_path / f"{i}.bin").read_bytes() == b for i, b in enumerate(bodies.values()))
    if budget == 300_000:
        assert most[0] <= 3 and engine.held_peak <= 300_000, (most, engine.held_peak)
    else:
        assert most[0] > 3, most
    assert engine.held == 0, "every held byte was given back"


CHAINS = {  # what is in the environment (and the profile files), as botocore's chain meets it
    "keys": {"AWS_ACCESS_KEY_ID": "AKENV", "AWS_SECRET_ACCESS_KEY": "env-secret"},
    "keys and a session token": {"AWS_ACCESS_KEY_ID": "ASENV", "AWS_SECRET_ACCESS_KEY": "env-secret",
                                 "AWS_SESSION_TOKEN": "session-token"},
    "both token variables": {"AWS_ACCESS_KEY_ID": "ASENV", "AWS_SECRET_ACCESS_KEY": "env-secret",
                             "AWS_SESSION_TOKEN": "session-token", "AWS_SECURITY_TOKEN": "older-token"},
    "keys beside AWS_PROFILE": {"AWS_ACCESS_KEY_ID": "AKENV", "AWS_SECRET_ACCESS_KEY": "env-secret",
                                "AWS_PROFILE": "other"},
    "AWS_PROFILE alone": {"AWS_PROFILE": "other"},
    "a key without its secret": {"AWS_ACCESS_KEY_ID": "AKENV", "AWS_PROFILE": "other"},
    "keys that expire": {"AWS_ACCESS_KEY_ID": "AKENV", "AWS_SECRET_ACCESS_KEY": "env-secret",
                         "AWS_CREDENTIAL_EXPIRATION": "2099-01-01T00:00:00Z"},
}


@pytest.fixture
def aws_files(tmp_path, monkeypatch):
    """No AWS variable but an endpoint (so no request is made for a bucket's region), and profile files of
    our own: a default profile and `other`, each with keys and a region."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    (tmp_path / "credentials").write_text("[default]\naws_access_key_id = AKDEFAULT\naws_secret_access_key = d\n"
                                          "[other]\naws_access_key_id = AKOTHER\naws_secret_access_key = o\n")
    (tmp_path / "config").write_text("[default]\nregion = eu-west-3\n[profile other]\nregion = ap-south-1\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    return monkeypatch


def _new_store():
    """The store of bucket `data` from a fresh engine (closed again); raises what making it raised."""
    engine = Engine(concurrency=1, connect_timeout=1, read_timeout=1, attempts=1)
    try:
        return engine.store("data")
    finally:
        engine.close()


@pytest.mark.parametrize("chain", list(CHAINS))
@pytest.mark.parametrize("region", [None, "sa-east-1"])
def test_the_store_signs_with_what_botocores_chain_returns(aws_files, chain, region):
    """Keys in the environment are read without botocore (0.2 s a sync): the credentials and region the store
    gets are the ones botocore's own chain resolves, for every mix of keys, tokens, profiles and expiry."""
    import botocore.session

    for k, v in CHAINS[chain].items():
        aws_files.setenv(k, v)
    if region:
        aws_files.setenv("AWS_DEFAULT_REGION", region)
    session = botocore.session.get_session()
    engine = Engine(concurrency=1, connect_timeout=1, read_timeout=1, attempts=1)
    try:
        if chain == "a key without its secret":  # botocore refuses it: so do we, in its words
            from botocore.exceptions import PartialCredentialsError

            with pytest.raises(PartialCredentialsError):
                session.get_credentials()
            with pytest.raises(TransferError, match="AWS_SECRET_ACCESS_KEY") as e:
                engine.store("data")
            assert e.value.code == "credentials"
            return
        want = session.get_credentials().get_frozen_credentials()
        store = engine.store("data")
        got = store.credential_provider()
    finally:
        engine.close()
    assert (got["access_key_id"], got["secret_access_key"], got["token"]) == (want.access_key, want.secret_key,
                                                                               want.token)
    assert store.config["region"] == session.get_config_variable("region")
    assert (transfer.env_keys() is None) == (chain in ("AWS_PROFILE alone", "keys that expire"))


def test_a_pack_sync_with_keys_in_the_environment_loads_neither_botocore_numpy_nor_tqdm(s3, odd_pack, tmp_path):
    """`python -m dali_pipe sync` of a pack starts in a tenth of a second: neither botocore (its import and
    credential chain, 0.2 s), numpy (60 ms) nor, under --no-progress, tqdm (50 ms) is loaded when the
    environment holds the keys; its last line counts the pack's files as a dataset's sync counts its images."""
    import subprocess
    import sys

    from dali_pipe.s3 import make_client

    client = make_client(2)
    client.create_bucket(Bucket="data")
    files = sorted(q for q in odd_pack.iterdir() if q.is_file())
    for q in files:
        client.put_object(Bucket="data", Key=f"pack/{q.name}", Body=q.read_bytes())
    code = ("import sys; from dali_pipe.cli.commands import main; main(sys.argv[1:]); "
            "print(sorted(m for m in ('botocore', 'boto3', 'numpy', 'torch', 'tqdm') if m in sys.modules))")
    listed = len([q for q in files if q.suffix in (".tar", ".idx")])
    for rerun in (False, True):
        out = subprocess.run([sys.executable, "-c", code, "sync", "--no-progress", "s3://data/pack",
                              str(tmp_path / "got")], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        summary, modules = out.stdout.strip().splitlines()[-2:]
        assert modules == "[]", out.stdout + out.stderr
        assert summary.startswith(f"sync: {0 if rerun else listed} downloaded") and f"{listed if rerun else 0} unchanged" in summary, summary
        assert f"{listed} listed" in summary, summary
    assert sorted(q.name for q in (tmp_path / "got").iterdir() if not q.name.startswith(".")) == [
        q.name for q in files if q.suffix in (".tar", ".idx", ".json")]


def test_an_edited_credentials_file_is_read_again_in_the_same_process(aws_files, tmp_path):
    """A notebook that fixes its keys in ~/.aws/credentials and retries signs with the new ones (botocore's
    session, kept per process for speed, keeps what it found: it is made again when the files change)."""
    aws_files.setenv("AWS_PROFILE", "other")

    assert _new_store().credential_provider()["access_key_id"] == "AKOTHER"
    (tmp_path / "credentials").write_text("[other]\naws_access_key_id = AKFIXED\naws_secret_access_key = fixed\n")
    assert _new_store().credential_provider()["access_key_id"] == "AKFIXED"


def test_what_botocore_refuses_is_a_credentials_error_naming_it(aws_files):
    """A profile that is not there (asked for the region too) and an expiry botocore cannot read are told in
    botocore's words as a credentials problem, not an opaque HTTP error."""
    aws_files.setenv("AWS_ACCESS_KEY_ID", "AKENV")
    aws_files.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    aws_files.setenv("AWS_PROFILE", "nope")  # keys win, but the region is asked of the missing profile
    for extra in ({}, {"AWS_CREDENTIAL_EXPIRATION": "garbage"}):
        for k, v in extra.items():
            aws_files.setenv(k, v)
        with pytest.raises(TransferError) as e:
            _new_store()
        assert e.value.code == "credentials" and ("nope" in e.value.detail or "garbage" in e.value.detail), e.value


def test_a_long_secret_in_a_credentials_error_is_redacted_whole(aws_files):
    """botocore's message names the container credentials URL; one longer than the message's cut is still
    redacted (the text is redacted before it is cut)."""
    secret = "p" * 40 + "SECRETPASSWORDTAIL" + "q" * 300
    aws_files.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://admin:{secret}@127.0.0.1:1/creds")
    aws_files.setenv("AWS_EC2_METADATA_DISABLED", "true")
    aws_files.setenv("AWS_METADATA_SERVICE_NUM_ATTEMPTS", "1")
    aws_files.setenv("AWS_METADATA_SERVICE_TIMEOUT", "1")
    aws_files.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")  # no profile keys: on to the container
    with pytest.raises(TransferError) as e:
        _new_store()
    assert e.value.code == "credentials"
    assert "SECRET" not in e.value.detail and "pppp" not in e.value.detail, e.value.detail


glibc_only = pytest.mark.skipif(not limits.on_glibc(), reason="glibc's malloc only")
LEFT_ALONE = {"MALLOC_ARENA_TEST": "8"}  # glibc's own default on 64-bit: malloc as it is, and the engine keeps off it
STREAM = """
import asyncio, resource, sys
from pathlib import Path
from dali_pipe import limits, transfer
limits.own_process()  # as our commands do (a user's own process keeps glibc's defaults)
engine = transfer.Engine(concurrency=4, connect_timeout=5, read_timeout=10, attempts=2)
engine.run(engine.size("data", "s/0.bin"))  # the store and its connections made before counting
engine.ranges = False  # one streamed GET per object, as from a server that answers ranges whole (rclone's)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
async def four():
    await asyncio.gather(*(engine.download("data", f"s/{i}.bin", Path(sys.argv[1], f"{i}.bin"), int(sys.argv[2]))
                           for i in range(4)))
engine.run(four())
print(limits._memory_kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
engine.close()
"""


@glibc_only
def test_a_streamed_download_reuses_the_memory_its_chunks_free(s3, tmp_path):
    """Four 48 MB objects through the engine, each in one GET streamed in 1 MB chunks (each a fresh bytes
    object, freed once written): with malloc as glibc leaves it, the freed chunks go back to the kernel and
    the next ones fault their pages in anew; kept (what an engine in our commands asks for), the same memory
    serves them."""
    import subprocess
    import sys

    from dali_pipe.s3 import make_client

    client = make_client(2)
    client.create_bucket(Bucket="data")
    size = 48 << 20
    for i in range(4):
        client.put_object(Bucket="data", Key=f"s/{i}.bin", Body=os.urandom(size))
    faults = {"kept": [], "glibc's": []}
    for r in range(3):  # three pairs, alternating: the other tests' load moves a single pair (8 550 against 6 925 once)
        for how, env in (("kept", {}), ("glibc's", LEFT_ALONE))[::1 if r % 2 == 0 else -1]:
            out = subprocess.run([sys.executable, "-c", STREAM, str(tmp_path), str(size)], capture_output=True,
                                 text=True, timeout=120, env={**os.environ, **env})
            assert out.returncode == 0, out.stderr
            kept, n = out.stdout.split()
            assert kept == ("True" if how == "kept" else "False")
            faults[how].append(int(n))
            assert all((tmp_path / f"{i}.bin").stat().st_size == size for i in range(4))
    median = {how: statistics.median(n) for how, n in faults.items()}
    # 192 MB is 49 152 pages; measured 7 900-9 800 vs 15 000-23 800
    assert median["kept"] * 3 < median["glibc's"] * 2, faults


ARENAS = """
import ctypes, os, sys, tempfile
from concurrent.futures import ThreadPoolExecutor
from dali_pipe.cli import cli
from dali_pipe.cli.commands import main
if sys.argv[1] == "sync":  # against an endpoint nothing listens on: it fails at once, past the engine's making
    from dali_pipe.limits import own_process
    own_process()  # as `python -m dali_pipe` does (as_a_command): the process is our command's
    cli(lambda: main(["sync", "--no-progress", "s3://data/x", sys.argv[2]]))
else:
    from dali_pipe.sync import make_engine
    make_engine(8).close()
with ThreadPoolExecutor(6) as pool:  # threads that allocate, after the command
    list(pool.map(lambda _: len([b"\x01" * (1 << 20) for _ in range(4)]), range(60)))
libc = ctypes.CDLL(None)
libc.fdopen.restype, libc.fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
with tempfile.TemporaryFile() as f:
    fp = ctypes.c_void_p(libc.fdopen(os.dup(f.fileno()), b"w"))
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    f.seek(0)
    print(f.read().count(b"<heap nr="))
"""


@glibc_only
def test_the_sync_command_keeps_to_one_malloc_arena_and_a_library_engine_does_not(tmp_path):
    """The sync command's threads all move the same bytes: one arena for them (asked before any thread starts).
    An engine made in someone else's process (training's shard streaming) leaves the arenas alone."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
    arenas = {}
    for how in ("sync", "engine"):
        out = subprocess.run([sys.executable, "-c", ARENAS, how, str(tmp_path / "got")], capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        arenas[how] = int(out.stdout.split()[-1])
    assert arenas["sync"] == 1 and arenas["engine"] > 1, arenas


@pytest.mark.parametrize("mode", ["asyncio", "threads"])
def test_the_benchmarks_floor_client_copies_every_byte_of_the_prefix(s3, tmp_path, monkeypatch, mode):
    """tools/sync_floor.py, the least a Python client of obstore does (bench_sync.py --floors times it beside
    s5cmd): every object under the prefix, nested ones too, lands whole, one above 8 MiB streamed at its offsets;
    nothing of a sibling prefix, no folder marker; bench_sync's check after each run finds it all there, and
    finds a short file. A failed write fails the run (on threads too), and a bad argument gets the usage."""
    monkeypatch.syspath_prepend(str(TOOLS))
    from bench_sync import missing
    from sync_floor import CHUNK, PART

    assert (CHUNK, PART) == (transfer.CHUNK, transfer.PART)  # copied there, to keep asyncio out of its imports
    bucket = f"floor-{os.urandom(4).hex()}"  # moto's objects outlive its server: a fresh bucket holds only these
    client = make_client(2)
    client.create_bucket(Bucket=bucket)
    bodies = {"p/a.tar": os.urandom(9 << 20 | 123), "p/c/d.jpg": os.urandom(5000), "p/c/e/f.idx": b"x",
              "p/packed.json": b"{}"}
    for key, body in {**bodies, "p/": b"", "p/c/": b"", "px/outside.tar": b"no", "q/outside.tar": b"no"}.items():
        client.put_object(Bucket=bucket, Key=key, Body=body)
    served = tmp_path / "served"
    for key, body in bodies.items():
        (served / key[2:]).parent.mkdir(parents=True, exist_ok=True)
        (served / key[2:]).write_bytes(body)

    def floor(*args, **kw):
        return subprocess.run([sys.executable, str(TOOLS / "sync_floor.py"), *args], capture_output=True, text=True,
                              timeout=60, **kw)

    dest = tmp_path / "dest"
    done = floor(mode, f"s3://{bucket}/p", str(dest), "--at-once", "2")
    assert done.returncode == 0, done.stderr
    assert {str(q.relative_to(dest)): q.read_bytes() for q in dest.rglob("*") if q.is_file()} == {
        k[2:]: v for k, v in bodies.items()}
    assert missing(served, dest) is None
    with open(dest / "a.tar", "r+b") as f:
        f.truncate(100)
    assert "1 of 4 files missing or short" in missing(served, dest)
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "c").write_bytes(b"a file where the folder c/ must go")
    failed = floor(mode, f"s3://{bucket}/p", str(blocked))
    assert failed.returncode == 1 and ("FileExistsError" in failed.stderr or "NotADirectoryError" in failed.stderr), (
        failed.stderr)
    for bad, says in [(["fibers", f"s3://{bucket}/p", str(dest)], "asyncio or threads"),
                      ([mode, f"s3://{bucket}/p", str(dest), "--at-once", "0"], "1 or more")]:
        refused = floor(*bad)
        assert refused.returncode == 1 and says in refused.stderr, refused.stderr
    no_endpoint = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    refused = floor(mode, f"s3://{bucket}/p", str(dest), env=no_endpoint)
    assert refused.returncode == 1 and "set AWS_ENDPOINT_URL" in refused.stderr, refused.stderr




def test_uploads_in_parts_hold_no_more_than_the_budget_and_land_whole_with_their_metadata(s3, tmp_path, monkeypatch):
    """Four files of 11 MB put at once in parts of 5 MiB (S3's least part; four a file in flight): the parts held
    stay within IN_FLIGHT_BYTES (room for one upload's), every object lands whole, and its user metadata reads
    back, through the engine and through boto3 (the peer)."""
    monkeypatch.setattr(transfer, "PART", 5 << 20)
    monkeypatch.setattr(transfer, "IN_FLIGHT_BYTES", 4 * (5 << 20))
    client = make_client(4)
    client.create_bucket(Bucket="uploads")
    bodies = {f"f{i:02d}.bin": os.urandom(11_000_000) for i in range(4)}
    for name, body in bodies.items():
        (tmp_path / name).write_bytes(body)
    engine = Engine(concurrency=32, connect_timeout=2, read_timeout=20, attempts=3)
    try:
        async def all_of_them():
            import asyncio

            await asyncio.gather(*(engine.put("uploads", f"p/{n}", tmp_path / n, {"sha256": n}) for n in bodies))

        engine.run(all_of_them())
        assert 0 < engine.held_peak <= transfer.IN_FLIGHT_BYTES
        assert engine.run(engine.metadata("uploads", "p/f03.bin")) == {"sha256": "f03.bin"}
    finally:
        engine.close()
    for name, body in bodies.items():
        got = client.get_object(Bucket="uploads", Key=f"p/{name}")
        assert got["Body"].read() == body and got["Metadata"] == {"sha256": name}
