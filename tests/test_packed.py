"""Packed data as a source: each sample once per epoch, across ranks and across a resume; training
and evaluation from a local pack and from S3 (synced, or streamed when it does not fit)."""
from __future__ import annotations

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
def packed(photo_root, tmp_path_factory):
    """photo_root (43 train / 5 val) packed into several small shards."""
    import os

    dst = tmp_path_factory.mktemp("packed")
    os.environ.setdefault("DALI_PIPE_CACHE", str(dst / "cache"))
    main(["pack", str(photo_root), str(dst / "p"), "--max-side", "96", "--shard-size", "60kB", "--workers", "2"])
    return dst / "p"


def _shards(packed):
    from dali_pipe.shards.source import open_packed

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


def test_pack_keys_and_labels_survive_the_pipeline(packed, photo_root):
    """Validation through DALI yields every val image's class, as the manifest says."""
    from dali_pipe.manifest import read_manifest

    m = read_manifest(photo_root, val_fraction=0.1, seed=0, skip_missing=False)
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


def test_train_and_evaluate_from_a_local_pack(packed, tmp_path, cache_dir):
    out = tmp_path / "m"
    res = train.main(["--data", str(packed), "--model", "tiny", "--device", "cpu", "--epochs", "1", "--batch-size",
                      "8", "--num-threads", "1", "--output", str(out)])
    assert res["global_step"] == 43 // 8 and res["val_samples"] == 5
    main(["evaluate", "--model", str(out), "--data", str(packed), "--device", "cpu", "--output", str(tmp_path / "e"),
          "--split", "all"])
    assert json.loads((tmp_path / "e" / "metrics.json").read_text())["images"] == 48


@pytest.mark.parametrize("route", ["sync", "stream"])
def test_train_from_a_pack_on_s3(route, photo_root, s3_process, tmp_path, cache_dir, monkeypatch, capsys):
    """Packed to S3, read back: synced when it fits, streamed by DALI from S3 when it does not (the free
    space is made too small)."""
    import dali_pipe.packed as packed_mod
    from dali_pipe.sync import make_client

    make_client(4).create_bucket(Bucket="data")
    main(["pack", str(photo_root), "s3://data/packed", "--max-side", "96", "--shard-size", "60kB"])
    if route == "stream":
        monkeypatch.setattr(packed_mod, "HEADROOM", 1 << 60)
    res = train.main(["--data", "s3://data/packed", "--model", "tiny", "--device", "cpu", "--epochs", "1",
                      "--batch-size", "8", "--num-threads", "1", "--output", str(tmp_path / "m"), "--cache-dir",
                      str(cache_dir)])
    assert res["global_step"] == 43 // 8
    local = cache_dir / "s3" / "data" / "packed"
    tars = list(local.glob("*.tar"))
    assert (local / "packed.json").is_file() and list(local.glob("*.idx"))
    if route == "sync":
        assert len(tars) == len(json.loads((local / "packed.json").read_text())["splits"]["train"]["shards"]) + 1
    else:
        assert not tars and "reading them from S3 as needed" in capsys.readouterr().err
