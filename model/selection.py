"""--select best: keep the weights of the epoch with the best validation accuracy.

After each validation (not the sanity check), when `val_acc` is at least the best so far (ties go
to the later epoch), rank 0 writes the model in save_pretrained form to CHECKPOINT_DIR/best (a
temporary folder renamed into place). The best epoch and accuracy are part of the Lightning
checkpoint (this callback's state), so a resumed run keeps comparing against them, and the folder
lives beside last.ckpt (under SageMaker, /opt/ml/checkpoints, synced to S3).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytorch_lightning as pl

RULE_BEST = "the best validation accuracy (ties: the later epoch)"
RULE_LAST = "the last epoch"
RULE_NO_VAL = "the last epoch (no validation data, so no best one)"


class BestModel(pl.Callback):
    def __init__(self, checkpoint_dir: Path | str):
        self.dir = Path(checkpoint_dir) / "best"
        self.best: dict | None = None  # {"epoch": 1-based, "val_acc": float, "global_step": int}

    @property
    def state_key(self) -> str:
        return "BestModel"

    def state_dict(self) -> dict:
        return {"best": self.best}

    def load_state_dict(self, state: dict) -> None:
        self.best = state.get("best")

    def on_validation_end(self, trainer, pl_module) -> None:
        acc = trainer.callback_metrics.get("val_acc")
        if trainer.sanity_checking or acc is None:
            return
        acc = float(acc)
        if self.best is not None and acc < self.best["val_acc"]:
            return
        self.best = {"epoch": trainer.current_epoch + 1, "val_acc": acc, "global_step": trainer.global_step}
        if trainer.is_global_zero:
            tmp = self.dir.with_name(f".best.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            pl_module.model.save_pretrained(tmp)
            old = self.dir.with_name(f".best.old-{os.getpid()}")
            if self.dir.exists():
                os.replace(self.dir, old)
            os.replace(tmp, self.dir)
            shutil.rmtree(old, ignore_errors=True)

    def choice(self, select: str) -> tuple[Path | None, dict]:
        """(folder holding the selected weights, or None for the in-memory last ones; the record for
        metrics.json)."""
        if select == "best" and self.best is not None and self.dir.is_dir():
            return self.dir, {"epoch": self.best["epoch"], "val_acc": self.best["val_acc"], "rule": RULE_BEST}
        return None, {"rule": RULE_LAST if select == "last" else RULE_NO_VAL}
