"""`python -m dali_pipe evaluate` and the metrics behind it, checked against transformers' pipeline()."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import copy_trained

from dali_pipe.cli.commands import main
from model import evaluation

ROOT = Path(__file__).resolve().parents[1]


def test_metrics_from_known_logits():
    logits = torch.tensor([[5.0, 0, 0, 0, 0, 0], [0, 5, 0, 0, 0, 0], [0, 5, 0, 0, 0, 0], [0, 0, 5, 4, 0, 0]])
    labels = torch.tensor([0, 1, 0, 3])
    m = evaluation.compute(logits, labels, {i: f"c{i}" for i in range(6)})
    assert m["accuracy"] == 0.5 and m["top5"] == 1.0 and m["images"] == 4
    assert m["confusion"]["classes"] == ["c0", "c1", "c2", "c3"]
    assert m["confusion"]["matrix"] == [[1, 1, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
    assert m["per_class"]["c1"] == {"precision": 0.5, "recall": 1.0, "f1": pytest.approx(2 / 3), "support": 1}
    assert m["per_class"]["c2"]["support"] == 0 and m["per_class"]["c3"]["recall"] == 0.0
    assert evaluation.top_confusions(m)[:2] == [("c0", "c1", 1), ("c3", "c2", 1)]


def test_many_classes_get_a_table_of_top_confusions(tmp_path):
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(400, 80, generator=g), torch.randint(0, 80, (400,), generator=g)
    m = evaluation.compute(logits, labels, {i: f"class{i}" for i in range(80)})
    evaluation.write(m, tmp_path)
    assert (tmp_path / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "metrics.json").read_text())["images"] == 400


def test_evaluate_matches_transformers_pipeline(trained, photo_root, tmp_path, cache_dir, capsys):
    """The val split through DALI agrees with pipeline('image-classification') on the same files,
    up to a few images (the two resize kernels differ). Without --val-fraction, the split is the one training
    made (its --val-fraction 0.25, from the model folder; before, the default 0.1 scored other images)."""
    from transformers import pipeline

    out = tmp_path / "eval"
    main(["evaluate", "--model", str(trained), "--data", str(photo_root), "--device", "cpu", "--output", str(out),
          "--num-threads", "1"])
    m = json.loads((out / "metrics.json").read_text())
    assert m["images"] == 10 and set(m["per_class"]) == {"astronaut", "chelsea", "coffee", "rocket"}
    assert "top5" not in m and (out / "confusion.png").is_file()
    assert m["val_fraction"] == 0.25 and m["training_split"]["as_in_training"] is True
    text = capsys.readouterr().out
    assert "evaluate: 10 images, accuracy" in text
    assert "split: as training made it, the one the model validated on (a hash of each sample's path or key with " \
           "the val fraction and seed, per class: --val-fraction 0.25, --seed 0)" in text

    from dali_pipe.manifest import read_manifest

    val = read_manifest(photo_root, val_fraction=0.25, seed=0, skip_missing=False).val
    classes = read_manifest(photo_root, val_fraction=0.25, seed=0, skip_missing=False).classes
    clf = pipeline("image-classification", model=str(trained), device=-1)
    ref = [clf(s.path, top_k=1)[0]["label"] == classes[s.label] for s in val]
    assert abs(sum(ref) - round(m["accuracy"] * 10)) <= 2, (sum(ref), m["accuracy"])


def test_unknown_labels_are_named(trained, tmp_path, cache_dir):
    from dali_pipe.cli.evaluate import LabelError
    from dali_pipe.demo import make_photo_dataset

    other = make_photo_dataset(tmp_path / "d", classes=5, per_class=3)  # adds 'hubble_deep_field'
    with pytest.raises(LabelError, match=r"1 label\(s\) the model was not trained on: \['hubble_deep_field'\]"):
        main(["evaluate", "--model", str(trained), "--data", str(other), "--device", "cpu", "--split", "all",
              "--output", str(tmp_path / "e")])


@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_the_models_own_folder_as_output_is_refused_and_its_records_are_kept(trained, photo_root, tmp_path, command):
    """--output equal to --model (by another path too) is refused before anything is read or written: evaluate's
    metrics.json and bad_images.tsv replaced training's there (its run record and split); a folder inside it
    is fine."""
    import hashlib

    from dali_pipe.errors import UserError

    model = copy_trained(trained, tmp_path / "m")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in model.iterdir() if p.is_file()}
    for output in (model, tmp_path / "m" / ".." / "m"):
        with pytest.raises(UserError, match=rf"{command}: --output .* is the model's folder \(--model .*\), whose "
                                            r"metrics.json and bad_images.tsv are training's records; pass another "
                                            rf"--output, such as .*/{command}"):
            main([command, "--model", str(model), "--data", str(photo_root), "--device", "cpu", "--output",
                  str(output)])
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in model.iterdir() if p.is_file()} == before
    other = copy_trained(trained, tmp_path / "other")  # another model's folder as --output: refused as well
    with pytest.raises(UserError, match=rf"{command}: --output .*other holds a trained model"):
        main([command, "--model", str(model), "--data", str(photo_root), "--device", "cpu", "--output", str(other)])


def test_cli_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dali_pipe", "evaluate", "--data", str(tmp_path)], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--model: required" in r.stderr and "Traceback" not in r.stderr


def test_a_full_disk_under_the_output_is_one_clear_line(trained, photo_root, tmp_path, cache_dir, capsys):
    """evaluate writing to a full disk (tmpfs): exit status 2 and one line naming the file, no traceback."""
    import signal
    import sys

    from helpers import fill, small_disk

    from dali_pipe.cli import cli

    with small_disk(tmp_path / "disk", "1m") as disk:
        fill(disk)
        handler, streams = signal.getsignal(signal.SIGTERM), (sys.stdout, sys.stderr)
        try:
            rc = cli(lambda: main(["evaluate", "--model", str(trained), "--data", str(photo_root), "--device", "cpu",
                                   "--output", str(disk / "eval")]))
        finally:
            signal.signal(signal.SIGTERM, handler)
            sys.stdout, sys.stderr = streams
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.count("error: ") == 1
    assert "no space left on device" in err.lower() and f"{disk / 'eval'}/" in err, err


def test_the_confusion_figure_says_which_split_it_counts():
    import matplotlib.pyplot as plt

    logits, labels = torch.eye(3)[[0, 1, 2, 1]] * 5, torch.tensor([0, 1, 2, 2])
    for split, words in (("val", "validation split: 4 images"), ("train", "training split: 4 images"),
                         ("all", "all images (train + val): 4 images")):
        m = {**evaluation.compute(logits, labels, {i: f"c{i}" for i in range(3)}), "split": split}
        fig = evaluation.figure(m)
        assert fig.axes[0].get_title().startswith(words), fig.axes[0].get_title()
        plt.close(fig)


def test_a_split_flag_given_is_honoured_and_said_to_differ(trained, photo_root, tmp_path, cache_dir, capsys):
    """--val-fraction 0.1 after a training at 0.25: evaluate scores that split (5 images) and says it is not the
    one the model validated on, and why; a model folder from before the split was recorded: a note."""
    from dali_pipe.cli.evaluate import trained_split
    from dali_pipe.config import resolve

    main(["evaluate", "--model", str(trained), "--data", str(photo_root), "--device", "cpu", "--output",
          str(tmp_path / "e"), "--num-threads", "1", "--val-fraction", "0.1"])
    m = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert m["images"] == 5 and m["training_split"]["as_in_training"] is False
    assert "note: this is not the split the model validated on: --val-fraction 0.1 (training: 0.25). Some of " \
           "these images may be ones it trained on" in capsys.readouterr().out

    older = tmp_path / "older"
    copy_trained(trained, older, model_only=True)
    metrics = json.loads((older / "metrics.json").read_text())
    metrics.pop("split")
    (older / "metrics.json").write_text(json.dumps(metrics))
    from dali_pipe.cli.commands import parser
    from dali_pipe.cli.parser import parse, settings_from

    ns, _ = parse(["evaluate", "--model", str(older), "--data", str(photo_root)], parser())
    del ns.command
    s = resolve(settings_from(ns))
    record, note = trained_split(s)
    assert record is None and s.data.val_fraction == 0.1
    assert note == (f"note: {older} does not record how its validation split was made (written by an older version):"
                    " --val-fraction 0.1 and --seed 0 decide it here; pass those of training")


def test_a_damaged_split_record_is_named_and_a_damaged_metrics_json_is_refused(trained, photo_root, tmp_path):
    """A split record edited or damaged (a seed that is no integer, no data digest, not a record at all) is named,
    and the flags decide the split; a metrics.json that is no JSON makes the folder's checksums uncheckable, so
    the model is refused (before: the split fell to the defaults silently, and a flipped weight byte went
    unnoticed)."""
    from dali_pipe.cli.commands import parser
    from dali_pipe.cli.evaluate import trained_split
    from dali_pipe.cli.parser import parse, settings_from
    from dali_pipe.config import resolve
    from model.loading import ModelLoadError, load_trained

    def copy(name: str, edit) -> Path:
        folder = tmp_path / name
        copy_trained(trained, folder, model_only=True)
        metrics = json.loads((folder / "metrics.json").read_text())
        edit(metrics)
        (folder / "metrics.json").write_text(json.dumps(metrics))
        return folder

    def split_of(folder: Path):
        ns, _ = parse(["evaluate", "--model", str(folder), "--data", str(photo_root)], parser())
        del ns.command
        s = resolve(settings_from(ns))
        return trained_split(s), s

    for name, edit, words in (("seed", lambda m: m["split"].update(seed="five"), "seed: 'five'"),
                              ("digest", lambda m: m["split"].pop("samples"), "samples: None"),
                              ("garbage", lambda m: m.update(split="garbage"), "'garbage'")):
        (record, note), s = split_of(copy(name, edit))
        assert record is None and s.data.val_fraction == 0.1 and s.data.seed == 0, name
        assert note.startswith(f"note: {tmp_path / name}/metrics.json's split record is damaged (") and words in note
        assert note.endswith("--val-fraction 0.1 and --seed 0 decide it here; pass those of training"), note
    broken = copy("broken", lambda m: None)
    (broken / "metrics.json").write_text((broken / "metrics.json").read_text() + "}garbage")
    with pytest.raises(ModelLoadError, match=r"metrics.json is damaged \(not JSON\), so the checksums"):
        load_trained(str(broken))
