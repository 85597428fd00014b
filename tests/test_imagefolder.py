"""A folder of class subfolders as a dataset: classes, indices and files exactly torchvision's ImageFolder's
(tests/torchvision_imagefolder/: its own reading of a tricky tree), ImageNet's train/ + val/ split, the
dataset.tsv the folder implies, and the same layout on S3."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from dali_pipe.forms import IMG_EXTENSIONS
from dali_pipe.imagefolder import ImageFolderError, read_image_folder, tree, write_manifest
from dali_pipe.inputs import detect
from dali_pipe.manifest import read_manifest

FIXTURE = Path(__file__).parent / "torchvision_imagefolder"


def _fixture():
    spec = importlib.util.spec_from_file_location("make_fixture", FIXTURE / "make_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, json.loads((FIXTURE / "expected.json").read_text(encoding="utf-8"))


def test_classes_indices_and_files_are_torchvisions(tmp_path):
    """Case, unicode (composed and decomposed), dots, spaces, hidden folders and files, nested and linked folders,
    non-image files: the classes, class_to_idx and samples (in order) torchvision's ImageFolder gives; a class
    folder without images is refused, as torchvision refuses it."""
    make, expected = _fixture()
    data = make.build_tree(tmp_path / "a")
    assert list(IMG_EXTENSIONS) == expected["IMG_EXTENSIONS"]
    t = tree(data)
    assert list(t) == expected["classes"] and {c: i for i, c in enumerate(t)} == expected["class_to_idx"]
    assert [[rel, i] for i, files in enumerate(t.values()) for rel in files] == expected["samples"]
    m = read_image_folder(data, val_fraction=0.2, seed=0)
    assert m.classes == expected["classes"]
    got = sorted((os.path.relpath(s.path, data), s.label) for s in m.train + m.val)
    resolved = sorted((os.path.relpath(os.path.realpath(data / rel), data), i) for rel, i in expected["samples"])
    assert got == resolved and detect(str(data)).name == "imagefolder"
    assert "hash of its path" in m.note and m.val
    empty = make.build_tree(tmp_path / "b", empty_class=True)
    assert expected["empty_class_error"].startswith("Found no valid file for the classes empty")
    with pytest.raises(ImageFolderError, match=r"\(an ImageFolder\): 1 class folder\(s\) hold no image \('empty'"):
        read_image_folder(empty, val_fraction=0.2, seed=0)


def _pair(photo_root: Path, dest: Path) -> Path:
    """photo_root as ImageNet lays data out: train/CLASS/ and val/CLASS/ (hard links to the photos)."""
    for i, p in enumerate(sorted(photo_root.glob("*/*.jpg"))):
        target = dest / ("val" if i % 4 == 0 else "train") / p.parent.name / p.name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(p, target)
    return dest


def test_train_and_val_folders_split_and_the_manifest_command(photo_root, tmp_path, capsys):
    """train/ + val/ (ImageNet's layout) is the split, with train/'s classes; `python -m dali_pipe manifest` writes
    the dataset.tsv it implies (which reads back as the same samples and split), refuses to replace one without
    --force, and a val/ class that train/ lacks is named."""
    from dali_pipe.cli.commands import main

    root = _pair(photo_root, tmp_path / "imagenet")
    m = read_image_folder(root, val_fraction=0.5, seed=0)
    assert m.note == "split: the train/ and val/ folders (ImageNet's layout)"
    assert (len(m.train), len(m.val), m.classes) == (36, 12, sorted(p.name for p in photo_root.iterdir() if p.is_dir()))
    assert all("/val/" in s.path for s in m.val) and all("/train/" in s.path for s in m.train)
    assert main(["manifest", str(root)]) == 0 and "48 images" in capsys.readouterr().out
    back = read_manifest(root, val_fraction=0.5, seed=0, skip_missing=False)
    assert {(s.path, back.classes[s.label]) for s in back.val} == {(s.path, m.classes[s.label]) for s in m.val}
    assert {(s.path, back.classes[s.label]) for s in back.train} == {(s.path, m.classes[s.label]) for s in m.train}
    with pytest.raises(ImageFolderError, match="exists already; pass --force"):
        write_manifest(root, force=False)
    assert write_manifest(root, force=True)[1] == 48
    (root / "dataset.tsv").unlink()
    (root / "val" / "stranger").mkdir()
    shutil.copy(next(photo_root.glob("*/*.jpg")), root / "val" / "stranger" / "x.jpg")
    with pytest.raises(ImageFolderError, match=r"class folder\(s\) \['stranger'\] are not in"):
        read_image_folder(root, val_fraction=0.5, seed=0)


def test_manifest_on_a_full_disk_leaves_nothing(tmp_path):
    """A disk that fills while dataset.tsv is written: one message, no dataset.tsv and no temporary file left."""
    from helpers import fill, small_disk

    make, _ = _fixture()
    with small_disk(tmp_path / "disk", "1m") as disk:
        data = make.build_tree(disk)
        fill(disk, leave=0)
        with pytest.raises(ImageFolderError, match="cannot write .*dataset.tsv"):
            write_manifest(data, force=False)
        assert not [p for p in data.iterdir() if "dataset.tsv" in p.name]


def test_an_imagefolder_on_s3_reads_what_the_bucket_holds(photo_root, s3, tmp_path):
    """s3://bucket/prefix of class folders: the images are synced (nothing else), classes and split as for the local
    folder; an object removed from the bucket is not read again from the cache's copy."""
    from dali_pipe.config import DataSettings
    from dali_pipe.dataset import prepare
    from dali_pipe.s3 import make_client

    client = make_client(4)
    client.create_bucket(Bucket="pets-bucket")
    files = sorted(photo_root.glob("*/*.jpg"))
    for p in files:
        client.upload_file(str(p), "pets-bucket", f"pets/{p.parent.name}/{p.name}")
    client.put_object(Bucket="pets-bucket", Key="pets/README.md", Body=b"not an image")
    data = DataSettings(data="s3://pets-bucket/pets", cache_dir=str(tmp_path / "cache"), val_fraction=0.25)
    m, _ = prepare(data, tmp_path / "out", num_threads=1)
    local = read_image_folder(photo_root, val_fraction=0.25, seed=0)
    rel = lambda samples, root: sorted(os.path.relpath(s.path, root) for s in samples)  # noqa: E731
    assert m.classes == local.classes and m.note == local.note
    assert rel(m.val, m.root) == rel(local.val, photo_root) and len(m.train) == len(local.train)
    assert not (m.root / "README.md").exists()
    gone = f"{files[0].parent.name}/{files[0].name}"
    client.delete_object(Bucket="pets-bucket", Key=f"pets/{gone}")
    again, _ = prepare(data, tmp_path / "out", num_threads=1)
    assert len(again.train) + len(again.val) == 47 and (m.root / gone).exists(), "the stale copy stays, unread"


def test_a_linked_class_folder_whose_real_name_is_not_utf8(tmp_path):
    """A class folder that is a link to a folder whose name is not UTF-8: its files are read through the link's
    real path (as before the columns), not a crash."""
    import os

    from dali_pipe.imagefolder import read_image_folder
    from dali_pipe.samples import Samples

    root = tmp_path / "lk"
    real = os.fsdecode(bytes(tmp_path) + b"/real\xff")
    os.makedirs(real)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(2):
            (root / c / f"{i}.jpg").write_bytes(b"x")
    for i in range(2):
        with open(os.path.join(real, f"{i}.jpg"), "wb") as f:
            f.write(b"x")
    os.symlink(real, root / "c")
    m = read_image_folder(root, val_fraction=0.3, seed=0)
    both = Samples.of(list(m.train) + list(m.val))
    assert m.classes == ["a", "b", "c"]
    assert sorted(p for p, label in zip(both.files, both.labels.tolist()) if label == 2) == \
        [os.path.join(real, "0.jpg"), os.path.join(real, "1.jpg")]
    assert len(m.digest()) == 16


def test_folders_that_are_not_data_are_refused_by_name(photo_root, tmp_path):
    """A folder beside train/ and val/ that is neither (holdout/, __MACOSX/ from a Mac zip), both val/ and
    validation/, a symbolic link loop and a folder linked into both splits: each refused naming the folder, where
    they trained the split names as classes, or read the same images again and again, exit 0. A test/ beside
    train/ and val/ is still left out, and a folder listed twice in one split is listed twice, as torchvision does."""
    import train
    from dali_pipe.config import UsageError
    from dali_pipe.forms import LayoutError

    root = _pair(photo_root, tmp_path / "imagenet")
    (root / "test" / "astronaut").mkdir(parents=True)
    assert read_image_folder(root, val_fraction=0.5, seed=0).split_rule == "folders"
    for sibling, told in (("holdout", r"and beside them holdout/, which is neither a split nor a class: move it out"),
                          ("__MACOSX", r"and beside them __MACOSX/, which is neither"),
                          ("validation", r"holds train/ and both val/ and validation/")):
        (root / sibling / "x").mkdir(parents=True)
        with pytest.raises(LayoutError, match=told):
            read_image_folder(root, val_fraction=0.5, seed=0)
        with pytest.raises(UsageError, match=told):
            train.main(["--data", str(root), "--model", "tiny", "--device", "cpu", "--output", str(tmp_path / "o")])
        shutil.rmtree(root / sibling)

    shutil.rmtree(root / "test")
    for rename, told in ((("val", "test"), r"holds the split folders test/, train/, but not ImageNet's layout"),
                         (("val", "Val"), r"holds the split folders Val/, train/, but not"),
                         (("val", "valid"), r"holds the split folders train/, valid/, but not")):
        (root / rename[0]).rename(root / rename[1])
        with pytest.raises(LayoutError, match=told):
            read_image_folder(root, val_fraction=0.5, seed=0)
        (root / rename[1]).rename(root / rename[0])
    flat = tmp_path / "flat"  # train/CLASS/ beside a val/ of images without class folders
    _pair(photo_root, flat)
    for f in list((flat / "val").rglob("*.jpg")):
        f.rename(flat / "val" / f.name)
    for d in [d for d in (flat / "val").iterdir() if d.is_dir()]:
        d.rmdir()
    with pytest.raises(LayoutError, match=r"holds train/ and val/, but val/ holds no class folders"):
        read_image_folder(flat, val_fraction=0.5, seed=0)

    cls = next((root / "train").iterdir())
    os.symlink("..", cls / "loop")  # train/CLASS/loop -> train/
    with pytest.raises(ImageFolderError, match=rf"{cls}/loop/{cls.name} is {cls} again, one of its own parents"):
        read_image_folder(root, val_fraction=0.5, seed=0)
    (cls / "loop").unlink()
    os.symlink(cls, root / "val" / cls.name / "leak")  # val/CLASS/leak -> train/CLASS
    with pytest.raises(ImageFolderError, match=r"which the train split holds too: its images would be both trained "):
        read_image_folder(root, val_fraction=0.5, seed=0)
    (root / "val" / cls.name / "leak").unlink()
    other = sorted((root / "train").iterdir())[1]
    os.symlink(cls, other / "again")  # within train/: listed twice, as torchvision lists it
    m = read_image_folder(root, val_fraction=0.5, seed=0)
    assert len(m.train) == 36 + len(list(cls.glob("*.jpg")))


def test_a_class_folder_without_images_is_told_before_torch_loads(photo_root, tmp_path):
    """train.py on an ImageFolder with an empty class folder: the listing is read in the pre-flight, so the
    mistake is said before torch and Lightning load (before, after them: 4-6 s)."""
    import shutil

    from helpers import told_before_torch

    cat = sorted(photo_root.glob("*/*.jpg"))[:2]
    (tmp_path / "d" / "cat").mkdir(parents=True)
    (tmp_path / "d" / "dog").mkdir()
    for p in cat:
        shutil.copy(p, tmp_path / "d" / "cat" / p.name)
    said = told_before_torch(["--data", str(tmp_path / "d"), "--model", "tiny", "--output", str(tmp_path / "o")])
    assert "1 class folder(s) hold no image ('dog'" in said, said
