"""--select best: keep the weights of the epoch with the best validation accuracy.

After each validation (not the sanity check), when `val_acc` is at least the best so far (ties go
to the later epoch; an epoch whose val_acc or val_loss is not finite never is best: its weights
diverged), rank 0 writes the model in save_pretrained form to CHECKPOINT_DIR/best (a
temporary folder renamed into place), with `best.json` inside, written last: the epoch, its
accuracy, the step, the run and the size and sha256 of every file (checked before it is exported). The best epoch and accuracy are also part of the Lightning
checkpoint (this callback's state), so a resumed run keeps comparing against them, and the folder
lives beside last.ckpt (under SageMaker, /opt/ml/checkpoints, synced to S3).

A failed save (a full disk) stops the run with one message and keeps the previous best folder and
the last checkpoint; the rerun resumes. A kill between the two renames of a save leaves no `best`
but the previous (`.best.old-PID`) and the new (`.best.tmp-PID`) folders: `recover` puts one back.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytorch_lightning as pl

from dali_pipe.errors import UserError
from dali_pipe.workdir import fix_for, move, pid_alive, remove, remove_dead_temps, write_failure

from .files import damaged_files, file_record
from .loading import ModelLoadError, load_checked

RULE_BEST = "the best validation accuracy (ties: the later epoch)"
RULE_LAST = "the last epoch"
RULE_NO_VAL = "the last epoch (no validation data, so no best one)"
RULE_BEFORE_VAL = "the last weights: training stopped before the first validation (--max-steps), so no epoch was " \
                  "validated"
RECORD = "best.json"


class BestSaveError(UserError):
    """The best model could not be written; the previous one and the last checkpoint are kept."""


class BestModelError(UserError):
    """The saved best model is missing or damaged; the message gives the ways out."""


class BestModel(pl.Callback):
    def __init__(self, checkpoint_dir: Path | str, run_id: str | None = None):
        self.dir = Path(checkpoint_dir) / "best"
        self.run_id = run_id
        self.best: dict | None = None  # {"epoch": 1-based, "val_acc": float, "global_step": int}

    @property
    def state_key(self) -> str:
        return "BestModel"

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state.get("best")

    def on_validation_end(self, trainer, pl_module) -> None:
        acc, loss = trainer.callback_metrics.get("val_acc"), trainer.callback_metrics.get("val_loss")
        if trainer.sanity_checking or acc is None:
            return
        acc = float(acc)
        if not math.isfinite(acc) or (loss is not None and not math.isfinite(float(loss))):
            return  # a model whose outputs are NaN: its "accuracy" is the argmax of NaN, never the best
        if self.best is not None and acc < self.best["val_acc"]:
            return
        best = {"epoch": trainer.current_epoch + 1, "val_acc": acc, "global_step": trainer.global_step}
        if trainer.is_global_zero:
            self._save(pl_module.model, best)
        self.best = best

    def _save(self, model, best: dict) -> None:
        tmp = self.dir.with_name(f".best.tmp-{os.getpid()}")
        old = self.dir.with_name(f".best.old-{os.getpid()}")
        root = self.dir.parent  # the checkpoint dir: what this run owns
        try:
            remove(tmp, root, quiet=True)
            model.save_pretrained(tmp)
            files = file_record(tmp)
            (tmp / RECORD).write_text(json.dumps({**best, "run": self.run_id, "files": files}))  # last: it is whole
        except Exception as e:  # OSError, safetensors' SafetensorError: a full disk
            reason = write_failure(e, tmp.parent)
            remove(tmp, root, quiet=True)
            fix = fix_for(reason, root)
            kept = [what for what, path in (("the previous best model", self.dir),
                                            ("the last checkpoint", self.dir.with_name("last.ckpt"))) if path.exists()]
            raise BestSaveError(
                f"could not save the best model (epoch {best['epoch']}, val_acc {best['val_acc']:.4f}) to {self.dir} "
                f"({reason}); " + (f"{' and '.join(kept)} {'is' if len(kept) == 1 else 'are'} kept" if kept else
                                   "no checkpoint was saved before it (--checkpoint-every-steps saves within epochs)")
                + f". {fix[0].upper()}{fix[1:]} (or pass another --checkpoint-dir) and rerun the same command"
                + (" to resume." if "the last checkpoint" in kept else ".")) from None
        if self.dir.exists():
            move(self.dir, old, root)
        move(tmp, self.dir, root)
        remove(old, root, quiet=True)

    def choice(self, select: str, last: dict) -> tuple[Path | None, dict]:
        """(folder holding the selected weights, or None for the in-memory last ones; the record for
        metrics.json: which weights, as {"epoch", "global_step", "rule"}, with "val_acc" for the best).
        `last` is where the last weights are ({"epoch": 1-based, "global_step"}). With --select best the
        folder must hold this run's best model, whole: else BestModelError with the ways out."""
        if select != "best" or self.best is None:
            rule = RULE_LAST if select == "last" else RULE_NO_VAL if select == "none" else RULE_BEFORE_VAL
            return None, {**last, "rule": rule}

        way_out = ("pass --select last to export the last epoch instead, or --resume never to train again "
                   "(the checkpoint is moved aside)")
        if not self.dir.is_dir():
            raise BestModelError(f"the best model (epoch {self.best['epoch']}) should be in {self.dir}, which is "
                                 f"missing; {way_out}.")
        try:
            saved = json.loads((self.dir / RECORD).read_text())
        except FileNotFoundError:
            saved = dict(self.best)  # written by an older version, without its record
        except (OSError, ValueError):
            raise BestModelError(f"{self.dir / RECORD} is damaged; {way_out}.") from None
        if self.run_id is not None and saved.get("run") not in (None, self.run_id):
            raise BestModelError(f"{self.dir} holds the best model of another run; {way_out}.")
        damaged = damaged_files(self.dir, saved)
        if damaged:
            raise BestModelError(f"the best model cannot be used: {'; '.join(damaged)}; {way_out}.")
        try:
            load_checked(str(self.dir), f"the best model in {self.dir}")
        except ModelLoadError as e:
            raise BestModelError(f"the best model in {self.dir} cannot be used: {e.reason}; {way_out}.") from None
        if (saved["epoch"], saved["val_acc"]) != (self.best["epoch"], self.best["val_acc"]):
            # saved before a kill, then the run resumed from an earlier checkpoint: the weights are what
            # the folder says they are, and metrics.json says so
            print(f"note: the best model on disk is epoch {saved['epoch']} (val_acc {saved['val_acc']:.4f}), saved "
                  f"before the run resumed from an earlier checkpoint", file=sys.stderr)
        return self.dir, {"epoch": saved["epoch"], "global_step": saved.get("global_step"),
                          "val_acc": saved["val_acc"], "rule": RULE_BEST}


def recover(checkpoint_dir: Path | str) -> None:
    """Put a best folder back after a kill between the two renames of a save (the previous one,
    which the last checkpoint describes, else the new one when whole), then remove what dead
    writers left."""
    root = Path(checkpoint_dir)
    best = root / "best"
    if not best.exists():
        def dead(p: Path) -> bool:
            pid = p.name.rsplit("-", 1)[-1]
            return pid.isdigit() and (int(pid) == os.getpid() or not pid_alive(int(pid)))

        candidates = [p for p in sorted(root.glob(".best.old-*")) if dead(p)]
        candidates += [p for p in sorted(root.glob(".best.tmp-*")) if dead(p) and (p / RECORD).is_file()]
        if candidates:
            move(candidates[0], best, root)
    for pattern in (".best.tmp-*", ".best.old-*"):
        remove_dead_temps(root, pattern, include_own=True)
