"""The LightningModule: epoch metrics against a hand computation, optimizer groups, LR schedule."""
from __future__ import annotations

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from helpers import Batches, tiny_settings

from model.module import ImageClassifier

CLASSES = ["a", "b", "c"]


def _batches(sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batches((torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes)


def _trainer(**kw):
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kw)


def test_validation_metrics_are_sample_weighted_over_uneven_batches():
    """val_loss/val_acc over batches of 5 and 3 equal a per-sample mean computed by hand."""
    torch.manual_seed(0)
    module = ImageClassifier(tiny_settings(), seed=0, classes=CLASSES)
    module.configure_model()
    batches = _batches([5, 3])
    _trainer().validate(module, dataloaders=batches, verbose=False)
    m = module._last_val
    with torch.no_grad():
        logits = torch.cat([module(x) for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    assert m["val_samples"] == 8
    assert m["val_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    assert m["val_acc"] == pytest.approx((logits.argmax(-1) == y).float().mean().item())


def test_training_epoch_metrics_and_metric_line(capsys):
    torch.manual_seed(0)
    module = ImageClassifier(tiny_settings(), seed=0, classes=CLASSES)
    _trainer(max_epochs=2).fit(module, train_dataloaders=_batches([4, 4, 2]))
    assert [r["epoch"] for r in module.epoch_metrics] == [1, 2]
    assert all(r["train_samples"] == 10 for r in module.epoch_metrics)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("METRIC ")]
    assert lines[0].startswith("METRIC epoch=1 train_loss=")
    assert "train_acc=" in lines[0] and "train_samples=10" in lines[0]


def test_weight_decay_spares_biases_and_norms_and_schedule_warms_up_then_decays():
    module = ImageClassifier(tiny_settings(weight_decay=0.05, warmup_fraction=0.2, lr=1e-3), seed=0, classes=CLASSES)
    trainer = _trainer(max_steps=10)
    trainer.fit(module, train_dataloaders=_batches([2] * 10))
    opt = trainer.optimizers[0]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"]) and any(p.ndim == 1 for p in no_decay["params"])
    sched = trainer.lr_scheduler_configs[0].scheduler
    lrs = [f(s) * 1e-3 for s in range(11) for f in sched.lr_lambdas[:1]]
    assert lrs[0] == 0 and lrs[2] == pytest.approx(1e-3) and lrs[1] < lrs[2]  # 2 warmup steps
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])) and lrs[10] == pytest.approx(0, abs=1e-12)
