"""The public API (dali_pipe.__all__), used as a user would: a cheap import, keywords checked as the CLI
checks its flags, your own LightningModule in a plain Trainer with exact mid-epoch resume through
Lightning's ModelCheckpoint, the public callbacks, benchmark() and the README's example."""
from __future__ import annotations

import json
import os
import re
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import resume_trace as rt

ROOT = Path(__file__).resolve().parents[1]
BATCH, EPOCHS = 8, 3


@pytest.fixture(scope="module")
def indexed(photo_root, tmp_path_factory):
    """48 photos, each its own class; 41 train, 7 val (split column): 5 steps of 8 per epoch."""
    return rt.indexed_dataset(photo_root, tmp_path_factory.mktemp("indexed") / "data")


def test_import_is_cheap_and_every_public_name_resolves():
    """`import dali_pipe` loads no torch, DALI, Lightning or transformers; each name in __all__ then loads."""
    code = ("import sys, dali_pipe\n"
            "heavy = [m for m in ('torch', 'nvidia.dali', 'pytorch_lightning', 'transformers', 'boto3', 'pandas') "
            "if m in sys.modules]\nprint(heavy)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    import dali_pipe

    assert sorted(dali_pipe.__all__) == sorted(set(dali_pipe.__all__)) and "DaliDataModule" in dir(dali_pipe)
    for name in dali_pipe.__all__:
        assert getattr(dali_pipe, name).__doc__, name
    with pytest.raises(AttributeError):
        dali_pipe.NoSuchThing  # noqa: B018


def test_help_is_the_reference():
    """help(dali_pipe.DaliDataModule) shows the keyword signature, the batch contract and every setting with
    its default, its CLI flag and its one-line doc from config.py."""
    import pydoc

    import dali_pipe
    from dali_pipe.api import LIBRARY_HELP
    from dali_pipe.config import FIELDS

    text = pydoc.render_doc(dali_pipe.DaliDataModule, renderer=pydoc.plaintext)
    assert ("DaliDataModule(data: Union[str, os.PathLike, NoneType] = None, *, model: Optional[str] = None, "
            "image_size: Union[int, tuple[int, int], NoneType] = None") in text
    flat = " ".join(text.replace("|", " ").split())
    assert "images (B, 3, H, W) float32" in flat and 'trainer.fit(..., ckpt_path="last")' in flat
    for name in ("batch_size", "val_fraction", "seed", "device", "num_threads", "auto_augment", "cache_dir"):
        f = FIELDS[name][1]
        doc = LIBRARY_HELP.get(name, f.metadata["help"])
        assert f"{name}={f.default!r} (--{name.replace('_', '-')}): {doc}" in flat, name


def test_keywords_are_the_cli_flags_checked_and_resolved_the_same_way(photo_root, tmp_path, cache_dir, capsys):
    """Bad values: one UsageError with the CLI's own lines; an unknown keyword names the closest one; strings
    read as the CLI reads them; defaults resolve as the CLI's (cache dir, device); what a small set's epochs
    leave out is said."""
    import dali_pipe
    from dali_pipe.cli import parse_train

    with pytest.raises(dali_pipe.UsageError) as e:
        dali_pipe.DaliDataModule(data=tmp_path / "nope", batch_size=0, device="tpu", crop_scale=(0.5, 0.1),
                                 val_fraction="lots", image_size=64)
    msg = str(e.value)
    with pytest.raises(dali_pipe.UsageError) as cli:
        parse_train(["--batch-size", "0", "--device", "tpu", "--val-fraction", "lots"])
    for flag, keyword in (("--batch-size: 0", "batch_size=0"), ("--device: 'tpu'", "device='tpu'"),
                          ("--val-fraction: 'lots'", "val_fraction='lots'")):
        assert flag in str(cli.value) and flag not in msg  # the CLI's words, and the library's: keywords
        assert str(cli.value).split(flag)[1].split("\n")[0] in msg.split(keyword)[1], (flag, msg)
    assert "crop_scale=(0.5, 0.1) must be 0 < MIN <= MAX <= 1" in msg and "data='" in msg and "--" not in msg
    assert "mean: required with image_size=" in msg and "std: required" in msg
    with pytest.raises(TypeError, match="'batchsize' \\(did you mean 'batch_size'\\?\\)"):
        dali_pipe.DaliDataModule(data=photo_root, model="tiny", batchsize=8)
    dm = dali_pipe.DaliDataModule(data=photo_root, image_size=(32, 48), mean=0.5, std=(0.25, 0.25, 0.25),
                                  batch_size="8", decoder_device_padding="64MB")
    assert dm.data.batch_size == 8 and dm.pipeline.decoder_device_padding == 64_000_000
    assert (dm.spec.height, dm.spec.width, dm.spec.mean) == (32, 48, (0.5, 0.5, 0.5))
    assert dm.data.cache_dir == str(cache_dir) and dm.pipeline.device == "auto" and dm.device == "cpu"
    with pytest.raises(dali_pipe.UserError, match="call dm.prepare_data\\(\\) first"):
        dm.classes  # noqa: B018
    dm.prepare_data()
    assert not (Path.cwd() / "bad_images.tsv").exists()  # no output given, nothing bad: no report file
    small = dali_pipe.DaliDataModule(data=photo_root, model="tiny", batch_size=32, num_threads=1)
    small.prepare_data()
    small.setup("fit")  # the library says what the epochs leave out, as the CLI's summary does
    err = capsys.readouterr().err
    assert "note: 11 of the 43 training images (26%) are left out of every epoch" in err
    assert "; batch_size=21 would drop 1." in err  # the keyword, not --batch-size
    with pytest.raises(dali_pipe.UserError, match=r"^batch_size=64 is larger than the 43 training images .*; pass "
                                                  r"batch_size=43 or lower\.$"):
        dali_pipe.DaliDataModule(data=photo_root, model="tiny", batch_size=64, num_threads=1).setup("fit")


class _Traced:
    """A user's own LightningModule, built from dm.classes, that records what each step trained."""

    def __new__(cls, classes, trace: Path, sigterm_at: int | None = None):
        import pytorch_lightning as pl
        import torch

        class Module(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.head = torch.nn.Linear(3, len(classes))

            def training_step(self, batch, batch_idx):
                images, labels = batch
                assert images.shape == (BATCH, 3, 64, 64) and images.dtype == torch.float32
                assert labels.shape == (BATCH,) and labels.dtype == torch.int64
                with open(trace, "a") as f:
                    f.write(json.dumps({"kind": "train", "step": self.global_step,
                                        "labels": [classes[i] for i in labels.tolist()]}) + "\n")
                return torch.nn.functional.cross_entropy(self.head(images.mean((2, 3))), labels)

            def validation_step(self, batch, batch_idx):
                self.log("val_loss", torch.nn.functional.cross_entropy(self.head(batch[0].mean((2, 3))), batch[1]))

            def on_train_batch_end(self, outputs, batch, batch_idx):
                if self.global_step == sigterm_at:
                    os.kill(os.getpid(), signal.SIGTERM)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Module()


def _fit(data, ckpt: Path, trace: Path, *, max_steps=-1, sigterm_at=None, batch_size=BATCH, module=None):
    """A user's script: public names and their own Trainer only; returns the Trainer and its monitor."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    import dali_pipe

    dm = dali_pipe.DaliDataModule(data=data, model="tiny", batch_size=batch_size, device="cpu", num_threads=1)
    dm.prepare_data()
    monitor = dali_pipe.MonitorCallback(verbose=False)
    trainer = pl.Trainer(max_epochs=EPOCHS, max_steps=max_steps, default_root_dir=ckpt.parent, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[ModelCheckpoint(dirpath=ckpt, every_n_train_steps=3, save_last=True),
                                    dali_pipe.SpotSafeCheckpoint(), monitor])
    trainer.fit(module or _Traced(dm.classes, trace, sigterm_at), datamodule=dm, ckpt_path="last")
    return trainer, monitor


def test_own_module_in_a_plain_trainer_resumes_mid_epoch_exactly(indexed, tmp_path, cache_dir, capsys):
    """Stopped by max_steps at step 7 (epoch 2; the last periodic save is step 6), resumed with
    ckpt_path="last", stopped by SIGTERM in epoch 3 (saved, SystemExit(0)), resumed to the end: every epoch
    trains each sample once, the replayed step is the very same batch, and a checkpoint of another batch
    size is refused before anything is restored: the module's weights are still its own (before, Lightning
    had loaded the checkpoint's into it before the DataModule refused)."""
    import torch

    import dali_pipe

    ckpt, trace = tmp_path / "ckpt", tmp_path / "trace.jsonl"
    trainer, monitor = _fit(indexed, ckpt, trace, max_steps=7)
    assert trainer.global_step == 7
    assert torch.load(ckpt / "last.ckpt", weights_only=False)["global_step"] == 6
    assert abs(sum(monitor.report["time_budget"]["shares"].values()) - 1) < 1e-9
    first = rt.read(trace)
    with pytest.raises(SystemExit) as stop:
        _fit(indexed, ckpt, trace, sigterm_at=11)
    assert stop.value.code in (None, 0)
    assert "SIGTERM: checkpoint saved to" in capsys.readouterr().err
    assert torch.load(ckpt / "last.ckpt", weights_only=False)["global_step"] == 12
    trainer, _ = _fit(indexed, ckpt, trace)
    assert trainer.global_step == EPOCHS * (41 // BATCH)

    records = rt.read(trace)
    replayed = [r for r in records[len(first):] if r["step"] == 6][0]
    assert replayed["labels"] == [r for r in first if r["step"] == 6][0]["labels"]
    last = {r["step"]: r for r in records}  # a step trained again after a resume replaces the one it undid
    kept = [{**r, "epoch": r["step"] // (41 // BATCH)} for _, r in sorted(last.items())]
    train_set = {r.split("\t")[1] for r in (indexed / "dataset.tsv").read_text().splitlines()[1:]
                 if r.endswith("\ttrain")}
    rt.assert_each_sample_once_per_epoch(kept, train=train_set, epochs=EPOCHS, batch=BATCH)

    module = _Traced(sorted(train_set | {r.split("\t")[1] for r in (indexed / "dataset.tsv").read_text()
                                         .splitlines()[1:]}), tmp_path / "other.jsonl")
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(dali_pipe.RunMismatchError, match="batch_size: 8 in the checkpoint, 4 now"):
        _fit(indexed, ckpt, tmp_path / "other.jsonl", batch_size=4, module=module)
    assert not (tmp_path / "other.jsonl").exists()
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_run_fingerprint_adds_your_own_keys():
    import dali_pipe

    saved = dali_pipe.RunFingerprint(model="vit-b16", width=512).state_dict()
    dali_pipe.RunFingerprint(model="vit-b16", width=512).load_state_dict(saved)
    with pytest.raises(dali_pipe.RunMismatchError, match="width: 512 in the checkpoint, 768 now"):
        dali_pipe.RunFingerprint(model="vit-b16", width=768).load_state_dict(saved)
    # checked as the Trainer's checkpoint IO reads the file, before Lightning restores the module's weights
    import types

    class IO:
        def load_checkpoint(self, path, **kw):
            return {"callbacks": {"RunFingerprint": saved}}

    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(checkpoint_io=IO()),
                                    state=types.SimpleNamespace(fn="fit"))
    dali_pipe.RunFingerprint(model="vit-b16", width=768).setup(trainer, None, "fit")
    with pytest.raises(dali_pipe.RunMismatchError, match="width: 512 in the checkpoint, 768 now"):
        trainer.strategy.checkpoint_io.load_checkpoint("last.ckpt")


def test_benchmark_your_own_module(photo_root, tmp_path, cache_dir, capsys):
    """dali_pipe.benchmark(module, dm): the user's training_step fed by each loader, side by side; a report
    with one progress line per loader, a table per round, no training log."""
    import dali_pipe

    dm = dali_pipe.DaliDataModule(data=photo_root, model="tiny", batch_size=8, device="cpu", num_threads=1)
    dm.prepare_data()
    report = dali_pipe.benchmark(lambda: _Traced(dm.classes, tmp_path / "t.jsonl"), dm, loaders="dali,synthetic",
                                 steps=3, repeat=1, output=tmp_path / "b")  # warmup: chosen for the machine
    assert set(report["loaders"]) == {"dali", "synthetic"} and "dali_vs_synthetic" in report["ratios"]
    for m in report["loaders"].values():
        assert m["images_per_sec"] > 0 and abs(sum(m["time_budget"]["shares"].values()) - 1) < 1e-9
    assert json.loads((tmp_path / "b" / "benchmark.json").read_text())["config"]["model"] == "<lambda>"
    out = capsys.readouterr().out
    assert "benchmark: chose warmup=2 for this machine (no GPU" in out, out[:500]
    assert report["config"]["warmup"] == 2 and report["config"]["steps"] == 3
    assert out.count("round 1/1      dali: ") == 1 and "round 1/1 (then each loader's time budget" in out
    assert "METRIC" not in out and "GPU available" not in out


def test_the_readme_example_runs_as_written(photo_root, tmp_path, cache_dir, monkeypatch, capsys):
    """examples/own_lightning_module.py DATA OUT 7 stops mid-epoch; run again, it resumes and finishes its 3
    epochs (15 steps; its ModelCheckpoint saves every 2, so the last save is step 14, in epoch 3)."""
    import torch

    example = ROOT / "examples" / "own_lightning_module.py"
    assert len(example.read_text().splitlines()) <= 30
    out = tmp_path / "out"
    for extra in (["7"], []):
        monkeypatch.setattr(sys, "argv", [str(example), str(photo_root), str(out), *extra])
        runpy.run_path(str(example), run_name="__main__")
    last = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert (last["global_step"], last["epoch"]) == (EPOCHS * (43 // 8) - 1, EPOCHS - 1)
    assert capsys.readouterr().out.count("MONITOR time: ") == 2


def test_sigterm_names_a_path_a_rerun_finds_when_the_logger_versions_the_folder(photo_root, tmp_path, cache_dir,
                                                                                 capsys):
    """A ModelCheckpoint without dirpath saves into the logger's version folder, new in every run, where a
    rerun's ckpt_path="last" does not look: SpotSafeCheckpoint says so before training, and on SIGTERM names
    the checkpoint's own path to resume from (which does resume)."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger

    import dali_pipe

    dm = dali_pipe.DaliDataModule(data=photo_root, model="tiny", batch_size=BATCH, device="cpu", num_threads=1)
    dm.prepare_data()

    def fit(ckpt_path, sigterm_at=None):
        trainer = pl.Trainer(max_epochs=1, logger=CSVLogger(tmp_path), enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                             default_root_dir=tmp_path, callbacks=[ModelCheckpoint(save_last=True,
                                                                                   every_n_train_steps=2),
                                                                   dali_pipe.SpotSafeCheckpoint()])
        trainer.fit(_Traced(dm.classes, tmp_path / "t.jsonl", sigterm_at), datamodule=dm, ckpt_path=ckpt_path)
        return trainer

    with pytest.raises(SystemExit):
        fit("last", sigterm_at=1)
    err = capsys.readouterr().err
    assert "a rerun's fit(ckpt_path=\"last\") would not find" in err and "ModelCheckpoint(dirpath=" in err, err
    saved = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert f'ckpt_path="{saved}"' in err and 'ckpt_path="last"))' not in err, err
    assert fit(str(saved)).global_step == 43 // BATCH


def test_a_training_flag_given_to_the_datamodule_says_where_it_belongs():
    """lr=, epochs=, precision= or mixup_alpha= (train.py flags of the model and run, not of the data) are
    refused naming where they go in your own code, before any data is read."""
    import dali_pipe

    for key, where in (("lr", "optimizer"), ("epochs", "Trainer(max_epochs="), ("precision", "Trainer(precision="),
                       ("mixup_alpha", "LightningModule")):
        with pytest.raises(TypeError, match=rf"{key}.*{re.escape(where)}") as e:
            dali_pipe.DaliDataModule(data="/nonexistent", model="tiny", **{key: 1})
        assert "the DataModule takes" in str(e.value) and "batch_size" in str(e.value)


TIMM = json.loads((ROOT / "tests" / "timm_configs" / "configs.json").read_text())["configs"]  # timm's own


def test_timm_data_configs_give_the_spec_timm_evaluates_with(photo_root, cache_dir):
    """data_config= as timm.data.resolve_data_config returns it (10 models, written by timm 1.0.31): validation
    resizes the shorter side and crops as timm's own evaluation transform does, with its interpolation; a
    config the pipeline cannot follow is refused, naming the key."""
    import dali_pipe

    for name, fixture in TIMM.items():
        config, want = fixture["config"], fixture["eval"]
        spec = dali_pipe.DaliDataModule(data=photo_root, data_config=config).spec
        assert [spec.height, spec.width] == want["crop"] and spec.resize_shorter == want["resize_shorter"], name
        assert spec.interp == {"bicubic": "cubic", "bilinear": "linear"}[want["interpolation"]], name
        assert (spec.mean, spec.std) == (tuple(config["mean"]), tuple(config["std"])), name
    bad = {**TIMM["resnet50"]["config"], "interpolation": "random", "crop_mode": "squash", "input_size": [3, 224, 192]}
    with pytest.raises(dali_pipe.UsageError) as e:
        dali_pipe.DaliDataModule(data=photo_root, data_config=bad, model="tiny")
    for words in ("model / data_config: pass one of them", "data_config: interpolation 'random' is not one of",
                  "data_config: crop_mode 'squash'", "data_config: input_size (3, 224, 192) is not square"):
        assert words in str(e.value), (words, str(e.value))


def test_a_timm_config_is_honoured_by_the_pipeline(photo_root, cache_dir):
    """ViT-B/16's timm config (bicubic, crop_pct 0.9): the validation batch equals PIL's bicubic resize of the
    shorter side to 248 and a 224 center crop (the evaluation transform timm builds), and not its bilinear one.
    The reference's crop rounds a half-pixel margin up, as DALI does (torchvision rounds it to even)."""
    import numpy as np
    from PIL import Image

    import dali_pipe

    def reference(path: str, resample) -> np.ndarray:
        im = Image.open(path).convert("RGB")
        w, h = im.size
        short = 248
        size = (short, int(short * h / w)) if w < h else (int(short * w / h), short)
        im = im.resize(size, resample)
        left, top = int((size[0] - 224) / 2 + 0.5), int((size[1] - 224) / 2 + 0.5)
        x = np.asarray(im.crop((left, top, left + 224, top + 224)), np.float32) / 255.0
        return ((x - 0.5) / 0.5).transpose(2, 0, 1)

    dm = dali_pipe.DaliDataModule(data=photo_root, data_config=TIMM["vit_base_patch16_224"]["config"], batch_size=4,
                                  device="cpu", num_threads=1, val_fraction=0.25)
    dm.prepare_data()
    dm.setup("validate")
    images, _ = next(iter(dm.val_dataloader()))
    for image, sample in zip(images.numpy(), dm.manifest.val[:4]):
        cubic = np.abs(image - reference(sample.path, Image.BICUBIC))
        linear = np.abs(image - reference(sample.path, Image.BILINEAR))
        assert cubic.mean() < 0.01 and np.percentile(cubic, 99) < 0.06, (sample.path, cubic.mean())
        assert cubic.mean() < linear.mean(), sample.path


def test_lightning_cli_shows_and_checks_the_keyword_types(capsys):
    """LightningCLI (jsonargparse) reads the typed signature: --help lists each data argument with its type and
    choices (it showed them all as "Untyped"), and a value of the wrong type or outside the choices is refused."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.cli import LightningCLI

    import dali_pipe

    class Module(pl.LightningModule):
        def __init__(self, width: int = 2):
            super().__init__()
            self.layer = torch.nn.Linear(width, 1)

    def cli(*args):
        with pytest.raises(SystemExit) as e:
            LightningCLI(Module, dali_pipe.DaliDataModule, run=False, save_config_callback=None, args=list(args))
        return e.value.code, capsys.readouterr()

    code, out = cli("--help")
    text = " ".join(out.out.split())
    assert code == 0 and "Untyped" not in text
    for words in ("--data.batch_size BATCH_SIZE (type: int, default: 32)",
                  "--data.scan {off,fast,full} (type: Literal['off', 'fast', 'full'], default: fast)",
                  "--data.crop_scale [ITEM,...] (type: tuple[float, float], default: (0.08, 1.0))",
                  "--data.stream_cache STREAM_CACHE (type: Union[int, str, null], default: null)",
                  "--data.data_config DATA_CONFIG (type: Optional[dict], default: null)"):
        assert words in text, words
    for bad in (["--data.batch_size", "many"], ["--data.scan", "deep"], ["--data.crop_scale", "[0.5]"]):
        code, out = cli(*bad)
        assert code != 0 and bad[0][2:] in out.err, (bad, out.err[-500:])


def test_prepare_data_says_what_the_data_is_once(photo_root, cache_dir, capsys):
    """The data summary (classes, the split's counts, the scan) is printed by prepare_data, once."""
    import dali_pipe

    dm = dali_pipe.DaliDataModule(data=photo_root, model="tiny", num_threads=1)
    dm.prepare_data()
    dm.prepare_data()  # as trainer.fit does after the user's call
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("data: ")]
    assert lines == ["data: 4 classes (astronaut, chelsea, coffee, rocket); 43 train + 5 val images; scan fast: 0 of "
                     "48 excluded"]


def test_every_public_name_is_itself_whatever_was_imported_first():
    """Each name of dali_pipe.__all__ is the documented object even when its module was imported first (as the
    CLI's benchmark imports its own): a module named like a public name would replace it on the package, and
    dali_pipe.benchmark(...) said "'module' object is not callable" after a benchmark ran in the same process."""
    import subprocess
    import sys

    code = ("import importlib, types, dali_pipe\n"
            "for m in set(dali_pipe._WHERE.values()): importlib.import_module('dali_pipe.' + m)\n"
            "print([n for n in dali_pipe.__all__ if isinstance(getattr(dali_pipe, n), types.ModuleType)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
