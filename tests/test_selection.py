"""--select best: the best folder is whole and this run's, or refused with the ways out; a kill between
its two renames is repaired on the next run."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from model.selection import RULE_BEFORE_VAL, RULE_BEST, BestModel, BestModelError, recover


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)


def test_a_kill_between_the_two_renames_of_a_best_save_is_repaired(trained, tmp_path):
    """No best/, the previous best as .best.old-PID and the new one as .best.tmp-PID (whole): the previous
    one (which the last checkpoint describes) is put back and the other removed."""
    ck = tmp_path / "ck"
    pid = _dead_pid()
    for name, epoch in ((f".best.old-{pid}", 3), (f".best.tmp-{pid}", 4)):
        shutil.copytree(trained / "checkpoints" / "best", ck / name)
        record = json.loads((ck / name / "best.json").read_text())
        (ck / name / "best.json").write_text(json.dumps({**record, "epoch": epoch}))
    recover(ck)
    assert [p.name for p in ck.iterdir()] == ["best"]
    assert json.loads((ck / "best" / "best.json").read_text())["epoch"] == 3


def test_the_best_model_is_checked_before_it_is_exported(trained, tmp_path):
    """Its record is what metrics.json reports; damaged weights or another run's folder are refused,
    pointing at --select last."""
    ck = tmp_path / "ck"
    shutil.copytree(trained / "checkpoints" / "best", ck / "best")
    record = json.loads((ck / "best" / "best.json").read_text())
    best = BestModel(ck, run_id=record["run"])
    best.best = {k: record[k] for k in ("epoch", "val_acc", "global_step")}
    folder, selected = best.choice("best", {"epoch": 4, "global_step": 16})
    assert folder == ck / "best" and selected == {"epoch": record["epoch"], "global_step": record["global_step"],
                                                  "val_acc": record["val_acc"], "rule": RULE_BEST}
    best.run_id = "another"
    with pytest.raises(BestModelError, match="holds the best model of another run; pass --select last"):
        best.choice("best", {})
    best.run_id = record["run"]
    weights = ck / "best" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(BestModelError, match=r"cannot be used: .*model.safetensors is damaged .*; pass --select last"):
        best.choice("best", {})


def test_an_epoch_whose_validation_is_not_finite_is_never_best(tmp_path):
    """A diverged model's val_acc is the argmax of NaN logits: with val_loss NaN (or val_acc NaN) the epoch is
    not best, nothing is saved; --select best before any validation says which weights it exported and why."""
    import types

    import torch

    best = BestModel(tmp_path)
    best._save = lambda model, record: pytest.fail("a NaN epoch was saved as the best")
    for acc, loss in ((0.4, float("nan")), (float("nan"), 1.0), (0.4, float("inf"))):
        trainer = types.SimpleNamespace(sanity_checking=False, current_epoch=0, global_step=5, is_global_zero=True,
                                        callback_metrics={"val_acc": torch.tensor(acc), "val_loss": torch.tensor(loss)})
        best.on_validation_end(trainer, types.SimpleNamespace(model=None))
    assert best.best is None
    assert best.choice("best", {"epoch": 1, "global_step": 3}) == (None, {"epoch": 1, "global_step": 3,
                                                                          "rule": RULE_BEFORE_VAL})
