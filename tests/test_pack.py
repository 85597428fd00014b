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

import train
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


@pytest.mark.slow
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
    # the stopped pack is no data: refused by name, with the fix (before: trained on its shards so far, exit 0)
    told = r"is an unfinished pack \(its .pack-progress.json is there, its packed.json is not: the pack was stopped\); " \
           r"rerun the pack command that wrote it"
    from dali_pipe.config import UsageError
    from dali_pipe.forms import UnfinishedPackError
    from dali_pipe.inputs import detect

    with pytest.raises(UnfinishedPackError, match=told):
        detect(str(dst))
    from dali_pipe.config import DataSettings
    from dali_pipe.inputs import read

    for part in (dst / "train-000000.tar", str(dst / "train-{000000..000000}.tar")):  # one of its shards, a pattern
        with pytest.raises(UnfinishedPackError, match=told):
            read(DataSettings(data=str(part), cache_dir=str(tmp_path / "c")))
    with pytest.raises(UsageError, match=told):
        train.main(["--data", str(dst), "--model", "tiny", "--device", "cpu", "--output", str(tmp_path / "o")])
    main(["pack", str(photo_root), str(dst), "--max-side", "100", "--shard-size", "40kB"])
    clean = json.loads((tmp_path / "clean" / "packed.json").read_text())
    assert json.loads((dst / "packed.json").read_text()) == clean
    assert not [f for f in dst.iterdir() if ".tmp-" in f.name]
    for sh in clean["splits"]["train"]["shards"]:
        assert (dst / sh["name"]).read_bytes() == (tmp_path / "clean" / sh["name"]).read_bytes()


def test_each_shard_carries_the_sha256_and_the_xxh3_128_of_its_bytes(odd_pack):
    """packed.json records per shard both checksums, as hashlib and the xxhash library compute them: the sha256
    for any tool (sha256sum), the XXH3-128 that syncs, streams and checks before training verify at ~9 GB/s."""
    import hashlib

    import xxhash

    shards = [s for split in json.loads((odd_pack / "packed.json").read_text())["splits"].values()
              for s in split["shards"]]
    assert shards
    for s in shards:
        raw = (odd_pack / s["name"]).read_bytes()
        assert (s["sha256"], s["xxh3_128"]) == (hashlib.sha256(raw).hexdigest(), xxhash.xxh3_128(raw).hexdigest())


@pytest.mark.parametrize("field,value,message", [
    ("xxh3_128", "0" * 32, "has xxh3_128 .*packed.json records 000000000000"),
    ("sha256", "f" * 64, "has sha256 .*packed.json records ffffffffffff"),
    ("xxh3_128", 12345, "'xxh3_128' is not 32 hexadecimal digits"),
    ("xxh3_128", None, "'xxh3_128' is not 32 hexadecimal digits"),
    ("xxh3_128", "A" * 32, "'xxh3_128' is not 32 hexadecimal digits"),
])
def test_a_rerun_holds_both_checksums_to_the_bytes_even_after_readers_checked_them(odd_pack, odd_root, tmp_path,
                                                                                   cache_dir, field, value, message):
    """A rerun over a finished pack checks both checksums of each shard (and refuses a malformed one as every
    reader does): a verdict a reader recorded (its fast checksum only) does not make it 'nothing to do'."""
    import shutil

    from dali_pipe.pack import PackError
    from dali_pipe.shards.packs import open_packed
    from dali_pipe.shards.verdicts import verify_local

    dst = tmp_path / "p"
    shutil.copytree(odd_pack, dst)

    def again():  # the command that made odd_pack
        main(["pack", str(odd_root), str(dst), "--max-side", "96", "--shard-size", "60kB", "--workers", "1"])

    again()  # nothing to do: the pack's verdicts are cached
    meta = json.loads((dst / "packed.json").read_text())
    meta["splits"]["train"]["shards"][0][field] = value
    (dst / "packed.json").write_text(json.dumps(meta))
    if field == "sha256":  # a reader checks the fast checksum and records that verdict
        verify_local(open_packed(str(dst), "unused").train, cache_dir, progress=False)
    with pytest.raises(PackError, match=message):
        again()


def test_nothing_to_do_only_over_a_pack_whose_bytes_match(odd_pack, odd_root, tmp_path, cache_dir):
    """A rerun over a finished pack whose shard has a flipped byte (same size) or whose index lies is an error
    naming the file, not 'nothing to do'; once repaired, the rerun has nothing to do."""
    import shutil

    from dali_pipe.pack import PackError

    dst = tmp_path / "p"
    shutil.copytree(odd_pack, dst)

    def again():  # the command that made odd_pack
        main(["pack", str(odd_root), str(dst), "--max-side", "96", "--shard-size", "60kB", "--workers", "1"])

    shard = dst / json.loads((dst / "packed.json").read_text())["splits"]["train"]["shards"][0]["name"]
    good = shard.read_bytes()
    shard.write_bytes(good[:3000] + bytes([good[3000] ^ 1]) + good[3001:])
    with pytest.raises(PackError, match=f"{shard.name}.*sha256"):
        again()
    shard.write_bytes(good)
    meta = json.loads((dst / "packed.json").read_text())
    meta["splits"]["train"]["shards"][0]["xxh3_128"] = "0" * 32  # the fast checksum is held to the bytes too
    (dst / "packed.json").write_text(json.dumps(meta))
    with pytest.raises(PackError, match=f"{shard.name} has xxh3_128 .*packed.json records 000000000000"):
        again()
    (dst / "packed.json").write_text((odd_pack / "packed.json").read_text())
    index = shard.with_suffix(".idx")
    lines = index.read_text().splitlines()
    index.write_text("\n".join([lines[0]] + lines[2:] + [lines[1]]) + "\n")  # same samples, other order
    with pytest.raises(PackError, match=index.name):
        again()
    index.write_text("\n".join(lines) + "\n")
    again()
    assert json.loads((dst / "packed.json").read_text()) == json.loads((odd_pack / "packed.json").read_text())


def test_a_pack_killed_before_its_first_shard_leaves_no_temporary_file(photo_root, tmp_path, cache_dir):
    """SIGKILL before the first shard is finished leaves its temporary file and no progress file; the rerun
    removes it (a dead writer's), and DST holds the pack and nothing else."""
    dst = tmp_path / "p"
    dst.mkdir()
    (dst / ".train-000000.tar.tmp-999999999").write_bytes(b"x" * 1000)
    _pack(photo_root, dst)
    assert {f.name for f in dst.iterdir()} == _pack_files(dst)


def test_other_settings_on_an_unfinished_pack_are_refused(photo_root, tmp_path, cache_dir):
    from dali_pipe.pack import PROGRESS_NAME, PackError

    dst = tmp_path / "p"
    dst.mkdir()
    (dst / PROGRESS_NAME).write_text(json.dumps({"settings": {"max_side": 999}, "splits": {}}))
    with pytest.raises(PackError, match="unfinished pack of other data or settings"):
        _pack(photo_root, dst)


def _pack_files(dst: Path) -> set[str]:
    """What DST must hold: the shards, their indexes, packed.json and bad_images.tsv; nothing else of ours
    (no lock, temporary or progress file)."""
    meta = json.loads((dst / "packed.json").read_text())
    names = {n for split in meta["splits"].values() for s in split["shards"] for n in (s["name"], s["index"])}
    return names | {"packed.json", "bad_images.tsv"}


def test_odd_names_pack_as_webdataset_reads_them(odd_pack, odd_root):
    """The webdataset library reads a pack of odd names sample by sample: each image decodes, cls as webdataset
    decodes it is the manifest label's index in packed.json's classes, and the json member names the row as
    dataset.tsv wrote it; DST holds the pack and nothing else."""
    import webdataset as wds

    from dali_pipe.manifest import read_table

    meta = json.loads((odd_pack / "packed.json").read_text())
    rows = dict(zip(read_table(odd_root / "dataset.tsv")["image_path"], read_table(odd_root / "dataset.tsv")["label"]))
    shards = [str(odd_pack / s["name"]) for split in meta["splits"].values() for s in split["shards"]]
    seen = []
    for sample in wds.WebDataset(shards, shardshuffle=False).decode("pil"):
        assert sample["jpg"].mode == "RGB" and max(sample["jpg"].size) <= 96
        assert sample["cls"] == meta["classes"].index(rows[sample["json"]["image_path"]])
        assert sample["json"]["label"] == rows[sample["json"]["image_path"]]
        seen.append(sample["json"]["image_path"])
    assert sorted(seen) == sorted(rows)
    assert {p.name for p in odd_pack.iterdir()} == _pack_files(odd_pack)


def test_shards_of_others_repack_with_pre_resize_and_scan(peer_dir, tmp_path, cache_dir):
    """pack SRC=a folder of ShardWriter shards: every good sample once, its label by name, the split kept, the
    images resized to --max-side; the bad members (--scan full) listed with shard and key, never packed."""
    import webdataset as wds
    from conftest import BAD_MEMBERS

    dst = tmp_path / "re"
    _pack(peer_dir, dst, "--max-side", "64", "--scan", "full", "--max-bad-fraction", "0.2", "--workers", "1")
    meta = json.loads((dst / "packed.json").read_text())
    assert meta["splits"]["val"]["samples"] == 6 and meta["splits"]["train"]["samples"] == 42
    labels = {}
    for split in ("train", "val"):
        for s in wds.WebDataset([str(dst / s["name"]) for s in meta["splits"][split]["shards"]],
                                shardshuffle=False).decode("pil"):
            assert max(s["jpg"].size) <= 64 and meta["classes"][s["cls"]] == s["json"]["label"]
            labels[s["json"]["image_path"]] = (s["json"]["label"], split)
    assert len(labels) == 48 and all(label == f"s{int(key[-3:]):03d}" for key, (label, _) in labels.items())
    rows = [r.split("\t") for r in (dst / "bad_images.tsv").read_text().splitlines()[1:]]
    assert {r[3] for r in rows} == set(BAD_MEMBERS) and all(r[2] == "train-000002.tar" for r in rows)


def test_an_s3_pack_killed_during_its_upload_finishes_on_rerun(photo_root, s3, tmp_path, cache_dir, capsys):
    """An s3:// pack whose upload stopped half way (its finished pack still in the staging folder) is uploaded
    on a rerun; a rerun after that has nothing to do, unless a shard in S3 was replaced (same size, other bytes):
    then it is uploaded again; other settings replace the pack in S3, its stale objects removed, also when that
    upload was stopped after the old packed.json was gone. The bucket never holds a lock, temporary or progress
    file."""
    from helpers import s3_listing as list_objects

    from dali_pipe.s3 import make_client

    client = make_client(4)
    client.create_bucket(Bucket="data")
    staging = cache_dir / "pack-staging" / "data" / "packed"
    _pack(photo_root, staging, "--workers", "1")  # what a kill -9 during the upload leaves behind
    first = json.loads((staging / "packed.json").read_text())["splits"]["train"]["shards"][0]
    client.upload_file(str(staging / first["name"]), "data", f"packed/{first['name']}")
    _pack(photo_root, "s3://data/packed", "--workers", "1")
    local = tmp_path / "fresh"
    _pack(photo_root, local, "--workers", "1")
    assert set(list_objects(client, "data", "packed/")) == _pack_files(local)
    assert json.loads(client.get_object(Bucket="data", Key="packed/packed.json")["Body"].read()) == json.loads(
        (local / "packed.json").read_text())
    capsys.readouterr()
    _pack(photo_root, "s3://data/packed", "--workers", "1")
    assert "already holds this pack" in capsys.readouterr().err
    good = (local / first["name"]).read_bytes()  # replaced in S3 by bytes of the same size: uploaded again
    client.put_object(Bucket="data", Key=f"packed/{first['name']}", Body=good[:3000] + bytes([good[3000] ^ 1]) + good[3001:])
    _pack(photo_root, "s3://data/packed", "--workers", "1")
    assert "nothing to do" not in capsys.readouterr().err
    assert client.get_object(Bucket="data", Key=f"packed/{first['name']}")["Body"].read() == good
    from dali_pipe.transfer import Engine

    def dying(*a, **k):  # the replacing upload stops (a kill) once the old packed.json is gone
        raise SystemExit("killed")

    real = Engine.put  # what the pack command uploads with
    Engine.put = dying
    try:
        with pytest.raises(SystemExit):
            _pack(photo_root, "s3://data/packed", "--workers", "1", "--shard-size", "150kB")
    finally:
        Engine.put = real
    from dali_pipe.forms import UnfinishedPackError
    from dali_pipe.inputs import detect

    with pytest.raises(UnfinishedPackError, match=r"is a pack whose upload was stopped .*rerun the pack command"):
        detect("s3://data/packed", str(tmp_path / "another-cache"))  # (before: its shards so far trained)
    _pack(photo_root, "s3://data/packed", "--workers", "1", "--shard-size", "150kB")
    meta = json.loads(client.get_object(Bucket="data", Key="packed/packed.json")["Body"].read())
    names = {n for sp in meta["splits"].values() for s in sp["shards"] for n in (s["name"], s["index"])}
    assert meta["settings"]["shard_size"] == 150_000 and set(list_objects(client, "data", "packed/")) == names | {
        "packed.json", "bad_images.tsv"}


def test_shards_of_others_in_several_s3_folders_repack_each_from_its_own(photo_root, s3, tmp_path, cache_dir):
    """Packing `s3://.../{train,val}/part-0.tar` (two shards of one name in two folders) copies each from its own
    folder: the val folder's samples make the val split, the train folder's the train split."""
    import webdataset as wds

    from dali_pipe.s3 import make_client

    photos = sorted(photo_root.glob("*/*.jpg"))
    client = make_client(4)
    client.create_bucket(Bucket="data")
    source = {}
    for n, split in enumerate(("train", "val")):
        with wds.TarWriter(str(tmp_path / f"{split}.tar")) as w:
            for i in range(4):
                source[f"{split}{i}"] = photos[10 * n + i].read_bytes()
                w.write({"__key__": f"{split}{i}", "jpg": source[f"{split}{i}"], "cls": i % 2})
        client.upload_file(str(tmp_path / f"{split}.tar"), "data", f"shards/{split}/part-0.tar")
    dst = tmp_path / "p"
    _pack("s3://data/shards/{train,val}/part-0.tar", dst, "--workers", "1", "--max-side", "400")  # copied as they are
    meta = json.loads((dst / "packed.json").read_text())
    paths = {split: sorted(p for s in meta["splits"][split]["shards"] for p in s["image_paths"]) for split in meta["splits"]}
    assert paths == {"train": [f"train{i}" for i in range(4)], "val": [f"val{i}" for i in range(4)]}
    packed = {json.loads(m["json"])["image_path"]: m["jpg"] for m in _members(dst).values()}
    assert packed == source


def test_a_full_disk_during_pack_is_one_message_and_loses_nothing(photo_root, tmp_path, cache_dir):
    """Packing onto a disk that fills up stops with one message naming the folder; the finished shards stay and
    no temporary file is left; after room is made, the rerun ends with the same pack as one that never stopped."""
    from dali_pipe.pack import PackError

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    try:
        with pytest.raises(PackError, match=r"no space left on the disk of .*disk.*finished shard\(s\) .* are kept"):
            _pack(photo_root, disk / "p", "--workers", "1")
        left = {p.name for p in (disk / "p").iterdir()}
        assert any(n.endswith(".tar") for n in left) and not [n for n in left if ".tmp" in n]
        subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        _pack(photo_root, disk / "p", "--workers", "1")
        _pack(photo_root, tmp_path / "clean", "--workers", "1")
        assert json.loads((disk / "p" / "packed.json").read_text()) == json.loads(
            (tmp_path / "clean" / "packed.json").read_text())
        assert {p.name for p in (disk / "p").iterdir()} == _pack_files(disk / "p")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_the_progress_file_is_appended_a_line_a_shard_and_a_cut_line_is_skipped(tmp_path):
    """read_progress: the JSON-lines form (settings, then a line a finished shard with the failures since), a line a
    kill cut short skipped (its shard is written again), the one-object form of earlier versions read as it was."""
    from dali_pipe.pack import PROGRESS_NAME, read_progress

    assert read_progress(tmp_path) is None
    shard = {"name": "train-000000.tar", "size": 10, "samples": 2, "next": 2}
    lines = [{"settings": {"seed": 1}}, {"split": "train", "shard": shard, "failed": {"a": "corrupt JPEG data"}},
             {"split": "val", "shard": {**shard, "name": "val-000000.tar"}, "failed": {}}]
    (tmp_path / PROGRESS_NAME).write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"split": "train", "sh')
    prog = read_progress(tmp_path)
    assert prog["settings"] == {"seed": 1} and prog["failed"] == {"a": "corrupt JPEG data"}
    assert [s["name"] for s in prog["splits"]["train"]] == ["train-000000.tar"] and len(prog["splits"]["val"]) == 1
    (tmp_path / PROGRESS_NAME).write_text(json.dumps({"settings": {"seed": 1}, "splits": {"train": [shard]}}))
    assert read_progress(tmp_path) == {"settings": {"seed": 1}, "splits": {"train": [shard]}, "failed": {}}
    (tmp_path / PROGRESS_NAME).write_text(json.dumps({"split": "train", "shard": shard}) + "\n")
    assert read_progress(tmp_path) is None  # no settings line: not a progress file of ours


def test_a_small_dataset_is_cut_into_eight_shards_a_split_and_says_so(photo_root, tmp_path, cache_dir, capsys):
    """Under the default --shard-size (150 MB) 48 photos would make one shard a split, with which streaming has
    nothing to fetch ahead and two readers nothing to share: each split gets 8 shards (or one per image where
    it has fewer), the pack says why, and webdataset reads every image once."""
    import webdataset as wds

    main(["pack", str(photo_root), str(tmp_path / "p"), "--workers", "1"])
    meta = json.loads((tmp_path / "p" / "packed.json").read_text())
    counts = {split: [s["samples"] for s in v["shards"]] for split, v in meta["splits"].items()}
    assert counts == {"train": [6] * 7 + [1], "val": [1] * 5}, counts
    assert "each split in 8 shards or more (at most 6 train, 1 val images a shard)" in capsys.readouterr().err
    keys = [s["__key__"] for s in wds.WebDataset(sorted(str(p) for p in (tmp_path / "p").glob("*.tar")),
                                                 shardshuffle=False)]
    assert len(keys) == len(set(keys)) == 48


def test_an_s3_pack_packed_again_replaces_every_object_and_no_upload_is_left_open(photo_root, s3, tmp_path, cache_dir):
    """Packed to S3 at --quality 90, then again at 60: every object in S3 is the new pack's (an index of the
    same size as the old one's was kept before, and reading it failed), and a rerun has nothing to do only when
    they all are; a multipart upload a killed run left open under the prefix is aborted."""
    from helpers import s3_listing

    from dali_pipe.s3 import make_client

    client = make_client(4)
    client.create_bucket(Bucket="data")
    client.create_multipart_upload(Bucket="data", Key="q/train-000000.tar")  # what a kill mid-upload leaves
    for quality in ("90", "60"):
        _pack(photo_root, "s3://data/q", "--workers", "1", "--quality", quality)
    local = tmp_path / "local"
    _pack(photo_root, local, "--workers", "1", "--quality", "60")
    assert set(s3_listing(client, "data", "q/")) == _pack_files(local)
    for name in _pack_files(local) - {"packed.json"}:
        assert client.get_object(Bucket="data", Key=f"q/{name}")["Body"].read() == (local / name).read_bytes(), name
    assert not client.list_multipart_uploads(Bucket="data", Prefix="q/").get("Uploads")
