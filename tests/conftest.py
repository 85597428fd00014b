"""Shared fixtures: small real-photo datasets in the seed's layout, and the GPU marker."""
from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

# Tests send SIGINT (Ctrl-C) to the commands they start. A suite started with SIGINT ignored (a background job of
# a non-interactive shell: `cmd &` in a script, nohup in CI) would pass that on to every child, where Python then
# never raises KeyboardInterrupt, as a command started so should; the suite's own children are started as from a
# terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests", ROOT / "tools"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def _has_gpu() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible (these tests run on the GPU check machine)"
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False, "DALI is not installed"
    return True, ""


def pytest_collection_modifyitems(config, items):
    # the long multi-process tests first (a stable sort: the same order on every xdist worker), so that none
    # of them starts last and leaves the other worker idle at the end
    items.sort(key=lambda item: "slow" not in item.keywords)
    ok, why = _has_gpu()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"GPU test skipped: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def photo_root(tmp_path_factory) -> Path:
    """4 classes x 12 real-photo JPEGs (96-160 px), manifest without a label column."""
    from dali_pipe.demo import make_photo_dataset

    return make_photo_dataset(tmp_path_factory.mktemp("photos"), classes=4, per_class=12)


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


@pytest.fixture(scope="session")
def s3_process_port() -> int:
    """One loopback port for every s3_process server of the session: DALI's S3 client keeps the endpoint of
    its first use for the life of the process, so a second server on another port would be unreachable to it."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


@pytest.fixture
def s3_process(monkeypatch, s3_process_port):
    """moto's S3 server in its own process (DALI's own S3 client must not wait on this process's GIL,
    as it would with the threaded server), fresh for each test; the AWS env points boto3 and DALI at it."""
    import subprocess

    from s3server import wait_listening

    port = s3_process_port
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(port)
    url = f"http://127.0.0.1:{port}"
    for k, v in {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv("DALI_PIPE_CACHE", str(d))
    return d


@pytest.fixture(scope="session")
def trained(photo_root, tmp_path_factory) -> Path:
    """A tiny ViT trained for 4 epochs on photo_root (val fraction 0.25): the folder train.py wrote."""
    import os

    import train

    out = tmp_path_factory.mktemp("trained")
    old = os.environ.get("DALI_PIPE_CACHE")
    os.environ["DALI_PIPE_CACHE"] = str(out / "cache")
    try:
        train.main(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "4",
                    "--batch-size", "8", "--num-threads", "1", "--val-fraction", "0.25", "--lr", "2e-3",
                    "--output", str(out / "model")])
    finally:
        os.environ.pop("DALI_PIPE_CACHE") if old is None else os.environ.update(DALI_PIPE_CACHE=old)
    return out / "model"


@pytest.fixture(scope="session")
def odd_root(photo_root, tmp_path_factory) -> Path:
    """photo_root's 48 photos under odd names, each its own class (corpus.odd_names_dataset)."""
    from corpus import odd_names_dataset

    return odd_names_dataset(photo_root, tmp_path_factory.mktemp("odd"))


@pytest.fixture(scope="session")
def odd_pack(odd_root, tmp_path_factory) -> Path:
    """odd_root packed (max side 96, 60 kB shards, one process)."""
    import os

    from dali_pipe.cli.commands import main

    dst = tmp_path_factory.mktemp("oddpack") / "p"
    old = os.environ.get("DALI_PIPE_CACHE")
    os.environ["DALI_PIPE_CACHE"] = str(dst.parent / "cache")
    try:
        main(["pack", str(odd_root), str(dst), "--max-side", "96", "--shard-size", "60kB", "--workers", "1"])
    finally:
        os.environ.pop("DALI_PIPE_CACHE") if old is None else os.environ.update(DALI_PIPE_CACHE=old)
    return dst


BAD_MEMBERS = {"nocls": "no .cls member", "textcls": "is not an integer", "broken": "truncated JPEG",
               "p001": "duplicate key", "noimage": "no image member", "huffman": "corrupt JPEG data"}


@pytest.fixture(scope="session")
def peer_dir(photo_root, tmp_path_factory) -> Path:
    """photo_root written by webdataset's ShardWriter (corpus.peer_shards: train/val shards, jpg/png/webp,
    plain cls, json labels), plus the bad members of BAD_MEMBERS in the last training shard (the last only
    found by --scan full)."""
    import io

    import skimage.data
    from corpus import peer_shards
    from PIL import Image

    photo = Image.fromarray(skimage.data.astronaut()).resize((64, 64))
    buf = io.BytesIO()
    photo.save(buf, format="JPEG")
    good = buf.getvalue()
    i = good.index(b"\xff\xc4")  # the Huffman table's code counts made impossible: headers parse, decoding fails

    def extra(write):
        write({"__key__": "nocls", "jpg": good})
        write({"__key__": "textcls", "jpg": good, "cls": "cat"})
        write({"__key__": "broken", "jpg": good[: len(good) // 2], "cls": 1})
        write({"__key__": "p001", "jpg": good, "cls": 1})
        write({"__key__": "noimage", "txt": "no picture here", "cls": 2})
        write({"__key__": "huffman", "jpg": good[:i + 4] + b"\x00" + b"\xff" * 16 + good[i + 21:], "cls": 3})

    dest = tmp_path_factory.mktemp("peer") / "shards"
    peer_shards(photo_root, dest, extra=extra)
    return dest
