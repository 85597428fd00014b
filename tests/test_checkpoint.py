"""Spot-safe checkpoints: atomic saves, SIGTERM and kill -9."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _train_cmd(photo_root, out, steps):
    return [sys.executable, str(ROOT / "train.py"), "--data", str(photo_root), "--model", "tiny", "--device", "cpu",
            "--batch-size", "4", "--epochs", "50", "--max-steps", str(steps), "--num-threads", "1",
            "--output", str(out), "--checkpoint-every-steps", "5", "--val-fraction", "0.1"]


def test_sigterm_saves_and_rerun_resumes_to_the_same_step(tmp_path, photo_root, cache_dir):
    """SIGTERM mid-training: checkpoint saved, exit 0; the rerun resumes and ends at --max-steps."""
    out = tmp_path / "run"
    env = {**os.environ, "DALI_PIPE_CACHE": str(cache_dir), "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen(_train_cmd(photo_root, out, 60), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env)
    ckpt = out / "checkpoints" / "last.ckpt"
    deadline = time.time() + 300
    while not ckpt.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert ckpt.exists(), "a periodic checkpoint appeared"
    p.send_signal(signal.SIGTERM)
    log, _ = p.communicate(timeout=300)
    assert p.returncode == 0, log[-3000:]
    assert "stopped by SIGTERM" in log
    import torch

    step = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]
    assert 0 < step < 60
    r = subprocess.run(_train_cmd(photo_root, out, 60), capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout and "TRAINED global_step=60" in r.stdout


def test_kill_9_during_save_keeps_previous_checkpoint(tmp_path):
    """A save killed mid-write leaves the previous last.ckpt whole; the stale temp file is cleaned on resume."""
    ckdir = tmp_path / "ck"
    script = f"""
import sys, time, torch
sys.path.insert(0, {str(ROOT)!r})
from model.checkpoint import SpotSafeCheckpoint
class T:
    global_step = 1
    is_global_zero = True
    def __init__(self, slow): self.slow = slow
    def save_checkpoint(self, path):
        if not self.slow:
            torch.save({{"global_step": 1, "w": torch.arange(10)}}, path); return
        with open(path, "wb") as f:
            f.write(b"PARTIAL" * 1000); f.flush()
            print("writing", flush=True); time.sleep(60)
cb = SpotSafeCheckpoint({str(ckdir)!r})
cb.save(T(False))
cb.save(T(True))
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    p.kill()
    p.wait()
    import torch

    from model.checkpoint import resume_path

    assert torch.load(ckdir / "last.ckpt", weights_only=False)["global_step"] == 1
    assert list(ckdir.glob(".last.ckpt.tmp-*"))
    assert resume_path(ckdir) == str(ckdir / "last.ckpt")
    assert not list(ckdir.glob(".last.ckpt.tmp-*"))
