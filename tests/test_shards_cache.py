"""Shard bytes, always checked: local packs verified once (verdicts cached), S3 shards fetched through a
fault-injecting proxy in front of moto's server (throttling, cut and stalled bodies, flipped bytes), a
credentialed endpoint, and the streaming cache: plan order, bounded disk, a resume that refetches only
what it needs."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash
from faultproxy import FaultProxy

from dali_pipe.cli.commands import main
from dali_pipe.s3 import Bounds
from dali_pipe.shards import cache as cache_mod
from dali_pipe.shards import packsync
from dali_pipe.shards import verdicts as verdicts_mod
from dali_pipe.shards.cache import StreamCache, StreamCacheError
from dali_pipe.shards.fetchers import Fetcher
from dali_pipe.shards.packsync import fetch_to
from dali_pipe.shards.reader import ShardReader
from dali_pipe.shards.verdicts import Remote, ShardError, ShardFetchError, Verdicts, verify_local

FAST = Bounds(connect_timeout=1.0, read_timeout=0.5, stall=1.0)  # a silent endpoint named in seconds


@pytest.fixture(scope="module")
def pack(photo_root, tmp_path_factory):
    """photo_root (43 train / 5 val) packed into more shards than the shuffle window holds."""
    dst = tmp_path_factory.mktemp("cachepack")
    os.environ.setdefault("DALI_PIPE_CACHE", str(dst / "cache"))
    main(["pack", str(photo_root), str(dst / "p"), "--max-side", "96", "--shard-size", "8kB", "--workers", "1"])
    return dst / "p"


def _train(pack):
    from dali_pipe.shards.packs import open_packed

    return open_packed(str(pack), "unused").train


@pytest.fixture(scope="module")
def moto_with_pack(pack):
    """moto's server on 127.0.0.1 (this module's), holding the pack's training shards under s3://data/p/."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    url = "http://{}:{}".format(*server.get_host_and_port())
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        from dali_pipe.s3 import make_client

        client = make_client(4)
        client.create_bucket(Bucket="data")
        for p in _train(pack).paths:
            client.upload_file(p, "data", f"p/{Path(p).name}")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    yield url
    server.stop()


@pytest.fixture
def bucket(moto_with_pack, pack, monkeypatch):
    """The pack's shards in moto, reached through a fault proxy: (proxy, Shards with s3:// paths)."""
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    proxy = FaultProxy(moto_with_pack).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    train = _train(pack)
    yield proxy, dataclasses.replace(train, paths=tuple(f"s3://data/p/{Path(p).name}" for p in train.paths))
    proxy.stop()


def _remote(shards, i, checksum="sha256"):
    """Shard i as packed.json describes it: with its sha256 only (a pack made before the fast checksum), or with
    its xxh3_128 too."""
    return Remote(shards.paths[i], shards.sizes[i], shards.sha256[i], xxh3=shards.xxh3[i] if checksum != "sha256"
                  else None)


def test_a_local_shard_with_a_flipped_byte_is_named_and_verdicts_are_cached(pack, tmp_path, monkeypatch):
    """A damaged shard stops the run before training, naming it; an unchanged pack is hashed once, with its
    fast checksum (packed.json's xxh3_128) and not its sha256."""
    import shutil

    copy = tmp_path / "p"
    shutil.copytree(pack, copy)
    train = _train(copy)
    hashed, slow = [], []
    real = verdicts_mod.file_xxh3
    monkeypatch.setattr(verdicts_mod, "file_xxh3", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(verdicts_mod, "file_sha256", lambda p: slow.append(p))
    verify_local(train, tmp_path / "cache", progress=False)
    verify_local(train, tmp_path / "cache", progress=False)
    assert len(hashed) == len(train.paths) and not slow, "the second check hashed nothing, the first no sha256"
    victim = Path(train.paths[1])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="do not match packed.json") as e:
        verify_local(train, tmp_path / "cache", progress=False)
    assert victim.name in str(e.value) and "sync the pack again" in str(e.value)


def test_a_verdict_vouches_only_for_the_checksum_it_checked(pack, tmp_path, monkeypatch):
    """A verdict records the checksum that was computed: a shard checked by its XXH3-128 is not taken as
    checked by its sha256, and a sha256 verdict (an earlier version's) does not spare a pack's XXH3-128 check."""
    import shutil

    copy = tmp_path / "p"
    shutil.copytree(pack, copy)
    train = _train(copy)
    first = train.paths[0]
    verdicts = Verdicts(tmp_path / "cache")
    verdicts.record(first, train.sha256[0])  # as an earlier version recorded it, after a sha256 check
    verdicts.save()
    hashed = []
    real = verdicts_mod.file_xxh3
    monkeypatch.setattr(verdicts_mod, "file_xxh3", lambda p: hashed.append(p) or real(p))
    verify_local(train, tmp_path / "cache", progress=False)
    assert first in hashed, "the sha256 verdict spared the XXH3-128 check"
    data = json.loads((tmp_path / "cache" / "shard-verdicts.json").read_text())
    assert sorted(v[2] for v in data.values()) == sorted(f"xxh3_128:{x}" for x in set(train.xxh3))
    wrong = dataclasses.replace(train, sha256=("f" * 64,) + train.sha256[1:], xxh3=None)  # a sha256-only check
    with pytest.raises(ShardError, match="has sha256"):
        verify_local(wrong, tmp_path / "cache", progress=False)


def test_the_verdicts_file_holds_no_path(pack, tmp_path):
    """shard-verdicts.json is keyed by digests: an hf_ token in the pack's path is not written there."""
    import shutil

    copy = tmp_path / "hf_abcdefghijklmnopqrstuvwxyz0123" / "p"
    shutil.copytree(pack, copy)
    verify_local(_train(copy), tmp_path / "cache", progress=False)
    text = (tmp_path / "cache" / verdicts_mod.VERDICTS_NAME).read_text()
    assert "hf_" not in text and str(tmp_path) not in text and len(json.loads(text)) == len(_train(copy).paths)


def test_transient_faults_are_retried_and_the_bytes_are_right(bucket, tmp_path):
    """A 503 SlowDown, a body cut mid-stream, a stalled body and a flipped byte: each retried, then the
    shard lands whole and matching."""
    proxy, shards = bucket
    fetcher = Fetcher(bounds=FAST)
    try:
        for i, kind in enumerate(["503", "cut", "stall", "flip"]):
            name = shards.paths[i].rsplit("/", 1)[1]
            proxy.arm(kind, name, times=1, stall_s=5)
            dest = tmp_path / name
            fetcher.fetch(_remote(shards, i), dest)
            assert verdicts_mod.file_sha256(dest) == shards.sha256[i]
            assert proxy.applied(kind) == 1
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary file left"
    finally:
        fetcher.close()


@pytest.mark.parametrize("kind", ["flip", "stall"])
def test_a_fault_that_persists_is_named_with_endpoint_and_key_in_bounded_time(bucket, tmp_path, kind):
    """Every GET damaged or stalled: the fetch gives up after its attempts and names the shard (and for
    a stall the endpoint); nothing is left at the destination."""
    proxy, shards = bucket
    name = shards.paths[0].rsplit("/", 1)[1]
    proxy.arm(kind, name, times=100, stall_s=20)
    fetcher, outcome = Fetcher(bounds=FAST), []

    def attempt():
        try:
            fetcher.fetch(_remote(shards, 0), tmp_path / name)
        except ShardError as e:
            outcome.append(e)

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(120)
    fetcher.close()
    assert not t.is_alive(), "the fetch did not give up"
    assert outcome and f"s3://data/p/{name}" in str(outcome[0])
    if kind == "flip":
        assert "does not match" in str(outcome[0]) and "upload the pack again" in str(outcome[0])
    else:
        assert isinstance(outcome[0], ShardFetchError) and proxy.url in str(outcome[0])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("checksum", ["sha256", "xxh3_128"])
@pytest.mark.parametrize("part", [None, 2048], ids=["one GET", "ranged parts"])
def test_a_shards_checksum_comes_from_its_bytes_as_they_land_and_a_damaged_one_is_still_caught(bucket, tmp_path,
                                                                                               monkeypatch, part,
                                                                                               checksum):
    """The fetch hashes a shard's bytes as the engine writes them (one GET: the body as it comes; ranged parts,
    which land in any order: the file read back once they all have), not in a second pass over the file; a
    byte flipped in transit still fails the check, twice, and nothing is left. With the fast checksum in
    packed.json, that is what is computed (no sha256); without it (an older pack), the sha256."""
    from dali_pipe import transfer

    proxy, shards = bucket
    if part is not None:
        monkeypatch.setattr(transfer, "PART", part)  # the 8 kB shards come in ranged GETs of 2 kB
    hashed, made = [], []
    monkeypatch.setattr(verdicts_mod, "file_sha256", lambda p: hashed.append(p) or "0" * 64)
    monkeypatch.setattr(verdicts_mod, "file_xxh3", lambda p: hashed.append(p) or "0" * 32)
    real = Remote.digest
    monkeypatch.setattr(Remote, "digest", lambda self: (lambda d: made.append(d.name.lower()) or d)(real(self)))
    fetcher = Fetcher(bounds=FAST)
    try:
        dest = tmp_path / "ok.tar"
        assert fetcher.fetch(_remote(shards, 0, checksum), dest) == shards.sizes[0]
        ranged = [r for r in proxy.requests if r[0] == "GET" and "range" in {k.lower() for k in r[3]}]
        assert bool(ranged) == (part is not None) and fetcher.engine.ranges is (True if part else None)
        assert made == [checksum], "the sha256 is computed only where no fast checksum is known"
        name = shards.paths[1].rsplit("/", 1)[1]
        proxy.arm("flip", name, times=100)
        with pytest.raises(ShardError, match=f"does not match its size and checksum .*has {checksum} ") as e:
            fetcher.fetch(_remote(shards, 1, checksum), tmp_path / name)
        assert f"s3://data/p/{name}" in str(e.value) and proxy.applied("flip") >= 2
    finally:
        fetcher.close()
    assert not hashed, "a landed shard was read again to hash it"
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == shards.sha256[0]
    assert xxhash.xxh3_128(dest.read_bytes()).hexdigest() == shards.xxh3[0], "packed.json's xxh3_128: XXH3-128"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.tar"], "a damaged shard or a temporary file stayed"


def test_credentials_in_the_endpoint_url_sign_the_requests(bucket, tmp_path, monkeypatch):
    """AWS_ENDPOINT_URL=http://KEY:SECRET@host:port: the requests go to host:port, signed with KEY, and
    neither reaches the Host header; a failure message does not show the secret."""
    proxy, shards = bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url.replace("http://", "http://AKIDURL:s3cr3t%2Fx@"))
    fetcher = Fetcher(bounds=FAST)
    try:
        fetcher.fetch(_remote(shards, 0), tmp_path / "s.tar")
        headers = {k.lower(): v for k, v in proxy.requests[-1][3].items()}  # HTTP names are case-insensitive
        assert "Credential=AKIDURL/" in headers["authorization"] and "@" not in headers["host"]
        with pytest.raises(ShardFetchError) as e:
            fetcher.fetch(Remote("s3://data/p/none.tar", 10, None), tmp_path / "n.tar")
        assert "s3cr3t" not in str(e.value)
    finally:
        fetcher.close()


class _Info:
    def __init__(self, epoch, iteration):
        self.epoch_idx, self.iteration = epoch, iteration


def _du(folder: Path, suffix: str | None = ".tar") -> int:
    """Bytes of the shards (suffix None: of all files) in a cache folder now; a file evicted between the
    listing and its stat counts 0."""
    total = 0
    for f in folder.iterdir():
        if suffix is None or f.suffix == suffix:
            try:
                total += f.stat().st_size
            except FileNotFoundError:  # the fetcher thread evicted it meanwhile
                pass
    return total


def _minimum(reader, shards) -> int:
    """The least bound the cache accepts for `reader`: its plans' bytes in use at once, plus one shard."""
    return max(reader.plan(e).in_use(shards.sizes, extra=reader.batch) for e in (0, 1)) + max(shards.sizes)


def test_streamed_epochs_match_local_ones_within_the_bound(bucket, pack, tmp_path):
    """Two epochs through the smallest cache the plan allows: the same bytes and labels in the same order
    as from local disk, the cache never above its bound, consumed shards evicted and fetched again, and
    one GET per fetch (no HEAD)."""
    proxy, shards = bucket
    local = ShardReader(_train(pack), batch=4, seed=1, rank=0, world=1, training=True)
    remotes = [_remote(shards, i) for i in range(len(shards.paths))]
    bound = _minimum(local, shards)
    assert bound < sum(shards.sizes), "the pack is larger than the cache"
    cache = StreamCache(tmp_path / "c", remotes, bound, bounds=FAST)
    view = cache.view(shards)
    reader = ShardReader(shards, batch=4, seed=1, rank=0, world=1, training=True, store=view)
    view.register(reader)
    peak = 0
    try:
        for epoch in range(2):
            for k in range(reader.batches):
                got, want = reader(_Info(epoch, k)), local(_Info(epoch, k))
                assert [bytes(x) for x in got[0]] == [bytes(x) for x in want[0]]
                assert np.array_equal(got[1], want[1])
                peak = max(peak, _du(tmp_path / "c"))
        assert peak <= bound and cache.peak <= bound
        assert cache.fetched > len(shards.paths), "shards were evicted and fetched again in epoch 2"
        assert not [r for r in proxy.requests if r[0] == "HEAD"], "sizes and ETags come from one LIST"
    finally:
        cache.close()
        reader.close()
        local.close()


def test_a_cache_too_small_for_the_window_is_refused(bucket, tmp_path):
    """--stream-cache below what the plan has in use at once: an error naming the setting and the minimum, in
    readable units (never '0.0 MB'), rounded up so that the size it asks for is enough."""
    _, shards = bucket
    cache = StreamCache(tmp_path / "c", [_remote(shards, i) for i in range(len(shards.paths))], max(shards.sizes), bounds=FAST)
    try:
        reader = ShardReader(shards, batch=4, seed=1, rank=0, world=1, training=True, store=cache.view(shards))
        with pytest.raises(StreamCacheError, match="raise --stream-cache to at least") as e:
            cache.view(shards).register(reader)
    finally:
        cache.close()
    assert " 0.0 " not in str(e.value), str(e.value)
    from dali_pipe.config import parse_size

    enough = parse_size(str(e.value).split("at least ")[1].split(",")[0].replace(" ", ""))
    cache = StreamCache(tmp_path / "c", [_remote(shards, i) for i in range(len(shards.paths))], enough, bounds=FAST)
    try:  # the size the message asks for is enough
        cache.view(shards).register(ShardReader(shards, batch=4, seed=1, rank=0, world=1, training=True,
                                                store=cache.view(shards)))
    finally:
        cache.close()


def test_a_resumed_epoch_fetches_only_what_it_still_needs(bucket, tmp_path, monkeypatch):
    """Stopped mid-epoch and rebuilt on the same folder: shards that landed are kept, and every shard the
    epoch still reads is fetched before any that it has finished (those only for the next epoch)."""
    _, shards = bucket
    remotes = [_remote(shards, i) for i in range(len(shards.paths))]
    asked = []
    real = Fetcher.fetch
    monkeypatch.setattr(Fetcher, "fetch", lambda self, r, *a, **kw: asked.append(r.url) or real(self, r, *a, **kw))

    def run(iterations):
        cache = StreamCache(tmp_path / "c", remotes, sum(shards.sizes), bounds=FAST)
        reader = ShardReader(shards, batch=4, seed=2, rank=0, world=1, training=True, store=cache.view(shards))
        cache.view(shards).register(reader)
        try:
            for k in iterations:
                reader(_Info(0, k))
        finally:
            cache.close()
            reader.close()
        return reader.plan(0)

    plan = run(range(3))
    start = 3 * 4
    kept = {f.name for f in (tmp_path / "c").glob("*.tar")}
    asked.clear()
    run([3])
    names = [u.rsplit("/", 1)[1] for u in asked]
    assert not set(names) & kept, "a shard that had landed was fetched again"
    still = {shards.paths[s].rsplit("/", 1)[1] for s, (_, last) in plan.spans.items() if last >= start} - kept
    finished = {shards.paths[s].rsplit("/", 1)[1] for s, (_, last) in plan.spans.items() if last < start} - kept
    needed_first = [n for n in names if n in still]
    assert set(needed_first) == still or len(needed_first) >= cache_mod.FETCH_PARALLEL
    if finished & set(names):
        assert max(names.index(n) for n in needed_first) < min(names.index(n) for n in finished & set(names))


@pytest.fixture(scope="module")
def big_pack(tmp_path_factory):
    """About 40 MB of real photos (100 of 600-700 px, each under six names, each name its own class)
    packed into shards of about 300 kB; every 25th name in the validation split."""
    from dali_pipe.demo import make_photo_dataset

    root = tmp_path_factory.mktemp("big")
    photos = make_photo_dataset(root / "photos", classes=5, per_class=20, side=(600, 700))
    rels = (photos / "dataset.tsv").read_text().splitlines()[1:]
    data = root / "data"
    lines = ["image_path\tlabel\tsplit"]
    for copy in range(6):
        for i, rel in enumerate(rels):
            name = f"c{copy}/{Path(rel).stem}.jpg"
            (data / name).parent.mkdir(parents=True, exist_ok=True)
            (data / name).symlink_to(photos / rel)
            lines.append(f"{name}\ts{copy}{i:03d}\t{'val' if (copy * 100 + i) % 25 == 3 else 'train'}")
    (data / "dataset.tsv").write_text("\n".join(lines) + "\n")
    os.environ.setdefault("DALI_PIPE_CACHE", str(root / "cache"))
    main(["pack", str(data), str(root / "p"), "--max-side", "700", "--shard-size", "300kB", "--workers", "1"])
    return data, root / "p"


@pytest.mark.slow
def test_training_streams_a_pack_three_times_its_cache_through_faults(big_pack, s3_process, tmp_path, monkeypatch):
    """A --stream-cache too small for the shuffle windows is refused at once, asking for a size that is
    enough; followed, on a 40 MB pack over three times that size, through a proxy that throttles, cuts and
    damages one GET each (a stall is the transient test's): the run completes, trains each sample once, and
    the cache never holds more than its bound plus one shard."""
    import json

    import resume_trace as rt

    import train
    from dali_pipe.s3 import make_client

    data, packed = big_pack
    meta = json.loads((packed / "packed.json").read_text())
    shards = [s for split in meta["splits"].values() for s in split["shards"]]
    assert sum(s["size"] for s in shards) > 36e6
    from concurrent.futures import ThreadPoolExecutor

    client = make_client(8)
    client.create_bucket(Bucket="data")
    files = [f for f in packed.iterdir() if f.is_file() and not f.name.startswith(".")]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda f: client.upload_file(str(f), "data", f"big/{f.name}"), files))
    proxy = FaultProxy(s3_process).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    cache = tmp_path / "cache"
    argv = ["--data", "s3://data/big", "--packed-s3", "stream", "--model", "tiny", "--device", "cpu", "--epochs", "1",
            "--batch-size", "64", "--num-threads", "2", "--output", str(tmp_path / "out"), "--cache-dir", str(cache)]
    with pytest.raises(StreamCacheError, match=r"readers \(training and validation\).*raise --stream-cache to at least"
                       ) as refused:  # too small for the windows: refused at setup, with the size that is enough
        train.main(argv + ["--stream-cache", "300kB"])
    from dali_pipe.config import parse_size

    advised = parse_size(str(refused.value).split("raise --stream-cache to at least ")[1].split(",")[0])
    assert advised <= 12e6, refused.value  # the pack is more than three times the size asked for
    for kind, shard in zip(["503", "cut", "flip"], ["train-000003", "train-000010", "train-000030"]):
        proxy.arm(kind, shard + ".tar")
    trace = tmp_path / "trace.jsonl"
    rt.install(trace, patch=monkeypatch.setattr)
    stream = cache / "stream" / "s3" / "data" / "big" / "rank-0"
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.02):
            if stream.is_dir():
                peak[0] = max(peak[0], _du(stream, None))  # partial downloads too

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        res = train.main(argv + ["--stream-cache", str(advised)])  # the advice, followed, trains
    finally:
        done.set()
        sampler.join()
    rows = [x.split("\t") for x in (data / "dataset.tsv").read_text().splitlines()[1:]]
    train_set = {x[1] for x in rows if x[2] == "train"}
    rt.assert_each_sample_once_per_epoch(rt.read(trace), train=train_set, epochs=1, batch=64,
                                         val={x[1] for x in rows if x[2] == "val"})
    assert res["global_step"] == len(train_set) // 64
    assert 0 < peak[0] <= advised + max(s["size"] for s in shards), peak[0]
    assert all(proxy.applied(k) == 1 for k in ("503", "cut", "flip"))


def test_peer_shards_of_unknown_size_and_sha256_are_listed_then_streamed(bucket, pack, tmp_path):
    """Shards known only by URL (peer shards not yet indexed with sizes): one LIST gives their sizes, and the
    reader streams the same bytes as from local disk."""
    _, shards = bucket
    peer = dataclasses.replace(shards, sizes=None, sha256=None)
    cache = StreamCache(tmp_path / "c", [Remote(u, None, None) for u in peer.paths], sum(shards.sizes), bounds=FAST)
    reader = ShardReader(peer, batch=4, seed=0, rank=0, world=1, training=True, store=cache.view(peer))
    local = ShardReader(_train(pack), batch=4, seed=0, rank=0, world=1, training=True)
    try:
        cache.view(peer).register(reader)
        assert [cache.remotes[u].size for u in peer.paths] == list(shards.sizes)
        got, want = reader(_Info(0, 0)), local(_Info(0, 0))
        assert [bytes(x) for x in got[0]] == [bytes(x) for x in want[0]]
    finally:
        cache.close()
        reader.close()
        local.close()


def test_a_full_disk_while_fetching_is_named(bucket, tmp_path):
    """The cache's disk fills up mid-fetch (a 64 kB tmpfs): one error naming the folder and what to do."""
    import subprocess

    _, shards = bucket
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        big = max(range(len(shards.paths)), key=lambda i: shards.sizes[i])
        (disk / "filler").write_bytes(b"x" * (64 * 1024 - shards.sizes[big] // 2))
        fetcher = Fetcher(bounds=FAST)
        with pytest.raises(ShardError, match="is full") as e:
            fetcher.fetch(_remote(shards, big), disk / "s.tar")
        fetcher.close()
        assert str(disk) in str(e.value) and not [p for p in disk.iterdir() if p.name != "filler"]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_the_cache_is_one_runs_and_its_size_must_fit_the_disk(bucket, tmp_path):
    """A second process streaming into the same folder stops at once, naming the first; a --stream-cache
    larger than the disk's free space is refused, naming both."""
    from helpers import hold_lock

    from dali_pipe.shards.cache import stream_bound
    from dali_pipe.workdir import BusyError

    _, shards = bucket
    folder = tmp_path / "c"
    with pytest.raises(StreamCacheError, match="has .* free for it"):
        stream_bound(1 << 60, folder)
    assert stream_bound(None, folder, 2) < stream_bound(None, folder, 1)
    holder = hold_lock(folder, "run streaming these shards")
    try:
        with pytest.raises(BusyError, match=str(holder.pid)):
            StreamCache(folder, [_remote(shards, 0)], 1 << 30, bounds=FAST)
    finally:
        holder.kill()
        holder.wait()


def _all_landed(cache, n: int) -> None:
    import time

    deadline = time.monotonic() + 60
    while len(cache.resident) < n:
        assert time.monotonic() < deadline, "the cache did not fetch every shard"
        time.sleep(0.05)


def test_a_shard_gone_cut_or_changed_in_the_cache_is_fetched_again(bucket, pack, tmp_path, capsys):
    """After the first batch, three landed shards the reader has not opened yet are deleted, truncated, and
    overwritten with other bytes of the same size: each is fetched again (one line each) and the epoch reads
    the same bytes as from local disk (before: "restore it, or pack the data again", with the objects intact
    in S3). A shard that keeps going missing is named after HEALS fetches."""
    _, shards = bucket
    local = ShardReader(_train(pack), batch=4, seed=3, rank=0, world=1, training=True)
    cache = StreamCache(tmp_path / "c", [_remote(shards, i) for i in range(len(shards.paths))], sum(shards.sizes), bounds=FAST)
    reader = ShardReader(shards, batch=4, seed=3, rank=0, world=1, training=True, store=cache.view(shards))
    cache.view(shards).register(reader)
    try:
        first = reader(_Info(0, 0))
        assert [bytes(x) for x in first[0]] == [bytes(x) for x in local(_Info(0, 0))[0]]
        _all_landed(cache, len(shards.paths))
        unopened = [s for s in dict.fromkeys(int(x) for x in reader.plan(0).shard) if s not in reader._files]
        gone, cut, changed = (cache.local(shards.paths[s]) for s in unopened[-3:])
        gone.unlink()
        os.truncate(cut, cut.stat().st_size - 100)
        data = bytearray(changed.read_bytes())
        data[len(data) // 2] ^= 0xFF
        changed.write_bytes(data)
        capsys.readouterr()
        for k in range(1, reader.batches):
            got, want = reader(_Info(0, k)), local(_Info(0, k))
            assert [bytes(x) for x in got[0]] == [bytes(x) for x in want[0]] and np.array_equal(got[1], want[1])
        err = capsys.readouterr().err
        assert f"{gone} cannot be read" in err and f"{cut} has " in err and f"{changed} has sha256" in err, err
        assert err.count("; fetching s3://data/p/") == 3
        url = shards.paths[unopened[-1]]  # fetched again once above (its bytes had changed)
        cache.local(url).unlink()
        assert cache.path(url, reader) == str(cache.local(url))  # gone again: fetched a second time
        cache.local(url).unlink()
        with pytest.raises(ShardError, match=r"cannot be read .*, after it was fetched again 2 time\(s\): something "
                                             r"else removes or writes files in"):
            cache.path(url, reader)
    finally:
        cache.close()
        reader.close()
        local.close()


def _stream_all(shards, remotes, folder):
    """A run that streams every shard into `folder` and stops (what a rerun finds there)."""
    cache = StreamCache(folder, remotes, sum(shards.sizes), bounds=FAST)
    reader = ShardReader(shards, batch=4, seed=4, rank=0, world=1, training=True, store=cache.view(shards))
    cache.view(shards).register(reader)
    try:
        reader(_Info(0, 0))
        _all_landed(cache, len(shards.paths))
    finally:
        cache.close()
        reader.close()


def test_a_rerun_keeps_every_shard_that_landed_whole(bucket, tmp_path, capsys):
    """The verdicts file was not saved before a kill (it is saved every few seconds): the rerun hashes the
    shards it finds instead of fetching them again, keeping every whole one and fetching only a damaged
    one (before: a resumed stream fetched 5 of 17 shards again that were all there)."""
    _, shards = bucket
    remotes = [_remote(shards, i) for i in range(len(shards.paths))]
    _stream_all(shards, remotes, tmp_path / "c")
    (tmp_path / "c" / verdicts_mod.VERDICTS_NAME).unlink()
    damaged = tmp_path / "c" / shards.paths[0].rsplit("/", 1)[1]
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(data)
    capsys.readouterr()
    again = StreamCache(tmp_path / "c", remotes, sum(shards.sizes), bounds=FAST)
    try:
        assert set(again.resident) == set(shards.paths) - {shards.paths[0]}
        assert f"; {len(shards.paths) - 1} already there)" in capsys.readouterr().err
    finally:
        again.close()


def test_the_stream_cache_refusal_asks_for_enough_for_every_reader(bucket, tmp_path):
    """The training and the validation reader both use the cache: the refusal counts both, so the size it
    asks for is accepted (before: 300KB -> "at least 553.0 kB" -> "at least 645.2 kB"). With 2 ranks per node
    the node's size is asked for; a disk with less room than that is named at once; the room a refusal
    names for --stream-cache is rounded down, so that passing it is accepted."""
    from dali_pipe.config import parse_size
    from dali_pipe.shards.cache import stream_bound, stream_room

    _, shards = bucket
    remotes = [_remote(shards, i) for i in range(len(shards.paths))]

    def readers(cache):
        held = [ShardReader(shards, batch=4, seed=1, rank=0, world=1, training=training, store=cache.view(shards))
                for training in (True, False)]  # held, as the loaders hold theirs (a dropped reader needs nothing)
        for reader in held:
            cache.view(shards).register(reader, check=False)
        cache.check()

    for local_ranks in (1, 2):
        folder = tmp_path / f"c{local_ranks}"
        cache = StreamCache(folder, remotes, max(shards.sizes), local_ranks=local_ranks, bounds=FAST)
        try:
            with pytest.raises(StreamCacheError, match=r"readers \(training and validation\)") as e:
                readers(cache)
        finally:
            cache.close()
        advice = str(e.value).split("raise --stream-cache to at least ")[1].split(",")[0]
        enough = parse_size(advice)
        cache = StreamCache(folder, remotes, stream_bound(enough, folder, local_ranks), local_ranks=local_ranks, bounds=FAST)
        try:
            readers(cache)  # the size the refusal asked for is enough for both
        finally:
            cache.close()
    room = stream_room(tmp_path / "c1")
    with pytest.raises(StreamCacheError, match="free for it") as e:
        stream_bound(room + 10_000_000, tmp_path / "c1")
    stream_bound(parse_size(str(e.value).split(" has ")[1].split(" free")[0]), tmp_path / "c1")


def test_a_pack_sync_onto_a_disk_too_small_is_refused_before_any_download(s3, odd_pack, tmp_path):
    """`python -m dali_pipe sync` of a pack onto a disk (a real tmpfs) that cannot hold its shards: one message
    with the sizes and the fix, before the first GET (it used to fetch the index files and part of a shard,
    then fail on the full disk with training's advice)."""
    from helpers import small_disk

    from dali_pipe.s3 import SyncError, make_client

    client = make_client(2)
    client.create_bucket(Bucket="data")
    files = [q for q in odd_pack.iterdir() if q.is_file()]
    for q in files:
        client.put_object(Bucket="data", Key=f"pack/{q.name}", Body=q.read_bytes())
    shards = sum(q.stat().st_size for q in files if q.suffix == ".tar")
    with small_disk(tmp_path / "disk", f"{max(8, shards // 2048)}k") as disk:
        with pytest.raises(SyncError, match=r"s3://data/pack: the pack's \d+ shard\(s\) need .* in .*/disk/p, which "
                                            r"has .* free .*; free space there, or sync to another disk.*Nothing was "
                                            r"downloaded"):
            fetch_to("s3://data/pack", disk / "p", mode="sync", workers=4, progress=False, cache_dir=tmp_path / "c")
        assert not [p for p in (disk / "p").rglob("*") if p.is_file()]


def test_training_readies_a_pack_on_s3_through_one_engine_with_the_listing_asked_beside_packed_json(
        s3, odd_pack, tmp_path, monkeypatch):
    """A training run's --data s3://pack (fetch, here streamed): packed.json, the prefix's one LIST (asked for before
    packed.json's answer is waited for) and the index files through one engine; the index files land matching."""
    from dali_pipe.s3 import make_client
    from dali_pipe.transfer import Engine

    client = make_client(2)
    client.create_bucket(Bucket="data")
    for q in odd_pack.iterdir():
        if q.is_file():
            client.put_object(Bucket="data", Key=f"pack/{q.name}", Body=q.read_bytes())
    order, engines = [], []
    real_read, real_list, real_init = Engine.read, Engine.list, Engine.__init__
    monkeypatch.setattr(Engine, "read", lambda self, b, k: order.append(k) or real_read(self, b, k))
    monkeypatch.setattr(Engine, "list", lambda self, b, p: order.append("LIST") or real_list(self, b, p))
    monkeypatch.setattr(Engine, "__init__", lambda self, **kw: engines.append(kw) or real_init(self, **kw))
    local = packsync.fetch("s3://data/pack", tmp_path / "c", mode="stream", workers=4, progress=False)
    assert order == ["LIST", "pack/packed.json"] and len(engines) == 1, (order, engines)
    indexes = [q.name for q in odd_pack.iterdir() if q.suffix == ".idx"]
    assert indexes and all((local / n).read_bytes() == (odd_pack / n).read_bytes() for n in indexes)


def test_a_kept_shard_changed_in_the_cache_with_its_mtime_kept_is_named_when_read(bucket, tmp_path):
    """A rerun keeps the shards an earlier run left in the stream cache by their verdict (size and mtime); one of
    them changed in place with its mtime kept is not fetched again, so the reader hashes it as it opens it (a
    shard fetched in this run was checked as it landed) and stops naming it: before, the run trained on it."""
    from dali_pipe.shards.reader import ShardReadError

    _, shards = bucket
    remotes = [_remote(shards, i, "xxh3") for i in range(len(shards.paths))]
    _stream_all(shards, remotes, tmp_path / "c")
    for path in shards.paths:  # every shard: the first batch of the rerun opens some of them
        kept = tmp_path / "c" / path.rsplit("/", 1)[1]
        st = os.stat(kept)
        data = bytearray(kept.read_bytes())
        data[700] ^= 0x20
        kept.write_bytes(data)
        os.utime(kept, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = StreamCache(tmp_path / "c", remotes, sum(shards.sizes), bounds=FAST)
    reader = ShardReader(shards, batch=4, seed=4, rank=0, world=1, training=True, store=again.view(shards))
    again.view(shards).register(reader)
    try:
        assert set(again.resident) == set(shards.paths)  # kept by their verdicts, not fetched
        with pytest.raises(ShardReadError, match="changed after it was checked"):
            reader(_Info(0, 0))
    finally:
        again.close()
        reader.close()


def test_a_stream_cache_too_small_is_told_from_packed_json_before_torch_loads(bucket, moto_with_pack, pack, tmp_path):
    """train.py --packed-s3 stream with too small a --stream-cache: refused from packed.json before torch and
    Lightning load (before: at setup, 15-17 s in), asking for the size the stream cache's own check asks for once
    the index files are local (the readers of training and validation, for 1 and 2 ranks: every rank's)."""
    import shutil

    import boto3
    from helpers import told_before_torch

    from dali_pipe.shards.preflight import stream_preflight

    client = boto3.client("s3", endpoint_url=moto_with_pack)  # not through the proxy: the uploads are not tested
    for f in pack.iterdir():
        if f.is_file() and not f.name.startswith("."):
            client.upload_file(str(f), "data", f"whole/{f.name}")
    split = {}
    for name in ("train", "val"):
        local = getattr(open_packed_here(pack), name)
        split[name] = dataclasses.replace(local, paths=tuple(f"s3://data/whole/{Path(p).name}" for p in local.paths))
    remotes = [_remote(s, i) for s in split.values() for i in range(len(s.paths))]

    def advice(error) -> str:
        return str(error).split("raise --stream-cache to at least ")[1].split(",")[0]

    for ranks in (1, 2):
        asked = []
        for rank in range(ranks):
            cache = StreamCache(tmp_path / f"c{ranks}-{rank}", remotes, 1000, local_ranks=ranks, bounds=FAST)
            held = [ShardReader(split[n], batch=4, seed=3, rank=rank, world=ranks, training=n == "train",
                                store=cache.view(split[n])) for n in ("train", "val")]
            try:
                for reader, n in zip(held, ("train", "val")):
                    cache.view(split[n]).register(reader, check=False)
                with pytest.raises(StreamCacheError) as e:
                    cache.check()
                asked.append(advice(e.value))
            finally:
                cache.close()
        with pytest.raises(StreamCacheError) as e:
            stream_preflight("s3://data/whole", tmp_path / "cache", mode="stream", stream_cache=1000 * ranks,
                             batch=4, seed=3, world=ranks, local_ranks=ranks)
        assert advice(e.value) == max(asked, key=lambda a: float(a.split()[0]) * (1e3 if "MB" in a else 1)), (
            e.value, asked)
    stream_preflight("s3://data/whole", tmp_path / "cache", mode="auto", stream_cache=1000, batch=4, seed=3,
                     world=1, local_ranks=1)  # auto: the pack fits the disk, so it is synced, not streamed
    said = told_before_torch(["--data", "s3://data/whole", "--packed-s3", "stream", "--stream-cache", "10kB", "--model",
                              "tiny", "--batch-size", "4", "--seed", "3", "--output", str(tmp_path / "o"), "--cache-dir",
                              str(tmp_path / "cache")])
    assert said.startswith("StreamCacheError --stream-cache gives this process 10.0 kB"), said
    assert advice(said) == asked_1(split, remotes, tmp_path), said
    assert not (tmp_path / "cache").exists()  # a refusal leaves no folder behind (the disk asked, none made)
    # shards an earlier sync left whole in the pack's local copy are read from there: counted as nothing
    copy = tmp_path / "cache" / "s3" / "data" / "whole"
    copy.mkdir(parents=True, exist_ok=True)
    first = Path(split["train"].paths[0]).name
    shutil.copy(pack / first, copy / first)
    partly = dict(split, train=dataclasses.replace(split["train"], paths=(str(copy / first),) + split["train"].paths[1:]))
    with pytest.raises(StreamCacheError) as e:
        stream_preflight("s3://data/whole", tmp_path / "cache", mode="stream", stream_cache=1000, batch=4, seed=3,
                         world=1, local_ranks=1)
    assert advice(e.value) == asked_1(partly, [r for r in remotes if not r.url.endswith(first)], tmp_path / "p"), e.value
    for f in pack.glob("*.tar"):
        shutil.copy(f, copy / f.name)
    stream_preflight("s3://data/whole", tmp_path / "cache", mode="stream", stream_cache=1000, batch=4, seed=3,
                     world=1, local_ranks=1)  # every shard local: nothing is streamed, so nothing to refuse


def open_packed_here(pack):
    from dali_pipe.shards.packs import open_packed

    return open_packed(str(pack), "unused")


def asked_1(split, remotes, tmp_path) -> str:
    """What the stream cache of one rank asks for with batch 4 and seed 3."""
    cache = StreamCache(tmp_path / "one", remotes, 1000, bounds=FAST)
    held = [ShardReader(split[n], batch=4, seed=3, rank=0, world=1, training=n == "train", store=cache.view(split[n]))
            for n in ("train", "val")]
    try:
        for reader, n in zip(held, ("train", "val")):
            cache.view(split[n]).register(reader, check=False)
        with pytest.raises(StreamCacheError) as e:
            cache.check()
    finally:
        cache.close()
    return str(e.value).split("raise --stream-cache to at least ")[1].split(",")[0]


def test_a_streamed_training_stopped_by_sigterm_releases_its_stream_lock(moto_with_pack, pack, tmp_path, monkeypatch):
    """SIGTERM during a streamed run: SpotSafeCheckpoint saves after the step and the run exits 0, and the
    stream cache is closed on the way out (Lightning tears the datamodule down only after a run that ends
    normally): no lock of its rank-N folder is left under the cache dir's locks/."""
    import resume_trace as rt

    import train
    from dali_pipe.s3 import make_client

    for k, v in {"AWS_ENDPOINT_URL": moto_with_pack, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    client = make_client(4)
    for f in pack.iterdir():
        if f.is_file() and not f.name.startswith("."):
            client.upload_file(str(f), "data", f"whole/{f.name}")
    cache = tmp_path / "cache"
    monkeypatch.setenv("DALI_PIPE_CACHE", str(cache))
    rt.install(tmp_path / "trace.jsonl", sigterm_at_step=1, patch=monkeypatch.setattr)
    res = train.main(["--data", "s3://data/whole", "--packed-s3", "stream", "--model", "tiny", "--device", "cpu",
                      "--epochs", "1", "--batch-size", "4", "--num-threads", "1", "--output", str(tmp_path / "out"),
                      "--cache-dir", str(cache)])
    assert res["interrupted"] and res["stopped_by"] == "SIGTERM"
    assert not list((cache / "locks").glob("*")), list((cache / "locks").glob("*"))
