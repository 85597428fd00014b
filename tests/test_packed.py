"""Packed data as a source: each sample once per epoch, across ranks and across a resume; training
and evaluation from a local pack and from S3 (synced, or streamed when it does not fit)."""
from __future__ import annotations

import io
import json
from collections import Counter

import pytest
from helpers import cpu_options

import train
from dali_pipe.cli.commands import main
from dali_pipe.loader import DaliLoader
from dali_pipe.pipeline import build_pipeline
from dali_pipe.spec import ImageSpec

SPEC = ImageSpec(16, 16, (0.5,) * 3, (0.5,) * 3)


@pytest.fixture(scope="module")
def packed(odd_pack):
    """photo_root under odd names (corpus.odd_names_dataset; 43 train / 5 val) packed into several small shards."""
    return odd_pack


def _shards(packed):
    from dali_pipe.shards.packs import open_packed

    return open_packed(str(packed), "unused")


def _loader(source, batch, training, shard=0, shards=1, seed=3):
    opts = cpu_options(batch, threads=2, training=training, shard_id=shard, num_shards=shards, seed=seed)
    return DaliLoader(lambda ck: build_pipeline(source, SPEC, opts, training=training, checkpoint=ck),
                      training=training)


def _labels(loader):
    return [i for _, y in loader for i in y.tolist()]


def test_each_sample_once_per_epoch_on_one_and_two_ranks(packed):
    p = _shards(packed)
    assert len(p.train.paths) > 2 and len(p.train) == 43 and len(p.val) == 5
    train_counts = Counter(s for s in _labels(_loader(p.train, 43, False)))  # every training label, once through
    loader = _loader(p.train, 5, True)
    orders = []
    for _ in range(3):
        seen = _labels(loader)
        assert len(seen) == len(loader) * 5 == 40 and not Counter(seen) - train_counts
        orders.append(seen)
    assert orders[0] != orders[1]
    for _ in range(2):
        assert Counter(_labels(_loader(p.val, 2, False))) == Counter(_labels(_loader(p.val, 5, False)))
    ranks = [_loader(p.train, 5, True, shard=r, shards=2) for r in range(2)]
    for _ in range(3):
        per_rank = [_labels(ld) for ld in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == len(ranks[0]) * 5
        assert not Counter(per_rank[0] + per_rank[1]) - train_counts, "no sample on both ranks or twice"


def test_pack_keys_and_labels_survive_the_pipeline(packed, odd_root):
    """Validation through DALI yields every val image's class, as the manifest says."""
    from dali_pipe.manifest import read_manifest

    m = read_manifest(odd_root, val_fraction=0.1, seed=0, skip_missing=False)
    assert sorted(_labels(_loader(_shards(packed).val, 2, False))) == sorted(s.label for s in m.val)


def test_restore_continues_the_shuffled_shard_stream(packed):
    p = _shards(packed)
    reference = [[y.tolist() for _, y in ld] for ld in [_loader(p.train, 5, True)] for _ in range(2)]
    first = _loader(p.train, 5, True)
    it = iter(first)
    head = [y.tolist() for _, (_, y) in zip(range(3), it)]
    second = _loader(p.train, 5, True)
    second.restore(first.state())
    assert head + [y.tolist() for _, y in second] == reference[0]
    assert [y.tolist() for _, y in second] == reference[1]


def test_seed_changes_the_shard_order(packed):
    p = _shards(packed)
    assert _labels(_loader(p.train, 5, True, seed=1)) != _labels(_loader(p.train, 5, True, seed=2))


def test_train_evaluate_and_predict_from_a_local_pack(packed, odd_root, tmp_path, cache_dir, monkeypatch):
    """Odd names packed: training sees every training image once and validates every val image once; evaluate
    reads all 48; predict writes one row per image whose image_path joins back to dataset.tsv as written. With a
    JPEG start marker broken inside the pack, evaluate and predict leave that image out and list it."""
    import shutil

    import resume_trace

    from dali_pipe.manifest import read_manifest, read_table
    from dali_pipe.shards.format import read_index

    trace, out = tmp_path / "trace.jsonl", tmp_path / "m"
    resume_trace.install(trace, patch=monkeypatch.setattr)
    res = train.main(["--data", str(packed), "--model", "tiny", "--device", "cpu", "--epochs", "1", "--batch-size",
                      "8", "--num-threads", "1", "--output", str(out)])
    m = read_manifest(odd_root, val_fraction=0.1, seed=0, skip_missing=False)
    assert res["global_step"] == len(m.train) // 8 and res["val_samples"] == len(m.val)
    resume_trace.assert_each_sample_once_per_epoch(resume_trace.read(trace), epochs=1, batch=8,
                                                   train={m.classes[x.label] for x in m.train},
                                                   val={m.classes[x.label] for x in m.val})
    main(["evaluate", "--model", str(out), "--data", str(packed), "--device", "cpu", "--output", str(tmp_path / "e"),
          "--split", "all"])
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["images"] == 48
    written = list(read_table(odd_root / "dataset.tsv")["image_path"])
    assert any(p.startswith("./") for p in written) and any("%" in p for p in written)
    main(["predict", "--model", str(out), "--data", str(packed), "--device", "cpu", "--output", str(tmp_path / "p")])
    rows = [r.split("\t") for r in (tmp_path / "p" / "predictions.tsv").read_text(encoding="utf-8").splitlines()[1:]]
    assert sorted(r[0] for r in rows) == sorted(written), "one row per image, named as dataset.tsv names it"

    broken = tmp_path / "broken"
    shutil.copytree(packed, broken)
    meta = json.loads((broken / "packed.json").read_text())
    shard = meta["splits"]["val"]["shards"][0]
    off, _ = read_index(broken / shard["index"])[0].members["jpg"]
    with open(broken / shard["name"], "r+b") as f:  # the start marker (FF D8) gone, as a buggy tool might write it
        f.seek(off)
        f.write(b"\x00\x00")
    from dali_pipe.shards.format import file_sums

    shard["sha256"], shard["xxh3_128"] = file_sums(broken / shard["name"])  # checksums that agree: only the scan can tell
    (broken / "packed.json").write_text(json.dumps(meta))
    for command, folder in (("evaluate", "e2"), ("predict", "p2")):
        main([command, "--model", str(out), "--data", str(broken), "--device", "cpu", "--output", str(tmp_path / folder),
              "--split", "all"][: None if command == "evaluate" else -2])
        report = (tmp_path / folder / "bad_images.tsv").read_text(encoding="utf-8").splitlines()
        assert len(report) == 2 and report[1].split("\t")[0] == shard["image_paths"][0]
        assert "not an image" in report[1] and shard["name"] in report[1]
    assert json.loads((tmp_path / "e2" / "metrics.json").read_text())["images"] == 47
    assert len((tmp_path / "p2" / "predictions.tsv").read_text().splitlines()) == 48


@pytest.mark.parametrize("route", ["sync", "stream"])
def test_train_from_a_pack_on_s3(route, photo_root, s3_process, tmp_path, cache_dir, monkeypatch, capsys):
    """Packed to S3, read back: synced when it fits, streamed through the bounded cache when it does not
    (the free space is made too small)."""
    import dali_pipe.shards.packsync as packsync
    from dali_pipe.s3 import make_client

    make_client(4).create_bucket(Bucket="data")
    main(["pack", str(photo_root), "s3://data/packed", "--max-side", "96", "--shard-size", "60kB"])
    if route == "stream":
        monkeypatch.setattr(packsync, "HEADROOM", 1 << 60)
    res = train.main(["--data", "s3://data/packed", "--model", "tiny", "--device", "cpu", "--epochs", "1",
                      "--batch-size", "8", "--num-threads", "1", "--output", str(tmp_path / "m"), "--cache-dir",
                      str(cache_dir)])
    assert res["global_step"] == 43 // 8
    local = cache_dir / "s3" / "data" / "packed"
    tars = list(local.glob("*.tar"))
    assert (local / "packed.json").is_file() and list(local.glob("*.idx"))
    if route == "sync":
        splits = json.loads((local / "packed.json").read_text())["splits"]
        assert len(tars) == sum(len(v["shards"]) for v in splits.values())
    else:
        said = capsys.readouterr()
        assert not tars and "streaming them through a bounded cache" in said.err
        assert "streamed from S3 not scanned beforehand" in said.out and " of 48 excluded" not in said.out, said.out
        again = train.main(["--data", "s3://data/packed", "--model", "tiny", "--device", "cpu", "--epochs", "1",
                            "--batch-size", "8", "--num-threads", "1", "--output", str(tmp_path / "m"), "--cache-dir",
                            str(cache_dir), "--stream-cache", "1kB"])  # (--stream-cache is no part of the run)
        assert again.get("nothing_to_do"), again  # the finished run is told, not the cache too small to stream it
        assert list((cache_dir / "stream" / "s3" / "data" / "packed" / "rank-0").glob("*.tar"))


def test_a_pack_of_the_first_format_reads_its_six_digit_labels(photo_root, tmp_path):
    """A pack written the first way (format /1: six-digit .cls, no json member, no image_paths) still reads
    with every label right."""
    import tarfile

    from dali_pipe.shards.format import IndexEntry, file_sha256, format_index

    photos = sorted(photo_root.glob("*/*.jpg"))[:12]
    tar, entries = tmp_path / "train-000000.tar", []
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as t:
        for i, photo in enumerate(photos):
            members = {}
            for ext, data in (("jpg", photo.read_bytes()), ("cls", f"{i % 11:06d}".encode())):
                info = tarfile.TarInfo(f"{photo.parent.name}/{photo.stem}.{ext}")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
                members[ext] = (t.offset - (len(data) + 511) // 512 * 512, len(data))
            entries.append(IndexEntry(f"{photo.parent.name}/{photo.stem}", members))
    (tmp_path / "train-000000.idx").write_text(format_index(entries))
    shard = {"name": tar.name, "index": "train-000000.idx", "samples": 12, "size": tar.stat().st_size,
             "sha256": file_sha256(tar)}
    (tmp_path / "packed.json").write_text(json.dumps({"format": "dali_pipe-packed/1", "classes": [f"c{i}" for i in
                                                      range(11)], "splits": {"train": {"samples": 12,
                                                                                       "shards": [shard]}}}))
    from dali_pipe.config import DataSettings
    from dali_pipe.inputs import read

    p = read(DataSettings(data=str(tmp_path), cache_dir=str(tmp_path / "cache")))
    assert [s.cls for s in p.shards] == [[i % 11 for i in range(12)]]
    assert _labels(_loader(p.train, 12, False)) == [i % 11 for i in range(12)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_shard_bytes_decode_as_pil_decodes_them(packed, device):
    """Validation over the pack's shards (bytes fed to DALI's decoder by the shard reader; nvJPEG on the GPU)
    equals PIL + numpy on the same tar members, image for image, with the labels of their cls members."""
    import io
    import tarfile

    import numpy as np
    from test_pipeline import SPEC as PIPE_SPEC
    from test_pipeline import TOL, _options, _reference, _run

    from dali_pipe.shards.format import parse_cls

    val = _shards(packed).val
    members = {}
    for path in val.paths:
        with tarfile.open(path) as t:
            for m in t.getmembers():
                key, ext = m.name.rsplit(".", 1)
                members.setdefault(key, {})[ext] = t.extractfile(m).read()
    keys = [k for k in members]  # tar order = index order = the evaluation plan's order (one rank)
    pipe = build_pipeline(val, PIPE_SPEC, _options(len(keys), device), training=False)
    out, labels = _run(pipe)
    ref = np.stack([_reference(io.BytesIO(members[k]["jpg"]), PIPE_SPEC) for k in keys])
    assert labels.tolist() == [parse_cls(members[k]["cls"]) for k in keys]
    err = np.abs(out - ref)
    for got, tol in zip((err.mean(), np.percentile(err, 99), err.max()), TOL[device]):
        assert got < tol


@pytest.mark.gpu
def test_gpu_recipe_trains_from_a_pack(packed, tmp_path, cache_dir):
    """On the GPU, from a pack: --auto-augment, mixup and cutmix, random erasing and --clip-grad-norm under
    the GPU's precision (fp16's GradScaler on a T4, bf16 elsewhere) train every step and export the model."""
    res = train.main(["--data", str(packed), "--model", "tiny", "--device", "gpu", "--epochs", "2", "--batch-size",
                      "8", "--auto-augment", "rand", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
                      "--random-erase", "0.25", "--label-smoothing", "0.1", "--clip-grad-norm", "1.0",
                      "--output", str(tmp_path / "out")])
    assert res["global_step"] == 2 * (43 // 8)
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "metrics.json").exists()


def test_a_shard_changed_in_place_with_its_mtime_kept_is_named_when_read(photo_root, tmp_path, cache_dir):
    """A byte of a pack's shard flipped, its size and mtime kept (what cp -p, rsync -a and bit rot keep): the
    check before training trusts its cached verdict (kept by size and mtime) and passes, but the reader hashes
    each shard as it first opens it and stops naming the shard; before, evaluate read the other bytes, exit 0."""
    import os

    from dali_pipe.shards.packs import open_packed
    from dali_pipe.shards.reader import ShardReadError
    from dali_pipe.shards.verdicts import verify_local

    main(["pack", str(photo_root), str(tmp_path / "p"), "--max-side", "96", "--workers", "1"])
    shards = open_packed(str(tmp_path / "p"), cache_dir)
    verify_local(shards.train, cache_dir, progress=False)  # hashed once: the verdict is kept by size and mtime
    assert _labels(_loader(shards.train, 8, False))  # and it reads
    victim = shards.train.paths[2]
    st = os.stat(victim)
    with open(victim, "r+b") as f:
        f.seek(700)  # inside the first image
        byte = f.read(1)
        f.seek(700)
        f.write(bytes([byte[0] ^ 0x20]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    verify_local(shards.train, cache_dir, progress=False)  # the dodge: the cached verdict still vouches for it
    with pytest.raises(ShardReadError, match=rf"{victim} changed after it was checked \(its xxh3 is not the one"):
        _labels(_loader(shards.train, 8, False))
