"""Shards as a source: packs and shards written by others, their classes and split, every member checked
before training (bad ones left out and listed, pack damage named), indexes made once in the cache dir."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import BAD_MEMBERS

from dali_pipe.config import DataSettings
from dali_pipe.inputs import read
from dali_pipe.shards.shardset import ShardSourceError


def _open(data, cache_dir, **kw):
    return read(DataSettings(data=str(data), cache_dir=str(cache_dir), **kw))


def _listing(folder):
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def _tar(path, samples):
    """One shard of `samples` (webdataset's sample dicts), written by webdataset's own TarWriter."""
    import webdataset as wds

    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as w:
        for sample in samples:
            w.write(sample)
    return path


def test_shards_of_others_classes_split_and_bad_members(peer_dir, tmp_path, monkeypatch):
    """A folder of ShardWriter shards: classes named by the json label, validation from the shards named val,
    every bad member (no cls, a non-integer cls, a broken or missing image, a repeated key; a corrupt one with
    --scan full) left out and listed with shard and key; indexed once into the cache dir, the folder untouched."""
    import dali_pipe.shards.source as source
    from dali_pipe.dataset import ScanError, prepare

    before = _listing(peer_dir)
    s = _open(peer_dir, tmp_path / "cache", scan="full", max_bad_fraction=0.2)
    assert s.note == "classes named by the json label" and s.classes == [f"s{i:03d}" for i in range(48)]
    assert len(s.val) == 6 and len(s.train) == 42 and s.remap is None
    assert all(sh.split == ["val"] * len(sh.keys) for sh in s.shards if sh.name.startswith("val-"))
    bad = {sh.keys[e]: (sh.name, r) for sh, e, r in s.bad}
    assert set(bad) == set(BAD_MEMBERS) and all(BAD_MEMBERS[k] in r for k, (_, r) in bad.items()), bad
    assert bad["p001"][0] == "train-000002.tar" and "also in train-000000.tar" in bad["p001"][1]
    assert _listing(peer_dir) == before and len(list((tmp_path / "cache" / "shards").glob("*.idx"))) == 4
    fast = _open(peer_dir, tmp_path / "fresh", scan="fast")
    assert {sh.keys[e] for sh, e, _ in fast.bad} == set(BAD_MEMBERS) - {"huffman"}, "only a decode finds it"

    monkeypatch.setattr(source, "index_tar", lambda *a, **k: pytest.fail("indexed twice"))
    out = tmp_path / "out"
    data = DataSettings(data=str(peer_dir), cache_dir=str(tmp_path / "cache"), scan="full", max_bad_fraction=0.2)
    shards, result = prepare(data, out, num_threads=1)
    rows = [r.split("\t") for r in (out / "bad_images.tsv").read_text().splitlines()]
    assert rows[0] == ["image_path", "reason", "shard", "key"] and {r[3] for r in rows[1:]} == set(BAD_MEMBERS)
    assert len(result.bad) == 6 and result.total == 54
    with pytest.raises(ScanError, match="6 of 54 images are bad"):
        prepare(DataSettings(data=str(peer_dir), cache_dir=str(tmp_path / "cache"), scan="full"), out, num_threads=1)


def test_classes_txt_names_sparse_classes_and_a_hash_split_stays_put(photo_root, tmp_path):
    """classes.txt (a BOM and CRLF read as meant) names the cls integers (sparse ones map to contiguous classes);
    a cls it does not name is an error naming shard and key; without val shards the split is a hash of the key,
    unmoved by new shards; a brace pattern selects shards."""
    photo = next(photo_root.glob("*/*.jpg")).read_bytes()
    d = tmp_path / "d"
    for n in range(2):
        _tar(d / f"part-{n}.tar", ({"__key__": f"k{n}_{i}", "jpg": photo, "cls": 5 * (i % 2)} for i in range(20)))
    (d / "classes.txt").write_bytes("\ufeffcat\r\nx\r\nx\r\nx\r\nx\r\ndog\r\n".encode())  # as Notepad saves it
    s = _open(f"{d}/part-{{0..1}}.tar", tmp_path / "c", val_fraction=0.3)
    assert s.classes == ["cat", "dog"] and s.remap == (0, -1, -1, -1, -1, 1) and s.note == "classes named by classes.txt"
    split = {sh.keys[e]: sh.split[e] for sh in s.shards for e in range(len(sh.keys))}
    assert 0 < list(split.values()).count("val") < 40
    _tar(d / "part-2.tar", [{"__key__": "new", "jpg": photo, "cls": 0}])
    grown = _open(d, tmp_path / "c", val_fraction=0.3)
    assert {k: v for sh in grown.shards for k, v in zip(sh.keys, sh.split) if k != "new"} == split
    (d / "classes.txt").write_text("cat\n")
    with pytest.raises(ShardSourceError, match=r"part-0.tar: sample 'k0_1' has class 5, but classes.txt names 1"):
        _open(d, tmp_path / "c")


def _damaged(odd_pack, tmp_path, damage):
    p = tmp_path / "p"
    shutil.copytree(odd_pack, p)
    meta = json.loads((p / "packed.json").read_text())
    damage(p, meta)
    (p / "packed.json").write_text(json.dumps(meta))
    return p


def _cls_to(p, meta, value: bytes):
    from dali_pipe.shards.format import read_index

    shard = meta["splits"]["train"]["shards"][0]
    off, size = read_index(p / shard["index"])[1].members["cls"]
    with open(p / shard["name"], "r+b") as f:
        f.seek(off)
        f.write(value.rjust(size, b"9")[:size])


def _index_edit(p, meta, edit):
    shard = meta["splits"]["train"]["shards"][0]
    lines = (p / shard["index"]).read_text().splitlines()
    (p / shard["index"]).write_text("\n".join([lines[0]] + edit(lines[1:])) + "\n")


def _swap_cls_offsets(rows):
    a, b = rows[0].split(), rows[1].split()
    ia, ib = a.index("cls"), b.index("cls")
    a[ia + 1], b[ib + 1] = b[ib + 1], a[ia + 1]
    return [" ".join(a), " ".join(b)] + rows[2:]


DAMAGE = {
    "an index of other order": (lambda p, m: _index_edit(p, m, lambda rows: rows[1:] + rows[:1]),
                                r"sample 1 of its index .* by its json member, but packed.json lists"),
    "an index pointing at another sample's cls": (lambda p, m: _index_edit(p, m, _swap_cls_offsets),
                                                  r"is not where the index says: the tar member at byte"),
    "cls outside the classes": (lambda p, m: _cls_to(p, m, b"99"), r"has class 99, but packed.json lists 48"),
    "a class missing": (lambda p, m: m["classes"].pop(), r"has class 47, but packed.json lists 47 classes"),
    "index deleted": (lambda p, m: (p / m["splits"]["val"]["shards"][0]["index"]).unlink(), r"val-000000.idx is missing"),
    "a wrong shard count": (lambda p, m: m["splits"]["train"]["shards"][0].update(samples=99),
                            r"train-000000.tar holds 99 samples by packed.json, but its index"),
    "a wrong split count": (lambda p, m: m["splits"]["train"].update(samples=85), r"splits.train.samples is 85"),
}


def test_a_pack_has_the_identity_it_had_before_the_fast_checksum(odd_pack, tmp_path):
    """The same pack with and without packed.json's xxh3_128 (as an earlier version wrote it) is the same data to a
    run, so a run started on one resumes on the other."""
    old = tmp_path / "old"
    shutil.copytree(odd_pack, old)
    meta = json.loads((old / "packed.json").read_text())
    for split in meta["splits"].values():
        for shard in split["shards"]:
            assert shard.pop("xxh3_128")
    (old / "packed.json").write_text(json.dumps(meta))
    new = _open(odd_pack, tmp_path / "c1").digest()
    assert new == _open(old, tmp_path / "c2").digest()
    meta["splits"]["train"]["shards"][0]["sha256"] = "0" * 64  # the digest still tells packs apart
    (old / "packed.json").write_text(json.dumps(meta))
    assert _open(old, tmp_path / "c3").digest() != new


@pytest.mark.parametrize("case", list(DAMAGE))
def test_pack_damage_is_an_error_naming_the_file(case, odd_pack, tmp_path):
    """A .cls outside the classes, a class missing from packed.json, a deleted index file, wrong counts and an index
    that lies (other order, another sample's member) stop the run before training with an error naming the file."""
    damage, message = DAMAGE[case]
    with pytest.raises(ShardSourceError, match=message):
        _open(_damaged(odd_pack, tmp_path, damage), tmp_path / "cache")


def test_train_and_predict_on_shards_of_others(peer_dir, tmp_path, cache_dir, monkeypatch, capsys):
    """ShardWriter shards in a folder train: each sample once per epoch with its own label (the bad members never
    reach the pipeline), the summary says where the class names came from; predict names each sample by its key
    and labels the samples without a usable cls too."""
    import resume_trace

    import train
    from dali_pipe.cli.commands import main

    trace, out = tmp_path / "trace.jsonl", tmp_path / "m"
    resume_trace.install(trace, patch=monkeypatch.setattr)
    train.main(["--data", str(peer_dir), "--model", "tiny", "--device", "cpu", "--epochs", "2", "--batch-size", "8",
                "--num-threads", "1", "--scan", "full", "--max-bad-fraction", "0.2", "--output", str(out)])
    assert "classes named by the json label" in capsys.readouterr().out
    val = {f"s{i:03d}" for i in range(48) if i % 8 == 5}
    resume_trace.assert_each_sample_once_per_epoch(resume_trace.read(trace), epochs=2, batch=8, val=val,
                                                   train={f"s{i:03d}" for i in range(48)} - val)
    main(["predict", "--model", str(out), "--data", str(peer_dir), "--device", "cpu", "--output", str(tmp_path / "p"),
          "--scan", "full"])
    rows = [r.split("\t")[0] for r in (tmp_path / "p" / "predictions.tsv").read_text().splitlines()[1:]]
    assert sorted(rows) == sorted([f"photo {i:03d}" if i % 5 == 0 else f"p{i:03d}" for i in range(48)] +
                                  ["nocls", "textcls"]), "predict reads no cls: a sample without one is labelled too"


def test_shards_of_others_on_s3_each_sample_once(photo_root, s3_process, tmp_path):
    """An s3:// prefix of ShardWriter shards (no val shards: a hash split by --val-fraction): indexed with one
    GET per shard into the cache dir, the bucket untouched; the reader yields each training sample once with its
    own label, and validation every other sample once."""
    from collections import Counter

    from corpus import peer_shards
    from helpers import datamodule
    from helpers import s3_listing as list_objects

    from dali_pipe.s3 import make_client
    from dali_pipe.spec import ImageSpec

    labels = peer_shards(photo_root, tmp_path / "peer", val_every=None)
    client = make_client(4)
    client.create_bucket(Bucket="data")
    for p in sorted((tmp_path / "peer").iterdir()):
        client.upload_file(str(p), "data", f"peer/{p.name}")
    before = list_objects(client, "data", "")
    dm = datamodule("s3://data/peer", tmp_path / "out", batch_size=5, cache_dir=tmp_path / "cache",
                    spec=ImageSpec(16, 16, (0.5,) * 3, (0.5,) * 3), val_fraction=0.25)
    dm.prepare_data()
    dm.setup()
    names = dm.manifest.classes
    val = [names[i] for i in _labels(dm.val_dataloader())]
    # the training split in index order (DALI's own S3 streaming under a 1024-sample shuffle buffer takes ~10 s here;
    # the training order over Shards is the local test's)
    trained = [names[i] for i in _labels(dm.loader(dm.manifest.train, training=False))]
    assert max(Counter(val + trained).values()) == 1, "no sample twice, none in both splits"
    assert len(val) == len(dm.manifest.val) > 0 and len(trained) == len(dm.manifest.train)
    assert len(dm.manifest.train) + len(val) == 48 and sorted(names) == sorted(f"s{i:03d}" for i in labels.values())
    assert list_objects(client, "data", "") == before and len(list((tmp_path / "cache" / "shards").glob("*.idx"))) == 3


def _labels(loader):
    return [i for _, y in loader for i in y.tolist()]


def test_compound_member_names_are_read_as_webdataset_reads_them(photo_root, tmp_path):
    """webdataset names a member by all that follows the key's first dot (`KEY.image.jpg` is `image.jpg`, read by
    `to_tuple('image.jpg', 'label.cls')`): such samples train with those bytes and labels; of several compound images
    the one named image.* is read (beside a mask); several with none so named, and two dotted keys that webdataset
    too reads as one sample, are left out naming the members; a sample of no member we read is listed."""
    import webdataset as wds

    from dali_pipe.shards.format import image_member, label_member, read_index

    photos = [p.read_bytes() for p in sorted(photo_root.glob("*/*.jpg"))[:3]]
    d = tmp_path / "d"
    _tar(d / "part-0.tar", [*({"__key__": f"k{i}", "image.jpg": photos[i % 3], "label.cls": i % 2} for i in range(4)),
                            {"__key__": "seg", "image.jpg": photos[1], "mask.png": photos[2], "label.cls": 1},
                            {"__key__": "img.v2", "jpg": photos[0], "cls": 0},  # key `img`, members v2.jpg, v2.cls
                            {"__key__": "pair", "left.jpg": photos[0], "right.jpg": photos[1], "label.cls": 0},
                            {"__key__": "dot.v1", "jpg": photos[0], "cls": 0}, {"__key__": "dot.v2", "jpg": photos[1],
                                                                                "cls": 1},
                            {"__key__": "only", "txt": "no picture, no class"}])
    s = _open(d, tmp_path / "c", val_fraction=0)
    bad = {sh.keys[e]: r for sh, e, r in s.bad}
    assert set(bad) == {"pair", "dot", "only"}, bad
    assert "several image members (left.jpg, right.jpg)" in bad["pair"] and "dot" not in bad["pair"]
    assert "several image members (v1.jpg, v2.jpg)" in bad["dot"] and "write keys without dots" in bad["dot"]
    peer = {x["__key__"]: x for x in wds.WebDataset(str(d / "part-0.tar"), shardshuffle=False)}
    assert set(peer) == {"k0", "k1", "k2", "k3", "seg", "img", "pair", "dot", "only"}, "webdataset groups them so too"
    sh, raw = s.shards[0], (d / "part-0.tar").read_bytes()
    for e, entry in enumerate(read_index(sh.index_path)):
        if e in sh.bad:
            continue
        (ioff, isize), (coff, csize) = entry.members[image_member(entry.members)], entry.members[label_member(
            entry.members)]
        want = peer[entry.key]
        assert raw[ioff:ioff + isize] == want.get("image.jpg", want.get("v2.jpg"))
        assert int(raw[coff:coff + csize]) == int(want.get("label.cls", want.get("v2.cls"))) == sh.cls[e]
    assert len(s.train) == 6 and s.classes == ["0", "1"]


def test_a_dangling_shard_link_is_named_not_skipped(photo_root, tmp_path):
    """A `.tar` in the shards folder that is a dangling symbolic link stops the run naming it, instead of the run
    training silently without that shard."""
    d = tmp_path / "d"
    _tar(d / "part-0.tar", ({"__key__": f"k{i}", "jpg": photo.read_bytes(), "cls": i % 2}
                            for i, photo in enumerate(sorted(photo_root.glob("*/*.jpg"))[:4])))
    (d / "part-1.tar").symlink_to(tmp_path / "elsewhere" / "part-1.tar")
    with pytest.raises(ShardSourceError, match=r"part-1.tar is a dangling symbolic link"):
        _open(d, tmp_path / "c")


def test_classes_txt_naming_two_classes_alike_is_refused(photo_root, tmp_path):
    """classes.txt giving two used classes one name (which would merge them by name in evaluate and the model's
    label2id) is an error naming the name and both lines."""
    photo = next(photo_root.glob("*/*.jpg")).read_bytes()
    d = tmp_path / "d"
    _tar(d / "part-0.tar", ({"__key__": f"k{i}", "jpg": photo, "cls": i % 3} for i in range(6)))
    (d / "classes.txt").write_text("cat\ndog\ncat\n")
    with pytest.raises(ShardSourceError, match=r"classes.txt names class 0 and class 2 alike \('cat', lines 1 and 3\)"):
        _open(d, tmp_path / "c")


def test_a_brace_pattern_over_train_and_val_folders_splits_by_folder(photo_root, tmp_path):
    """`shards/{train,val}/part-0.tar`: the shards in the folder named val are the validation set, as shards named
    val are (the words that tell shards apart count, not the folder that holds them all)."""
    photo = next(photo_root.glob("*/*.jpg")).read_bytes()
    root = tmp_path / "val" / "shards"  # a folder above all of them may say val too: it tells nothing apart
    for split in ("train", "val"):
        _tar(root / split / "part-0.tar", ({"__key__": f"{split}{i}", "jpg": photo, "cls": i % 2} for i in range(6)))
    s = _open(f"{root}/{{train,val}}/part-0.tar", tmp_path / "c")
    assert len(s.train) == 6 and len(s.val) == 6
    assert {sh.split[0] for sh in s.shards if sh.path.endswith("/val/part-0.tar")} == {"val"}


def test_an_s3_brace_pattern_may_span_folders(photo_root, s3, tmp_path):
    """`s3://bucket/shards/{train,val}/part-0.tar` finds the shards in both folders (each folder listed once) and
    the val folder's shard is the validation set; a shard the pattern names and S3 lacks is named. The plain prefix
    finds the train/ and val/ sub-prefixes' shards (a .tar.gz among them, decompressed into the cache dir) and
    names the object beside them that is not read."""
    from dali_pipe.s3 import make_client

    photo = next(photo_root.glob("*/*.jpg")).read_bytes()
    client = make_client(4)
    client.create_bucket(Bucket="data")
    for split in ("train", "val"):
        _tar(tmp_path / f"{split}.tar", ({"__key__": f"{split}{i}", "jpg": photo, "cls": i % 2} for i in range(4)))
        client.upload_file(str(tmp_path / f"{split}.tar"), "data", f"shards/{split}/part-0.tar")
    s = _open("s3://data/shards/{train,val}/part-0.tar", tmp_path / "c")
    assert len(s.train) == 4 and len(s.val) == 4 and s.shards[1].path == "s3://data/shards/val/part-0.tar"
    with pytest.raises(ShardSourceError, match=r"not in S3, e.g. s3://data/shards/test/part-0.tar"):
        _open("s3://data/shards/{train,test}/part-0.tar", tmp_path / "c")

    import gzip

    client.delete_object(Bucket="data", Key="shards/val/part-0.tar")
    client.put_object(Bucket="data", Key="shards/val/part-0.tar.gz", Body=gzip.compress((tmp_path / "val.tar").read_bytes()))
    client.put_object(Bucket="data", Key="shards/notes.txt", Body=b"x")
    s = _open("s3://data/shards", tmp_path / "c")
    assert [sh.name for sh in s.shards] == ["s3://data/shards/train/part-0.tar", "s3://data/shards/val/part-0.tar.gz"]
    assert len(s.train) == 4 and len(s.val) == 4 and s.unused == ["notes.txt"]
    assert s.shards[1].path.startswith(str(tmp_path / "c" / "gunzip")) and _sha(Path(s.shards[1].path)) == _sha(
        tmp_path / "val.tar")


def test_temporary_files_of_a_killed_indexer_are_removed(photo_root, tmp_path):
    """An index or verdict file half written by a run killed with -9 (its hidden temporary, named with the dead
    PID) is removed from the cache dir by the next run that indexes shards; a live writer's is kept."""
    import os
    import subprocess
    import sys

    d = tmp_path / "d"
    _tar(d / "part-0.tar", ({"__key__": f"k{i}", "jpg": photo.read_bytes(), "cls": i % 2}
                            for i, photo in enumerate(sorted(photo_root.glob("*/*.jpg"))[:4])))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    shards = tmp_path / "c" / "shards"
    shards.mkdir(parents=True)
    left = shards / f".0123abcd.idx.tmp-{int(dead.stdout)}"
    left.write_text("v1.2 9\n")
    live = shards / f".4567ef.json.tmp-{os.getppid()}"
    live.write_text("{")
    _open(d, tmp_path / "c")
    assert not left.exists() and live.exists()


def _writer(pattern, **kw):
    import webdataset as wds

    Path(pattern).parent.mkdir(parents=True, exist_ok=True)
    return wds.ShardWriter(str(pattern), verbose=0, **kw)


def _photo_samples(photo_root, indices):
    photos = sorted(photo_root.glob("*/*.jpg"))
    return [{"__key__": f"p{i:03d}", "jpg": photos[i].read_bytes(), "cls": i} for i in indices]


def _epoch_labels(loader) -> list[int]:
    return sorted(i for _, y in loader for i in y.tolist())


def test_train_val_test_subfolders_mixing_tar_and_tar_gz_each_sample_once(photo_root, tmp_path, capsys):
    """A plain folder whose train/ and val/ subfolders hold .tar, .tar.gz and .tgz shards (ShardWriter's) trains on
    all of them, the val folder's shards being the validation set and the test folder's neither; every file neither
    data nor a known sidecar is named at start-up; each sample comes once per epoch, as webdataset's reader has it."""
    import webdataset as wds
    from helpers import datamodule

    from dali_pipe.spec import ImageSpec

    root = tmp_path / "shards"
    for pattern, indices in ((root / "train" / "a-%06d.tar", range(0, 16)), (root / "train" / "b-%06d.tar.gz",
                             range(16, 32)), (root / "val" / "v-%06d.tgz", range(32, 36)),
                             (root / "test" / "t-%06d.tar", range(36, 40))):
        with _writer(pattern, maxcount=8) as w:
            for sample in _photo_samples(photo_root, indices):
                w.write(sample)
    for name in ("notes.txt", "README.md", "train/a-000000_stats.json", "train/a-000000.idx", "train/old.tar.bz2"):
        (root / name).write_text("x")
    (root / "train" / "more").mkdir()
    s = _open(root, tmp_path / "cache")
    assert sorted(sh.name for sh in s.shards) == ["test/t-000000.tar", "train/a-000000.tar", "train/a-000001.tar",
                                                  "train/b-000000.tar.gz", "train/b-000001.tar.gz", "val/v-000000.tgz"]
    assert s.unused == ["notes.txt", "train/more/ (a folder)",
                        "train/old.tar.bz2 (only .tar, .tar.gz and .tgz shards are read)"], s.unused
    assert "1 test shard(s) (test/t-000000.tar) are neither trained on nor validated" in s.held_out
    assert len(s.test) == 4
    peer = {x["__key__"]: int(x["cls"]) for f in sorted(root.rglob("*")) if f.name.endswith((".tar", ".gz", ".tgz"))
            for x in wds.WebDataset(str(f), shardshuffle=False)}  # webdataset reads .tar.gz and .tgz itself
    assert {sh.keys[e]: sh.cls[e] for sh in s.shards for e in range(len(sh.keys))} == peer and len(peer) == 40

    dm = datamodule(root, tmp_path / "out", batch_size=8, cache_dir=tmp_path / "cache",
                    spec=ImageSpec(16, 16, (0.5,) * 3, (0.5,) * 3))
    dm.prepare_data()
    assert "data: not read: notes.txt; train/more/ (a folder); train/old.tar.bz2" in capsys.readouterr().err
    dm.setup()
    assert _epoch_labels(dm.train_dataloader()) == list(range(32)), "every training sample once, .tar and .tar.gz"
    assert _epoch_labels(dm.val_dataloader()) == list(range(32, 36))


def test_a_gzipped_shard_is_decompressed_once_checked_and_redone(photo_root, tmp_path, monkeypatch, capsys):
    """One .tar.gz given as --data is decompressed once into CACHE/gunzip (its copy's sha256 that of the tar inside)
    and read from there; a rerun decompresses nothing; a damaged or deleted copy is made again; a broken gzip and a
    cache disk without room for the copies are refused naming them."""
    import gzip
    import hashlib

    from helpers import small_disk

    import dali_pipe.shards.source as source

    gz = tmp_path / "one.tar.gz"
    with _writer(tmp_path / "one-%01d.tar.gz", maxcount=100) as w:
        for sample in _photo_samples(photo_root, range(6)):
            w.write(sample)
    (tmp_path / "one-0.tar.gz").rename(gz)
    cache = tmp_path / "cache"
    s = _open(gz, cache)
    copy = Path(s.shards[0].path)
    assert copy.parent == cache / "gunzip" and s.shards[0].name == "one.tar.gz" and len(s.train) + len(s.val) == 6
    assert s.shards[0].sha256 == hashlib.sha256(gzip.decompress(gz.read_bytes())).hexdigest() == _sha(copy)
    monkeypatch.setattr(source, "Gunzip", lambda raw: pytest.fail("decompressed twice"))
    import dali_pipe.shards.verdicts as verdicts_mod

    monkeypatch.setattr(verdicts_mod, "file_xxh3", lambda p: pytest.fail("the copy hashed again: its verdict was not kept"))
    _open(gz, cache)
    monkeypatch.undo()
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    assert _open(gz, cache).shards[0].sha256 == _sha(copy) and "decompressing it again" in capsys.readouterr().err
    copy.unlink()
    assert _open(gz, cache).shards[0].sha256 == _sha(copy)
    with small_disk(tmp_path / "small", "2m") as small:
        with pytest.raises(ShardSourceError, match=r"1 gzipped shard\(s\) decompress to about .* free space"):
            _open(gz, small / "cache")
    gz.write_bytes(gz.read_bytes()[:-200])
    with pytest.raises(ShardSourceError, match=r"one.tar.gz: not a readable gzip"):
        _open(gz, cache)


def _sha(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def http_root(tmp_path):
    """A plain http.server on 127.0.0.1 serving a fresh folder: (folder, base URL)."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    www = tmp_path / "www"
    www.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(www)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_https_shards_through_faults_each_sample_once(photo_root, http_root, tmp_path, capsys):
    """Shards named by http(s):// URLs, with a nested brace pattern (expanded as braceexpand does): indexed with one
    streaming GET each (a cut one read again), classes.txt read beside them, trained through the streaming cache
    with each sample once per epoch (a damaged transfer refetched after its sha256 check, a cut one read again); a
    missing shard is named
    with its status; a presigned URL's signature reaches no message and no file name."""
    from braceexpand import braceexpand
    from faultproxy import FaultProxy
    from helpers import datamodule

    from dali_pipe.shards.cache import local_name
    from dali_pipe.shards.fetchers import Fetcher
    from dali_pipe.shards.verdicts import Remote, ShardError
    from dali_pipe.spec import ImageSpec

    www, url = http_root
    for pattern, indices in ((www / "train" / "shard-%06d.tar", range(20)), (www / "val" / "shard-%06d.tar",
                                                                           range(20, 24))):
        with _writer(pattern, maxcount=10) as w:
            for sample in _photo_samples(photo_root, indices):
                w.write(sample)
    (www / "classes.txt").write_text("".join(f"c{i}\n" for i in range(24)))
    proxy = FaultProxy(url).start()
    try:
        data = f"{proxy.url}/{{train/shard-{{000000..000001}},val/shard-000000}}.tar"
        proxy.arm("cut", "train/shard-000001", times=1)
        cache = tmp_path / "cache"
        s = _open(data, cache)
        assert [sh.path for sh in s.shards] == list(braceexpand(data)) and proxy.applied("cut") == 1
        assert s.classes == [f"c{i}" for i in range(24)] and len(s.train) == 20 and len(s.val) == 4

        dm = datamodule(data, tmp_path / "out", batch_size=5, cache_dir=cache, spec=ImageSpec(16, 16, (0.5,) * 3,
                                                                                               (0.5,) * 3))
        dm.prepare_data()
        dm.setup()
        proxy.arm("flip", "train/shard-000000", times=1)
        proxy.arm("cut", "val/shard-000000", times=1)
        try:
            assert _epoch_labels(dm.train_dataloader()) == list(range(20))
            assert _epoch_labels(dm.val_dataloader()) == list(range(20, 24))
        finally:
            dm.teardown()
        assert proxy.applied("flip") == 1, "the damaged copy was caught by its sha256 and fetched again"
        assert proxy.applied("cut") == 2, "the cut transfer was read again"
    finally:
        proxy.stop()
    with pytest.raises(ShardSourceError, match=r"1 of its 1 shard\(s\) cannot be read, e.g. .*/shard-000009.tar: HTTP "
                                               r"404; the object is not there"):
        _open(f"{url}/train/shard-000009.tar", cache)
    signed = f"{url}/val/shard-000000.tar?X-Amz-Signature=0123secret4567&X-Amz-Credential=AKIDsecret"
    s = _open(signed, cache)
    with pytest.raises(ShardError, match="changed after it was indexed") as err:  # its sha256 check fails
        Fetcher().fetch(Remote(signed, s.shards[0].size, "0" * 64), tmp_path / "copy" / local_name(signed))
    shown = str(err.value) + capsys.readouterr().err + s.shards[0].name
    assert "secret" not in shown and not [p for p in tmp_path.rglob("*") if "secret" in p.name], shown


def _bomb_tar(photo_root, path, big: int) -> None:
    """Five real samples, then a member `big` bytes long (zeros: a hole in a sparse file) and its cls."""
    import io
    import tarfile

    with open(path, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for s in _photo_samples(photo_root, range(5)):
                for ext in ("jpg", "cls"):
                    data = s[ext] if ext == "jpg" else str(s[ext]).encode()
                    info = tarfile.TarInfo(f"{s['__key__']}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
            f.seek(tar.offset)
            info = tarfile.TarInfo("bomb.jpg")
            info.size = big
            f.write(info.tobuf(tarfile.USTAR_FORMAT))
            f.seek(-(-big // 512) * 512, 1)  # the member's zeros, as a hole
            info = tarfile.TarInfo("bomb.cls")
            info.size = 1
            f.write(info.tobuf(tarfile.USTAR_FORMAT) + b"1".ljust(512, b"\0") + bytes(1024))
            tar.fileobj = io.BytesIO()  # the end is written: tarfile's close writes into nothing


def test_a_member_bomb_is_listed_bad_unread_in_bounded_memory(photo_root, tmp_path):
    """A tar holding a 600 MiB member: the member is listed bad, never read into memory (peak RSS of the process
    well under the member), the other samples kept. Before, the indexer read each member whole: 1.5 GiB took
    5.2 GB of RAM before the scan said "not an image"."""
    import subprocess
    import sys

    gz = tmp_path / "bomb.tar"
    _bomb_tar(photo_root, gz, 600 << 20)
    code = ("import json, resource, sys; from dali_pipe.config import DataSettings; "
            "from dali_pipe.inputs import read; "
            f"s = read(DataSettings(data={str(gz)!r}, cache_dir={str(tmp_path / 'cache')!r}, max_bad_fraction=0.5)); "
            "print(json.dumps({'kept': len(s.train) + len(s.val), 'bad': [r for _, _, r in s.bad], "
            "'rss': int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) // 1024}))")  # (of this
    # program alone: ru_maxrss would count the 600 MiB this test held when it started the child)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["kept"] == 5 and got["bad"] == ["a member of 629145600 bytes, over the 256 MiB a member may hold "
                                               "(not read)"], got
    assert got["rss"] < 450, got  # MB: the member alone is 600


def test_a_gzip_bomb_stops_at_its_stated_ratio_leaving_no_copy(photo_root, tmp_path):
    """A 0.6 MB .tar.gz whose tar holds 600 MiB (its gzip trailer says so, truthfully or not: anyone can write
    it) is stopped once its copy passes GUNZIP_RATIO_MAX times the compressed size (or GUNZIP_FLOOR), named as
    a bomb with the fix; no partial copy stays. Before, only the free disk (less 1 GiB) stopped it."""
    import gzip
    import zlib

    from dali_pipe.shards.source import GUNZIP_FLOOR, GUNZIP_RATIO_MAX

    tar = tmp_path / "bomb.tar"
    _bomb_tar(photo_root, tar, 600 << 20)
    gz = tmp_path / "data" / "bomb.tar.gz"
    gz.parent.mkdir()
    with open(tar, "rb") as src, open(gz, "wb") as out:
        z = zlib.compressobj(1, zlib.DEFLATED, 31)  # gzip framing
        for chunk in iter(lambda: src.read(8 << 20), b""):
            out.write(z.compress(chunk))
        out.write(z.flush())
    tar.unlink()
    size = gz.stat().st_size
    assert size * GUNZIP_RATIO_MAX < 600 << 20 and GUNZIP_FLOOR < 600 << 20
    with gzip.open(gz) as g:  # the peer reads it whole: it is a valid gzip
        assert g.read(512)
    with pytest.raises(ShardSourceError) as e:
        _open(gz.parent, tmp_path / "cache")
    assert f"bomb.tar.gz decompresses to more than {GUNZIP_RATIO_MAX} times its compressed bytes" in str(e.value)
    assert "gunzip" in str(e.value)
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.stat().st_size > 1 << 20] == []


@pytest.mark.parametrize("body", ["endless", "silent", "chunked"])
def test_an_https_shard_whose_body_never_ends_stops_at_its_deadline(tmp_path, body):
    """A server that sends a tar header claiming a 6 GiB member and then bytes forever (a Content-Length of 64 GiB),
    or nothing more: the indexing stops at its deadline, once (no retry would end sooner), naming the shard and why,
    in bounded time (before: it hung for good). The same endless body sent chunked, without a length, is refused at
    once with the fix: the transfer client (obstore) reads no body without a Content-Length."""
    import tarfile
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dali_pipe.shards import source

    class Endless(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # (chunked bodies are HTTP/1.1's)

        def do_GET(self):
            self.send_response(200)
            if body == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(64 << 30))
            self.end_headers()
            info = tarfile.TarInfo("x.jpg")
            info.size = 6 << 30
            chunks = [info.tobuf(tarfile.USTAR_FORMAT)] + [b"\xff" * 65536] * 10**6
            try:
                for chunk in chunks:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if body == "chunked" else chunk)
                    self.wfile.flush()
                    time.sleep(0.01 if body != "silent" else 30)
            except OSError:  # the client gave up
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/shard.tar"
    said = (r"indexing .*shard.tar: the server sends it without a Content-Length \(chunked\).*serve the shards as "
            r"static files" if body == "chunked" else r"indexing .*shard.tar.*no complete copy within its deadline \(2 s\)")
    try:
        start = time.monotonic()
        with pytest.raises(ShardSourceError, match=said):
            source._read_source(source.Listed("shard.tar", url, "x", None), source.Collector("fast", 10**8, 1),
                                deadline_s=2)
        assert time.monotonic() - start < (2 if body == "chunked" else 10)
    finally:
        server.shutdown()


def test_cache_files_of_another_json_type_are_made_again(peer_dir, tmp_path):
    """Every JSON file of the cache dir (an index's meta, the verdicts) replaced by valid JSON of another type
    ([], a number, a string): the shards read as before, the files made again; it was an AttributeError
    traceback."""
    from dali_pipe.shards.verdicts import VERDICTS_NAME

    cache = tmp_path / "cache"
    first = _open(peer_dir, cache)
    jsons = [p for p in cache.rglob("*.json")] + [cache / VERDICTS_NAME]
    assert len(jsons) > 2
    for p, text in zip(jsons, ["[]", "3", '"x"'] * len(jsons)):
        p.write_text(text)
    again = _open(peer_dir, cache)
    assert [len(s.keys) for s in again.shards] == [len(s.keys) for s in first.shards]
    assert [a.bad for a in again.shards] == [b.bad for b in first.shards]
