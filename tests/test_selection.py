"""--select best: the best folder is whole and this run's, or refused with the ways out; a kill between
its two renames is repaired on the next run."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from model.selection import RULE_BEST, BestModel, BestModelError, recover


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
    folder, selected = best.choice("best")
    assert folder == ck / "best" and selected == {"epoch": record["epoch"], "val_acc": record["val_acc"],
                                                  "rule": RULE_BEST}
    best.run_id = "another"
    with pytest.raises(BestModelError, match="holds the best model of another run; pass --select last"):
        best.choice("best")
    best.run_id = record["run"]
    weights = ck / "best" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(BestModelError, match=r"cannot be used: .*model.safetensors is damaged .*; pass --select last"):
        best.choice("best")
