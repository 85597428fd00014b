"""Training progress: plain lines for logs (SageMaker, CI, pipes), where a bar is unreadable, and a bar
on a terminal; both count epochs as the METRIC lines do (epoch 1 of N is the first).

`PlainProgressBar` is a Lightning `ProgressBar` (so the Trainer uses it instead of a bar) that prints a
line at most every `every_s` seconds and at each quarter of an epoch:

    progress: epoch 2/5 step 120/400 (30%), loss 0.8123, lr 4.20e-04, 512.3 images/s, data-wait 3%, ETA 0:02:10

`TerminalProgressBar` is Lightning's tqdm bar, with its epochs counted from 1 ("Epoch 1/2", where
Lightning says "Epoch 0") and the lines printed through it (`trainer.progress_bar_callback.print`, as
`LightningModule.print` does) written whole. Lightning's default bar on a terminal is Rich's when rich
is installed: it wraps printed lines at the terminal's width, so a METRIC line became two lines and a
log scraper (SageMaker's metric regex; its local mode and `docker run -t` run under a terminal) found
nothing. tqdm writes a line whole, above the bar.

Why not Lightning's `ThroughputMonitor`: it synchronises the GPU on every step to time it. And
lightning_fabric's `Throughput` reports nothing until its window fills. The rate here is images
over the wall time since the previous line, which needs no sync; the loss is read (one sync) only
when a line is printed.
"""
from __future__ import annotations

import datetime
import time

from pytorch_lightning.callbacks import ProgressBar, TQDMProgressBar


class PlainProgressBar(ProgressBar):
    def __init__(self, every_s: float = 30.0):
        super().__init__()
        self.every_s = every_s
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer, pl_module):
        self._batches_done = 0  # batches since this (re)start, for the ETA
        self._t_start = time.perf_counter()
        self.on_train_epoch_start(trainer, pl_module)  # a run resumed mid-epoch gets no epoch-start hook

    def on_train_epoch_start(self, trainer, pl_module):
        now = time.perf_counter()
        self._last, self._images, self._wait, self._t_end = now, 0, 0.0, None
        self._marks = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._t_end is not None:
            self._wait += now - self._t_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._t_end = now = time.perf_counter()
        self._batches_done += 1
        self._images += len(batch[1]) * trainer.world_size
        if not (self._enabled and trainer.is_global_zero):
            return
        done, total = batch_idx + 1, self.total_train_batches
        quarter = int(4 * done // total) if total else 0
        if now - self._last < self.every_s and (quarter in self._marks or quarter == 0):
            return
        self._marks.add(quarter)
        span = max(now - self._last, 1e-9)
        parts = [f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} step {done}/{total} ({done / total:.0%})"]
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            parts.append(f"loss {float(loss):.4f}")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}")
        parts.append(f"{self._images / span:.1f} images/s")
        parts.append(f"data-wait {min(1.0, self._wait / span):.0%}")
        eta = self._eta(trainer, done, total)
        if eta is not None:
            parts.append(f"ETA {eta}")
        print("progress: " + ", ".join(parts), flush=True)
        self._last, self._images, self._wait = now, 0, 0.0

    def _eta(self, trainer, done: int, total) -> str | None:
        """Remaining training batches at the average pace since this (re)start (validation not counted)."""
        if not total or total == float("inf") or not self._batches_done:
            return None
        remaining = total - done + total * max(0, trainer.max_epochs - trainer.current_epoch - 1)
        if trainer.max_steps and trainer.max_steps > 0:
            steps_left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            remaining = min(remaining, max(0, steps_left))
        per_batch = (time.perf_counter() - self._t_start) / self._batches_done
        return str(datetime.timedelta(seconds=round(remaining * per_batch)))


class TerminalProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar counting epochs as METRIC does (see the module's documentation)."""

    def on_train_epoch_start(self, trainer, *_):  # Lightning's, with the description it draws first replaced
        total = self.total_train_batches
        self.train_progress_bar.reset(total=None if total == float("inf") else total)
        self.train_progress_bar.initial = 0
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch + 1}/{trainer.max_epochs}")
