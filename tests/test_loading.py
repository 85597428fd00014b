"""Model loading: built-ins, any transformers image classifier, head resizing, refusals."""
from __future__ import annotations

import json

import pytest
from helpers import copy_trained

import train
from model.loading import ModelLoadError, load_model, load_processor, parameter_count


def _convnext(path, labels=("x", "y", "z")):
    from transformers import ConvNextConfig, ConvNextForImageClassification, ConvNextImageProcessorPil

    cfg = ConvNextConfig(num_channels=3, depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 24, 32], num_labels=len(labels),
                         id2label=dict(enumerate(labels)), label2id={c: i for i, c in enumerate(labels)})
    ConvNextForImageClassification(cfg).save_pretrained(path)
    ConvNextImageProcessorPil(size={"shortest_edge": 64}, crop_pct=0.875).save_pretrained(path)
    return path


def test_builtin_models_and_meta_parameter_count():
    assert type(load_model("tiny", ["a", "b"])).__name__ == "ViTForImageClassification"
    assert parameter_count("vit-b16-random", ["c"] * 1000) == 86_567_656  # ViT-B/16 with a 1000-class head
    assert load_processor("tiny").size["height"] == 64


def test_a_convnext_trains_with_its_own_config_and_a_new_head(photo_root, tmp_path, cache_dir, capsys):
    from dali_pipe.spec import ImageSpec

    src = _convnext(tmp_path / "convnext")
    spec = ImageSpec.from_processor(load_processor(str(src)))
    assert (spec.height, spec.width, spec.resize_shorter, spec.interp) == (64, 64, 73, "cubic")  # 64 / crop_pct
    out = tmp_path / "out"
    res = train.main(["--data", str(photo_root), "--model", str(src), "--device", "cpu", "--epochs", "1",
                      "--batch-size", "8", "--num-threads", "1", "--output", str(out), "--lr", "1e-3"])
    assert res["global_step"] == 43 // 8
    err = capsys.readouterr().err
    assert "its head predicts 3 classes; a new head for your 4 classes is trained from scratch" in err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "convnext" and cfg["id2label"]["3"] == "rocket"


def test_a_checkpoint_that_is_no_image_classifier_is_refused(tmp_path):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                         intermediate_size=8)).save_pretrained(tmp_path / "bert")
    with pytest.raises(ModelLoadError, match="'bert' checkpoint, which transformers cannot build as an image class"):
        load_processor(str(tmp_path / "bert"))
    with pytest.raises(ModelLoadError, match="local directory"):
        load_model(str(tmp_path / "missing"), ["a", "b"])


def test_evaluate_and_predict_refuse_weights_that_do_not_match_the_config(trained, photo_root, tmp_path, cache_dir):
    """A ResNet config.json beside a ViT's weights: transformers would only warn and evaluate with random
    weights; evaluate and predict refuse, naming missing and unexpected keys."""
    import shutil

    from transformers import ResNetConfig

    from dali_pipe.cli.commands import main

    mixed = tmp_path / "mixed"
    shutil.copytree(trained, mixed, ignore=shutil.ignore_patterns("checkpoints", "tensorboard", "metrics.json"))
    vit = json.loads((mixed / "config.json").read_text())
    ResNetConfig(num_labels=4, id2label=vit["id2label"], label2id=vit["label2id"], embedding_size=8,
                 hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1]).save_pretrained(mixed)
    for command in ("evaluate", "predict"):
        with pytest.raises(ModelLoadError, match=r"its weights do not match its config.json \(a 'resnet' model\): "
                                                 r"\d+ missing key\(s\) \(classifier.*\d+ unexpected key\(s\) "
                                                 r"\(classifier.*vit\.embeddings"):
            main([command, "--model", str(mixed), "--data", str(photo_root), "--device", "cpu", "--output",
                  str(tmp_path / command)])


def test_a_local_model_fine_tunes_in_training_mode(trained):
    """from_pretrained returns a model in eval mode, which Lightning keeps: dropout and batch-norm
    statistics would stay frozen for the whole fine-tune."""
    model = load_model(str(trained), ["a", "b"])
    assert all(m.training for m in model.modules())


def test_a_fine_tune_says_in_one_line_each_which_weights_it_does_not_take(tmp_path, capfd):
    """A new head is one line of ours, not transformers' load-report table; a backbone-only checkpoint (no
    classifier, an unused pooler) names the weights that start random and those left unused."""
    from transformers import ViTConfig, ViTModel

    load_model(str(_convnext(tmp_path / "convnext")), ["a", "b", "c", "d"])
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "MISMATCH" not in err, err
    assert "a new head for your 4 classes is trained from scratch" in err and "note:" not in err, err

    cfg = ViTConfig(image_size=32, patch_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32)
    ViTModel(cfg).save_pretrained(tmp_path / "backbone")  # the pooler ViTForImageClassification does not have
    model = load_model(str(tmp_path / "backbone"), ["a", "b"])
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err, err
    assert "2 weight(s) are not in the checkpoint and start from random values (classifier.bias, classifier.weight)" \
        in err, err
    assert "2 weight(s) of the checkpoint are not used (pooler.dense.bias, pooler.dense.weight)" in err, err
    assert model.training and model.config.num_labels == 2


def test_image_source_changes_with_what_the_input_size_is_computed_from(trained, tmp_path):
    """The digest a checkpoint records beside its image size: equal for the same processor files, another for a
    changed preprocessor_config.json (a new size), a processor_config.json added, or another built-in, and None where the model cannot be read
    without transformers (a folder that does not exist, a hub id offline and not cached). Reading it loads
    neither torch nor transformers."""
    import os
    import subprocess
    import sys

    from model.loading import image_source

    folder = tmp_path / "model"
    copy_trained(trained, folder, model_only=True)
    before = image_source(str(folder))
    assert before == image_source(str(trained)) and len(before) == 64
    config = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**config, "size": {"height": 32, "width": 32}}))
    changed = image_source(str(folder))
    assert changed not in (None, before)
    (folder / "processor_config.json").write_text(json.dumps({"image_processor": config}))  # read first (transformers 5)
    assert image_source(str(folder)) not in (None, before, changed)
    assert image_source("tiny") == image_source("tiny") != image_source("vit-b16-random")
    assert image_source(str(tmp_path / "nowhere")) is None
    code = ("import sys\nfrom model.loading import image_source\n"
            f"image_source({str(folder)!r}); image_source('tiny')\n"
            "print(image_source('google/vit-base-patch16-224'), [m for m in ('torch', 'transformers') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert r.stdout.strip() == "None []", r.stderr  # a hub id offline and not cached: unknown, not "no file"
