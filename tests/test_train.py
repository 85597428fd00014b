"""train.py end to end on the CPU with the tiny ViT and the DALI CPU pipeline (real Trainer, no mocks)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh interpreter from the repository's root (for what a process does at its start
    and exit), its output captured."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_fit_learns_and_saved_model_reloads(photo_root, tmp_path, cache_dir):
    """Loss goes down over a short fit; the saved model reloads with from_pretrained and gives the same logits."""
    out = tmp_path / "out"
    res = train.main(["--data", str(photo_root), "--model", "tiny", "--epochs", "4", "--batch-size", "8",
                      "--device", "cpu", "--output", str(out), "--val-fraction", "0.25", "--num-threads", "1"])
    assert res["global_step"] == 4 * (38 // 8)  # 38 train, 10 val at --val-fraction 0.25
    events = list((out / "tensorboard").glob("events.*"))
    assert events, "TensorBoard events written"
    assert res["train_loss"] < 1.2  # starts near ln(4) = 1.39

    import torch
    from transformers import AutoImageProcessor, ViTForImageClassification

    model = ViTForImageClassification.from_pretrained(out).eval()
    assert model.config.id2label == {0: "astronaut", 1: "chelsea", 2: "coffee", 3: "rocket"}
    assert json.loads((out / "label_map.json").read_text())["0"] == "astronaut"
    proc = AutoImageProcessor.from_pretrained(out)
    assert proc.size["height"] == 64
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = {k[len("model."):]: v for k, v in ckpt["state_dict"].items()}
    twin = ViTForImageClassification(model.config)
    twin.load_state_dict(state)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        np.testing.assert_allclose(model(pixel_values=x).logits, twin.eval()(pixel_values=x).logits, atol=1e-5)


def test_loss_goes_down_epoch_over_epoch(photo_root, tmp_path, cache_dir, capsys):
    train.main(["--data", str(photo_root), "--model", "tiny", "--epochs", "6", "--batch-size", "8",
                "--device", "cpu", "--output", str(tmp_path / "o"), "--num-threads", "1", "--lr", "2e-3"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("METRIC ")]
    assert len(lines) == 6
    losses = [float(ln.split("train_loss=")[1].split()[0]) for ln in lines]
    assert losses[-1] < losses[0] * 0.8, losses


def test_invalid_flags_listed_together(tmp_path):
    """One error names every bad flag with its value and what is allowed."""
    with pytest.raises(train.UsageError) as e:
        train.main(["--epochs", "banana", "--batch-size", "0", "--precision", "fp8", "--device", "tpu",
                    "--val-fraction", "1.5", "--data", str(tmp_path / "nope"), "--scan", "deep"])
    msg = str(e.value)
    for needle in ["--epochs: 'banana' is not an integer", "--batch-size: 0", "--precision: 'fp8'",
                   "--device: 'tpu'", "--val-fraction: 1.5", "--data:", "--scan: 'deep'"]:
        assert needle in msg, (needle, msg)


def test_precision_auto():
    from dali_pipe.config import resolve_precision

    assert resolve_precision("auto", "cpu") == "32-true"
    assert resolve_precision("16-mixed", "cpu") == "16-mixed"


@pytest.mark.slow
def test_cli_documented_form_and_clean_errors(photo_root, tmp_path, cache_dir, capsys):
    """`python train.py --data DIR --model tiny --epochs 2 --device cpu --output OUT` works as written, in a
    terminal of 80 columns: each METRIC line is one line that SageMaker's metric regex (docs/sagemaker.md)
    reads (Lightning's Rich bar wrapped it at 80 columns, so the regex found no val_acc), and the bar counts
    epochs as METRIC does ("Epoch 1/2" for epoch=1, where it said "Epoch 0/1"); a bad manifest is one clear
    line on stderr and exit 2, not a traceback."""
    import re

    from helpers import under_a_terminal

    out = tmp_path / "OUT"
    env = {"DALI_PIPE_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT), "TERM": "xterm", "COLUMNS": "80"}
    code, text = under_a_terminal([sys.executable, str(ROOT / "train.py"), "--data", str(photo_root), "--model",
                                   "tiny", "--epochs", "2", "--device", "cpu", "--output", str(out)], env)
    assert code == 0, text[-3000:]
    assert (out / "config.json").is_file() and "image processor, label map and metrics.json written to" in text
    lines = [ln for ln in re.split(r"[\r\n]+", text) if "METRIC" in ln]
    assert [ln.split()[1] for ln in lines] == ["epoch=1", "epoch=2"], lines
    for line in lines:
        m = re.search(r"METRIC epoch=\d+ .*val_acc=([0-9.]+)", line)  # SageMaker's validation:accuracy
        assert m and 0 <= float(m.group(1)) <= 1 and line.startswith("METRIC "), line
    assert "Epoch 1/2" in text and "Epoch 2/2" in text and "Epoch 0" not in text and "progress: " not in text

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "dataset.tsv").write_text("image_path\nonly/a.jpg\n")
    from dali_pipe.cli import cli

    rc = cli(lambda: train.main(["--data", str(bad), "--model", "tiny", "--device", "cpu", "--output",
                                 str(tmp_path / "o2")]))  # train.py's entry, in this process
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("error: ") and "missing" in err


@pytest.mark.gpu
def test_gpu_fit_with_autocast(photo_root, tmp_path, cache_dir):
    """On a GPU: mixed decode, outputs on the GPU, and auto precision (bf16 on sm80+, fp16 before)."""
    import torch

    res = train.main(["--data", str(photo_root), "--model", "tiny", "--epochs", "2", "--batch-size", "8",
                      "--device", "gpu", "--output", str(tmp_path / "g")])
    assert res["global_step"] == 2 * (43 // 8)
    from dali_pipe.config import resolve_precision

    expected = "bf16-mixed" if torch.cuda.get_device_capability()[0] >= 8 else "16-mixed"
    assert resolve_precision("auto", "gpu") == expected


@pytest.mark.gpu
def test_gpu_loader_outputs_on_device(photo_root, tmp_path, cache_dir):
    from helpers import datamodule

    from dali_pipe.spec import ImageSpec

    dm = datamodule(photo_root, tmp_path / "o", batch_size=8, cache_dir=cache_dir, device="gpu", threads=3,
                    spec=ImageSpec(64, 64, (0.5,) * 3, (0.5,) * 3))
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.is_cuda and y.is_cuda and y.dtype.is_floating_point is False


def test_unknown_flag_is_a_usage_error_not_an_exit():
    with pytest.raises(train.UsageError, match="unrecognized arguments: --bogus"):
        train.main(["--bogus"])


def test_local_model_path_finetunes_and_missing_path_is_clear(photo_root, tmp_path, cache_dir):
    """--model takes a save_pretrained directory (here: a previous run's output); a bad path says what to do."""
    first = tmp_path / "first"
    args = ["--data", str(photo_root), "--epochs", "1", "--batch-size", "8", "--device", "cpu", "--num-threads", "1"]
    train.main(args + ["--model", "tiny", "--output", str(first)])
    res = train.main(args + ["--model", str(first), "--output", str(tmp_path / "second")])
    assert res["global_step"] == 43 // 8  # 43 train, 5 val at the default --val-fraction
    with pytest.raises(train.UsageError, match=r"--model: '.*no-such-model' does not exist; pass the folder a "
                                               r"training run wrote"):
        train.main(args + ["--model", str(tmp_path / "no-such-model"), "--output", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_week_one_recipe_trains_and_the_best_epoch_is_selected(photo_root, tmp_path, cache_dir, capsys):
    """Every recipe flag at once trains on the CPU; OUT holds the epoch with the best val_acc (ties: the
    later), metrics.json says which and why; TensorBoard gets the learning rate."""
    out = tmp_path / "o"
    res = train.main(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "3",
                      "--batch-size", "8", "--num-threads", "1", "--output", str(out), "--val-fraction", "0.25",
                      "--label-smoothing", "0.1", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
                      "--auto-augment", "trivial", "--random-erase", "0.25", "--weight-decay", "0.05",
                      "--grad-accum", "2", "--clip-grad-norm", "1.0", "--crop-scale", "0.35", "1.0"])
    assert res["global_step"] == 3 * (38 // 8 // 2)
    text = capsys.readouterr().out
    assert "batch: 8 per process x 1 process(es) x 2 accumulation = 16 per optimizer step; 2 steps per epoch, 6 in " \
           "all" in text
    assert "data: 4 classes (astronaut, chelsea, coffee, rocket); 38 train + 10 val images; scan fast: 0 of 48" in text
    metrics = json.loads((out / "metrics.json").read_text())
    accs = [e["val_acc"] for e in metrics["epochs"]]
    best = max(i for i, a in enumerate(accs) if a == max(accs)) + 1
    assert metrics["selected"] == {"epoch": best, "global_step": 2 * best, "val_acc": max(accs),
                                   "rule": "the best validation accuracy (ties: the later epoch)"}
    assert (out / "model.safetensors").read_bytes() == (out / "checkpoints" / "best" / "model.safetensors").read_bytes()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(out / "tensorboard")).Reload()
    assert any(tag.startswith("lr") for tag in tb.Tags()["scalars"]), tb.Tags()["scalars"]


def test_select_last_and_no_validation_data(photo_root, tmp_path, cache_dir):
    """--select last, and no validation data: the last epoch is the model, said in metrics.json; without
    validation data no Lightning warning about an empty validation loader."""
    import warnings

    cases = ((["--select", "last"], "the last epoch", 43 // 8),
             (["--val-fraction", "0"], "the last epoch (no validation data, so no best one)", 48 // 8))
    for i, (extra, rule, steps) in enumerate(cases):
        out = tmp_path / str(i)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train.main(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "1",
                        "--batch-size", "8", "--num-threads", "1", "--output", str(out), *extra])
        assert not [w for w in caught if "across ranks is zero" in str(w.message)], [str(w.message) for w in caught]
        assert json.loads((out / "metrics.json").read_text())["selected"] == {"epoch": 1, "global_step": steps,
                                                                              "rule": rule}


def test_start_up_summary_says_what_small_data_drops(photo_root, cache_dir):
    """48 training images at batch 32: the summary says 16 are dropped each epoch, and that 24 drops none."""
    from dali_pipe.cli import fit, parse_train
    from dali_pipe.config import resolve
    from dali_pipe.dataset import read

    s = resolve(parse_train(["--data", str(photo_root), "--model", "tiny", "--batch-size", "32", "--val-fraction", "0"]))
    text = fit.summary(s, read(s.data), None, 250_000)
    assert "1 steps per epoch" in text and "note: 16 of the 48 training images (33%) are left out of every epoch" in text
    assert "--batch-size 24 would drop 0" in text
    s.data.batch_size = 16
    assert "note:" not in fit.summary(s, read(s.data), None, 250_000)


def test_our_warnings_print_as_one_plain_line(tmp_path):
    """A warning of ours (the manifest's dropped duplicate rows) prints as one 'warning:' line, not Python's
    file:line, category and source line."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for name in ("a/1.jpg", "a/2.jpg", "b/1.jpg", "b/2.jpg"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "dataset.tsv").write_text("image_path\na/1.jpg\na/1.jpg\na/2.jpg\nb/1.jpg\nb/2.jpg\n")
    code = ("import sys; from dali_pipe.cli import cli; from dali_pipe.manifest import read_manifest; "
            f"sys.exit(cli(lambda: read_manifest({str(tmp_path)!r}, val_fraction=0.1, seed=0, skip_missing=False)))")
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stderr == f"warning: {tmp_path / 'dataset.tsv'}: dropped 1 duplicate row(s) (same image_path, label and split).\n"


def test_steps_per_epoch_count_the_step_of_an_epochs_last_partial_accumulation(photo_root, cache_dir):
    """48 images at batch 8 with --grad-accum 4: 6 batches make 2 optimizer steps per epoch (Lightning steps at an
    epoch's last batch), as a real Trainer counts them; the summary and the resume position say 2, not 1."""
    import pytorch_lightning as pl
    import torch

    from dali_pipe.cli import fit, parse_train
    from dali_pipe.config import resolve
    from dali_pipe.dataset import read

    s = resolve(parse_train(["--data", str(photo_root), "--model", "tiny", "--batch-size", "8", "--val-fraction", "0",
                             "--grad-accum", "4"]))

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(48, 1)), batch_size=8)
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    trainer.fit(Tiny(), data)
    assert fit.steps_per_epoch(s, read(s.data)) == trainer.global_step == 2
    assert "2 steps per epoch" in fit.summary(s, read(s.data), None, 250_000)


def _dataset(root: Path, photo_root: Path, tsv: str) -> Path:
    """A dataset root whose class folders are photo_root's (linked), with its own dataset.tsv."""
    root.mkdir(parents=True)
    for folder in ("astronaut", "chelsea", "coffee", "rocket"):
        (root / folder).symlink_to(photo_root / folder)
    (root / "dataset.tsv").write_text(tsv)
    return root


DATA_MISTAKES = {  # name -> (dataset.tsv from photo_root's rows, the message's words)
    "misspelt header": (lambda rows: "imagepath\n" + "".join(f"{r}\n" for r in rows),
                        r"dataset.tsv: line 1: column 'imagepath' looks like a typo of 'image_path'"),
    "a CSV file": (lambda rows: "image_path,label\n" + "".join(f"{r},{r.split('/')[0]}\n" for r in rows),
                   r"dataset.tsv: line 1: the header 'image_path,label' is comma-separated: this is a CSV file"),
    "no train rows": (lambda rows: "image_path\tsplit\n" + "".join(f"{r}\tval\n" for r in rows),
                      r"dataset.tsv: the 'split' column marks no row train \(all 48 say val, lines 2 to 49\)"),
    "a missing file": (lambda rows: "image_path\n" + "".join(f"{r}\n" for r in rows + ["rocket/gone.jpg"]),
                       r"dataset.tsv: 1 listed file\(s\) missing .*'rocket/gone.jpg'"),
}


def test_data_mistakes_are_told_before_torch_and_lightning_load(photo_root, tmp_path):
    """Each data mistake is one message naming the file and line, given before torch, Lightning, transformers
    or pandas load (~10 s here): train.py, evaluate and pack read the manifest first, in the main process; a
    path that does not exist says so (pack's SRC included)."""
    import re

    rows = (photo_root / "dataset.tsv").read_text().split()[1:]
    cases = {}
    for i, (name, (tsv, _)) in enumerate(DATA_MISTAKES.items()):
        root = str(_dataset(tmp_path / f"d{i}", photo_root, tsv(rows)))
        cases[name] = ["train", "--data", root, "--model", "tiny", "--output", str(tmp_path / "out")]
    cases["a CSV file (evaluate)"] = ["commands", "evaluate", "--model", "tiny", "--data", cases["a CSV file"][2]]
    cases["a CSV file (pack)"] = ["commands", "pack", cases["a CSV file"][2], str(tmp_path / "packed")]
    cases["pack /nonexistent"] = ["commands", "pack", str(tmp_path / "nonexistent"), str(tmp_path / "packed")]
    cases["evaluate --data /nonexistent"] = ["commands", "evaluate", "--model", "tiny", "--data",
                                             str(tmp_path / "nonexistent")]
    cases["--data /nonexistent"] = ["train", "--data", str(tmp_path / "nonexistent")]
    code = ("import json, sys\nimport train\nfrom dali_pipe.cli import commands\nfrom dali_pipe.errors import UserError\n"
            "out = {}\n"
            f"for name, argv in {cases!r}.items():\n"
            "    try:\n"
            "        (train.main if argv[0] == 'train' else commands.main)(argv[1:])\n"
            "        out[name] = ['no error', []]\n"
            "    except UserError as e:\n"
            "        out[name] = [str(e), [m for m in ('torch', 'pytorch_lightning', 'transformers', 'pandas', "
            "'nvidia.dali') if m in sys.modules]]\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**__import__("os").environ, "DALI_PIPE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    told = json.loads(r.stdout)
    expected = {name: words for name, (_, words) in DATA_MISTAKES.items()}
    expected.update({"a CSV file (evaluate)": expected["a CSV file"], "a CSV file (pack)": expected["a CSV file"],
                     "pack /nonexistent": r"SRC '.*/nonexistent' does not exist",
                     "evaluate --data /nonexistent": r"--data '.*/nonexistent' does not exist",
                     "--data /nonexistent": r"--data: '.*/nonexistent' does not exist"})
    for name, words in expected.items():
        message, loaded = told[name]
        assert re.search(words, message), (name, message)
        assert loaded == [], (name, loaded)
    assert not (tmp_path / "out").exists() and not (tmp_path / "packed").exists()


def test_train_reads_the_manifest_once_and_hands_it_to_the_command(photo_root, tmp_path, monkeypatch):
    """The manifest the CLI checked first is the one the command trains on: it is read once."""
    from dali_pipe import manifest as manifest_module
    from dali_pipe.cli import fit

    reads, seen = [], {}
    real = manifest_module.read_table
    monkeypatch.setattr(manifest_module, "read_table", lambda tsv, raw=None: reads.append(tsv) or real(tsv, raw))
    monkeypatch.setattr(fit, "run", lambda s, manifest=None, style="flag", **kw: seen.update(manifest=manifest) or {})
    train.main(["--data", str(photo_root), "--model", "tiny", "--output", str(tmp_path / "o"), "--device", "cpu"])
    assert reads == [photo_root / "dataset.tsv"]
    assert len(seen["manifest"].train) + len(seen["manifest"].val) == 48


def test_a_failed_run_leaves_no_empty_folder_of_ours(photo_root, tmp_path, cache_dir):
    """A run that fails after its pre-flight made OUT and OUT/checkpoints (a batch larger than the data) removes
    the folders it made that are still empty; a folder that was there before stays, and so does what is in it."""
    from dali_pipe.dataset import BatchTooLargeError

    argv = ["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--batch-size", "64", "--num-threads", "1",
            "--devices", "auto"]  # (with a number of devices, a batch larger than the data is told before OUT is made)
    with pytest.raises(BatchTooLargeError):
        train.main(argv + ["--output", str(tmp_path / "runs" / "new")])
    assert list(tmp_path.iterdir()) == [cache_dir]  # neither runs/new/checkpoints, nor runs/new, nor runs
    (tmp_path / "mine").mkdir()
    with pytest.raises(BatchTooLargeError):
        train.main(argv + ["--output", str(tmp_path / "mine")])
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["bad_images.tsv"]  # the scan's report is kept


def test_python_m_dali_pipe_train_is_train_py():
    """`python -m dali_pipe train FLAGS` is `python train.py FLAGS` (it was "invalid choice"): the same parser,
    help and messages."""
    from dali_pipe.cli import commands

    with pytest.raises(train.UsageError, match=r"--epochs: 'x' is not an integer"):
        commands.main(["train", "--epochs", "x"])
    r = subprocess.run([sys.executable, "-m", "dali_pipe", "train", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: python train.py"), r.stdout[:200] + r.stderr
    r = subprocess.run([sys.executable, "-m", "dali_pipe", "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert "train     train a model: the same as python train.py" in r.stdout


def test_with_several_nodes_the_manifest_is_read_after_the_hosts_meet(photo_root, tmp_path, monkeypatch):
    """--num-nodes 2: the CLI does not read the manifest first (a host failing before it joins the meeting would
    leave the others waiting for --dist-timeout); the DataModule reads it after the meeting, as before."""
    from dali_pipe import cli
    from dali_pipe.cli import fit

    seen = {}
    monkeypatch.setattr(cli, "described", lambda data, what="--data": pytest.fail("read before the meeting"))
    monkeypatch.setattr(fit, "run", lambda s, manifest=None, style="flag", **kw: seen.update(manifest=manifest) or {})
    train.main(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--num-nodes", "2",
                "--output", str(tmp_path / "o")])
    assert seen == {"manifest": None}


def test_a_diverging_run_stops_with_exit_1_exports_nothing_and_keeps_the_last_finite_checkpoint(photo_root, tmp_path,
                                                                                                 cache_dir, capsys):
    """--lr 1e4 with a checkpoint every step: an update with a finite loss turns the weights NaN before the loss
    is; the check before each save looks at the weights too, so the run stops there (exit 1, one line naming the
    step and --lr, no traceback); OUT holds no model, and last.ckpt is the step it names, every tensor finite
    (before, the save after step 3 wrote NaN weights and the message called them finite)."""
    import torch
    from helpers import run_train

    out = tmp_path / "out"
    rc = run_train(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "2", "--batch-size",
                    "8", "--num-threads", "1", "--lr", "1e4", "--output", str(out), "--checkpoint-every-steps", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err[-2000:]
    assert "error: training diverged: the " in err and "are no longer finite" in err, err[-2000:]
    assert "--lr 10000 is too high" in err and "Nothing was exported" in err
    assert not {"metrics.json", "config.json", "model.safetensors"} & {p.name for p in out.iterdir()}
    state = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert f"(step {state['global_step']}) is the last checkpoint, saved while the weights were finite" in err, err
    tensors = list(state["state_dict"].values()) + [v for s in state["optimizer_states"][0]["state"].values()
                                                    for v in s.values() if torch.is_tensor(v)]
    assert all(torch.isfinite(v).all() for v in tensors)


ENTRY_RUNS = {"python -m dali_pipe": "runpy.run_module('dali_pipe', run_name='__main__', alter_sys=True)",
              "train.py": "runpy.run_path('train.py', run_name='__main__')"}  # each entry point, run as a command


@pytest.mark.parametrize("entry", list(ENTRY_RUNS))
def test_the_entry_points_load_their_modules_with_the_collector_off_and_turn_it_back_on(entry):
    """train.py and python -m dali_pipe turn the collector off before their first import: loading the command's
    modules runs no collection (37 passes before, for python -m dali_pipe), then as_a_command() freezes what they
    made and turns it back on. Imported as a module (this file imports train), train.py leaves the collector alone."""
    run = ENTRY_RUNS[entry]
    argv = ["dali_pipe", "sync", "--help"] if entry != "train.py" else ["train.py", "--help"]
    code = ("import atexit, gc, runpy, sys\n"
            "passes, marks, off, freeze = [], {}, gc.disable, gc.freeze\n"
            "gc.callbacks.append(lambda phase, info: phase == 'start' and passes.append(info['generation']))\n"
            "gc.disable = lambda: (marks.setdefault('off', len(passes)), off())[1]\n"
            "gc.freeze = lambda: (marks.setdefault('frozen', len(passes)), freeze(),\n"
            "                     marks.setdefault('count', gc.get_freeze_count()))[1]\n"
            "atexit.register(lambda: print(marks.get('frozen', 0) - marks.get('off', -1000), gc.isenabled(),\n"
            "                              marks.get('count', 0) > 10000, flush=True))  # passes from off to frozen\n"
            f"sys.argv = {argv!r}\n{run}\n")
    r = _python(code, timeout=120)
    assert r.returncode == 0, r.stderr
    passes, enabled, frozen = r.stdout.splitlines()[-1].split()
    assert int(passes) == 0 and enabled == "True" and frozen == "True", r.stdout.splitlines()[-1]
    import gc

    assert gc.isenabled() and train.__name__ == "train"


@pytest.mark.parametrize("entry", list(ENTRY_RUNS))
def test_an_entry_point_whose_imports_fail_gives_the_collector_back(entry):
    """Run inside a process that outlives it (python -i, pdb, runpy), an entry point whose first import fails
    turns the collector back on before the error goes up."""
    run = ENTRY_RUNS[entry]
    code = ("import gc, importlib.abc, runpy, sys\n"
            "class Broken(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'dali_pipe.cli':\n            raise ImportError('broken here')\n"
            "sys.meta_path.insert(0, Broken())\n"
            f"try:\n    {run}\nexcept ImportError as e:\n    print(e, gc.isenabled())\n")
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "broken here True", r.stdout


def test_command_imports_freeze_what_a_command_loads_and_leave_a_library_alone():
    """command_imports(), around a command's lazy import of its heavy modules: in a command (after
    as_a_command) no full collection runs while they load (the young ones do), what they made is frozen after,
    and the thresholds are back, also when the import fails; in the user's own process (as_a_command never
    called) nothing changes."""
    code = ("import gc\nfrom dali_pipe.cli import NO_FULL_PASS, as_a_command, command_imports\n"
            "default = gc.get_threshold()\n"
            "with command_imports():\n    library = (gc.get_threshold() == default, gc.get_freeze_count())\n"
            "as_a_command()\nbefore = gc.get_freeze_count()\n"
            "with command_imports():\n"
            "    inside = (gc.isenabled(), gc.get_threshold() == default[:2] + (NO_FULL_PASS,))\n"
            "    import fractions, statistics\n"
            "grew = gc.get_freeze_count() > before\n"
            "try:\n    with command_imports():\n        import no_such_module_here\n"
            "except ImportError:\n    pass\n"
            "print(library, inside, grew, gc.isenabled(), gc.get_threshold() == default)\n")
    r = _python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "(True, 0) (True, True) True True True", r.stdout


def test_training_loads_its_heavy_modules_through_command_imports(photo_root, tmp_path):
    """train.py's main(), in a command: the modules it loads lazily (the finished-run check, the training
    command; numpy through the data check) load with no full collection and are frozen, and the run itself
    has the collector's usual thresholds (the modules stand in here, recording what they see)."""
    code = ("import gc, importlib.abc, importlib.util, json, sys\n"
            "seen, default = {}, gc.get_threshold()\n"
            "class Stand(importlib.abc.MetaPathFinder, importlib.abc.Loader):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name in ('dali_pipe.cli.finished', 'dali_pipe.cli.fit'):\n"
            "            return importlib.util.spec_from_loader(name, self)\n"
            "    def create_module(self, spec):\n        return None\n"
            "    def exec_module(self, module):\n"
            "        seen[module.__name__] = (gc.get_threshold()[2] > default[2], gc.get_freeze_count())\n"
            "        module.nothing_to_do = module.fits = module.holds_a_run = lambda *a: None\n"
            "        module.run = lambda *a, **k: seen.setdefault('run', (gc.get_threshold() == default,\n"
            "                                                               gc.get_freeze_count())) and {}\n"
            "sys.meta_path.insert(0, Stand())\n"
            "from dali_pipe.cli import as_a_command, main\nas_a_command()\n"
            f"main(['--data', {str(photo_root)!r}, '--model', 'tiny', '--device', 'cpu', '--output', "
            f"{str(tmp_path / 'out')!r}])\n"
            "print(json.dumps(seen))\n")
    r = _python(code, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.splitlines()[-1])
    assert seen["dali_pipe.cli.finished"][0] and seen["dali_pipe.cli.fit"][0], seen  # no full pass while loading
    assert seen["run"][0] and seen["run"][1] > seen["dali_pipe.cli.finished"][1], seen  # frozen, thresholds back


def test_a_command_exits_without_the_shutdown_collection_and_keeps_its_finalizers():
    """as_a_command (train.py's and python -m dali_pipe's): what the imports made is frozen at once (no collection
    walks it again), at exit the garbage there is then is collected (a cycle's finalizer runs), the other atexit
    handlers run first, and the exit status is kept."""
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen' if gc.get_freeze_count() else 'not frozen', flush=True))\n"
            "from dali_pipe.cli import as_a_command\nbefore = gc.get_freeze_count()\nas_a_command()\n"
            "print('imports frozen' if before == 0 and gc.get_freeze_count() > 1000 else gc.get_freeze_count(), "
            "flush=True)\n"
            "atexit.register(lambda: print('other handler', flush=True))\n"
            "class Cycle:\n    def __del__(self):\n        print('finalized', flush=True)\n"
            "c = Cycle(); c.me = c\ndel c\n"
            "gc.disable()  # the cycle stays garbage until the exit's collection\nsys.exit(3)\n")
    r = _python(code)
    assert r.returncode == 3, r.stderr
    assert r.stdout.splitlines() == ["imports frozen", "other handler", "finalized", "frozen"], r.stdout


def test_a_sigterm_that_lands_in_a_finaliser_still_stops_the_command(tmp_path):
    """A SIGTERM that landed in a __del__ was lost when the CLI's handler raised (Python prints and drops what a
    finaliser raises), and the command ran to its end, exit 0. The handler only notes it now (dali_pipe/stop.py),
    and the command's next look at the flag stops it: 143."""
    import signal
    import time

    script = tmp_path / "slow_del.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
        "from dali_pipe.cli import cli\n"
        "from dali_pipe.stop import sleep\n"
        "class Slow:\n"
        "    def __del__(self):\n"
        "        print('in __del__', flush=True)\n"
        "        time.sleep(1.0)\n"
        "def entry():\n"
        "    Slow()\n"
        "    sleep(5)\n"
        "    print('ran to the end', flush=True)\n"
        "    return {}\n"
        "sys.exit(cli(entry))\n")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "in __del__"
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert (p.returncode, out, err) == (143, "", "stopped by SIGTERM\n")


def test_a_command_that_cancelled_requests_ends_without_finalization():
    """obstore's threads may still be finishing a request the command cancelled (a stop, a refusal while the LIST
    ran ahead), and one that hands its result to a finalized interpreter crashes the process (SIGSEGV after
    "stopped by SIGTERM", 3 of 118 stopped syncs). Such a command ends inside cli(), without finalization: its
    status, its last line and its atexit handlers as at a normal exit; one that cancelled nothing returns."""
    code = (
        "import asyncio, atexit, sys\n"
        "from dali_pipe.cli import as_a_command, cli\n"
        "from dali_pipe.errors import UserError\n"
        "from dali_pipe.transfer import Engine\n"
        "as_a_command()\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"

        "def entry():\n"
        "    engine = Engine(concurrency=1, connect_timeout=1, read_timeout=1, attempts=1)\n"
        "    if sys.argv[1] == 'cancel':\n"
        "        engine.submit(asyncio.sleep(30)).cancel()\n"
        "    engine.close()\n"
        "    raise UserError('refused')\n"
        "status = cli(entry)\n"
        "print('cli returned: the interpreter exits as usual', flush=True)\n"
        "sys.exit(status)\n")
    for how, returned in (("cancel", []), ("none", ["cli returned: the interpreter exits as usual"])):
        r = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 2 and r.stderr == "error: refused\n", (how, r.stderr)
        assert r.stdout.splitlines() == returned + ["atexit ran"], (how, r.stdout)


def test_grad_accum_over_the_batches_of_an_epoch_is_refused_naming_the_most_that_applies(photo_root, tmp_path,
                                                                                           cache_dir):
    """43 training images in batches of 8 are 5 batches an epoch: --grad-accum 16 trained, each step over those 5,
    and the summary said 'x 16 accumulation = 128 per optimizer step'. It is refused before training, naming the
    5 batches and the largest value that applies, which is accepted."""
    from dali_pipe.dataset import BatchTooLargeError, check_accumulation

    argv = ["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--batch-size", "8", "--num-threads", "1",
            "--output", str(tmp_path / "out"), "--grad-accum", "16"]
    with pytest.raises(BatchTooLargeError, match=r"--grad-accum 16 is more than the 5 batch\(es\) of 8 each of the 1 "
                                                 r"process\(es\) trains per epoch \(43 training images\).*pass "
                                                 r"--grad-accum 5 or lower"):
        train.main(argv)
    assert not (tmp_path / "out" / "checkpoints").exists()
    check_accumulation(43, 8, 1, 5)  # following the advice works
    with pytest.raises(BatchTooLargeError, match="pass --grad-accum 2 or lower"):
        check_accumulation(43, 8, 2, 3)


@pytest.mark.parametrize("flags, said", [(["--batch-size", "100"], "--batch-size 100 is larger than the 43 training"),
                                         (["--batch-size", "8", "--grad-accum", "16"], "--grad-accum 16 is more than")])
def test_a_batch_or_accumulation_the_data_cannot_fill_is_told_before_torch_loads(photo_root, tmp_path, flags, said):
    """A local dataset's training split is read before the heavy imports: --batch-size and --grad-accum too large
    for it are told from there (before: after torch and Lightning, about 4 s in)."""
    from helpers import told_before_torch

    said_now = told_before_torch(["--data", str(photo_root), "--model", "tiny", "--output", str(tmp_path / "o"),
                                  "--cache-dir", str(tmp_path / "c"), *flags])
    assert said_now.startswith(f"BatchTooLargeError {said}"), said_now


@pytest.mark.parametrize("entry", [["train.py"], ["-m", "dali_pipe"]])
def test_ctrl_c_while_the_command_loads_says_so_without_a_traceback(entry):
    """Ctrl-C before the CLI's handlers are in place (the command's first imports, about 0.1 s): 'stopped by
    Ctrl-C' and status 130, as later; before, a KeyboardInterrupt traceback (the import is made to raise it)."""
    code = ("import importlib.abc, runpy, sys\n"
            "class Stop(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'dali_pipe.cli':\n            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Stop())\n"
            + ("sys.argv = ['train.py']\nrunpy.run_path('train.py', run_name='__main__')\n" if entry == ["train.py"]
               else "sys.argv = ['dali_pipe']\nrunpy.run_module('dali_pipe', run_name='__main__')\n"))
    r = _python(code, timeout=60)
    assert r.returncode == 130 and r.stderr.strip() == "stopped by Ctrl-C", (r.returncode, r.stderr[-2000:])
