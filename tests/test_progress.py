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

