"""`pack`: every good image once, labels and split kept, resized right, odd formats made RGB JPEG,
bad ones reported; byte-identical on a rerun; resumable after kill -9."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from dali_pipe.cli.commands import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from corpus import make_corpus

    root = tmp_path_factory.mktemp("corpus")
    return root, make_corpus(root)


def _members(dst: Path) -> dict[str, dict[str, bytes]]:
    """{key: {ext: bytes}} over every shard of a pack."""
    out: dict[str, dict[str, bytes]] = {}
    for tar in sorted(dst.glob("*.tar")):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                key, ext = m.name.rsplit(".", 1)
                out.setdefault(key, {})[ext] = t.extractfile(m).read()
    return out


def _pack(src, dst, *extra):
    main(["pack", str(src), str(dst), "--max-side", "100", "--shard-size", "40kB", "--workers", "2",
          "--max-bad-fraction", "0.5", *extra])


def test_round_trip_on_odd_and_bad_images(corpus, tmp_path, cache_dir):
    from PIL import Image

    from dali_pipe.manifest import read_manifest

    root, expected = corpus
    dst = tmp_path / "packed"
    _pack(root, dst)
    meta = json.loads((dst / "packed.json").read_text())
    members = _members(dst)
    bad = {p for p, r in expected.items() if r}
    manifest = read_manifest(root, val_fraction=0.1, seed=0, skip_missing=False)
    good = {os.path.relpath(s.path, root): ("val" if s in manifest.val else "train", manifest.classes[s.label])
            for s in manifest.train + manifest.val if os.path.relpath(s.path, root) not in bad}
    assert set(members) == {rel.rsplit(".", 1)[0] for rel in good}, "every good image packed once"
    assert meta["classes"] == manifest.classes
    for rel, (split, label) in good.items():
        parts = members[rel.rsplit(".", 1)[0]]
        assert meta["classes"][int(parts["cls"])] == label
        im = Image.open(io.BytesIO(parts["jpg"]))
        assert im.format == "JPEG" and im.mode == "RGB" and max(im.size) <= 100
        with Image.open(root / rel) as orig:
            w, h = orig.size
        if rel == "odd/exif_rot.jpg":
            assert im.size == (96 * 100 // 160, 100)  # turned upright (160x96 tagged rotate-90), then fitted
        elif max(w, h) > 100:
            assert abs(im.size[0] / im.size[1] - w / h) < 0.05
    split_of = {k: s for s, v in meta["splits"].items() for sh in v["shards"] for k in
                [line.split()[3].rsplit(".", 1)[0] for line in (dst / sh["index"]).read_text().splitlines()[1:]]}
    assert all(split_of[rel.rsplit(".", 1)[0]] == split for rel, (split, _) in good.items())
    tiny = root / "odd/tiny1x1.jpg"
    assert members["odd/tiny1x1"]["jpg"] == tiny.read_bytes(), "a small RGB JPEG is copied byte for byte"
    report = dict(line.split("\t", 1) for line in (dst / "bad_images.tsv").read_text().splitlines()[1:])
    assert set(report) == bad and "cannot be packed" in report["bad/bad_huffman.jpg"]
    assert meta["splits"]["train"]["samples"] + meta["splits"]["val"]["samples"] == len(good)


def test_the_same_input_gives_byte_identical_shards(photo_root, tmp_path, cache_dir):
    _pack(photo_root, tmp_path / "a", "--workers", "1")
    _pack(photo_root, tmp_path / "b")
    a, b = (json.loads((tmp_path / d / "packed.json").read_text()) for d in "ab")
    assert a == b and len(a["splits"]["train"]["shards"]) > 1
    for sh in a["splits"]["train"]["shards"] + a["splits"]["val"]["shards"]:
        assert (tmp_path / "a" / sh["name"]).read_bytes() == (tmp_path / "b" / sh["name"]).read_bytes()


def test_resume_after_kill_9_gives_the_same_pack(photo_root, tmp_path, cache_dir):
    """Killed after its first shards, the rerun skips them and ends byte-identical to a clean pack."""
    _pack(photo_root, tmp_path / "clean")
    dst = tmp_path / "resumed"
    env = {**os.environ, "DALI_PIPE_CACHE": str(cache_dir)}
    p = subprocess.Popen([sys.executable, "-m", "dali_pipe", "pack", str(photo_root), str(dst), "--max-side", "100",
                          "--shard-size", "40kB", "--workers", "1"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list(dst.glob("train-*.tar"))) < 2:
        time.sleep(0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (dst / "packed.json").exists() and list(dst.glob("train-*.tar"))
    main(["pack", str(photo_root), str(dst), "--max-side", "100", "--shard-size", "40kB"])
    clean = json.loads((tmp_path / "clean" / "packed.json").read_text())
    assert json.loads((dst / "packed.json").read_text()) == clean
    assert not [f for f in dst.iterdir() if ".tmp-" in f.name]
    for sh in clean["splits"]["train"]["shards"]:
        assert (dst / sh["name"]).read_bytes() == (tmp_path / "clean" / sh["name"]).read_bytes()


def test_other_settings_on_an_unfinished_pack_are_refused(photo_root, tmp_path, cache_dir):
    from dali_pipe.pack import PROGRESS_NAME, PackError

    dst = tmp_path / "p"
    dst.mkdir()
    (dst / PROGRESS_NAME).write_text(json.dumps({"settings": {"max_side": 999}, "splits": {}}))
    with pytest.raises(PackError, match="unfinished pack of other data or settings"):
        _pack(photo_root, dst)
