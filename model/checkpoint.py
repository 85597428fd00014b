"""Spot-safe checkpoints: atomic `last.ckpt` every N steps, at the end, and on SIGTERM; resume on start.

Each save writes a temporary file in the same directory and renames it over `last.ckpt`, so a
kill at any moment (even -9 mid-write) leaves the previous checkpoint whole. On SIGTERM (spot
reclaim, `docker stop`), Lightning finishes the current step and raises SIGTERMException; this
callback then saves, and train.py exits 0 so the job can be resumed with the same command.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.utilities.exceptions import SIGTERMException

LAST = "last.ckpt"


def resume_path(checkpoint_dir: Path) -> str | None:
    """The checkpoint to resume from, if a previous run left one."""
    last = Path(checkpoint_dir) / LAST
    for stale in Path(checkpoint_dir).glob(f".{LAST}.tmp-*"):  # a save killed mid-write
        stale.unlink(missing_ok=True)
    if last.is_file():
        print(f"resuming from {last}")
        return str(last)
    return None


class SpotSafeCheckpoint(pl.Callback):
    def __init__(self, checkpoint_dir: Path, every_steps: int = 0):
        self.dir = Path(checkpoint_dir)
        self.every_steps = every_steps
        self.interrupted = False
        self.saves: list[tuple[int, float, float]] = []  # (global_step, start time, seconds) per save

    def save(self, trainer: pl.Trainer) -> None:
        start = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{LAST}.tmp-{os.getpid()}"
        trainer.save_checkpoint(tmp)  # every rank calls it (it holds a barrier); rank 0 writes
        if trainer.is_global_zero:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / LAST)
        self.saves.append((trainer.global_step, start, time.perf_counter() - start))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self.every_steps and step and step % self.every_steps == 0 and not trainer.received_sigterm:
            self.save(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.save(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            self.save(trainer)
            self.interrupted = True
