"""The image classifier as a LightningModule: AdamW with warmup + cosine, loss and accuracy.

The transformers model is built in `configure_model`, after the DataModule's `setup` has read the
manifest, so its head is sized to the data's classes (`trainer.datamodule.classes`), unless the
classes are given up front (the benchmark does).

Epoch metrics are torchmetrics objects: updated on the device every step, reduced across ranks
once per epoch. They are built so that no step waits for the GPU: tensor inputs only (a Python
number would be copied to the device with a sync) and `nan_strategy="disable"` (its NaN check is a
host-side `.any()`). The loss is a sum of `loss * batch` over a sum of samples rather than a
`MeanMetric`: with `nan_strategy="disable"`, torchmetrics 1.9 replaces a MeanMetric's weights by
ones, which would average batches of different sizes as if they were equal.

The metric sums live in the checkpoint too (summed over ranks; rank 0 takes them back on resume),
so an epoch interrupted by SIGTERM and resumed still prints one METRIC line over the whole epoch.

Divergence: each training step counts, on the device, how many losses in a row were not finite (and
the step where that began); nothing is read back then. The count is read where the run synchronises
anyway: Lightning's log points (every log_every_n_steps), the end of each epoch, and before each
checkpoint save (`check_finite`). The run stops (TrainingDiverged, exit status 1) when the loss is not
finite there and the weights no longer are either (AdamW turns one NaN gradient into NaN weights), or
after PATIENCE non-finite losses in a row. fp16's GradScaler skipping a step that overflowed leaves
the weights finite and the next loss finite, so it never trips this; and no checkpoint is written
with non-finite weights, so the last one on disk is the last good one.
"""
from __future__ import annotations

import dataclasses
import sys
import warnings

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from dali_pipe.config import ModelSettings
from dali_pipe.errors import RunFailed
from dali_pipe.redact import redact_tree

from .loading import load_model
from .mixing import MixSettings, mix

METRICS = tuple(f"{split}_{k}" for split in ("train", "val") for k in ("loss", "acc", "n"))
PATIENCE = 10  # non-finite training losses in a row that stop the run even while the weights stay finite


class TrainingDiverged(RunFailed):
    """The training loss stayed non-finite; the message names the step and the likely causes."""


class ImageClassifier(pl.LightningModule):
    def __init__(self, settings: ModelSettings, *, seed: int, classes: list[str] | None = None):
        """`seed` keys the mixup/cutmix draws (--seed); `classes` default to the DataModule's."""
        super().__init__()
        self.settings = settings
        # hparams.yaml, the TensorBoard events and the checkpoint carry these: no secret in a --model path
        self.save_hyperparameters(redact_tree({"model": dataclasses.asdict(settings), "classes": classes}))
        self.classes = classes
        self.model = None
        object.__setattr__(self, "_forward", None)  # model or its torch.compile wrapper; not a second submodule
        self.mixing = MixSettings(settings.mixup_alpha, settings.cutmix_alpha, settings.label_smoothing)
        self.seed = seed
        self.epoch_metrics: list[dict] = []  # one dict per finished epoch, as printed
        self.metric_lines = True  # print the METRIC line per epoch (the benchmark prints a report instead)
        self._last_val: dict | None = None
        self._streak = self._since = None  # on the device: non-finite losses in a row, the step the run began
        self._checked_step = -1  # the global step of the last log-point check

    # -- model -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from torchmetrics import SumMetric
        from torchmetrics.classification import MulticlassAccuracy

        if self.classes is None:
            self.classes = list(self.trainer.datamodule.classes)
        self.model = load_model(self.settings.model, self.classes)
        object.__setattr__(self, "_forward", torch.compile(self.model) if self.settings.compile else self.model)
        for split in ("train", "val"):
            setattr(self, f"{split}_loss", SumMetric(nan_strategy="disable"))  # sum of loss * samples
            setattr(self, f"{split}_acc", MulticlassAccuracy(len(self.classes), average="micro", validate_args=False))
            setattr(self, f"{split}_n", SumMetric(nan_strategy="disable"))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self._forward(pixel_values=images).logits

    # -- steps -------------------------------------------------------------------------------
    def _update(self, split: str, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        n = torch.full_like(loss, labels.numel())  # on the device: no host-to-device copy
        getattr(self, f"{split}_loss").update(loss.detach() * n)
        getattr(self, f"{split}_acc").update(logits.detach(), labels)
        getattr(self, f"{split}_n").update(n)

    def training_step(self, batch, batch_idx):
        images, labels = batch  # images (B,3,H,W) float on cuda:local_rank or CPU; labels (B,) int64, same device
        if self.mixing.active:  # soft targets (B, C); train_acc then compares with the un-mixed labels
            images, targets = mix(images, labels, len(self.classes), self.mixing,
                                  key=(self.seed, self.global_rank, self.current_epoch, batch_idx))
            logits = self(images)
            loss = F.cross_entropy(logits.float(), targets)
        else:
            logits = self(images)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.settings.label_smoothing)
        self._update("train", loss, logits, labels)
        self._watch(loss)
        self.log("train_loss_step", loss, on_step=True, on_epoch=False, logger=True)
        return loss

    # -- divergence (see the module docstring) -------------------------------------------------
    def _watch(self, loss: torch.Tensor) -> None:
        """Count non-finite losses in a row, on the device (no sync: a Python int is passed by value)."""
        bad = ~torch.isfinite(loss.detach())
        if self._streak is None:
            self._streak = torch.zeros((), dtype=torch.int64, device=loss.device)
            self._since = torch.zeros_like(self._streak)
        self._since = torch.where(bad & (self._streak == 0), self.global_step + 1, self._since)
        self._streak = torch.where(bad, self._streak + 1, 0)

    def divergence(self, weights: bool = False) -> str | None:
        """Why training cannot go on, or None. Reads the count from the device (a sync): call it only where
        the run synchronises anyway. `weights`: look at the weights even when every loss was finite (before a
        checkpoint is saved: one update with a finite loss can still make them NaN)."""
        streak = 0 if self._streak is None else int(self._streak)
        if streak == 0 and not weights:
            return None
        finite = torch.stack([torch.isfinite(p).all() for p in self.model.parameters()]).all()
        broken = not bool(finite)
        if not broken and streak < PATIENCE:
            return None  # e.g. fp16's GradScaler skipped an overflowing step: the weights are whole
        s = self.settings
        causes = [f"--lr {s.lr:g} is too high for this model and batch (try {s.lr / 10:g}, or a longer "
                  "--warmup-fraction)"]
        if s.precision == "16-mixed":
            causes.append("fp16 overflow (--precision bf16-mixed on GPUs that have bf16, such as A10G, L4, A100 "
                          "and H100; else 32-true)")
        if s.clip_grad_norm is None:
            causes.append("exploding gradients (--clip-grad-norm 1.0)")
        if not streak:  # every loss finite, the weights not (a save's look at them)
            what = f"the weights are no longer finite at step {self.global_step} (the loss was still finite)"
        else:
            what = (f"the training loss is not finite (NaN or inf) since step {int(self._since)} (step "
                    f"{self.global_step} now), " + ("and the weights are no longer finite" if broken else
                                                    f"{streak} batches in a row"))
        return (f"training diverged: {what}" +
                ". Likely cause: " + "; or ".join(causes) + ". Rerun with that changed and --resume never (another "
                "recipe is another run).")

    def check_finite(self, weights: bool = False) -> None:
        """Raise TrainingDiverged when `divergence()` finds a reason on any process (all decide together:
        every rank calls this at the same points)."""
        reason = self.divergence(weights)
        stop = reason is not None
        if self.trainer.world_size > 1:
            stop = self.trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            raise TrainingDiverged(reason or "training diverged: the training loss is not finite on another process")

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """At Lightning's log points (it reads the loss there, a sync): the divergence check."""
        step, every = self.global_step, self.trainer.log_every_n_steps
        if every and step and step % every == 0 and step != self._checked_step:
            self._checked_step = step
            self.check_finite()

    def validation_step(self, batch, batch_idx):
        images, labels = batch  # as in training_step
        if labels.numel() == 0:
            return None
        logits = self(images)
        self._update("val", F.cross_entropy(logits.float(), labels), logits, labels)

    def _compute(self, split: str) -> dict[str, float] | None:
        """The split's epoch metrics, reduced over ranks (one sync per epoch), then reset."""
        metrics = [getattr(self, f"{split}_{k}") for k in ("loss", "acc", "n")]
        with warnings.catch_warnings():  # an epoch resumed at its end has sums but no update in this process
            warnings.filterwarnings("ignore", message=".*was called before the ``update`` method.*")
            loss_sum, acc, n = (m.compute() for m in metrics)
        for m in metrics:
            m.reset()
        n = int(n.item())
        if n == 0:
            return None
        return {f"{split}_loss": float(loss_sum) / n, f"{split}_acc": float(acc), f"{split}_samples": n}

    def on_validation_epoch_end(self) -> None:
        m = self._compute("val")
        if m is not None:
            self.log_dict(m, sync_dist=False)  # already reduced
            if not self.trainer.sanity_checking:
                self._last_val = m

    def on_train_epoch_end(self) -> None:
        m = self._compute("train") or {}
        self.log_dict(m, sync_dist=False)
        row = {"epoch": self.current_epoch + 1, **m, **(self._last_val or {})}
        self._last_val = None
        self.epoch_metrics.append(row)
        if self.trainer.is_global_zero and self.metric_lines:  # through the progress bar: one whole line
            self.print("METRIC " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in row.items()))
            sys.stdout.flush()
        self.check_finite()  # the epoch's metrics were just read: a sync already

    # -- resume ------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The epoch's metric sums so far, over all ranks, and the finished epochs' rows."""
        states = {}
        for name in METRICS:
            for key, value in getattr(self, name).metric_state.items():
                value = value.detach().clone()
                if self.trainer.world_size > 1:
                    value = self.trainer.strategy.reduce(value, reduce_op="sum")
                states[f"{name}.{key}"] = value.cpu()
        checkpoint["epoch_metrics_so_far"] = {"states": states, "last_val": self._last_val,
                                              "rows": self.epoch_metrics}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        saved = checkpoint.get("epoch_metrics_so_far")
        if not saved:
            return
        if self.trainer.global_rank == 0:  # the sums are global: one rank holds them, the others start at 0
            for key, value in saved["states"].items():
                name, state = key.split(".")
                setattr(getattr(self, name), state, value.to(getattr(getattr(self, name), state).device))
        self._last_val, self.epoch_metrics = saved["last_val"], list(saved["rows"])

    # -- optimisation ------------------------------------------------------------------------
    def configure_optimizers(self):
        from transformers import get_cosine_schedule_with_warmup

        opt = adamw(self.model, self.settings, fused=fused_adamw(self.device.type))
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = max(1, int(total * self.settings.warmup_fraction))
        sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Lightning's clipping (`Trainer(gradient_clip_val=...)`, --clip-grad-norm), also for the fused
        AdamW under mixed precision, which Lightning's mixed-precision plugin refuses to clip ("does not
        allow for gradient clipping") because a fused step would unscale fp16 gradients itself. Here the
        gradients are unscaled first (the GradScaler's `unscale_`, which torch documents as the way to
        clip and runs on the device), then clipped as Lightning clips them; the scaler's step then sees
        them unscaled and passes only its inf flag to the fused kernel. No host sync: see
        docs/training.md. Every other case is Lightning's own path."""
        from pytorch_lightning.plugins.precision import MixedPrecision
        from pytorch_lightning.utilities import GradClipAlgorithmType

        plugin = self.trainer.precision_plugin
        if not (gradient_clip_val and optimizer.defaults.get("fused") and isinstance(plugin, MixedPrecision)):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        by_value = GradClipAlgorithmType(gradient_clip_algorithm or "norm") == GradClipAlgorithmType.VALUE
        clip_unscaled(optimizer, plugin.scaler, gradient_clip_val, by_value=by_value)


def fused_adamw(device_type: str) -> bool:
    """Fused AdamW on CUDA (one kernel for the step; with fp16 it also spares GradScaler its host-side inf
    check); torch's default (foreach) elsewhere."""
    return device_type == "cuda"


def adamw(model: torch.nn.Module, settings: ModelSettings, *, fused: bool) -> torch.optim.AdamW:
    """AdamW at --lr with --weight-decay on the weights, none on biases and norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=settings.lr, betas=(0.9, 0.999), fused=fused or None)


def clip_unscaled(optimizer: torch.optim.Optimizer, scaler, value: float, *, by_value: bool = False) -> None:
    """Clip the optimizer's gradients by norm or value (as Lightning's Precision.clip_gradients does),
    unscaling them first when `scaler` (an fp16 GradScaler) holds them scaled."""
    if scaler is not None and scaler.is_enabled():
        scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if by_value:
        torch.nn.utils.clip_grad_value_(params, value)
    else:
        torch.nn.utils.clip_grad_norm_(params, value)
