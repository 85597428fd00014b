"""S3 sync against a real S3 endpoint: moto's server on 127.0.0.1, boto3 over HTTP, no mocks."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dali_pipe.s3 import SyncError, make_client
from dali_pipe.sync import sync

ROOT = Path(__file__).resolve().parents[1]


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


def test_faults_are_retried_and_a_failed_sync_leaves_no_partial_file_and_the_rerun_completes(s3, photo_root,
                                                                                          tmp_path, monkeypatch):
    """Through a fault proxy: a 503 SlowDown and a cut body (once each) are retried and land whole; every GET of
    one class cut: those fail after their tries, naming the key, the completed files stay, no partial file
    nor manifest exists; the rerun (faults gone) fetches only the rest."""
    from faultproxy import FaultProxy

    server, url = s3
    _upload(photo_root)
    proxy = FaultProxy(url).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    proxy.arm("503", "coffee_0000.jpg")
    proxy.arm("cut", "coffee_0001.jpg")
    proxy.arm("cut", "/chelsea/", times=10**6)
    dest = tmp_path / "local"
    try:
        with pytest.raises(SyncError, match=r"(?s)\d+ of 48 download\(s\) failed.*rerun the sync.*chelsea/chelsea_"):
            sync("s3://data/ds", dest, workers=4, progress=False)
        assert proxy.applied("503") == 1 and (dest / "coffee/coffee_0000.jpg").read_bytes() == (
            photo_root / "coffee/coffee_0000.jpg").read_bytes()
        assert (dest / "coffee/coffee_0001.jpg").read_bytes() == (photo_root / "coffee/coffee_0001.jpg").read_bytes()
        assert not [p for p in dest.rglob("*") if ".part-" in p.name]
        assert not (dest / "dataset.tsv").exists()  # the manifest lands only when the set is complete
        assert not list(dest.rglob("chelsea_*.jpg"))
        partial = len(list(dest.rglob("*.jpg")))
        assert 0 < partial < 48
        proxy.faults.clear()
        done = sync("s3://data/ds", dest, workers=4, progress=False)
    finally:
        proxy.stop()
    assert done.downloaded == 48 - partial and done.skipped == partial
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


@pytest.mark.parametrize("uri, seg", [("s3://data/../../escape", ".."), ("s3://data/ds//x", ""), ("s3://data/./ds", "."),
                                      ("s3://../ds", "..")])
def test_a_prefix_that_no_folder_can_stand_for_is_refused_before_anything_is_written(tmp_path, uri, seg):
    """The cache dir's copy of s3://BUCKET/PREFIX is CACHE/s3/BUCKET/PREFIX: a '..' segment made it land outside
    (s3://b/../../x at CACHE/x), '//' and '.' share another prefix's folder. Refused, naming the URI, with nothing
    written."""
    import train
    from dali_pipe.config import UsageError
    from dali_pipe.s3 import local_target

    with pytest.raises(SyncError, match=rf"holds a {seg!r} segment, which no local folder can stand for"):
        local_target(uri, tmp_path / "cache")
    with pytest.raises((SyncError, UsageError)):
        train.main(["--data", uri, "--model", "tiny", "--device", "cpu", "--cache-dir", str(tmp_path / "cache"),
                    "--output", str(tmp_path / "o")])
    assert not (tmp_path / "escape").exists() and not (tmp_path / "cache").exists()


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
    assert "testing" not in str(e.value) and "[redacted]" not in str(e.value)  # the advice is not taken for a secret
    assert "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in str(e.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # a key without its secret: the message says which is missing
    with pytest.raises(SyncError, match="no usable AWS credentials .*AWS_SECRET_ACCESS_KEY") as e:
        sync("s3://data/ds", tmp_path / "x", workers=4, progress=False)


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
    assert rep["loaders"]["dali"]["images_per_sec"] > 0 and rep["config"]["images"] == 43  # the training split


def test_missing_objects_fail_unless_skip_missing(s3, photo_root, tmp_path):
    """Listed files absent from S3: a non-zero exit naming them; --skip-missing syncs the rest."""
    _upload(photo_root, extra_rows="coffee/ghost_1.jpg\ncoffee/ghost_2.jpg\n")
    with pytest.raises(SyncError, match=r"2 file\(s\) listed in dataset.tsv are not in s3://data/ds/.*--skip-missing"):
        sync("s3://data/ds", tmp_path / "a", workers=4, progress=False)
    assert not (tmp_path / "a" / "dataset.tsv").exists()
    r = subprocess.run([sys.executable, "-m", "dali_pipe", "sync", "s3://data/ds", str(tmp_path / "b"),
                        "--no-progress"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "ghost_1.jpg" in r.stderr and "Traceback" not in r.stderr
    stats = sync("s3://data/ds", tmp_path / "c", workers=4, progress=False, skip_missing=True)
    assert stats.missing == 2 and stats.downloaded == 48 and (tmp_path / "c" / "dataset.tsv").is_file()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_mid_sync_exits_cleanly_and_the_rerun_finishes(photo_root, tmp_path, monkeypatch, sig):
    """SIGTERM (or Ctrl-C's SIGINT) while downloading (every request takes 0.1 s): exit 143 (130) without a
    traceback and without a temporary file; the next sync completes the set."""
    import signal
    import time

    from s3server import delayed_server

    server = delayed_server(0.1)
    url = "http://%s:%d" % server.get_host_and_port()
    for k, v in {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    try:
        _upload(photo_root)
        dest = tmp_path / "L"
        p = subprocess.Popen([sys.executable, "-m", "dali_pipe", "sync", "s3://data/ds", str(dest), "--workers", "2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        deadline = time.time() + 60
        while time.time() < deadline and len(list(dest.rglob("*.jpg"))) < 2:
            time.sleep(0.05)
        p.send_signal(getattr(signal, sig))
        _, err = p.communicate(timeout=60)
        want = (143, "stopped by SIGTERM") if sig == "SIGTERM" else (130, "stopped by Ctrl-C")
        assert (p.returncode, want[1] in err, "Traceback" in err) == (want[0], True, False), err
        assert not [q for q in dest.rglob("*") if ".part-" in q.name or ".incoming-" in q.name]
        assert not (dest / "dataset.tsv").exists() and 0 < len(list(dest.rglob("*.jpg"))) < 48
        if sig == "SIGTERM":
            server.delay = 0
            done = sync("s3://data/ds", dest, workers=4, progress=False)
            assert done.downloaded + done.skipped == 48 and _tree(dest) == _tree(photo_root)
    finally:
        server.stop()


def test_the_instance_role_of_a_container_signs_the_requests(s3, photo_root, tmp_path, monkeypatch):
    """No keys in the environment, only the container credentials endpoint that SageMaker (and ECS) set
    (AWS_CONTAINER_CREDENTIALS_FULL_URI here, on 127.0.0.1): botocore's chain fetches the role's keys
    and token, and they sign every request of the sync."""
    import http.server
    import json

    from faultproxy import FaultProxy

    server, url = s3
    _upload(photo_root)
    role = {"AccessKeyId": "ASIAROLEKEY000000001", "SecretAccessKey": "role-secret", "Token": "role-token-xyz",
            "Expiration": "2099-01-01T00:00:00Z"}
    asked = []

    class Creds(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = json.dumps(role).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    creds = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Creds)
    threading.Thread(target=creds.serve_forever, daemon=True).start()
    proxy = FaultProxy(url).start()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"http://127.0.0.1:{creds.server_address[1]}/role")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        stats = sync("s3://data/ds", tmp_path / "L", workers=4, progress=False)
    finally:
        proxy.stop()
        creds.shutdown()
    assert stats.downloaded == 48 and asked and set(asked) == {"/role"}  # botocore retries a slow answer (1 s)
    headers = [{k.lower(): v for k, v in r[3].items()} for r in proxy.requests]
    assert headers and all("Credential=ASIAROLEKEY000000001/" in h["authorization"]
                           and h.get("x-amz-security-token") == "role-token-xyz" for h in headers)


def test_a_key_the_engine_cannot_name_elsewhere_in_the_prefix_does_not_stop_the_sync(s3, photo_root, tmp_path):
    """object_store refuses keys with an empty path segment (`ds/odd//x.bin`): such a prefix is listed by
    boto3 instead, and the manifest's files arrive."""
    client = _upload(photo_root)
    client.put_object(Bucket="data", Key="ds/odd//x.bin", Body=b"odd")
    assert sync("s3://data/ds", tmp_path / "L", workers=4, progress=False).downloaded == 48
    assert _tree(tmp_path / "L") == _tree(photo_root)


def test_temp_files_of_dead_syncs_are_removed_and_live_ones_kept(s3, photo_root, tmp_path):
    _upload(photo_root)
    dest = tmp_path / "L"
    (dest / "coffee").mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (dest / "coffee" / f".coffee_0001.jpg.part-1-{dead_pid}").write_bytes(b"half")
    (dest / f".dataset.tsv.incoming-{dead_pid}").write_bytes(b"half")
    (dest / f".sync-running-{dead_pid}").touch()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (dest / "coffee" / f".coffee_0002.jpg.part-1-{live.pid}").write_bytes(b"busy")
        sync("s3://data/ds", dest, workers=4, progress=False)
        left = sorted(q.name for q in dest.rglob(".*") if q.is_file() and not q.name.startswith((".sync-state",
                                                                                                ".dali_pipe")))
        assert left == [f".coffee_0002.jpg.part-1-{live.pid}"], left
    finally:
        live.kill()


def test_a_second_sync_into_the_same_target_stops_naming_the_first(s3, photo_root, tmp_path):
    from dali_pipe.workdir import BusyError

    _upload(photo_root)
    from helpers import hold_lock

    dest = tmp_path / "L"
    holder = hold_lock(dest, "sync")
    try:
        with pytest.raises(BusyError, match=rf"in use by another sync \(PID {holder.pid}\)"):
            sync("s3://data/ds", dest, workers=4, progress=False)
    finally:
        holder.kill()


def test_an_endpoint_that_never_answers_fails_fast_and_names_it(tmp_path, monkeypatch):
    """A server that accepts connections and never replies: the bounded timeouts and tries end the
    sync with a message naming the endpoint, its credentials redacted."""
    import socket
    import time

    from dali_pipe.s3 import Bounds

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    port = silent.getsockname()[1]
    for k, v in {"AWS_ENDPOINT_URL": f"http://admin:s3cr3tpass@127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    t = time.perf_counter()
    try:
        with pytest.raises(SyncError) as e:
            sync("s3://data/ds", tmp_path / "L", workers=2, progress=False,
                 bounds=Bounds(read_timeout=0.5, request_attempts=2))
    finally:
        silent.close()
    assert time.perf_counter() - t < 15
    msg = str(e.value)
    assert f"http://[redacted]@127.0.0.1:{port} did not answer" in msg and "s3cr3tpass" not in msg


def test_messages_name_the_endpoint_boto3_uses(monkeypatch):
    """With AWS_ENDPOINT_URL and AWS_ENDPOINT_URL_S3 both set, messages name the S3 one, the one boto3 sends to."""
    from dali_pipe.s3 import make_client
    from dali_pipe.sync import endpoint

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert endpoint() == make_client(1).meta.endpoint_url == "http://127.0.0.1:2"


def test_the_default_timeouts_bound_a_silent_endpoint_to_about_a_minute():
    """One request (the manifest, the LIST) and the whole download phase each end within about a minute."""
    from dali_pipe.s3 import SYNC_BOUNDS as b

    assert b.connect_timeout + b.request_attempts * b.read_timeout <= 65
    assert b.stall + b.read_timeout <= 65


def test_an_endpoint_silent_for_every_get_stops_the_whole_sync_at_one_deadline(s3, tmp_path, monkeypatch):
    """LIST and the manifest answer, then every GET of 200 files hangs (a proxy in front of moto): the sync
    stops after one shared deadline (its bounds' stall, set small here), not one per file, without
    retrying, and says so naming the endpoint; nothing partial is left."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from faultproxy import FaultProxy

    from dali_pipe.s3 import Bounds

    server, url = s3
    client = make_client(16)
    client.create_bucket(Bucket="data")
    rows = [f"c{i % 2}/f{i:03d}.jpg" for i in range(200)]
    client.put_object(Bucket="data", Key="ds/dataset.tsv", Body=("image_path\n" + "\n".join(rows) + "\n").encode())
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda r: client.put_object(Bucket="data", Key=f"ds/{r}", Body=b"x"), rows))
    proxy = FaultProxy(url).start()
    proxy.arm("hang", ".jpg", times=10**6)  # every GET of a photo
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    dest = tmp_path / "L"
    t = time.perf_counter()
    try:
        with pytest.raises(SyncError) as e:
            sync("s3://data/ds", dest, workers=32, progress=False, bounds=Bounds(read_timeout=0.5, stall=1.0))
    finally:
        proxy.stop()
    took = time.perf_counter() - t
    msg = str(e.value)
    assert f"{proxy.url} sent no data for 1 s, so the sync stops: 0 of 200 file(s) fetched" in msg, msg
    assert proxy.applied("hang") < 200, "the deadline stops the sync before every file has had its GET"
    assert took < 60, took  # loose: per file (200 x 3 tries x 0.5 s / 32 workers) it would be ~10 s or more
    assert not [p for p in dest.rglob("*") if ".part-" in p.name] and not (dest / "dataset.tsv").exists()


def test_a_full_disk_gives_one_clear_error_and_keeps_what_was_fetched(s3, photo_root, tmp_path, monkeypatch):
    """A 128 KiB disk (tmpfs) for 270 KB of photos: refused before the first GET, in readable units;
    when the disk fills during the downloads anyway (the room check skipped, as when another writer
    fills it), one SyncError says so, the fetched files are whole, no partial file or manifest."""
    import json

    from helpers import small_disk

    import dali_pipe.sync as mod

    _upload(photo_root)
    with small_disk(tmp_path / "disk", "128k") as disk:
        dest = disk / "L"
        with pytest.raises(SyncError, match=r"the 48 file\(s\) to download need \d+\.\d KiB, but .* has \d+\.\d KiB "
                                            r"free; free space there.*Nothing was downloaded"):
            sync("s3://data/ds", dest, workers=4, progress=False)
        monkeypatch.setattr(mod, "check_room", lambda dest, todo: None)
        with pytest.raises(SyncError, match=r"the disk under .* is full \(No space left on device\) after \d+ of 48 "
                                            r"file\(s\); the completed files are kept. Free about") as e:
            sync("s3://data/ds", dest, workers=4, progress=False)
        assert "Traceback" not in str(e.value)
        got = [p for p in dest.rglob("*.jpg")]
        assert got and all(p.read_bytes() == (photo_root / p.relative_to(dest)).read_bytes() for p in got)
        assert not [p for p in dest.rglob("*") if ".part-" in p.name or ".incoming-" in p.name]
        assert not (dest / "dataset.tsv").exists()
        state = dest / ".sync-state.json"
        assert not state.exists() or isinstance(json.loads(state.read_text()), dict)


def test_a_read_only_target_is_one_clear_error(s3, photo_root, tmp_path):
    """A target on a read-only file system: one SyncError naming it, no traceback (before: an OSError from
    the sync's running marker, then another from its removal)."""
    _upload(photo_root)
    disk = tmp_path / "ro"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (disk / "L").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(SyncError, match=r"cannot write into .*/ro/L \(Read-only file system\); make it writable"):
            sync("s3://data/ds", disk / "L", workers=4, progress=False)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_training_data_with_a_bad_row_fails_naming_the_s3_manifest_before_any_download(s3, photo_root, tmp_path):
    """--data s3://...: a row training would refuse (an empty label beside labelled rows) stops the sync
    before any GET, naming the manifest in S3 (the copy in the cache dir is overwritten by every sync)."""
    from dali_pipe.config import DataSettings
    from dali_pipe.dataset import prepare

    client = _upload(photo_root)
    rows = "".join(f"{line}\t{line.split('/')[0]}\n" for line in
                   (photo_root / "dataset.tsv").read_text().splitlines()[1:])
    text = "image_path\tlabel\n" + rows + "coffee/coffee_0001.jpg\t\n"
    client.put_object(Bucket="data", Key="ds/dataset.tsv", Body=text.replace("coffee/coffee_0001.jpg\tcoffee\n", "", 1).encode())
    data = DataSettings(data="s3://data/ds", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(SyncError, match=r"s3://data/ds/dataset.tsv: 1 bad row\(s\):\n  line 49: 'coffee/coffee_0001"
                                        r".jpg' has an empty label.*\nNothing was downloaded: fix the manifest in S3"):
        prepare(data, tmp_path / "out", num_threads=1)
    assert not list((tmp_path / "cache").rglob("*.jpg"))
    assert sync("s3://data/ds", tmp_path / "plain", workers=4, progress=False).downloaded == 48  # plain sync: labels unchecked


def test_a_row_naming_a_folder_in_s3_is_named_as_a_folder(s3, photo_root, tmp_path):
    """A row naming a folder of the prefix (as `aws s3 sync` lays them out) is an error saying so, with its
    line, before any download (before: 'not in s3://...'); predict's sync (--skip-missing) still fetches the rest."""
    _upload(photo_root, extra_rows="coffee\n")
    with pytest.raises(SyncError, match=r"line 50: 'coffee' is a folder in s3://data/ds/, not a file; list the "
                                        r"image files, one per row. Nothing was downloaded"):
        sync("s3://data/ds", tmp_path / "L", workers=4, progress=False)
    assert not list((tmp_path / "L").rglob("*.jpg"))
    assert sync("s3://data/ds", tmp_path / "P", workers=4, progress=False, skip_missing=True).downloaded == 48


def test_cli_sync_of_a_pack_asks_for_packed_json_once_through_one_engine(s3, photo_root, tmp_path, cache_dir,
                                                                          monkeypatch):
    """`python -m dali_pipe sync` of a pack: dataset.tsv (absent), packed.json and the prefix's one LIST are asked
    for at once (the LIST before dataset.tsv's answer is waited for), on one engine (no boto3 client), which then
    fetches the index files; the shards come through an engine of their own, whatever --workers (with the
    command's `--workers 1`, a shard waiting behind another for its one request counted as silent and was
    cancelled). The shards land whole, each matching packed.json, and packed.json lands last. They come in
    ranged parts (moto answers 206), several shards at once."""
    import hashlib
    import json

    from dali_pipe import transfer
    from dali_pipe.cli.commands import main
    from dali_pipe.transfer import Engine

    make_client(4).create_bucket(Bucket="data")
    main(["pack", str(photo_root), "s3://data/packed", "--max-side", "96", "--shard-size", "60kB"])
    reads, engines, lists, asked = [], [], [], []
    real_read, real_init, real_list = Engine.read, Engine.__init__, Engine.list
    monkeypatch.setattr(Engine, "read", lambda self, bucket, key: reads.append(key) or asked.append(key)
                        or real_read(self, bucket, key))
    monkeypatch.setattr(Engine, "list", lambda self, bucket, prefix: lists.append(prefix) or asked.append("LIST")
                        or real_list(self, bucket, prefix))
    monkeypatch.setattr(Engine, "__init__", lambda self, **kw: engines.append(kw) or real_init(self, **kw))
    import boto3.session

    monkeypatch.setattr(boto3.session.Session, "client", lambda *a, **kw: pytest.fail("a boto3 client was made"))
    dest = tmp_path / "local"
    monkeypatch.setattr(transfer, "PART", 16 << 10)  # the 60 kB shards in ranged GETs of 16 kB
    assert main(["sync", "s3://data/packed", str(dest), "--no-progress", "--workers", "1"]) == 0
    assert sorted(reads) == ["packed/dataset.tsv", "packed/packed.json"] and lists == ["packed/"]
    assert asked.index("LIST") < asked.index("packed/dataset.tsv"), asked  # asked beside it, not after its answer
    assert [e["concurrency"] for e in engines] == [1, 8], engines  # the command's (--workers), the shards' own
    assert engines[1]["read_timeout"] == 10.0  # a stalled shard body is retried after the shards' READ_TIMEOUT
    meta = json.loads((dest / "packed.json").read_text())
    shards = [s for split in meta["splits"].values() for s in split["shards"]]
    for s in shards:
        assert hashlib.sha256((dest / s["name"]).read_bytes()).hexdigest() == s["sha256"]
        assert (dest / s["index"]).is_file()
    landed = max((dest / n).stat().st_mtime_ns for s in shards for n in (s["name"], s["index"]))
    assert (dest / "packed.json").stat().st_mtime_ns >= landed
    assert not [p for p in dest.iterdir() if ".part-" in p.name]


@pytest.mark.parametrize("hard", ["low", "high"])
def test_a_low_open_file_limit_means_fewer_requests_in_flight_not_failed_files(s3, photo_root, tmp_path, hard):
    """400 files at the default 256 requests in flight under `ulimit -n 300`: where the hard limit is higher the
    soft one is raised (as Go's runtime does for s5cmd) and nothing is said; where it is 300 too, fewer requests
    go at once and stderr says why. Either way every file lands (before, most failed with EMFILE)."""
    import resource

    client = make_client(8)
    client.create_bucket(Bucket="data")
    photo = next(photo_root.rglob("*.jpg")).read_bytes()
    rows = ["image_path\tlabel"] + [f"c/{i:03d}.jpg\tc" for i in range(400)]
    for i in range(400):
        client.put_object(Bucket="data", Key=f"ds/c/{i:03d}.jpg", Body=photo)
    client.put_object(Bucket="data", Key="ds/dataset.tsv", Body="\n".join(rows).encode() + b"\n")
    _, top = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = (300, 300 if hard == "low" else top)
    r = subprocess.run([sys.executable, "-m", "dali_pipe", "sync", "s3://data/ds", str(tmp_path / "L"), "--no-progress"],
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit))
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(list((tmp_path / "L" / "c").iterdir())) == 400
    told = "the open-file limit (300, `ulimit -n`) leaves room for 86 S3 requests in flight, not 256"
    assert (told in r.stderr) == (hard == "low"), r.stderr[-2000:]


def test_an_asked_listing_serves_its_own_prefix_only_and_an_interrupted_wait_drops_it(s3, tmp_path):
    """listing(asked=...): the LIST asked for ahead (ask_listing) answers for its prefix; for another prefix a LIST
    of that one is made; a wait cut by Ctrl-C or SIGTERM cancels the request instead of leaving it running."""
    from concurrent.futures import Future

    from dali_pipe.sync import AskedListing, ask_listing, listing, make_engine

    client = make_client(4)
    client.create_bucket(Bucket="data")
    for key in ("a/1.jpg", "a/2.jpg", "b/3.jpg"):
        client.put_object(Bucket="data", Key=key, Body=key.encode())
    engine = make_engine(4)
    try:
        asked = ask_listing(engine, "s3://data/a")
        assert sorted(listing(engine, "data", "a/", asked)) == ["1.jpg", "2.jpg"]
        assert sorted(listing(engine, "data", "b/", asked)) == ["3.jpg"]  # not a/'s answer

        class Interrupted(Future):
            def result(self, timeout=None):
                raise KeyboardInterrupt

        cut = AskedListing("data", "a/", Interrupted())
        with pytest.raises(KeyboardInterrupt):
            listing(engine, "data", "a/", cut)
        assert cut.future.cancelled()
    finally:
        engine.close()


def test_a_sync_asks_for_the_listing_beside_the_manifest_and_drops_it_when_the_manifest_is_refused(
        s3, photo_root, tmp_path, monkeypatch):
    """sync() as training calls it (no listing given): the prefix's LIST is asked for before the manifest's answer
    is waited for, and the sync completes; where the manifest is missing, the LIST still in flight is cancelled,
    not waited for."""
    import asyncio

    from dali_pipe import sync as sync_mod
    from dali_pipe.s3 import ManifestMissing
    from dali_pipe.sync import make_engine
    from dali_pipe.transfer import Engine

    _upload(photo_root)
    order = []
    real_read, real_list = Engine.read, Engine.list
    monkeypatch.setattr(Engine, "read", lambda self, b, k: order.append(k) or real_read(self, b, k))
    monkeypatch.setattr(Engine, "list", lambda self, b, p: order.append("LIST") or real_list(self, b, p))
    stats = sync("s3://data/ds", tmp_path / "L", workers=4, progress=False)
    assert order[:2] == ["LIST", "ds/dataset.tsv"] and order.count("LIST") == 1, order  # the LIST asked is used
    assert stats.downloaded == stats.listed > 0

    async def never(self, bucket, prefix):
        await asyncio.Event().wait()

    monkeypatch.setattr(Engine, "list", never)
    made = []
    real_ask = sync_mod.ask_listing
    monkeypatch.setattr(sync_mod, "ask_listing", lambda *a: made.append(real_ask(*a)) or made[-1])
    engine = make_engine(4)
    try:
        with pytest.raises(ManifestMissing):
            sync("s3://data/nothing-here", tmp_path / "M", workers=4, progress=False, engine=engine)
        assert made and made[0].future.cancelled()
    finally:
        engine.close()


def test_the_state_is_a_snapshot_and_a_journal_that_a_kill_keeps(tmp_path):
    """Each fetched file is appended to the journal (not the whole state rewritten); a sync killed before its end
    leaves the journal, which the next one reads (a torn last line skipped); the end folds it into the snapshot."""
    import json

    from dali_pipe.sync import JOURNAL_NAME, STATE_NAME, SyncState

    (tmp_path / "a.jpg").write_bytes(b"12345")
    first = SyncState(tmp_path, every_s=0.0)
    first.record("a.jpg", 5, "e1")
    first.record("b\tc\nd.jpg", 7, "e2")  # any key: one JSON line each
    assert not (tmp_path / STATE_NAME).exists()  # killed here: no snapshot, the journal holds both
    with open(tmp_path / JOURNAL_NAME, "a") as f:
        f.write('["half.jpg", 3, "e')  # the line a kill cut
    again = SyncState(tmp_path)
    assert again.data == {"a.jpg": [5, "e1"], "b\tc\nd.jpg": [7, "e2"]}
    assert again.unchanged("a.jpg", 5, "e1", tmp_path / "a.jpg") and not again.unchanged("a.jpg", 5, "e9",
                                                                                         tmp_path / "a.jpg")
    again.record("e.jpg", 1, "e3")
    again.save()
    assert not (tmp_path / JOURNAL_NAME).exists()
    assert json.loads((tmp_path / STATE_NAME).read_text()) == {**again.data, "e.jpg": [1, "e3"]}
    assert SyncState(tmp_path).data == again.data
