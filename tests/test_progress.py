"""Plain progress lines for logs: step, loss, lr, images/s, data-wait and ETA."""
from __future__ import annotations

import re

import pytorch_lightning as pl
import torch
from helpers import Batches, tiny_settings

from model.module import ImageClassifier
from model.progress import PlainProgressBar


def test_lines_carry_loss_lr_rate_wait_and_eta(capsys):
    g = torch.Generator().manual_seed(0)
    batches = Batches((torch.randn(4, 3, 64, 64, generator=g), torch.randint(0, 2, (4,), generator=g))
                      for _ in range(8))
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
                         max_epochs=2, callbacks=[PlainProgressBar(every_s=3600)])
    trainer.fit(ImageClassifier(tiny_settings(), seed=0, classes=["a", "b"]), train_dataloaders=batches)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("progress: ")]
    assert len(lines) == 8  # a line at each quarter of each epoch
    pat = (r"progress: epoch 2/2 step 8/8 \(100%\), loss \d+\.\d{4}, lr \d\.\d\de[-+]\d\d, \d+\.\d images/s, "
           r"data-wait \d+%, ETA 0:00:00")
    assert re.fullmatch(pat, lines[-1]), lines[-1]


def _under_a_terminal(argv: list[str], env: dict, columns: int = 80, timeout: float = 300) -> str:
    """What a program writes to a pseudo-terminal of `columns` columns (as `docker run -t` and SageMaker's
    local mode give it), as a log scraper reads it."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdin, stdout and stderr are the terminal
        os.environ.update(env)
        os.execv(argv[0], argv)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        try:
            chunk = os.read(fd, 1 << 16) if ready else b""
        except OSError:  # the child closed the terminal
            break
        if ready and not chunk:
            break
        out += chunk
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out.decode(errors="replace")[-3000:]
    return out.decode(errors="replace")


def test_metric_lines_stay_whole_under_an_80_column_terminal(photo_root, tmp_path):
    """train.py under a terminal of 80 columns: each METRIC line is one line that SageMaker's metric regex
    (docs/sagemaker.md) reads, and the bar counts epochs as METRIC does ("Epoch 1/1" for epoch=1). Lightning's
    Rich bar wrapped the line at 80 columns, so the regex found no val_acc."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = _under_a_terminal([sys.executable, str(root / "train.py"), "--data", str(photo_root), "--model", "tiny",
                              "--epochs", "1", "--batch-size", "16", "--val-fraction", "0.25", "--device", "cpu",
                              "--num-threads", "1", "--output", str(tmp_path / "out")],
                             {"DALI_PIPE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(root),
                              "TERM": "xterm", "COLUMNS": "80"})
    lines = [ln for ln in re.split(r"[\r\n]+", text) if "METRIC" in ln]
    assert len(lines) == 1, lines
    m = re.search(r"METRIC epoch=\d+ .*val_acc=([0-9.]+)", lines[0])  # SageMaker's validation:accuracy
    assert m and 0 <= float(m.group(1)) <= 1 and lines[0].startswith("METRIC epoch=1 "), lines[0]
    assert "Epoch 1/1" in text and "Epoch 0" not in text
    assert os.get_terminal_size  # the child had a terminal (the bar is there, not plain progress lines)
    assert "progress: " not in text
