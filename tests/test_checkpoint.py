"""Spot-safe checkpoints and exact resume: SIGTERM mid-epoch, during validation, without a
validation set, kill -9 after a periodic checkpoint; atomic saves; the run fingerprint."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import resume_trace as rt
from helpers import copy_trained, run_train

import train

ROOT = Path(__file__).resolve().parents[1]
EPOCHS, BATCH = 3, 8


@pytest.fixture(scope="module")
def indexed(photo_root, tmp_path_factory):
    """48 photos, each its own class; 41 train, 7 val (split column)."""
    return rt.indexed_dataset(photo_root, tmp_path_factory.mktemp("indexed") / "data")


def _argv(data, out, *extra):
    return ["--data", str(data), "--model", "tiny", "--device", "cpu", "--epochs", str(EPOCHS), "--batch-size",
            str(BATCH), "--num-threads", "1", "--output", str(out), *extra]


def _sets(data: Path) -> tuple[set[str], set[str]]:
    rows = [r.split("\t") for r in (data / "dataset.tsv").read_text().splitlines()[1:]]
    return {r[1] for r in rows if r[2] == "train"}, {r[1] for r in rows if r[2] == "val"}


def _metric_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("METRIC ")]


_run = run_train  # train.py's entry in this process (tests/helpers.py)


def _curves(log_dir: Path) -> dict[str, list[int]]:
    """Every scalar curve in a TensorBoard folder as TensorBoard reads it (all event files, purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_ctrl_c_mid_epoch_saves_and_the_rerun_resumes_each_sample_once(indexed, tmp_path, cache_dir, monkeypatch,
                                                                       capsys):
    """Ctrl-C (SIGINT) during step 5, epoch 1's last: its validation runs, then step 6 (epoch 2, batch 1), then the
    save, and exit status 130 (before: Lightning's "Detected KeyboardInterrupt", exit 1, no checkpoint, and the
    rerun started over). The rerun continues the same permutation at the same place; across both runs every
    epoch trains each sample once and validates each once, each epoch's METRIC line covers the whole epoch, and
    TensorBoard's curves, read back, hold each step once, as an uninterrupted run logs them (no second copy of
    the steps the interrupted run logged, no gap at the resume)."""
    import signal

    import dali_pipe.cli.fit as fit

    monkeypatch.setattr(fit, "LOG_EVERY", 1)  # a loss and lr point at every step
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out"
    rt.install(trace, sigterm_at_step=4, patch=monkeypatch.setattr, stop_signal=signal.SIGINT)
    assert _run(_argv(indexed, out)) == 130  # signalled after step 4: not saved at 5, the epoch's last
    first = capsys.readouterr()
    assert "Ctrl-C: saving a checkpoint after the current step" in first.err and "Traceback" not in first.err
    assert "stopped by Ctrl-C; checkpoint saved to " in first.out and "(step 6). Rerun the same command to resume." \
        in first.out
    rt.install(trace, patch=monkeypatch.setattr)
    second = train.main(_argv(indexed, out))
    assert second["global_step"] == EPOCHS * (41 // BATCH)
    train_set, val_set = _sets(indexed)
    rt.assert_each_sample_once_per_epoch(rt.read(trace), train=train_set, epochs=EPOCHS, batch=BATCH, val=val_set)
    text = first.out + capsys.readouterr().out
    assert "resuming epoch 2, step 1 of 5 (global step 6) from " in text  # 5 steps of 8 per epoch
    lines = _metric_lines(text)
    assert [ln.split()[1] for ln in lines] == ["epoch=1", "epoch=2", "epoch=3"]
    assert all("train_samples=40" in ln and "val_samples=7" in ln for ln in lines), lines
    curves = _curves(out / "tensorboard")
    steps = list(range(EPOCHS * 5))
    assert curves["train_loss_step"] == curves["lr-AdamW/pg1"] == steps, curves
    assert curves["val_loss"] == curves["train_loss"] == [4, 9, 14] and curves["hp_metric"] == [0], curves


def test_ctrl_c_outside_training_stops_and_a_second_one_stops_at_once(tmp_path, capsys):
    """Ctrl-C before or after training (sync, scan, export) stops with exit 130 and one line, and cli() leaves
    the SIGINT and SIGTERM handlers as it found them; in training the
    first asks for the save and gives SIGINT its default action back, so a second one stops the process at
    once (without saving: the last checkpoint is kept); once training has ended, Ctrl-C stops at once again."""
    import signal

    from dali_pipe.cli import cli
    from dali_pipe.stop import check
    from model.checkpoint import SpotSafeCheckpoint

    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as a new process has it
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert cli(lambda: (signal.raise_signal(signal.SIGINT), check())) == 130  # a command that looks
        assert capsys.readouterr().err.strip() == "stopped by Ctrl-C"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as it was before cli()
        # SIGTERM too: one that comes while the interpreter exits, the result told, ends the process as
        # SIGTERM does (before, cli()'s handler raised inside an atexit callback: a traceback, and exit 0)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)

    class Strategy:
        checkpoint_io = None

    class Trainer:
        strategy, world_size = Strategy(), 1

    cb = SpotSafeCheckpoint(tmp_path)
    try:
        cb.setup(Trainer(), None, "fit")
        signal.raise_signal(signal.SIGINT)
        assert cb._agree_to_stop(Trainer()) == 2 and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        assert "press Ctrl-C again to stop at once without saving" in capsys.readouterr().err
        signal.signal(signal.SIGINT, cb._on_sigint)  # as Lightning's teardown puts back what it found
        cb.teardown(Trainer(), None, "fit")
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a parent that ignores Ctrl-C for us (a job started with &)
        ignoring = SpotSafeCheckpoint(tmp_path)
        ignoring.setup(Trainer(), None, "fit")
        signal.raise_signal(signal.SIGINT)  # ignored: training goes on
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and ignoring._agree_to_stop(Trainer()) == 0
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def test_sigterm_during_validation_finishes_it_then_resumes(indexed, tmp_path, cache_dir, monkeypatch, capsys):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out"
    rt.install(trace, sigterm_in_val_epoch=0, patch=monkeypatch.setattr)
    assert train.main(_argv(indexed, out))["interrupted"]
    rt.install(trace, patch=monkeypatch.setattr)
    train.main(_argv(indexed, out))
    train_set, val_set = _sets(indexed)
    rt.assert_each_sample_once_per_epoch(rt.read(trace), train=train_set, epochs=EPOCHS, batch=BATCH, val=val_set)
    lines = _metric_lines(capsys.readouterr().out)
    assert [ln.split()[1] for ln in lines] == ["epoch=1", "epoch=2", "epoch=3"]
    assert "train_samples=40" in lines[0] and "val_samples=7" in lines[0], lines[0]


def test_resume_without_validation_data(photo_root, tmp_path, cache_dir, monkeypatch, capsys):
    data = rt.indexed_dataset(photo_root, tmp_path / "data", val_every=None)
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out"
    rt.install(trace, sigterm_at_step=8, patch=monkeypatch.setattr)
    assert train.main(_argv(data, out))["interrupted"]
    rt.install(trace, patch=monkeypatch.setattr)
    assert train.main(_argv(data, out))["global_step"] == EPOCHS * (48 // BATCH)
    rt.assert_each_sample_once_per_epoch(rt.read(trace), train=_sets(data)[0], epochs=EPOCHS, batch=BATCH)
    assert len(_metric_lines(capsys.readouterr().out)) == EPOCHS


def test_max_steps_mid_epoch_then_more_steps_resumes_inside_that_epoch(indexed, tmp_path, cache_dir, monkeypatch,
                                                                       capsys):
    """--max-steps 2 stops inside epoch 1; a rerun for the whole epoch continues it at step 3 (before, it began
    a next epoch part-way): the epoch trains each sample once, validates each once, and reaches all its steps.
    Then --max-steps 10 continues the finished run at epoch 2 (before, an empty epoch 2 ran and the data trained
    as epoch 3), and --epochs 1 stops, naming what the checkpoint was trained to (before, a Lightning traceback)."""
    from model.resume import PastTheEndError

    trace, out = tmp_path / "trace.jsonl", tmp_path / "out"
    rt.install(trace, patch=monkeypatch.setattr)
    assert train.main(_argv(indexed, out, "--epochs", "1", "--max-steps", "2"))["global_step"] == 2
    assert train.main(_argv(indexed, out, "--epochs", "1"))["global_step"] == 41 // BATCH
    assert "resuming epoch 1, step 2 of 5 (global step 2) from " in capsys.readouterr().out
    assert train.main(_argv(indexed, out, "--max-steps", "10"))["global_step"] == 2 * (41 // BATCH)
    text = capsys.readouterr().out
    assert "resuming at the start of epoch 2 (5 steps each)" in text
    assert [ln.split()[1] for ln in _metric_lines(text)] == ["epoch=2"] and "train_samples=40" in text
    train_set, val_set = _sets(indexed)
    rt.assert_each_sample_once_per_epoch(rt.read(trace), train=train_set, epochs=2, batch=BATCH, val=val_set)
    with pytest.raises(PastTheEndError, match=r"last.ckpt is already past the end of this run: it was trained to "
                                              r"step 10 \(--epochs 3 --max-steps 10\), and this run asks for 5 steps "
                                              r"\(--epochs 1\).*Pass --epochs 3 --max-steps 10 to keep that run.*"
                                              r"--resume never.*--output"):
        train.main(_argv(indexed, out, "--epochs", "1"))
    assert json.loads((out / "metrics.json").read_text())["global_step"] == 10


@pytest.mark.slow
def test_kill_9_resumes_from_the_periodic_checkpoint_and_replays_only_after_it(indexed, tmp_path, cache_dir,
                                                                            monkeypatch):
    """kill -9 at step 8 with a checkpoint every 3 steps: the rerun resumes at step 6 and trains
    steps 7 and 8 again on the very same samples."""
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out"
    env = {**os.environ, "DALI_PIPE_CACHE": str(cache_dir)}
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
            f"import resume_trace, train\nfrom pathlib import Path\n"
            f"resume_trace.install(Path({str(trace)!r}), kill_at_step=8)\n"
            f"train.main({_argv(indexed, out, '--checkpoint-every-steps', '3')!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == -9, r.stderr[-2000:]
    first = rt.read(trace)
    killed = [x for x in first if x["kind"] == "train"]
    assert len(killed) == 8
    rt.install(trace, patch=monkeypatch.setattr)
    train.main(_argv(indexed, out, "--checkpoint-every-steps", "3"))
    second = rt.read(trace)[len(first):]
    replayed = [x for x in second if x["kind"] == "train"][:2]
    assert [x["labels"] for x in replayed] == [x["labels"] for x in killed[6:8]], "steps 7-8 replayed identically"
    lost = [id(x) for x in killed[6:8]]
    kept = [x for x in first if id(x) not in lost] + second
    rt.assert_each_sample_once_per_epoch(kept, train=_sets(indexed)[0], epochs=EPOCHS, batch=BATCH)


def test_ranks_make_the_same_collective_calls_when_only_one_saw_the_sigterm(tmp_path):
    """A SIGTERM that reached one rank only (docker stop signals PID 1; spot hosts get theirs at different
    moments), at a step where a periodic save is due (here deferred from the epoch's last batch): both ranks
    call the agreement and the save in the same order, so neither waits in a collective the other never
    enters (before, the signalled rank skipped the periodic save that its peer made: a deadlock)."""
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from model.checkpoint import SpotSafeCheckpoint

    class Trainer:
        num_training_batches, global_step, max_steps = 4, 0, -1

    def calls(signalled: bool) -> list[str]:
        cb, trainer, log = SpotSafeCheckpoint(tmp_path, every_steps=4), Trainer(), []
        cb._agree_to_stop = lambda t: log.append("agree") or True  # the all-reduce: the peer saw a SIGTERM
        cb.save = lambda t: log.append("save")
        cb._stop_requested = signalled
        for batch_idx, step in ((3, 4), (0, 5)):  # step 4 ends the epoch: its save waits; SIGTERM in validation
            trainer.global_step = step
            try:
                cb.on_train_batch_end(trainer, None, None, None, batch_idx)
            except SIGTERMException:
                break
        return log

    assert calls(signalled=True) == calls(signalled=False) == ["agree", "save"]


def test_save_killed_mid_write_keeps_the_previous_checkpoint(tmp_path):
    """A save killed mid-write leaves the previous last.ckpt whole; its temp file is removed on the next
    start, but a temp file of a live writer is left alone."""
    ckdir = tmp_path / "ck"
    script = f"""
import sys, time, torch
sys.path.insert(0, {str(ROOT)!r})
from model.checkpoint import SpotSafeCheckpoint
class T:
    global_step = current_epoch = 1
    is_global_zero = True
    def __init__(self, slow): self.slow = slow
    def save_checkpoint(self, path, weights_only=None):
        if not self.slow:
            torch.save({{"global_step": 1, "w": torch.arange(10)}}, path); return
        with open(path, "wb") as f:
            f.write(b"PARTIAL" * 1000); f.flush()
            print("writing", flush=True); time.sleep(60)
cb = SpotSafeCheckpoint({str(ckdir)!r})
cb.save(T(False))
cb.save(T(True))
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    p.kill()
    p.wait()
    import torch

    from model.resume import plan_resume

    assert torch.load(ckdir / "last.ckpt", weights_only=False)["global_step"] == 1
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    (ckdir / f".last.ckpt.tmp-{live.pid}").write_bytes(b"in progress")
    try:
        assert len(list(ckdir.glob(".last.ckpt.tmp-*"))) == 2
        plan_resume("auto", ckdir, {}, {})
        assert [p.name for p in ckdir.glob(".last.ckpt.tmp-*")] == [f".last.ckpt.tmp-{live.pid}"]
    finally:
        live.kill()


def test_failed_save_keeps_the_previous_checkpoint_and_no_temp_file(photo_root, tmp_path, cache_dir, monkeypatch):
    import torch

    from model.checkpoint import CheckpointSaveError

    calls = {"n": 0}
    real = torch.save

    def full_disk(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] >= 2:
            raise OSError(28, "No space left on device")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "o"
    with pytest.raises(CheckpointSaveError, match="No space left on device.*previous checkpoint is kept"):
        train.main(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "2",
                    "--batch-size", "8", "--num-threads", "1", "--output", str(out), "--checkpoint-every-steps", "2"])
    ck = out / "checkpoints"
    assert (ck / "last.ckpt").is_file() and not list(ck.glob(".*tmp-*"))
    assert json.loads((ck / "last.json").read_text())["global_step"] == 2


def test_final_checkpoint_failure_still_exports_the_model_and_fails(photo_root, tmp_path, cache_dir, monkeypatch):
    """A real full disk (tmpfs) with room for the model but not for the final checkpoint: torch.save fails
    without naming the cause, the error says the disk is full; the model is still exported, whole."""
    from helpers import fill, small_disk

    from dali_pipe.workdir import OutputError
    from model.checkpoint import SpotSafeCheckpoint
    from model.loading import load_trained

    real = SpotSafeCheckpoint.on_train_end

    def full_at_the_end(self, trainer, pl_module):
        fill(disk, leave=2 << 20)  # the exported model (1 MB) fits, the checkpoint (3 MB) does not
        return real(self, trainer, pl_module)

    monkeypatch.setattr(SpotSafeCheckpoint, "on_train_end", full_at_the_end)
    with small_disk(tmp_path / "disk", "16m") as disk:
        out = disk / "o"
        with pytest.raises(OutputError, match=r"training finished, but could not write a checkpoint to .* \(No space "
                                              r"left on device\); no earlier checkpoint exists"):
            train.main(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "1",
                        "--batch-size", "8", "--num-threads", "1", "--output", str(out)])
        assert load_trained(str(out)).config.num_labels == 4
        assert not list((out / "checkpoints").glob(".*tmp-*")) and not (out / "checkpoints" / "last.ckpt").exists()


def test_reused_output_never_returns_a_model_of_other_data(photo_root, indexed, tmp_path, cache_dir, capsys):
    """Same OUT, other data: stop before training naming what differs; --resume never moves the old
    checkpoint aside and trains; a finished run rerun with the same settings has nothing to do."""
    from dali_pipe.errors import RunMismatchError

    out = tmp_path / "out"
    args = ["--model", "tiny", "--device", "cpu", "--epochs", "1", "--batch-size", "8", "--num-threads", "1",
            "--output", str(out)]
    train.main(["--data", str(photo_root), *args])
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert train.main(["--data", str(photo_root), *args]) == {"nothing_to_do": True, "global_step": 5}
    assert "nothing to do: already trained to 5 steps" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(RunMismatchError) as e:
        train.main(["--data", str(indexed), *args])
    msg = str(e.value)
    assert "belongs to another run" in msg
    assert "the classes: 4 classes (astronaut, chelsea, coffee, rocket) in the checkpoint, 48 classes (s000" in msg
    assert "--output" in msg and "--resume never" in msg
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    res = train.main(["--data", str(indexed), *args, "--resume", "never"])
    assert res["global_step"] == 41 // 8
    assert len(list((out / "checkpoints").glob("last-*.ckpt"))) == 1
    assert json.loads((out / "config.json").read_text())["id2label"]["0"] == "s000"


def test_checkpoint_without_fingerprint_resumes_and_says_the_order_restarts(photo_root, tmp_path, cache_dir, capsys):
    import torch

    out = tmp_path / "out"
    args = ["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--batch-size", "8", "--num-threads", "1",
            "--output", str(out), "--max-steps", "3"]
    train.main(args)
    from model.selection import RULE_BEFORE_VAL  # validation data, but --max-steps 3 stopped before validating

    assert json.loads((out / "metrics.json").read_text())["selected"] == {"epoch": 1, "global_step": 3,
                                                                          "rule": RULE_BEFORE_VAL}
    ck = out / "checkpoints" / "last.ckpt"
    old = torch.load(ck, weights_only=False)
    for key in ("dali_pipe", "DaliDataModule"):
        old.pop(key, None)
    torch.save(old, ck)
    (out / "checkpoints" / "last.json").unlink()
    res = train.main(args[:-1] + ["6"])
    text = capsys.readouterr().out
    assert res["global_step"] == 6 and "without a run fingerprint or loader position: the data order restarts" in text


def test_second_run_on_the_same_output_stops_naming_the_holder(photo_root, tmp_path):
    from helpers import hold_lock

    from dali_pipe.workdir import BusyError

    out = tmp_path / "out"
    holder = hold_lock(out, "training run")
    try:
        with pytest.raises(BusyError, match=rf"in use by another training run \(PID {holder.pid}\); wait for it"):
            train.main(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--output", str(out)])
    finally:
        holder.kill()


def test_second_run_on_the_same_checkpoint_dir_stops_naming_the_holder_and_lets_go_of_its_output(photo_root,
                                                                                                 tmp_path):
    """Two runs with their own --output and one --checkpoint-dir (outside both): the second stops at once naming
    the first, and holds neither folder after (before: both exited 0, one's checkpoints written over)."""
    from helpers import hold_lock

    from dali_pipe.workdir import BusyError, lock, unlock

    ckpt = tmp_path / "shared-ckpt"
    holder = hold_lock(ckpt, "training run (its --checkpoint-dir)")
    try:
        with pytest.raises(BusyError, match=rf"{ckpt} is in use by another training run \(its --checkpoint-dir\) "
                                            rf"\(PID {holder.pid}\); wait for it to finish, or pass another "
                                            "--checkpoint-dir"):
            train.main(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--output",
                        str(tmp_path / "out2"), "--checkpoint-dir", str(ckpt)])
    finally:
        holder.kill()
    lock(tmp_path / "out2", "test", "")  # OUT was let go when the checkpoint dir was refused
    unlock(tmp_path / "out2")


def test_a_run_holds_its_default_checkpoint_dir_inside_out_too(tmp_path, cache_dir):
    """OUT/checkpoints (the default) is held on its own as well as OUT: a run whose --checkpoint-dir names another
    run's OUT/checkpoints finds it held (it exited 0 and wrote its last.ckpt there)."""
    import fcntl
    import os

    from dali_pipe.cli.finished import hold_out, release
    from dali_pipe.workdir import lock_path

    out = tmp_path / "A"
    hold_out(out, out / "checkpoints")
    try:
        for held in (out, out / "checkpoints"):
            fd = os.open(lock_path(held), os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
    finally:
        release(out, out / "checkpoints")
    assert not lock_path(out / "checkpoints").exists() and not lock_path(out).exists()


def test_unusable_outputs_get_one_clear_error(photo_root, tmp_path, monkeypatch):
    from dali_pipe.cli import fit
    from dali_pipe.workdir import OutputError

    args = ["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--num-threads", "1"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(OutputError, match=r"--output .*afile is a file, not a directory"):
        train.main(args + ["--output", str(afile)])
    with pytest.raises(OutputError, match=r"--checkpoint-dir /proc/1/nope is not writable"):
        train.main(args + ["--output", str(tmp_path / "o"), "--checkpoint-dir", "/proc/1/nope"])
    monkeypatch.setattr(fit, "bytes_needed", lambda params: 1 << 62)
    with pytest.raises(OutputError, match=re.escape("GiB free but the run writes about")):
        train.main(args + ["--output", str(tmp_path / "o2")])
    assert not list((tmp_path / "o2").glob("*.safetensors"))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_named_with_the_ways_out(trained, photo_root, tmp_path, cache_dir, damage):
    """last.ckpt truncated (the sidecar no longer describes it) or one byte flipped (it still does):
    resuming or exporting from it stops before Lightning with one error naming the file and
    --resume never, never a traceback; --resume never moves the damaged file aside."""
    from model.resume import CheckpointDamagedError, plan_resume

    out = tmp_path / "out"
    copy_trained(trained, out)
    ck = out / "checkpoints" / "last.ckpt"
    data = bytearray(ck.read_bytes())
    if damage == "truncate":
        ck.write_bytes(data[: len(data) * 2 // 3])
    else:
        data[len(data) // 2] ^= 0xFF
        ck.write_bytes(data)
    (out / "metrics.json").unlink()  # the run is finished but OUT is not: the model must come from last.ckpt
    argv = ["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "4", "--batch-size", "8",
            "--num-threads", "1", "--val-fraction", "0.25", "--lr", "2e-3", "--output", str(out)]
    for extra in ([], ["--epochs", "5"]):  # export from it, or resume it
        with pytest.raises(CheckpointDamagedError, match=rf"{ck} is damaged \(.*\); it cannot be resumed or exported "
                                                         r"from. Pass --resume never to start over"):
            train.main(argv + extra)
    plan = plan_resume("never", out / "checkpoints", {}, {})
    assert "the previous checkpoint is kept as" in plan.note and not ck.exists()


def test_the_sigterm_agreement_waits_as_long_as_the_trainers_collectives(tmp_path):
    """The ranks' SIGTERM all-reduce runs on a gloo side group with the Trainer's collective timeout
    (--dist-timeout), not gloo's default of 30 minutes: a lost peer ends it as it ends DDP's own."""
    code = """
import datetime, os, types
import torch, torch.distributed as dist
from model.checkpoint import SpotSafeCheckpoint
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
trainer = types.SimpleNamespace(world_size=2, strategy=types.SimpleNamespace(
    checkpoint_io=object(), _timeout=datetime.timedelta(seconds=42)))
cb = SpotSafeCheckpoint(os.environ["CKDIR"])
cb.setup(trainer, None, "fit")
print(cb._group._get_backend(torch.device("cpu")).options._timeout.total_seconds(), flush=True)
os._exit(0)  # the answer is printed: no interpreter teardown of torch and Lightning (3 s)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CKDIR": str(tmp_path)}, cwd=Path(__file__).parent.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == "42.0", r.stdout


def test_an_output_on_another_disk_without_room_for_the_model_stops_before_training(photo_root, tmp_path, cache_dir):
    """--output on a disk of its own (--checkpoint-dir elsewhere) too small for the model: one error before
    training, naming --output and both sizes (before, the run trained to its end, then failed to export)."""
    from helpers import small_disk

    from dali_pipe.workdir import OutputError

    with small_disk(tmp_path / "disk", "256k") as disk:
        with pytest.raises(OutputError, match=r"--output .*disk/out has \d+\.\d KiB free but the run writes about "
                                              r"\d+\.\d MiB there \(the model\)"):
            train.main(["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--num-threads", "1",
                        "--epochs", "1", "--output", str(disk / "out"), "--checkpoint-dir", str(tmp_path / "ck"),
                        "--cache-dir", str(cache_dir)])
        assert not (tmp_path / "ck" / "last.ckpt").exists()


def test_a_resume_with_another_grad_accum_is_refused_naming_it():
    """--grad-accum is part of the run (the batch per optimizer step, the steps per epoch): a checkpoint of
    another value is refused naming the flag; one written before the fingerprint held it is still resumed."""
    from model.resume import differences

    assert differences({"grad_accum": 2}, {"grad_accum": 1}) == ["--grad-accum: 2 in the checkpoint, 1 now"]
    assert differences({}, {"grad_accum": 1}) == []


def _trained_argv(photo_root, out, *extra):
    """The `trained` fixture's command."""
    return ["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "4", "--batch-size", "8",
            "--num-threads", "1", "--val-fraction", "0.25", "--lr", "2e-3", "--output", str(out), *extra]


def test_a_finished_run_rerun_with_another_recipe_stops_naming_each_setting(trained, photo_root, tmp_path, cache_dir):
    """The finished run rerun into its OUT with --lr 5e-2 --mixup-alpha 0.8 --auto-augment rand (before: "nothing
    to do", the old weights kept) stops before training, naming each setting with both values and the two ways
    out, OUT untouched; its model copied to another OUT, with another checkpoint dir, is refused the same way
    from its metrics.json."""
    from dali_pipe.errors import RunMismatchError

    out = tmp_path / "out"
    copy_trained(trained, out)
    weights = (out / "model.safetensors").read_bytes()
    recipe = ["--lr", "5e-2", "--mixup-alpha", "0.8", "--auto-augment", "rand"]
    with pytest.raises(RunMismatchError) as e:
        train.main(_trained_argv(photo_root, out, *recipe))
    assert str(e.value).splitlines() == [
        f"{out / 'checkpoints' / 'last.ckpt'} belongs to another run:", "  --auto-augment: 'none' in the checkpoint, "
        "'rand' now", "  --lr: 0.002 in the checkpoint, 0.05 now", "  --mixup-alpha: 0.0 in the checkpoint, 0.8 now",
        "  Use a new --output for this run, or --resume never to start over here (the old checkpoint is moved aside, "
        "not deleted)."]
    assert (out / "model.safetensors").read_bytes() == weights
    other = tmp_path / "other"
    copy_trained(trained, other, model_only=True)
    with pytest.raises(RunMismatchError, match=r"other holds the model of another run \(its metrics.json says so\):\n"
                                               r"  --lr: 0.002 in its model, 0.05 now\n  Use a new --output"):
        train.main(_trained_argv(photo_root, other, "--lr", "5e-2", "--checkpoint-dir", str(tmp_path / "ck")))
    assert not (tmp_path / "ck" / "last.ckpt").exists()


def test_a_checkpoint_from_before_the_recipe_counted_resumes_with_a_note(tmp_path):
    """A checkpoint whose fingerprint predates the recipe (data, model, batch size, seed, grad-accum only) is
    still this run's; the plan says which settings could not be checked against it."""
    import torch

    from model.resume import plan_resume

    old = {"samples": "abc", "classes": ["a", "b"], "model": "tiny", "image_size": [64, 64], "batch_size": 8,
           "world_size": 1, "seed": 0, "grad_accum": 1}
    torch.save({"w": torch.zeros(1)}, tmp_path / "last.ckpt")
    size = (tmp_path / "last.ckpt").stat().st_size
    (tmp_path / "last.json").write_text(json.dumps({"fingerprint": old, "targets": {"epochs": 2, "max_steps": -1},
                                                    "finished": False, "global_step": 3, "run": "r1", "size": size}))
    plan = plan_resume("auto", tmp_path, {**old, "lr": 1e-3, "mixup_alpha": 0.0}, {"epochs": 2, "max_steps": -1},
                       steps=10)
    assert plan.ckpt_path == str(tmp_path / "last.ckpt") and plan.run_id == "r1"
    assert plan.caveat == (f"note: {tmp_path / 'last.ckpt'} was written by an older version, before the recipe "
                           "counted toward a run's identity: --lr, --mixup-alpha could not be checked against it")
