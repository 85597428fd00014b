"""The registry of input forms: every registered form, written by its own peer (our pack command, webdataset's
ShardWriter, `datasets`' to_parquet and save_to_disk, a dataset.tsv, torchvision's folder layout), answers every
question the registry asks of a form: told apart locally and on S3, read as columns with the same classes and
samples, prepared from S3 into the same, packed, listed in the messages and in docs/data.md's table."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dali_pipe.cli.commands import main
from dali_pipe.config import DataSettings
from dali_pipe.inputs import FORMS, Form, by_name, detect, forms_text, read
from dali_pipe.s3 import ManifestMissing

ROOT = Path(__file__).resolve().parents[1]
PER_CLASS = 4


@pytest.fixture(scope="module")
def written(photo_root, tmp_path_factory) -> dict[str, Path]:
    """Each form holding the same 16 photos (4 classes of 4; every 4th photo in validation where the form
    carries a split), each written by the tool that writes that form."""
    import datasets
    import webdataset as wds

    root = tmp_path_factory.mktemp("forms")
    classes = sorted(p.name for p in photo_root.iterdir() if p.is_dir())
    photos = [(c, p) for c in classes for p in sorted((photo_root / c).glob("*.jpg"))[:PER_CLASS]]
    out = {}
    folder = root / "imagefolder"
    for c, p in photos:
        (folder / c).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, folder / c / p.name)
    out["imagefolder"] = folder
    shutil.copytree(folder, root / "manifest")
    (root / "manifest" / "dataset.tsv").write_text(
        "image_path\tlabel\n" + "".join(f"{c}/{p.name}\t{c}\n" for c, p in photos))
    out["manifest"] = root / "manifest"
    main(["pack", str(out["manifest"]), str(root / "pack"), "--workers", "1", "--cache-dir", str(root / "cache")])
    out["pack"] = root / "pack"
    (root / "shards").mkdir()
    writers = {s: wds.TarWriter(str(root / "shards" / f"{s}-000000.tar")) for s in ("train", "val")}
    for i, (c, p) in enumerate(photos):
        writers["val" if i % 4 == 3 else "train"].write({"__key__": f"s{i:03d}", "jpg": p.read_bytes(),
                                                          "cls": classes.index(c)})
    for w in writers.values():
        w.close()
    (root / "shards" / "classes.txt").write_text("\n".join(classes) + "\n")
    out["shards"] = root / "shards"
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": p.read_bytes(), "path": p.name} for _, p in photos],
                                     "label": [classes.index(c) for c, _ in photos]}, features=features)
    train, val = ds.select([i for i in range(len(photos)) if i % 4 != 3]), ds.select(range(3, len(photos), 4))
    (root / "parquet" / "data").mkdir(parents=True)
    train.to_parquet(root / "parquet/data/train-00000-of-00001.parquet", batch_size=5)
    val.to_parquet(root / "parquet/data/validation-00000-of-00001.parquet", batch_size=5)
    out["parquet"] = root / "parquet"
    datasets.DatasetDict({"train": train, "validation": val}).save_to_disk(root / "arrow")
    out["arrow"] = root / "arrow"
    assert set(out) == {f.name for f in FORMS}, "a registered form has no example here: add one"
    return out


def _columns(got) -> tuple[list[str], list[int]]:
    """(classes, every sample's class name, sorted), from the columns a form's read gives: a Manifest's label
    arrays, or a ShardSet's per-shard cls lists."""
    if hasattr(got, "shards"):
        assert all(isinstance(s.cls, list) for s in got.shards)  # a list per shard, not an object per sample
        labels = [got.classes[c] for s in got.shards for e, c in enumerate(s.cls) if e not in s.bad and
                  s.split[e] in ("train", "val")]
    else:
        assert isinstance(got.train.labels, np.ndarray) and isinstance(got.train.paths, np.ndarray)
        labels = [got.classes[c] for c in np.concatenate([got.train.labels, got.val.labels]).tolist()]
    return got.classes, sorted(labels)


@pytest.mark.parametrize("name", [f.name for f in FORMS])
def test_every_form_is_told_apart_read_as_columns_and_packed(name, written, tmp_path):
    form = by_name(name)
    assert isinstance(form, Form) and form.reader in ("files", "shards")
    assert detect(str(written[name])) is form
    data = DataSettings(data=str(written[name]), cache_dir=str(tmp_path / "cache"))
    got = read(data)
    expected_classes = sorted(p.name for p in written["imagefolder"].iterdir())
    classes, labels = _columns(got)
    assert classes == expected_classes
    assert labels == sorted(c for c in expected_classes for _ in range(PER_CLASS))
    assert len(got.train) > 0 and len(got.val) > 0 and len(got.train) + len(got.val) == 4 * PER_CLASS
    assert isinstance(got.digest(), str) and got.digest() == read(data).digest()
    assert main(["pack", str(written[name]), str(tmp_path / "packed"), "--workers", "1",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    packed = read(DataSettings(data=str(tmp_path / "packed"), cache_dir=str(tmp_path / "cache")))
    assert _columns(packed) == (classes, labels) and len(packed.val) == len(got.val)


def test_every_form_is_told_apart_on_s3_prepared_and_synced_into_what_it_reads_locally(written, s3, tmp_path):
    """Each form uploaded to S3: the registry tells which it is from the prefix's listing; training's
    preparation reads the same samples as the local form; `python -m dali_pipe sync` of the prefix makes a
    folder that is the same form, reading the same samples (before: it refused all but two forms)."""
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="forms")
    for name, folder in written.items():
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                client.upload_file(str(f), "forms", f"{name}/{f.relative_to(folder).as_posix()}")
    for form in FORMS:
        data = DataSettings(data=f"s3://forms/{form.name}", cache_dir=str(tmp_path / "cache"))
        assert detect(data.data) is form, form.name  # asked of S3 (nothing synced yet)
        got = form.prepare(data, num_threads=1, workers=2, labels=True)
        local = read(DataSettings(data=str(written[form.name]), cache_dir=str(tmp_path / "local-cache")))
        assert _columns(got) == _columns(local), form.name
        assert len(got.val) == len(local.val), form.name
        assert detect(data.data, data.cache_dir) is form, form.name  # (from the synced copy, where it is one)
        dest = tmp_path / "synced" / form.name
        assert main(["sync", data.data, str(dest), "--workers", "4"]) == 0
        assert detect(str(dest)) is form, form.name
        again = read(DataSettings(data=str(dest), cache_dir=str(tmp_path / "local-cache")))
        assert _columns(again) == _columns(local) and len(again.val) == len(local.val), form.name
    client.put_object(Bucket="forms", Key="nothing/notes.txt", Body=b"hello")
    with pytest.raises(ManifestMissing, match="s3://forms/nothing holds none of the input forms"):
        main(["sync", "s3://forms/nothing", str(tmp_path / "synced" / "nothing")])


def test_every_form_is_listed_in_the_messages_and_in_the_docs_table():
    text = forms_text()
    table = [line.split("|")[1].strip() for line in (ROOT / "docs/data.md").read_text().splitlines()
             if line.startswith("| ")]
    for form in FORMS:
        assert f"{form.title}: {form.example}" in text
        assert form.title in table, f"docs/data.md's table of forms has no row {form.title!r}"


def test_a_url_of_another_scheme_and_a_path_of_no_form_are_none_of_them(tmp_path):
    from dali_pipe.shards.shardset import ShardSourceError

    with pytest.raises(ShardSourceError, match="gs:// URLs are not read"):
        detect("gs://bucket/data")
    (tmp_path / "notes.txt").write_text("hello")
    assert detect(str(tmp_path)) is None and detect(str(tmp_path / "notes.txt")) is None
    assert detect(str(tmp_path / "missing")) is None


def test_on_s3_a_form_is_told_past_the_first_page_and_hidden_shards_are_none(written, s3, tmp_path):
    """A dataset.tsv beside 1000 class folders (what `manifest` writes for ImageNet's numbered classes) is past
    the first page of the prefix's listing: it is asked for by name, so the prefix is a dataset.tsv folder, not
    an ImageFolder. A hidden shard (.x.tar) is no shard on S3, as locally; a Parquet dataset with
    dataset_info.json beside its files is synced as Parquet (before: as save_to_disk, so only the JSON came)."""
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="edge")
    photo = next(written["imagefolder"].rglob("*.jpg")).read_bytes()
    for i in range(1000):
        client.put_object(Bucket="edge", Key=f"ds/{i:03d}/a.jpg", Body=photo)
    client.put_object(Bucket="edge", Key="ds/dataset.tsv", Body=b"image_path\tlabel\n000/a.jpg\tx\n001/a.jpg\ty\n")
    assert detect("s3://edge/ds") is by_name("manifest")
    shard = next(written["shards"].glob("train-*.tar"))
    client.upload_file(str(shard), "edge", "hidden/.upload-000000.tar")
    assert detect("s3://edge/hidden") is None
    client.upload_file(str(shard), "edge", "hidden/train-000000.tar")
    assert detect("s3://edge/hidden") is by_name("shards")
    got = read(DataSettings(data="s3://edge/hidden", cache_dir=str(tmp_path / "c"), val_fraction=0.0))
    assert [s.name for s in got.shards] == ["s3://edge/hidden/train-000000.tar"]
    for f in sorted((written["parquet"] / "data").glob("*.parquet")):
        client.upload_file(str(f), "edge", f"pq/{f.name}")
    client.put_object(Bucket="edge", Key="pq/dataset_info.json", Body=b"{}")
    assert detect("s3://edge/pq") is by_name("parquet")
    assert main(["sync", "s3://edge/pq", str(tmp_path / "pq")]) == 0
    assert sorted(p.name for p in (tmp_path / "pq").iterdir() if not p.name.startswith(".")) == [
        "dataset_info.json", "train-00000-of-00001.parquet", "validation-00000-of-00001.parquet"]


def test_a_misspelt_s3_prefix_is_told_before_torch_loads(written, s3, tmp_path):
    """train.py --data s3://bucket/typo: the registry asks the prefix before the heavy imports (before: after
    torch and Lightning, 4-6 s)."""
    import boto3
    from helpers import told_before_torch

    boto3.client("s3").create_bucket(Bucket="typo")
    said = told_before_torch(["--data", "s3://typo/datset", "--model", "tiny", "--output", str(tmp_path / "o"),
                              "--cache-dir", str(tmp_path / "c")])
    assert "NoDataError --data 's3://typo/datset' holds none of the input forms, or nothing at all" in said, said
    assert "names a file" not in said
    # an object's key, not a prefix: named as such, with the prefix to pass (for sync too)
    boto3.client("s3").put_object(Bucket="typo", Key="hf/train.parquet", Body=b"PAR1")
    said = told_before_torch(["--data", "s3://typo/hf/train.parquet", "--model", "tiny", "--output",
                              str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c")])
    assert ("it names a file (train.parquet), and an s3:// --data is a prefix (a folder): pass s3://typo/hf, the "
            "prefix holding it") in said, said
    with pytest.raises(ManifestMissing, match=r"check the prefix; it names a file \(train.parquet\).*pass s3://typo/hf"):
        main(["sync", "s3://typo/hf/train.parquet", str(tmp_path / "synced")])
    # a prefix named like a file that holds objects (Spark's or pyarrow's partitioned out.parquet/) is a folder:
    # no "it names a file ... pass s3://typo/spark" (which holds no form either)
    boto3.client("s3").put_object(Bucket="typo", Key="spark/out.parquet/label=0/part-0.parquet", Body=b"PAR1")
    said = told_before_torch(["--data", "s3://typo/spark/out.parquet", "--model", "tiny", "--output",
                              str(tmp_path / "o"), "--cache-dir", str(tmp_path / "c")])
    assert "holds none of the input forms" in said and "names a file" not in said, said
    with pytest.raises(ManifestMissing) as e:
        main(["sync", "s3://typo/spark/out.parquet", str(tmp_path / "synced")])
    assert "holds none of the input forms" in str(e.value) and "names a file" not in str(e.value)

