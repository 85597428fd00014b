"""Hugging Face datasets as a source, written by the `datasets` library itself: Parquet in the Hub's layout and
save_to_disk folders; classes from the ClassLabel, the split from the file names, each sample once per epoch
and an exact resume through the shard reader, bad rows listed in bad_images.tsv, ambiguous columns named."""
from __future__ import annotations

import io
from collections import Counter

import pytest
from helpers import cpu_options

from dali_pipe.config import DataSettings
from dali_pipe.loader import DaliLoader
from dali_pipe.pipeline import build_pipeline
from dali_pipe.shards.tables import TableSourceError, open_tables
from dali_pipe.spec import ImageSpec

SPEC = ImageSpec(16, 16, (0.5,) * 3, (0.5,) * 3)


@pytest.fixture(scope="module")
def hf(photo_root, tmp_path_factory):
    """photo_root's 48 photos, each its own ClassLabel class ('s007': a batch's labels say which photos it holds),
    written by `datasets`: the Hub's Parquet layout (data/train-*, data/validation-*, 5 rows per row group), a
    save_to_disk DatasetDict (train, validation, test), and a Parquet file with bad rows and two label columns."""
    import datasets
    from PIL import Image

    root = tmp_path_factory.mktemp("hf")
    photos = sorted(photo_root.glob("*/*.jpg"))
    names = [f"s{i:03d}" for i in range(len(photos))]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": p.read_bytes(), "path": p.name} for p in photos],
                                     "label": list(range(len(photos)))}, features=features)
    val = [i for i in range(48) if i % 6 == 0]
    (root / "hub" / "data").mkdir(parents=True)
    ds.select([i for i in range(48) if i not in val]).to_parquet(root / "hub/data/train-00000-of-00002.parquet",
                                                                  batch_size=5)
    ds.select(val).to_parquet(root / "hub/data/validation-00000-of-00001.parquet", batch_size=5)
    datasets.DatasetDict({"train": ds.select(range(30)), "validation": ds.select(range(30, 40)),
                          "test": ds.select(range(40, 48))}).save_to_disk(root / "dict")
    good = photos[0].read_bytes()
    buf = io.BytesIO()
    Image.open(photos[1]).save(buf, format="GIF")
    rows = [good, good[: len(good) // 2], buf.getvalue(), None, good, good]
    bad_features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"]),
                                      "coarse": datasets.ClassLabel(names=["x", "y"])})
    (root / "bad").mkdir()
    datasets.Dataset.from_dict({"image": [None if b is None else {"bytes": b, "path": None} for b in rows],
                                "label": [0, 1, 0, 1, -1, 1], "coarse": [0] * 6},
                               features=bad_features).to_parquet(root / "bad/part.parquet")
    return root


def _open(data, cache, **kw):
    return open_tables(DataSettings(data=str(data), cache_dir=str(cache), **kw))


def _loader(source, batch, training, seed=3):
    opts = cpu_options(batch, threads=1, training=training, seed=seed)
    return DaliLoader(lambda ck: build_pipeline(source, SPEC, opts, training=training, checkpoint=ck),
                      training=training)


def _labels(loader):
    return [i for _, y in loader for i in y.tolist()]


def test_parquet_each_sample_once_per_epoch_and_an_exact_resume(hf, tmp_path):
    """The Hub's layout: classes are the ClassLabel's names, validation the validation-* file; each row group is a
    shard, so each training sample comes once per epoch, in a new order each epoch, and a loader restored
    mid-epoch continues with the very batches of the uninterrupted run."""
    s = _open(hf / "hub", tmp_path)
    assert s.kind == "parquet" and s.classes == [f"s{i:03d}" for i in range(48)] and len(s.shards) == 10
    assert "split: the files' names" in s.note and "ClassLabel" in s.note
    val = {i for i in range(48) if i % 6 == 0}
    assert sorted(_labels(_loader(s.val, 3, False))) == sorted(val)
    loader = _loader(s.train, 5, True)
    epochs = [_labels(loader) for _ in range(2)]
    for seen in epochs:
        assert len(seen) == 40 and max(Counter(seen).values()) == 1 and not set(seen) & val
    assert epochs[0] != epochs[1]
    first = _loader(s.train, 5, True)
    it = iter(first)
    head = [y.tolist() for _, (_, y) in zip(range(3), it)]
    second = _loader(s.train, 5, True)
    second.restore(first.state())
    assert [i for b in head for i in b] + _labels(second) == epochs[0], "the uninterrupted run's first epoch"


def test_save_to_disk_dataset_dict_holds_out_its_test_split(hf, tmp_path):
    """A DatasetDict saved to disk: its split folders give train, validation and test (held out of training)."""
    from dali_pipe.inputs import detect

    assert detect(str(hf / "dict")).name == "arrow"
    s = _open(hf / "dict", tmp_path)
    assert (len(s.train), len(s.val), len(s.test), len(s.everything)) == (30, 10, 8, 48)
    assert sorted(_labels(_loader(s.test, 4, False))) == list(range(40, 48))


def test_bad_rows_are_listed_and_ambiguous_columns_named(hf, tmp_path):
    """A truncated JPEG, a GIF (which DALI cannot decode), a row without bytes and a label of -1 are left out and
    listed in bad_images.tsv with file and row; two ClassLabel columns are an error naming --label-column."""
    from dali_pipe.dataset import prepare

    with pytest.raises(TableSourceError, match=r"several label columns \(label, coarse\); pass --label-column"):
        _open(hf / "bad", tmp_path)
    data = DataSettings(data=str(hf / "bad"), cache_dir=str(tmp_path), label_column="label", max_bad_fraction=1.0,
                        val_fraction=0.0)
    shards, result = prepare(data, tmp_path / "out", num_threads=1)
    rows = [r.split("\t") for r in (tmp_path / "out" / "bad_images.tsv").read_text().splitlines()[1:]]
    reasons = {r[3]: r[1] for r in rows}
    assert set(reasons) == {f"part.parquet:{i}" for i in (1, 2, 3, 4)}, rows
    assert ("truncated JPEG" in reasons["part.parquet:1"] and "unsupported format GIF" in reasons["part.parquet:2"]
            and "no image bytes" in reasons["part.parquet:3"] and "-1" in reasons["part.parquet:4"])
    assert len(shards.train) == 2 and result.total == 6
    assert _open(hf / "bad", tmp_path, label_column="coarse", max_bad_fraction=1.0).classes == ["x", "y"]
    whole = (hf / "bad" / "part.parquet").read_bytes()
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "part.parquet").write_bytes(whole[: len(whole) // 2])  # a download cut short
    with pytest.raises(TableSourceError, match=r"part.parquet: not a readable Parquet file"):
        _open(tmp_path / "damaged", tmp_path, label_column="label")


def test_parquet_on_s3_is_synced_then_read(hf, s3, tmp_path):
    """An s3:// prefix of the Hub's layout (moto's server): synced to the cache dir, then read as the local copy."""
    from dali_pipe.dataset import prepare
    from dali_pipe.s3 import make_client

    client = make_client(4)
    client.create_bucket(Bucket="hub")
    for p in sorted((hf / "hub" / "data").iterdir()):
        client.upload_file(str(p), "hub", f"ds/data/{p.name}")
    data = DataSettings(data="s3://hub/ds", cache_dir=str(tmp_path / "cache"))
    shards, _ = prepare(data, tmp_path / "out", num_threads=1)
    assert shards.kind == "parquet" and (len(shards.train), len(shards.val)) == (40, 8)
    assert all(not p.startswith("s3://") for p in shards.train.paths)


def test_a_row_group_over_the_bound_is_refused_before_it_is_read(hf):
    """A Parquet row group is read whole (its label and image columns): one whose metadata says it holds more
    than the bound is refused naming the file, the group and the fix, before a byte of it is read; the groups
    `datasets` wrote (5 photos each) are far under GROUP_MAX."""
    import pyarrow.parquet as pq

    from dali_pipe.shards.tables import GROUP_MAX, check_row_groups

    md = pq.ParquetFile(hf / "hub/data/train-00000-of-00002.parquet").metadata
    sizes = [md.row_group(g).total_byte_size for g in range(md.num_row_groups)]
    assert check_row_groups(md, "train.parquet") == md.num_row_groups == 8 and max(sizes) < GROUP_MAX
    with pytest.raises(TableSourceError) as e:
        check_row_groups(md, "data/train.parquet", most=sorted(sizes)[-2])
    g = sizes.index(max(sizes))
    assert f"data/train.parquet: row group {g} holds {sizes[g]} bytes uncompressed" in str(e.value)
    assert "row_group_size=" in str(e.value)


def _flip(path, at):
    """One byte of `path` flipped at `at`, its size and mtime kept (cp -p, rsync -a, bit rot)."""
    import os

    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x20]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("form", ["hub", "dict"])
def test_a_table_changed_in_place_with_its_mtime_kept_is_named_when_read(hf, tmp_path, form):
    """A byte of a Parquet or Arrow file flipped, its size and mtime kept: the check before training trusts its
    cache (kept by path, size and mtime) and passes, but the reader hashes what it reads (a Parquet row group's
    image bytes before it reads the group; an Arrow file whole at its first batch) and stops naming the file and
    the group; before, the run read the changed bytes."""
    import shutil

    import pyarrow.parquet as pq

    from dali_pipe.shards.reader import ShardReadError
    from dali_pipe.shards.tables import image_span
    from dali_pipe.shards.verdicts import verify_local

    shutil.copytree(hf / form, tmp_path / form)
    s = _open(tmp_path / form, tmp_path / "cache")
    assert len(_labels(_loader(s.train, 5, True))) == len(s.train)  # it reads
    victim = s.train.paths[0]
    if form == "hub":
        start, end = image_span(pq.ParquetFile(victim).metadata, 1, "image")
        _flip(victim, (start + end) // 2)  # inside row group 1's image bytes
        said = rf"{victim} changed after it was checked \(the image bytes of row group 1 are not the ones checked\)"
    else:
        _flip(victim, __import__("os").stat(victim).st_size // 2)
        said = rf"{victim} changed after it was checked \(its xxh3 is not the one"
    s = _open(tmp_path / form, tmp_path / "cache")  # the dodge: the cached check still vouches for it
    verify_local(s.train, tmp_path / "cache", progress=False)
    with pytest.raises(ShardReadError, match=said):
        _labels(_loader(s.train, 5, True))


def test_rows_that_name_their_image_by_path_are_checked_again_when_the_file_changes(photo_root, tmp_path):
    """`Dataset.to_parquet` of images loaded from files keeps only their paths (bytes null): the check reads each
    file and remembers its size and mtime, and a file changed since (here: no longer an image) makes the table
    checked again, so the row is left out and named; before, the cached check still passed it, and DALI stopped
    mid-epoch."""
    import os
    import shutil

    import datasets

    folder = tmp_path / "pq"
    (folder / "imgs").mkdir(parents=True)
    for i, p in enumerate(sorted(photo_root.glob("*/*.jpg"))[:6]):
        shutil.copy(p, folder / "imgs" / f"{i}.jpg")
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    here = os.getcwd()
    os.chdir(folder)  # datasets keeps the paths as given: relative to the Parquet file's folder
    try:
        datasets.Dataset.from_dict({"image": [f"imgs/{i}.jpg" for i in range(6)], "label": [i % 2 for i in range(6)]},
                                   features=features).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    finally:
        os.chdir(here)
    s = _open(folder, tmp_path / "cache", val_fraction=0)
    assert not s.bad and len(_labels(_loader(s.train, 2, False))) == 6
    (folder / "imgs" / "2.jpg").write_text("no longer a photo\n")
    s = _open(folder, tmp_path / "cache", val_fraction=0)
    assert [(shard.keys[e], shard.image_paths[e]) for shard, e, _ in s.bad] == [
        ("train-00000-of-00001.parquet:2", "imgs/2.jpg")], s.bad
    assert len(_labels(_loader(s.train, 2, False))) == 5


@pytest.mark.parametrize("second", ["text", "reordered", "integers"])
def test_files_of_two_datasets_labels_are_refused_naming_each(photo_root, tmp_path, second):
    """A training file of one dataset beside a validation file of another, written by `datasets`: text labels
    beside a ClassLabel (each of its rows was listed bad, "label 'astronaut' is not one of the ClassLabel's 4
    names"), the ClassLabel's names in another order (refused without naming a file), text beside plain integers
    (trained on, with classes '0'..'3' beside 'astronaut'). Each is refused naming both files and the fix."""
    import datasets

    photos = sorted(photo_root.glob("*/*.jpg"))[:12]
    names = sorted(d.name for d in photo_root.iterdir() if d.is_dir())
    images = [{"bytes": p.read_bytes(), "path": p.name} for p in photos]
    labels = [names.index(p.parent.name) for p in photos]
    label_type = {"text": datasets.Value("string"), "reordered": datasets.ClassLabel(names=names[::-1]),
                  "integers": datasets.Value("int64")}
    first = datasets.Value("int64") if second == "integers" else datasets.ClassLabel(names=names)
    (tmp_path / "d/data").mkdir(parents=True)
    for split, feature in (("train", first), ("validation", label_type["text" if second == "integers" else second])):
        values = [names[i] for i in labels] if feature == datasets.Value("string") else labels
        datasets.Dataset.from_dict({"image": images, "label": values}, features=datasets.Features(
            {"image": datasets.Image(), "label": feature})).to_parquet(tmp_path / f"d/data/{split}-00000-of-00001.parquet")
    with pytest.raises(TableSourceError) as e:
        _open(tmp_path / "d", tmp_path / "cache")
    said = str(e.value)
    assert "its files hold the labels of different datasets" in said and "ds.cast_column('label', ClassLabel(" in said
    assert "data/train-00000-of-00001.parquet: " in said and "data/validation-00000-of-00001.parquet: " in said
    assert {"text": "text labels ('", "reordered": "a ClassLabel of 4 names (rocket, coffee, chelsea, astronaut)",
            "integers": "integer labels without a ClassLabel"}[second] in said


def test_a_save_to_disk_folder_without_its_state_json_is_named(hf, tmp_path):
    """save_to_disk folders copied without state.json: a Dataset's was called a folder holding none of the input
    forms, a DatasetDict split's 'cannot be read as JSON ([Errno 2] ...)'; both now name the missing file and the fix."""
    import shutil

    import datasets

    from dali_pipe.inputs import data_problem

    one = tmp_path / "one"
    datasets.load_from_disk(str(hf / "dict"))["test"].save_to_disk(one)
    (one / "state.json").unlink()
    said = data_problem(str(one))
    assert "holds data-00000-of-00001.arrow, as Dataset.save_to_disk writes them, but no state.json" in said
    assert "copy the whole folder again" in said and "none of the input forms" not in said
    shutil.copytree(hf / "dict", tmp_path / "dict")
    (tmp_path / "dict/validation/state.json").unlink()
    with pytest.raises(TableSourceError, match=r"dict/validation/state.json is missing: .*dataset_dict.json lists the "
                                               r"split 'validation'.*copy the whole .*dict again"):
        _open(tmp_path / "dict", tmp_path / "cache")


def test_a_dataset_of_test_files_only_is_named_as_such(hf, trained, tmp_path, cache_dir):
    """A Parquet dataset whose only file is data/test-*: training said "--batch-size 8 is larger than the 0 training
    images", evaluate --split val "no images in it (no split column ...)", and pack wrote a pack of 0 images, exit 0.
    Each now names the test file and the fix; evaluate --split test still reads it."""
    import datasets
    from helpers import datamodule

    from dali_pipe.cli.commands import main
    from dali_pipe.dataset import NoTrainingError
    from dali_pipe.errors import UserError
    from dali_pipe.pack import PackError

    src = tmp_path / "t"
    datasets.load_from_disk(str(hf / "dict"))["test"].to_parquet(src / "data/test-00000-of-00001.parquet")
    said = r"--data '.*t' holds only test files \(8 images in data/test-00000-of-00001.parquet\).*name them train-\*"
    dm = datamodule(src, tmp_path / "out", batch_size=4, cache_dir=cache_dir, spec=SPEC)
    dm.prepare_data()
    with pytest.raises(NoTrainingError, match=said):
        dm.setup_manifest(1)
    with pytest.raises(PackError, match=said.replace("--data", "SRC")):
        main(["pack", str(src), str(tmp_path / "packed"), "--workers", "1"])
    assert not (tmp_path / "packed/packed.json").exists()
    with pytest.raises(UserError, match=rf"--split val: {said}.*; pass --split test"):
        main(["evaluate", "--model", str(trained), "--data", str(src), "--device", "cpu", "--split", "val",
              "--output", str(tmp_path / "ev")])


def test_one_parquet_file_is_a_dataset_for_training_pack_and_predict(hf, trained, tmp_path, cache_dir):
    """--data train.parquet, the one file a single Dataset.to_parquet call writes, is the Parquet form for training,
    pack and predict (before: training and pack said "is not a directory", predict "not UTF-8 text"). A binary file
    of no form given to predict is named as such, not as a list file that is not UTF-8."""
    import csv

    from helpers import datamodule

    from dali_pipe.cli.commands import main
    from dali_pipe.errors import UserError
    from dali_pipe.inputs import by_name, data_problem, detect, read

    one = hf / "hub/data/train-00000-of-00002.parquet"
    assert detect(str(one)) is by_name("parquet") and data_problem(str(one)) is None
    got = _open(one, cache_dir, val_fraction=0.25)
    folder = _open(hf / "hub", cache_dir)
    assert len(got.train) + len(got.val) == len(folder.train) == 40 and len(got.val) > 0
    assert got.classes == folder.classes  # the ClassLabel's 48 names, not only those of its rows
    assert {k.split(":")[0] for s in got.shards for k in s.keys} == {one.name}
    dm = datamodule(one, tmp_path / "out", batch_size=4, cache_dir=cache_dir, spec=SPEC)
    dm.prepare_data()
    dm.setup_manifest(1)
    assert main(["pack", str(one), str(tmp_path / "packed"), "--workers", "1", "--cache-dir", str(cache_dir)]) == 0
    packed = read(DataSettings(data=str(tmp_path / "packed"), cache_dir=str(cache_dir)))
    assert len(packed.train) + len(packed.val) == 40
    assert main(["predict", "--model", str(trained), "--data", str(one), "--device", "cpu",
                 "--output", str(tmp_path / "pred"), "--cache-dir", str(cache_dir)]) == 0
    with open(tmp_path / "pred/predictions.tsv", newline="") as f:
        assert len(list(csv.DictReader(f, delimiter="\t"))) == 40
    arrow = next((hf / "dict/train").glob("*.arrow"))
    with pytest.raises(UserError, match=r"is a file predict does not read \(binary.*pass its folder"):
        main(["predict", "--model", str(trained), "--data", str(arrow), "--device", "cpu",
              "--output", str(tmp_path / "pred2"), "--cache-dir", str(cache_dir)])


def test_one_validation_file_is_named_as_such_by_training(hf, tmp_path, cache_dir):
    """--data validation.parquet (one file, as `ds["validation"].to_parquet(...)` writes it): its name makes every
    row validation, and training said "--batch-size 4 is larger than the 0 training images ...; add training
    images". It now names the file, why nothing trains and the fix; pack still packs it (evaluate reads a pack of
    validation images)."""
    import datasets
    from helpers import datamodule

    from dali_pipe.cli.commands import main
    from dali_pipe.dataset import NoTrainingError

    one = tmp_path / "validation.parquet"
    datasets.load_from_disk(str(hf / "dict"))["validation"].to_parquet(one)
    dm = datamodule(one, tmp_path / "out", batch_size=4, cache_dir=cache_dir, spec=SPEC)
    dm.prepare_data()
    with pytest.raises(NoTrainingError, match=r"--data '.*validation.parquet' holds only validation files \(10 images "
                                              r"in validation.parquet\).*trains on none.*without a split word.*--val-fraction"):
        dm.setup_manifest(1)
    assert main(["pack", str(one), str(tmp_path / "packed"), "--workers", "1"]) == 0
