"""Plain-text training progress for logs (SageMaker, CI, pipes), where a tqdm bar is unreadable.

Prints a line at most every `every_s` seconds and at each 25% of an epoch: step, share of the
epoch, images/s. It reads no tensor, so it adds no GPU sync.
"""
from __future__ import annotations

import time

import pytorch_lightning as pl


class PlainProgress(pl.Callback):
    def __init__(self, every_s: float = 30.0):
        self.every_s = every_s

    def on_train_epoch_start(self, trainer, pl_module):
        self._t0 = self._last = time.perf_counter()
        self._marks = set()
        self._first = None  # first batch index timed since this start (a resumed epoch starts mid-way)

    on_train_start = on_train_epoch_start  # a run resumed mid-epoch starts without the epoch hook

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not trainer.is_global_zero:
            return
        if self._first is None:
            self._first = batch_idx
        now, done, total = time.perf_counter(), batch_idx + 1, trainer.num_training_batches
        quarter = 4 * done // total if total else 0
        if now - self._last < self.every_s and (quarter in self._marks or quarter == 0):
            return
        self._marks.add(quarter)
        self._last = now
        images = (done - self._first) * len(batch[1]) * trainer.world_size
        print(f"progress: epoch {trainer.current_epoch + 1} step {done}/{total} ({done / total:.0%}), "
              f"{images / (now - self._t0):.1f} images/s", flush=True)
