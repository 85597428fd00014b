"""S3 sync against a real S3 endpoint: moto's server on 127.0.0.1, boto3 over HTTP, no mocks."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dali_pipe.sync import SyncError, make_client, sync

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def s3(monkeypatch):
    """A fresh moto S3 server on a free loopback port; the AWS env points boto3 at it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    for k, v in {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield server, url
    server.stop()


def _upload(photo_root: Path, bucket="data", prefix="ds", extra_rows=""):
    client = make_client(8)
    client.create_bucket(Bucket=bucket)
    text = (photo_root / "dataset.tsv").read_text() + extra_rows
    client.put_object(Bucket=bucket, Key=f"{prefix}/dataset.tsv", Body=text.encode())
    for line in text.splitlines()[1:]:
        rel = line.split("\t")[0]
        if (photo_root / rel).is_file():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=(photo_root / rel).read_bytes())
    client.put_object(Bucket=bucket, Key=f"{prefix}/unlisted/big.bin", Body=b"0" * 1000)
    return client


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()
            and not p.name.startswith(".")}


def test_sync_is_byte_identical_and_only_manifest_files(s3, photo_root, tmp_path):
    _upload(photo_root)
    dest = tmp_path / "local"
    stats = sync("s3://data/ds", dest, workers=8, progress=False)
    assert stats.downloaded == 48 and stats.skipped == 0
    got = _tree(dest)
    assert "unlisted/big.bin" not in got
    want = _tree(photo_root)
    assert got == want


def test_rerun_transfers_nothing_and_changed_file_is_refetched(s3, photo_root, tmp_path):
    client = _upload(photo_root)
    dest = tmp_path / "local"
    sync("s3://data/ds", dest, workers=8, progress=False)
    again = sync("s3://data/ds", dest, workers=8, progress=False)
    assert again.downloaded == 0 and again.skipped == 48 and again.bytes == 0
    client.put_object(Bucket="data", Key="ds/coffee/coffee_0000.jpg", Body=b"\xff\xd8\xff changed")
    third = sync("s3://data/ds", dest, workers=8, progress=False)
    assert third.downloaded == 1 and (dest / "coffee/coffee_0000.jpg").read_bytes() == b"\xff\xd8\xff changed"


def test_interrupted_sync_leaves_no_partial_file_and_rerun_completes(s3, photo_root, tmp_path, monkeypatch):
    """The server stops mid-sync: completed files stay, no partial file exists, the rerun finishes."""
    server, url = s3
    _upload(photo_root)
    dest = tmp_path / "local"
    import dali_pipe.sync as mod

    real = mod._download
    count = {"n": 0}
    lock = threading.Lock()

    def flaky(client, bucket, key, path, size):
        with lock:
            count["n"] += 1
            if count["n"] == 20:
                server.stop()
        return real(client, bucket, key, path, size)

    monkeypatch.setattr(mod, "_download", flaky)
    with pytest.raises(SyncError, match="rerun"):
        sync("s3://data/ds", dest, workers=4, progress=False, client=make_client(4, max_attempts=2,
                                                                                   connect_timeout=1))
    assert not [p for p in dest.rglob("*") if ".part-" in p.name]
    assert not (dest / "dataset.tsv").exists()  # the manifest lands only when the set is complete
    partial = len([p for p in dest.rglob("*.jpg")])
    assert 0 < partial < 48
    monkeypatch.setattr(mod, "_download", real)
    server.start()  # a fresh port: point boto3 at it
    os.environ["AWS_ENDPOINT_URL"] = "http://%s:%d" % server.get_host_and_port()
    done = sync("s3://data/ds", dest, workers=4, progress=False)
    assert done.downloaded + done.skipped == 48 and done.downloaded <= 48 - done.skipped
    assert _tree(dest) == _tree(photo_root)


@pytest.mark.parametrize("row", ["../../escape.jpg", "/etc/passwd"])
def test_hostile_row_refused_and_nothing_written_outside(s3, photo_root, tmp_path, row):
    client = _upload(photo_root, extra_rows=f"{row}\n")
    client.put_object(Bucket="data", Key="escape.jpg", Body=b"evil")
    dest = tmp_path / "a" / "b" / "local"
    before = set(tmp_path.rglob("*"))
    with pytest.raises(SyncError, match="refused 1 row.*nothing was downloaded"):
        sync("s3://data/ds", dest, workers=4, progress=False)
    after = set(tmp_path.rglob("*"))
    assert all(str(p).startswith(str(dest)) or p in dest.parents for p in after - before)
    assert not list(dest.rglob("*.jpg"))


def test_error_messages(s3, photo_root, tmp_path, monkeypatch):
    _upload(photo_root)
    with pytest.raises(SyncError, match="bucket 'nope' does not exist"):
        sync("s3://nope/ds", tmp_path / "x", workers=4, progress=False)
    with pytest.raises(SyncError, match=r"s3://data/wrong/dataset.tsv does not exist"):
        sync("s3://data/wrong", tmp_path / "x", workers=4, progress=False)
    with pytest.raises(SyncError, match="not an s3:// URI"):
        sync("data/ds", tmp_path / "x", workers=4, progress=False)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(SyncError, match="no usable AWS credentials") as e:
        sync("s3://data/ds", tmp_path / "x", workers=4, progress=False)
    assert "testing" not in str(e.value)


def test_cli_sync_form(s3, photo_root, tmp_path):
    """`python -m dali_pipe sync s3://bucket/prefix LOCAL_DIR` as documented, and its clean error."""
    _upload(photo_root)
    r = subprocess.run([sys.executable, "-m", "dali_pipe", "sync", "s3://data/ds", str(tmp_path / "L")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "sync: 48 downloaded" in r.stderr and (tmp_path / "L" / "dataset.tsv").is_file()
    r = subprocess.run([sys.executable, "-m", "dali_pipe", "sync", "s3://data/missing", str(tmp_path / "M")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "does not exist" in r.stderr


def test_training_from_s3(s3, photo_root, tmp_path, cache_dir):
    """--data s3://...: prepare_data syncs into the cache dir, then training reads local files."""
    import train

    _upload(photo_root)
    res = train.main(["--data", "s3://data/ds", "--model", "tiny", "--epochs", "1", "--batch-size", "8",
                      "--device", "cpu", "--output", str(tmp_path / "o"), "--cache-dir", str(cache_dir),
                      "--num-threads", "1"])
    assert res["global_step"] > 0
    assert (cache_dir / "s3" / "data" / "ds" / "dataset.tsv").is_file()


def test_benchmark_from_s3(s3, photo_root, tmp_path, cache_dir):
    """The benchmark mode syncs s3:// data first, like training does."""
    import train

    _upload(photo_root)
    rep = train.main(["--benchmark", "--data", "s3://data/ds", "--model", "none", "--loaders", "dali",
                      "--steps", "3", "--warmup", "1", "--batch-size", "4", "--device", "cpu",
                      "--output", str(tmp_path / "b"), "--cache-dir", str(cache_dir)])
    assert rep["loaders"]["dali"]["images_per_sec"] > 0 and rep["config"]["images"] == 44  # the training split
