"""Finished means exported: kills and full disks at the export, over an older OUT, damaged files in OUT;
a rerun exits 0 only with this run's complete model in OUT, exporting it again from the checkpoint."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import pytorch_lightning  # noqa: F401  (imported here, its log handler holds pytest's stderr, not one test's)
from helpers import copy_trained, run_train

import train


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """2 classes x 6 real photos: 10 train, 2 val; a one-epoch run is 2 steps of 4."""
    from dali_pipe.demo import make_photo_dataset

    return make_photo_dataset(tmp_path_factory.mktemp("small"), classes=2, per_class=6)


def _argv(data, out, *extra):
    return ["--data", str(data), "--model", "tiny", "--device", "cpu", "--batch-size", "4", "--num-threads", "1",
            "--output", str(out), *extra]


_run = run_train  # train.py's entry in this process (tests/helpers.py)


def _signal_after_move(monkeypatch, out: Path, name: str, action):
    """Call `action` right after `name` is moved into OUT by the export: a deterministic point between
    two moves, with the older files still beside it."""
    real = os.replace

    def replace(src, dst, *a, **k):
        real(src, dst, *a, **k)
        if Path(dst) == out / name:
            action()

    monkeypatch.setattr(os, "replace", replace)


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _assert_holds_checkpoint_model(out: Path, steps: int):
    """OUT holds the model a finished run selects: the best folder's weights, metrics.json of its steps."""
    import torch

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["global_step"] == steps and metrics["export"]["global_step"] == steps
    got, want = _weights(out), _weights(out / "checkpoints" / "best")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    from model.loading import load_trained

    model = load_trained(str(out))
    assert {str(k): v for k, v in model.config.id2label.items()} == json.loads((out / "label_map.json").read_text())


def test_sigterm_and_kill_9_during_the_export_over_an_older_out(small, tmp_path, cache_dir, monkeypatch, capsys):
    """OUT holds an older run's model (epochs 1); the same OUT trained on to epochs 2 gets SIGTERM between
    two moves of its export: a stop is a flag the commands look at (dali_pipe/stop.py), and the export, once
    started, lands whole (exit 0, OUT holds this model). Trained on to epochs 3, the export is killed -9 at the
    same point (a forked process): the rerun exports again and the last one says "nothing to do" only once OUT
    holds this model."""
    out = tmp_path / "out"
    assert _run(_argv(small, out, "--epochs", "1")) == 0
    older = _weights(out)
    _signal_after_move(monkeypatch, out, "config.json", lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert _run(_argv(small, out, "--epochs", "2")) == 0
    assert not list(out.glob(".model-tmp-*")) and _weights(out).keys() == older.keys()
    _assert_holds_checkpoint_model(out, 4)
    monkeypatch.undo()

    pid = os.fork()  # kill -9 at a known point of the re-export, in a child that needs no imports
    if pid == 0:
        try:
            import torch

            torch.set_num_threads(1)  # as DataLoader workers do: no OpenMP pool in a forked child
            _signal_after_move(monkeypatch, out, "config.json", lambda: os.kill(os.getpid(), signal.SIGKILL))
            train.main(_argv(small, out, "--epochs", "3"))
        finally:
            os._exit(3)  # not killed: the test fails below
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked rerun neither finished nor was killed")
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    assert (out / f".model-tmp-{pid}").is_dir() and not (out / "metrics.json").exists()

    capsys.readouterr()
    assert _run(_argv(small, out, "--epochs", "3")) == 0
    text = capsys.readouterr().out
    assert "already trained to 6 steps, but" in text and "has no metrics.json" in text
    assert "exporting the model again from" in text and not list(out.glob(".model-tmp-*"))
    _assert_holds_checkpoint_model(out, 6)
    assert _run(_argv(small, out, "--epochs", "3")) == 0
    assert "nothing to do: already trained to 6 steps" in capsys.readouterr().out


def test_a_full_disk_at_the_best_model_and_at_the_export(small, tmp_path, cache_dir, monkeypatch, capsys):
    """A real full disk (tmpfs): before the best-model save, one clear error and no temporary folder;
    after freeing space the rerun trains, and with the disk full before the export it fails naming OUT
    and keeps the checkpoint; after freeing space again the rerun exports from the checkpoint."""
    from helpers import fill, small_disk

    from model import export, selection

    with small_disk(tmp_path / "disk", "16m") as disk:
        out = disk / "out"
        argv = _argv(small, out, "--epochs", "1")
        real_save = selection.BestModel._save

        def full_then_save(self, *a, **k):
            fill(disk)
            return real_save(self, *a, **k)

        monkeypatch.setattr(selection.BestModel, "_save", full_then_save)
        assert _run(argv) == 2
        err = capsys.readouterr().err
        assert "error: could not save the best model (epoch 1, val_acc" in err and "No space left on device" in err
        assert "Traceback" not in err and not list((out / "checkpoints").glob(".best.*"))
        (disk / "filler").unlink()
        monkeypatch.undo()

        real_write = export.write

        def full_then_write(*a, **k):
            fill(disk)
            return real_write(*a, **k)

        monkeypatch.setattr(export, "write", full_then_write)
        assert _run(argv) == 2
        err = capsys.readouterr().err
        assert f"error: training finished, but the model could not be written to {out} (No space left on device)" \
               in err and "holds the trained weights: fix that (free space there" in err, err
        assert not list(out.glob(".model-tmp-*")) and not (out / "config.json").exists()
        (disk / "filler").unlink()
        monkeypatch.undo()

        capsys.readouterr()
        assert _run(argv) == 0
        assert "exporting the model again from" in capsys.readouterr().out
        _assert_holds_checkpoint_model(out, 2)


def test_out_turning_read_only_mid_training_is_one_line_naming_the_checkpoint_kept(small, tmp_path, cache_dir,
                                                                                  monkeypatch, capsys):
    """OUT (a tmpfs) turns read-only after step 3, the checkpoint dir elsewhere: one line naming the file that
    could not be written, the checkpoint kept (step 3, there to resume from) and the fix, exit 2, no traceback
    (before: a thread's traceback, a ValueError from Lightning's logger, then OSError: [Errno 30])."""
    import subprocess

    from helpers import small_disk

    from model.module import ImageClassifier

    ckpt = tmp_path / "ckpt"
    with small_disk(tmp_path / "disk", "16m") as out:
        def read_only_after_step_3(self, outputs, batch, batch_idx):
            if self.global_step == 3:
                subprocess.run(["mount", "-o", "remount,ro", str(out)], check=True)

        monkeypatch.setattr(ImageClassifier, "on_train_batch_end", read_only_after_step_3)
        argv = _argv(small, out, "--epochs", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", "1")
        assert _run(argv) == 2
        err = capsys.readouterr().err
        assert f"error: training stopped: cannot write {out / 'tensorboard'}" in err, err
        assert f"(Read-only file system); the last checkpoint, {ckpt / 'last.ckpt'} (step 3), is kept. Make " \
               f"{out / 'tensorboard'} writable for this user (or write elsewhere), then rerun the same command to " \
               "resume." in err, err
        assert "Traceback" not in err and "Exception in thread" not in err and "you tried to log" not in err, err
        assert json.loads((ckpt / "last.json").read_text())["global_step"] == 3


def _trained_argv(photo_root, out):
    return ["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "4", "--batch-size", "8",
            "--num-threads", "1", "--val-fraction", "0.25", "--lr", "2e-3", "--output", str(out)]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_model_in_out_is_exported_again_and_refused_by_evaluate(trained, photo_root, tmp_path, cache_dir,
                                                                          capsys, damage):
    """model.safetensors truncated, or one byte flipped: evaluate refuses it naming the file and the way
    out (never a traceback), and the rerun of the training command exports it again."""
    from dali_pipe.cli.commands import main
    from model.loading import ModelLoadError

    out = copy_trained(trained, tmp_path / "out")
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    else:
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(data)
    with pytest.raises(ModelLoadError, match=rf"{weights} is damaged.*rerun the training command that wrote it"):
        main(["evaluate", "--model", str(out), "--data", str(photo_root), "--device", "cpu", "--output",
              str(tmp_path / "eval")])
    capsys.readouterr()
    assert train.main(_trained_argv(photo_root, out)) == {"exported_again": True, "global_step": 16}
    text = capsys.readouterr().out
    assert f"{weights} is damaged" in text and "exporting the model again" in text
    assert f"{out} {weights}" not in text, "the folder named twice in a row"
    _assert_holds_checkpoint_model(out, 16)


def test_the_export_removes_only_what_the_previous_export_wrote(trained, tmp_path, capsys):
    """OUT's metrics.json (crafted, or a downloaded model folder reused as --output) names `../victim`, an
    absolute path, a link and a file changed since: the export leaves each alone with one line saying why,
    and removes only the plain file it recorded, unchanged, that the new export does not write (before, it
    deleted ../victim and the absolute path and exited 0). The check before "nothing to do" reads nothing
    outside OUT either."""
    from dali_pipe.shards.format import file_sha256
    from model.export import write
    from model.exported import problem
    from model.loading import load_processor, load_trained

    victim, absolute, out = tmp_path / "victim", tmp_path / "absolute", tmp_path / "out"
    out.mkdir()
    for f in (victim, absolute):
        f.write_text("keep")
    (out / "old.bin").write_bytes(b"the previous export's weights")
    (out / "edited.txt").write_text("the user's")
    (out / "link").symlink_to(victim)

    def rec(p):
        return {"size": p.stat().st_size, "sha256": file_sha256(p)}

    files = {"../victim": rec(victim), str(absolute): rec(absolute), "old.bin": rec(out / "old.bin"),
             "edited.txt": {"size": 10, "sha256": "0" * 64}, "link": rec(victim)}
    (out / "metrics.json").write_text(json.dumps({"export": {"run": "r", "global_step": 1, "select": "last",
                                                             "files": files}}))
    assert "'../victim', which is not a file name of that folder" in problem(out, run="r", global_step=1,
                                                                            select="last")
    capsys.readouterr()
    write(load_trained(str(trained)), load_processor(str(trained)), out, {"global_step": 2}, run="s", select="last")
    assert victim.read_text() == absolute.read_text() == "keep"
    assert (out / "link").is_symlink() and (out / "edited.txt").read_text() == "the user's"
    assert not (out / "old.bin").exists() and problem(out, run="s", global_step=2, select="last") is None
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("export: left")]
    assert len(lines) == 4 and all(f"previous metrics.json in {out} lists" in ln for ln in lines), lines
    assert sum("not a file name in that folder" in ln for ln in lines) == 2
