"""Long runs stay flat: host RSS grows less than 5% from epoch 2 to epoch 20."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_rss_flat_over_12_epochs(photo_root, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "longrun_rss.py"), "--data", str(photo_root),
                        "--epochs", "12", "--output", str(tmp_path / "o")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rep["rss_mb"]) == 12
    assert rep["growth_epoch2_to_last"] < 0.05, rep
