"""ViT image classifier as a LightningModule: AdamW with warmup + cosine, loss and accuracy.

The transformers model is built in `configure_model`, after the DataModule's `setup` has read the
manifest, so its head is sized to the data's classes (`trainer.datamodule.classes`).
Metrics are accumulated as device tensors and reduced across ranks once per epoch: no GPU sync
per step.
"""
from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from .vit import load_model


class ViTClassifier(pl.LightningModule):
    def __init__(self, model_name: str, lr: float, weight_decay: float = 0.05, warmup_fraction: float = 0.05,
                 classes: list[str] | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.model = None
        self._sums: dict[str, torch.Tensor] = {}
        self.epoch_metrics: list[dict] = []  # one dict per finished epoch, as printed

    # -- model -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.hparams.classes is None:
            self.hparams.classes = list(self.trainer.datamodule.classes)
        self.model = load_model(self.hparams.model_name, self.hparams.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=images).logits

    # -- steps -------------------------------------------------------------------------------
    def _accumulate(self, prefix: str, loss_sum: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        n = torch.tensor(labels.numel(), device=labels.device, dtype=torch.float64)
        correct = (logits.argmax(-1) == labels).sum().double()
        for k, v in ((f"{prefix}_loss", loss_sum.detach().double()), (f"{prefix}_correct", correct), (f"{prefix}_n", n)):
            self._sums[k] = self._sums.get(k, 0) + v

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits.float(), labels)
        self._accumulate("train", loss * labels.numel(), logits, labels)
        self.log("train_loss_step", loss, on_step=True, on_epoch=False, logger=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        if labels.numel() == 0:
            return None
        logits = self(images)
        self._accumulate("val", F.cross_entropy(logits.float(), labels, reduction="sum"), logits, labels)

    def _reduce(self, prefix: str) -> dict[str, float] | None:
        keys = [f"{prefix}_loss", f"{prefix}_correct", f"{prefix}_n"]
        if keys[0] not in self._sums and self.trainer.world_size == 1:
            return None
        vals = torch.stack([torch.as_tensor(self._sums.pop(k, 0.0), dtype=torch.float64, device=self.device)
                            for k in keys])
        vals = self.trainer.strategy.reduce(vals, reduce_op="sum")  # all ranks' sums, once per epoch
        loss, correct, n = vals.tolist()
        if n == 0:
            return None
        return {f"{prefix}_loss": loss / n, f"{prefix}_acc": correct / n, f"{prefix}_samples": int(n)}

    def on_validation_epoch_end(self) -> None:
        m = self._reduce("val")
        if m is not None:
            self.log_dict({k: float(v) for k, v in m.items()}, sync_dist=False)
            if not self.trainer.sanity_checking:
                self._last_val = m

    def on_train_epoch_start(self) -> None:
        self._last_val = None

    def on_train_epoch_end(self) -> None:
        m = self._reduce("train") or {}
        self.log_dict({k: float(v) for k, v in m.items()}, sync_dist=False)
        row = {"epoch": self.current_epoch + 1, **m, **(self._last_val or {})}
        self.epoch_metrics.append(row)
        if self.trainer.is_global_zero:
            print("METRIC " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in row.items()), flush=True)

    # -- optimisation ------------------------------------------------------------------------
    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
        fused = self.device.type == "cuda" or None  # fused AdamW only on CUDA
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=self.hparams.lr, betas=(0.9, 0.999), fused=fused)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = max(1, int(total * self.hparams.warmup_fraction))

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
