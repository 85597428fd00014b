"""Spot-safe checkpoints and the decision to resume.

Saving. `last.ckpt` is written every `--checkpoint-every-steps`, at the end, and on SIGTERM,
always to a temporary file in the same directory (its name carries the writer's PID) that is
renamed over `last.ckpt`, so a kill at any moment (even -9 mid-write) leaves the previous
checkpoint whole. A failed save (full disk) removes its temporary file and keeps the previous
checkpoint. A run whose weights are no longer finite (model/module.py's divergence check, made before
every save) stops instead of saving, so the last checkpoint is the last good one. Each checkpoint
carries the run's fingerprint, and a small `last.json` beside it
repeats the fingerprint and progress so a rerun can decide without loading the weights.

SIGTERM (spot reclaim, `docker stop`): the current training step finishes, every rank saves the
same step, and the command exits 0 so the job can be rerun. Ctrl-C (SIGINT) does the same, and the
command exits 130 (the status of a process stopped by Ctrl-C); a second Ctrl-C stops at once (the
default action of SIGINT: no save, the last checkpoint saved is kept, and a kill at any moment leaves
it whole). Outside training (sync, scan, export) both stop at once, cleaning up. A SIGTERM during validation lets the
validation finish (Lightning would stop mid-validation and, on resume, skip the rest of it), so
every epoch's validation runs whole; the save follows the next training step. No checkpoint is taken
at an epoch's last batch (periodic or for a SIGTERM): Lightning would resume it as a finished epoch,
skipping its validation; the save follows the next training step instead. When --max-steps ends
training inside an epoch, the final checkpoint is taken after that step, inside the epoch (at the
end of training Lightning has already counted the epoch as done), so a rerun with a larger
--max-steps or for whole epochs finishes that epoch first.

Resuming: model/resume.py decides what to resume (torch-free, so a rerun is decided before Lightning
loads).

The checkpoint file is written by `DirectCheckpointIO`: straight into the temporary name beside
`last.ckpt`. Lightning's own writer builds the whole checkpoint in memory, writes it to the
system's temporary folder and moves it over: a kill there leaves a checkpoint-sized file in /tmp,
and a full /tmp fails saves although the checkpoint dir has room.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path

import pytorch_lightning as pl
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.utilities.exceptions import SIGTERMException

from dali_pipe.datamodule import CheckedLoad
from dali_pipe.errors import UserError
from dali_pipe.stop import asked, clear
from dali_pipe.workdir import atomic, fix_for, temp_name, write_atomic, write_failure

from .loading import load_config
from .resume import LAST, SIDECAR, CheckpointDamagedError


class CheckpointSaveError(UserError):
    """A checkpoint could not be written; the previous one is kept."""


def model_from(state: dict, name: str, classes: list[str]):
    """The classifier whose weights a loaded checkpoint holds (its `model.` entries), built from
    --model's config with the head sized to `classes`."""
    from transformers import AutoModelForImageClassification

    model = AutoModelForImageClassification.from_config(load_config(name, classes))
    weights = {k[len("model."):]: v for k, v in state.get("state_dict", {}).items() if k.startswith("model.")}
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        raise CheckpointDamagedError(f"the checkpoint does not hold the weights of --model {name} "
                                     f"({str(e).splitlines()[0][:200]}); pass --resume never to train again") from None
    return model


def _save(torch, checkpoint: dict, path: Path) -> None:
    """torch.save into `path`, on the disk when it returns (fsync)."""
    with open(path, "wb") as f:
        torch.save(checkpoint, f)
        f.flush()
        os.fsync(f.fileno())


class DirectCheckpointIO(TorchCheckpointIO):
    """torch.save beside the target: a hidden name (SpotSafeCheckpoint's temporary name) is written as
    it is; any other (a ModelCheckpoint's) through `.NAME.tmp-PID` in the same folder, renamed when whole."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        import torch

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.name.startswith("."):  # already a temporary name: the caller lands it
            _save(torch, checkpoint, path)
        else:
            with atomic(path) as tmp:
                _save(torch, checkpoint, tmp)


def between_epochs(checkpoint: dict) -> None:
    """Make the final checkpoint, taken at the end of training after its last epoch finished, resume at the
    start of the next epoch (a rerun with more --epochs or --max-steps). As Lightning 2.6 saves it there,
    the finished epoch's batch counters (`current`) stay at its end, and a resume reads them as the next
    epoch's batches, all done: that epoch would run empty (no step, an empty METRIC row) and the data
    would train in the one after it. Set back to zero, as Lightning itself sets them when an epoch
    starts; the totals stay."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})

    def zero(progress: dict | None, part: str = "current") -> None:
        if isinstance(progress, dict) and isinstance(progress.get(part), dict):
            progress[part] = {k: 0 for k in progress[part]}

    zero(loop.get("epoch_loop.batch_progress"))
    if "epoch_loop.batch_progress" in loop:
        loop["epoch_loop.batch_progress"]["is_last_batch"] = False
    zero(loop.get("epoch_loop.scheduler_progress"))
    for progress in loop.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {}).values():
        zero(progress)
    zero(loop.get("epoch_loop.val_loop.batch_progress"), "total")  # counts validations within an epoch


# -- the callback -------------------------------------------------------------------------------
STOP_CODES = {"SIGTERM": 1, "SIGINT": 2}  # the ranks agree on the largest: Ctrl-C anywhere stops as Ctrl-C
STOP_NAMES = {v: k for k, v in STOP_CODES.items()}
EXIT_STATUS = {1: 0, 2: 130}  # SIGTERM: 0, so that the job is rerun; Ctrl-C: 130, as any program stopped by it


class SpotSafeCheckpoint(pl.Callback):
    SAVES_FINAL = True  # this callback writes the final checkpoint (a subclass may leave it to a ModelCheckpoint)

    def __init__(self, checkpoint_dir: Path, every_steps: int = 0, *, fingerprint: dict | None = None,
                 targets: dict | None = None, run_id: str | None = None, image_source: str | None = None):
        self.dir = Path(checkpoint_dir)
        self.run_id = run_id or uuid.uuid4().hex[:16]  # kept across resumes; the export records it
        self.every_steps = every_steps
        self.fingerprint, self.targets = fingerprint or {}, targets or {}
        self.image_source = image_source  # what the fingerprint's image size was computed from (loading.image_source)
        self.interrupted = False
        self.stopped_by: str | None = None  # "SIGTERM" or "SIGINT": what stopped the run (every rank agrees)
        self.saves: list[tuple[int, float, float]] = []  # (global_step, start time, seconds) per save
        self._finishing = False
        self.final_error: CheckpointSaveError | None = None  # the end-of-training save failed (reported after export)
        self._stop_requested = 0  # STOP_CODES: the signal this rank received (0: none)
        self._installed = False
        self._fitting = False  # between setup and the end of training: Ctrl-C saves first
        self._previous_sigint = None
        self._due = False  # a periodic save is due (deferred from an epoch's last batch)
        self._pending_stop = False  # saved for a stop: fit ends at the next batch's start
        self._saved_final = False  # the final checkpoint was taken inside an epoch (--max-steps)
        self._after_epoch = False  # the save being made follows a finished epoch (the end of training)
        self._seen_step = 0  # the global step at the last batch end seen
        self._group = None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint["dali_pipe"] = self._meta(trainer)
        if self._after_epoch:
            between_epochs(checkpoint)

    def _meta(self, trainer) -> dict:
        return {"fingerprint": self.fingerprint, "targets": self.targets, "finished": self._finishing,
                "global_step": trainer.global_step, "epoch": trainer.current_epoch, "run": self.run_id,
                "image_source": self.image_source}

    def save(self, trainer: pl.Trainer) -> None:
        check = getattr(getattr(trainer, "lightning_module", None), "check_finite", None)  # ImageClassifier's
        if callable(check):
            check(weights=True)  # weights that are no longer finite never replace the last good checkpoint
        start = time.perf_counter()
        tmp = temp_name(self.dir / LAST)
        if self.saves and trainer.is_global_zero and not self.dir.is_dir():
            print(f"checkpoint: {self.dir} is gone (removed while the run trained, with the checkpoints saved "
                  "before); saving there again", file=sys.stderr, flush=True)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(tmp, weights_only=False)  # every rank calls it (a barrier); rank 0 writes
            if trainer.is_global_zero:
                with atomic(self.dir / LAST, tmp):  # written by Lightning's save above (rank 0's)
                    with open(tmp, "rb") as f:
                        os.fsync(f.fileno())
                meta = {**self._meta(trainer), "size": (self.dir / LAST).stat().st_size}
                write_atomic(self.dir / SIDECAR, json.dumps(meta))
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            reason = write_failure(e, self.dir)
            tmp.unlink(missing_ok=True)
            kept = "the previous checkpoint is kept" if (self.dir / LAST).is_file() else "no earlier checkpoint exists"
            fix = fix_for(reason, self.dir)
            raise CheckpointSaveError(f"could not write a checkpoint to {self.dir} ({reason}); {kept}. "
                                      f"{fix[0].upper()}{fix[1:]}, or pass another --checkpoint-dir.") from None
        self.saves.append((trainer.global_step, start, time.perf_counter() - start))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._seen_step:  # inside a gradient accumulation: no optimizer step ended here
            return
        self._seen_step = step
        if self.every_steps and step % self.every_steps == 0:
            self._due = True
        if batch_idx + 1 >= trainer.num_training_batches:
            # the epoch's last batch: its validation and end-of-epoch hooks are still to come, and Lightning
            # resumes a checkpoint taken here as a finished epoch (no validation, no METRIC row, its sums
            # carried into the next epoch). The save (periodic, or for a SIGTERM) follows the next step.
            return
        # Agree first, then save: every rank must make the same collective calls in the same order, so no
        # rank may skip or add a save on its own flag (a rank that saw the SIGTERM skipping the periodic save
        # its peers make would leave them in the save's barrier and itself in the all-reduce: a deadlock).
        stop = self._agree_to_stop(trainer)
        final = self.SAVES_FINAL and 0 < trainer.max_steps <= step  # --max-steps ends training inside this epoch
        if final:
            # the final checkpoint is taken here, inside the epoch: saved in on_train_end, after Lightning has
            # counted the unfinished epoch as done, a rerun with more steps would skip the rest of it
            self._finishing = True
        if self._due or stop or final:
            self.save(trainer)  # one save serves them all
            self._due = False
            self._saved_final = final
        if stop:
            self.interrupted, self.stopped_by = True, STOP_NAMES[stop]
            self._fitting = False
            if final:  # no next batch to wait for
                self._stop(trainer)
            # Stop at the next batch's start, not here: Lightning still logs this step's metrics (TensorBoard's
            # curve would miss its point, which the resumed run does not train again) and the other callbacks
            # see its end (progress, monitor); the checkpoint above already holds every rank's state.
            self._pending_stop = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._pending_stop:
            self._stop(trainer)

    def _stop(self, trainer) -> None:
        """End fit after the stop's save: Lightning tears down; the command reports and exits 0 (SIGTERM) or
        130 (Ctrl-C)."""
        self._pending_stop = False
        raise SIGTERMException(EXIT_STATUS[STOP_CODES[self.stopped_by]])

    def on_train_end(self, trainer, pl_module) -> None:
        self._fitting = False
        if self._pending_stop:  # saved for a stop, and training ended before a next batch
            self._stop(trainer)
        if self._saved_final:  # taken inside the epoch at --max-steps (on_train_batch_end)
            return
        self._finishing = self._after_epoch = True
        try:
            self.save(trainer)
        except CheckpointSaveError as e:  # the model export still runs; the command then fails with both
            self.final_error = e
        finally:
            self._after_epoch = False

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._fitting = False
        if isinstance(exception, SIGTERMException) and not self.interrupted:
            self.save(trainer)
            self.interrupted = True
            self.stopped_by = self.stopped_by or "SIGTERM"

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._fitting = False
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) == self._on_sigint and self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)  # as before fit (after an error, ours defers to it)

    # -- SIGTERM: every rank stops after the same step ------------------------------------------
    # Lightning's own handler stops each rank where it sees the signal (mid-validation too) and
    # pairs collectives inside the signal handler, which can hang DDP. Ours only records the signal;
    # after each training step the ranks agree (a MAX all-reduce of the flag on a CPU side group,
    # so the GPU is not synchronised), save together and stop. A SIGTERM during validation lets it
    # finish, and the save follows the next training step.
    def setup(self, trainer, pl_module, stage: str) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, CheckedLoad):  # the DataModule's checks around it (its setup runs first)
            if type(io.inner) is TorchCheckpointIO:
                io.inner = DirectCheckpointIO()
        elif type(io) is TorchCheckpointIO:  # Lightning's default; a user's own is kept
            trainer.strategy.checkpoint_io = DirectCheckpointIO()
        self._group = None
        if stage == "fit":
            self._fitting = True
            self._install_sigint()
        if trainer.world_size > 1:
            import torch.distributed as dist

            # every rank calls it, in the same order; with the Trainer's collective timeout (--dist-timeout in
            # the CLI), not gloo's default of 30 minutes, so a lost peer ends this all-reduce as it ends DDP's
            timeout = getattr(trainer.strategy, "_timeout", None)
            self._group = dist.new_group(backend="gloo", timeout=timeout)

    def _install(self) -> None:
        if not self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)  # replaces Lightning's (registered just before)
            self._installed = True
            taken = asked()  # a stop the CLI's handler noted while the loaders were built: this one's now
            if taken is not None:
                clear()
                (self._on_sigint if taken == signal.SIGINT else self._on_sigterm)(taken, None)

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._install()

    def on_train_start(self, trainer, pl_module) -> None:
        self._seen_step = trainer.global_step  # a resumed run starts at its checkpoint's step
        self._install()

    def _on_sigterm(self, signum, frame) -> None:
        if not self._stop_requested:
            print("SIGTERM received: saving a checkpoint after the current step", file=sys.stderr, flush=True)
        self._stop_requested = max(self._stop_requested, STOP_CODES["SIGTERM"])

    # Ctrl-C: from setup on (Lightning registers no SIGINT handler of its own, and a Ctrl-C while the loaders
    # are built or the sanity check runs must not end in Lightning's "Detected KeyboardInterrupt", exit 1, no
    # save). The first one asks for the same stop as SIGTERM, and gives SIGINT back its default action, so a
    # second one stops the process at once, even inside a long call. Outside training (before setup, after
    # the end of training: the export) the handler that was there before runs (the CLI's: stop, exit 130).
    def _install_sigint(self) -> None:
        current = signal.getsignal(signal.SIGINT)
        if current is signal.SIG_IGN:  # the parent ignores Ctrl-C for us (a job started with & by a script): kept
            return
        if threading.current_thread() is threading.main_thread() and current != self._on_sigint:
            self._previous_sigint = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        if not self._fitting:
            previous = self._previous_sigint
            if callable(previous):  # the CLI's (a flag its commands look at), or Python's own in a user's script
                return previous(signum, frame)
            if previous != signal.SIG_IGN:  # the default action, as the handler before this one would have had it
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            return
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C: the default action, at once
        print("Ctrl-C: saving a checkpoint after the current step, then stopping (exit status 130); press Ctrl-C "
              "again to stop at once without saving (the last checkpoint saved is kept)", file=sys.stderr,
              flush=True)
        self._stop_requested = max(self._stop_requested, STOP_CODES["SIGINT"])

    def _agree_to_stop(self, trainer) -> int:
        """The stop every rank makes at this step: 0 (none), or the STOP_CODES of the signal any rank got."""
        if self._group is None:
            return int(self._stop_requested)
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(self._stop_requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())
