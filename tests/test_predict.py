"""`python -m dali_pipe predict`: one row per readable image, bad ones listed, top-k columns."""
from __future__ import annotations

import shutil

import pytest

from dali_pipe.cli.commands import main


def test_predict_a_folder_with_a_bad_file(trained, photo_root, tmp_path, cache_dir, capsys):
    """Every readable image gets a row, the bad one a line in bad_images.tsv; transformers' "Loading weights"
    bar is not printed (it is enabled here, as it is in a fresh process)."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    folder = tmp_path / "imgs"
    for p in sorted(photo_root.glob("*/*.jpg"))[:9]:
        dest = folder / p.parent.name / p.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dest)
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff not really")
    (folder / "dangling.jpg").symlink_to("nowhere.jpg")
    (folder / "loop.jpg").symlink_to("loop.jpg")
    out = tmp_path / "pred"
    main(["predict", "--model", str(trained), "--data", str(folder), "--device", "cpu", "--top-k", "2",
          "--output", str(out), "--batch-size", "4"])
    rows = [r.split("\t") for r in (out / "predictions.tsv").read_text().splitlines()]
    assert rows[0] == ["image_path", "label", "score", "label_2", "score_2"]
    assert len(rows) == 10 and sorted(r[0] for r in rows[1:]) == sorted(
        str(p.relative_to(folder)) for p in folder.glob("*/*.jpg"))
    classes = {"astronaut", "chelsea", "coffee", "rocket"}
    assert all(r[1] in classes and r[3] in classes and r[1] != r[3] and float(r[2]) >= float(r[4]) for r in rows[1:])
    bad = dict(r.split("\t") for r in (out / "bad_images.tsv").read_text().splitlines()[1:])
    assert bad.keys() == {"broken.jpg", "dangling.jpg", "loop.jpg"}
    assert bad["dangling.jpg"] == "dangling symbolic link (-> nowhere.jpg)"
    assert bad["loop.jpg"] == "symbolic link loop (-> loop.jpg)"
    assert "Loading weights" not in capsys.readouterr().err


def test_predict_a_manifest_without_labels(trained, photo_root, tmp_path, cache_dir):
    out = tmp_path / "pred"
    main(["predict", "--model", str(trained), "--data", str(photo_root / "dataset.tsv"), "--device", "cpu",
          "--output", str(out)])
    rows = (out / "predictions.tsv").read_text().splitlines()
    assert rows[0] == "image_path\tlabel\tscore" and len(rows) == 49


def test_predict_one_image_a_list_file_and_shards_without_labels(trained, photo_root, tmp_path, cache_dir):
    """predict takes one image file, a list file of paths (relative to its folder or absolute; blank lines, CRLF and
    a BOM read as meant; a missing one listed as bad), and one .tar of samples without cls (img2dataset's jpg, txt,
    json): each row named as the input names it, and one image's label the same whichever form it came in."""
    import webdataset as wds

    photos = sorted(photo_root.glob("*/*.jpg"))[:4]
    imgs = tmp_path / "imgs"
    (imgs / "sub").mkdir(parents=True)
    shutil.copy(photos[0], imgs / "a.jpg")
    shutil.copy(photos[1], imgs / "sub" / "b photo.jpg")
    (imgs / "list.txt").write_bytes(f"\ufeffa.jpg\r\n\r\n  sub/b photo.jpg \r\n{photos[2]}\r\nmissing.jpg\r\n".encode())
    with wds.TarWriter(str(tmp_path / "laion-000000.tar")) as w:
        for i, p in enumerate(photos):
            w.write({"__key__": f"{i:09d}", "jpg": p.read_bytes(), "txt": "a caption", "json": {"url": "x"}})

    def predict(data, name):
        main(["predict", "--model", str(trained), "--data", str(data), "--device", "cpu", "--output",
              str(tmp_path / name), "--batch-size", "4"])
        return dict(r.split("\t")[:2] for r in (tmp_path / name / "predictions.tsv").read_text().splitlines()[1:])

    one = predict(imgs / "a.jpg", "one")
    listed = predict(imgs / "list.txt", "list")
    shards = predict(tmp_path / "laion-000000.tar", "shards")
    assert list(one) == ["a.jpg"] and sorted(listed) == sorted(["a.jpg", "sub/b photo.jpg", str(photos[2])])
    assert (tmp_path / "list" / "bad_images.tsv").read_text().splitlines()[1:] == ["missing.jpg\tmissing"]
    assert sorted(shards) == [x["__key__"] for x in wds.WebDataset(str(tmp_path / "laion-000000.tar"),
                                                                  shardshuffle=False)]
    assert one["a.jpg"] == listed["a.jpg"] == shards["000000000"]


def test_predict_labels_every_image_of_a_folder_training_would_refuse(trained, photo_root, tmp_path, cache_dir):
    """train/ and val/ with a holdout/ beside them is no dataset for training (it is refused, naming holdout/),
    but predict never splits: it labels every image under the folder."""
    photo = next(photo_root.glob("*/*.jpg"))
    for rel in ("train/a/x.jpg", "val/a/y.jpg", "holdout/z.jpg"):
        (tmp_path / "d" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(photo, tmp_path / "d" / rel)
    assert main(["predict", "--model", str(trained), "--data", str(tmp_path / "d"), "--device", "cpu", "--output",
                 str(tmp_path / "p")]) == 0
    rows = (tmp_path / "p" / "predictions.tsv").read_text().splitlines()[1:]
    assert sorted(r.split("\t")[0] for r in rows) == ["holdout/z.jpg", "train/a/x.jpg", "val/a/y.jpg"]


def test_the_images_of_an_s3_dataset_and_of_an_s3_image_folder_are_listed(s3, photo_root, tmp_path):
    """predict's list of an s3:// prefix: a dataset.tsv folder's rows, an ImageFolder's images, each synced into
    the cache dir first (a module split once left this path calling a function that had moved)."""
    import boto3

    from dali_pipe.cli.predict import list_images

    client = boto3.client("s3")
    client.create_bucket(Bucket="bkt")
    photos = sorted(photo_root.glob("*/*.jpg"))[:3]
    for p in photos:
        client.upload_file(str(p), "bkt", f"ds/{p.parent.name}/{p.name}")
        client.upload_file(str(p), "bkt", f"folder/{p.parent.name}/{p.name}")
    rows = "".join(f"{p.parent.name}/{p.name}\n" for p in photos)
    client.put_object(Bucket="bkt", Key="ds/dataset.tsv", Body=("image_path\n" + rows).encode())
    expected = sorted(f"{p.parent.name}/{p.name}" for p in photos)
    for prefix in ("ds", "folder"):
        root, rels = list_images(f"s3://bkt/{prefix}", str(tmp_path / "cache"))
        assert sorted(rels) == expected and all((root / r).is_file() for r in rels), prefix


def test_a_misspelt_path_is_told_before_torch_loads(tmp_path):
    """predict --data naming nothing: said at once (before, after torch, Lightning and the model had loaded)."""
    import subprocess
    import sys

    (tmp_path / "model").mkdir()
    code = ("import sys; from dali_pipe.cli import NoDataError; from dali_pipe.cli.commands import main\n"
            f"try:\n    main(['predict', '--model', {str(tmp_path / 'model')!r}, '--data', {str(tmp_path / 'photoz')!r},"
            f" '--output', {str(tmp_path / 'out')!r}])\n"
            "except NoDataError as e:\n    print(e); print(sorted(m for m in ('torch', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"--data {str(tmp_path / 'photoz')!r} does not exist" in out.stdout and out.stdout.strip().endswith("[]")


def _bogus_huffman(good: bytes) -> bytes:
    """A JPEG whose headers parse (so --scan fast passes it) and whose Huffman table DALI refuses."""
    i = good.index(b"\xff\xc4")
    return good[:i + 4] + b"\x00" + b"\xff" * 16 + good[i + 21:]


def _rows(out):
    return [r.split("\t") for r in (out / "predictions.tsv").read_text().splitlines()[1:]]


def test_an_image_only_the_decoder_refuses_is_left_out_and_every_other_one_labelled(trained, photo_root, tmp_path,
                                                                                    cache_dir, capsys):
    """Two images that pass the checks before (headers parse) but that DALI cannot decode, in a folder and in a
    tar shard: predict names each, lists it in bad_images.tsv and labels every other image exactly as a run
    without them does (a new pipeline goes on after each); before, it stopped, writing nothing."""
    import io
    import tarfile

    photos = sorted(photo_root.glob("*/*.jpg"))[:11]
    bad_at = {2, 7}
    folder, clean = tmp_path / "imgs", tmp_path / "clean"
    for i, p in enumerate(photos):
        (folder / f"{i:02d}.jpg").parent.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:02d}.jpg").write_bytes(_bogus_huffman(p.read_bytes()) if i in bad_at else p.read_bytes())
        if i not in bad_at:
            clean.mkdir(exist_ok=True)
            shutil.copy(p, clean / f"{i:02d}.jpg")
    for name in ("train-000000.tar", "clean-000000.tar"):
        with tarfile.open(tmp_path / name, "w") as t:
            for i, p in enumerate(photos):
                if name.startswith("clean") and i in bad_at:
                    continue
                data = _bogus_huffman(p.read_bytes()) if i in bad_at else p.read_bytes()
                info = tarfile.TarInfo(f"s{i:02d}.jpg")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    tar = tmp_path / "train-000000.tar"
    for data, reference, names, said in (
            (folder, clean, ("02.jpg", "07.jpg"), [f"DALI could not decode {folder}/{n}.jpg; left out" for n in ("02", "07")]),
            (tar, tmp_path / "clean-000000.tar", ("s02", "s07"),
             [f"DALI could not decode sample {n!r} of {tar}; left out" for n in ("s02", "s07")])):
        out, ref = tmp_path / f"pred-{data.name}", tmp_path / f"ref-{data.name}"
        for d, o in ((data, out), (reference, ref)):
            main(["predict", "--model", str(trained), "--data", str(d), "--device", "cpu", "--output", str(o),
                  "--batch-size", "4", "--num-threads", "1"])
        assert _rows(out) == _rows(ref) and len(_rows(out)) == 9, (_rows(out), _rows(ref))
        bad = dict(r.split("\t")[:2] for r in (out / "bad_images.tsv").read_text().splitlines()[1:])
        assert set(bad) == set(names) and all("DALI could not decode it" in v for v in bad.values()), bad
        err = capsys.readouterr().err
        assert all(line in err for line in said), err


def test_a_16_bit_png_is_labelled_as_its_8_bit_picture(trained, tmp_path, cache_dir):
    """A 16-bit grayscale PNG is decoded to its picture, scaled to 8 bits (as pack converts it): predict labels it
    exactly as the same picture saved with 8 bits, and as transformers pipeline() labels that picture. (pipeline()
    given the 16-bit file itself sees a white image: PIL's I;16 -> RGB conversion clips every value above 255.)"""
    import numpy as np
    from PIL import Image
    from skimage import data
    from transformers import pipeline

    folder = tmp_path / "imgs"
    folder.mkdir()
    picture = data.astronaut()[..., 0]  # one channel of a photo the model was trained on
    Image.fromarray(picture.astype(np.uint16) * 257).save(folder / "sixteen.png")
    Image.fromarray(picture).save(folder / "eight.png")
    out = tmp_path / "pred"
    main(["predict", "--model", str(trained), "--data", str(folder), "--device", "cpu", "--output", str(out),
          "--top-k", "4"])
    rows = {r[0]: r[1:] for r in _rows(out)}
    assert rows["sixteen.png"] == rows["eight.png"], rows
    assert Image.open(folder / "sixteen.png").mode == "I;16"
    clf = pipeline("image-classification", model=str(trained), device=-1)
    assert clf(Image.fromarray(picture).convert("RGB"), top_k=1)[0]["label"] == rows["sixteen.png"][0]


def test_when_the_decoder_refuses_every_image_predict_says_so(trained, photo_root, tmp_path, cache_dir):
    """Every image passes the checks before and DALI refuses each: an error naming bad_images.tsv, which lists
    them all (going on after each failure would otherwise end with no row and exit 0)."""
    from dali_pipe.cli.predict import InputError

    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, p in enumerate(sorted(photo_root.glob("*/*.jpg"))[:3]):
        (folder / f"{i}.jpg").write_bytes(_bogus_huffman(p.read_bytes()))
    out = tmp_path / "pred"
    with pytest.raises(InputError, match=rf"DALI could decode none of the images; they are listed in {out}/bad_images"):
        main(["predict", "--model", str(trained), "--data", str(folder), "--device", "cpu", "--output", str(out)])
    assert len((out / "bad_images.tsv").read_text().splitlines()) == 4 and not (out / "predictions.tsv").exists()


def test_past_the_most_failures_the_ones_found_stay_listed(trained, photo_root, tmp_path):
    """Past the most images DALI may refuse in one run, predict stops with DALI's error, and bad_images.tsv lists
    those found so far (it held its header only)."""
    from dali_pipe.cli.predict import around_bad
    from dali_pipe.config import Settings
    from dali_pipe.datamodule import DaliDataModule
    from dali_pipe.loader import PipelineDecodeError
    from dali_pipe.manifest import Sample
    from dali_pipe.spec import ImageSpec
    from model.loading import load_processor, load_trained

    photos = sorted(photo_root.glob("*/*.jpg"))[:6]
    items = []
    for i, p in enumerate(photos):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(_bogus_huffman(p.read_bytes()) if i in (1, 2, 4) else p.read_bytes())
        items.append((path.name, str(path)))
    s = Settings()
    s.pipeline.device, s.pipeline.num_threads, s.model.precision = "cpu", 1, "32-true"
    dm = DaliDataModule(s.data, s.pipeline, ImageSpec.from_processor(load_processor(str(trained))), tmp_path / "o")
    dm.data.batch_size = 2
    listed = []
    with pytest.raises(PipelineDecodeError, match="4.jpg"):
        around_bad(s, load_trained(str(trained)), items,
                   lambda rest: dm.loader([Sample(p, i, i) for i, (_, p) in enumerate(rest)], training=False),
                   lambda e, rest: next((k for k, (_, p) in enumerate(rest) if p == e.path), None),
                   lambda failed: listed.append([name for (name, _), _ in failed]), by_label=True, most=2)
    assert listed == [["1.jpg", "2.jpg"]], listed


def test_a_stop_is_acted_on_at_the_next_batch():
    """SIGTERM while evaluate or predict runs the model: the handler only notes it (dali_pipe/stop.py), and the
    batch loop stops at its next batch, raising Terminated (exit 143: nothing is written), not at the end."""
    import os
    import signal

    import torch

    from dali_pipe import stop
    from dali_pipe.cli.infer import run_model

    class Model(torch.nn.Module):
        def forward(self, pixel_values):
            return type("Out", (), {"logits": pixel_values.mean(dim=(2, 3))})()

    def loader():
        for i in range(5):
            yield torch.zeros(2, 3, 4, 4), torch.arange(2)
            if i == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, stop.ask)
    got = []
    try:
        with pytest.raises(stop.Terminated):
            run_model(Model(), loader(), "cpu", "32-true", got=got)
    finally:
        stop.clear()
        signal.signal(signal.SIGTERM, old)
    assert len(got) == 2  # the batches before the signal, none after


def test_a_binary_file_of_no_form_is_named_as_such_and_a_utf16_list_as_not_utf8(tmp_path):
    """A list file saved as UTF-16 (PowerShell's `>`, Notepad's "Unicode") was called "a file predict does not read
    (binary ...)" because UTF-16 holds NUL bytes: it is text, told to be saved as UTF-8. A binary file of no form
    whose first bytes hold a tab before any newline (a Parquet file named .pq) was read as a tab-separated manifest
    and called "line 1: not UTF-8 text ...; save it as UTF-8": it is named as a binary file predict does not read
    (a Parquet file under another name, as one to name .parquet)."""
    import datasets

    from dali_pipe.cli.predict import InputError, list_images

    utf16 = tmp_path / "list.txt"
    utf16.write_text("a.jpg\nb.jpg\n", encoding="utf-16")
    with pytest.raises(InputError, match=r"list.txt: not UTF-8 text \(UTF-16\); a list file .*: save it as UTF-8"):
        list_images(str(utf16), str(tmp_path / "cache"))
    tabbed = tmp_path / "blob.bin"
    tabbed.write_bytes(b"\x00\x01\t\x02" + bytes(range(256)) * 4)  # its first "line" holds a tab
    pq = tmp_path / "data.pq"
    datasets.Dataset.from_dict({"image": [{"bytes": bytes(range(256)) * 8, "path": None}], "label": [0]},
                               features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
                               ).to_parquet(pq)
    with pytest.raises(InputError, match=rf"--data '{tabbed}' is a file predict does not read \(binary"):
        list_images(str(tabbed), str(tmp_path / "cache"))
    with pytest.raises(InputError, match=rf"--data '{pq}' is a Parquet file not named .parquet.*rename it data.parquet"):
        list_images(str(pq), str(tmp_path / "cache"))


def test_predict_told_an_s3_object_names_the_prefix_to_pass(s3, tmp_path):
    """predict --data s3://bucket/hf/train.parquet (an object, not a prefix) said "s3://bucket/hf/train.parquet/
    dataset.tsv does not exist; check the prefix (it must hold dataset.tsv)"; it now says, as training does, that
    it names a file and which prefix to pass."""
    import boto3

    from dali_pipe.cli.predict import InputError, list_images

    boto3.client("s3").create_bucket(Bucket="objs")
    boto3.client("s3").put_object(Bucket="objs", Key="hf/train.parquet", Body=b"PAR1")
    with pytest.raises(InputError, match=r"--data 's3://objs/hf/train.parquet'.*it names a file \(train.parquet\).*"
                                         r"pass s3://objs/hf, the prefix holding it"):
        list_images("s3://objs/hf/train.parquet", str(tmp_path / "cache"))
