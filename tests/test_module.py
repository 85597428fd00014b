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


class _ClipSeen(ImageClassifier):
    """Records the gradients' global norm right after clipping, as the optimizer step then sees them (on the
    device: `norms` reads them back after training)."""

    seen: list

    @property
    def norms(self) -> list[float]:
        return [n.item() for n in self.seen]

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.seen.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_clipping_the_fused_adamw_built_for_cuda_matches_lightnings_own(monkeypatch, precision):
    """The optimizer built exactly as on CUDA (fused AdamW), clipped through Lightning's clipping path under
    bf16-mixed and 16-mixed (a real GradScaler, on the CPU): no refusal, and the same steps as Lightning's own
    clipping of torch's default AdamW: the step sees unscaled gradients clipped to the norm, and the fp16 step
    whose gradients overflow is skipped by both."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    from model import module as module_mod

    assert module_mod.fused_adamw("cuda") and not module_mod.fused_adamw("cpu")
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(module_mod, "fused_adamw", lambda device_type, fused=fused: fused)
        torch.manual_seed(0)
        module = _ClipSeen(tiny_settings(), seed=0, classes=CLASSES)
        module.seen = []
        amp = {"precision": precision} if precision == "bf16-mixed" else {"plugins": [MixedPrecision(precision, "cpu")]}
        trainer = _trainer(max_steps=3, gradient_clip_val=0.05, **amp)
        trainer.fit(module, train_dataloaders=_batches([4, 4, 4]))
        assert bool(trainer.optimizers[0].defaults["fused"]) is fused and trainer.global_step == 3
        runs[fused] = ([p.detach().clone() for p in module.parameters()], module.norms)
    (fused_params, fused_norms), (ref_params, ref_norms) = runs[True], runs[False]
    assert fused_norms == pytest.approx(ref_norms, rel=1e-4, nan_ok=True)
    finite = [n for n in fused_norms if n == n]
    assert len(finite) >= 2 and finite == pytest.approx([0.05] * len(finite), rel=1e-3)
    # the same steps taken (or skipped): a skipped or mis-scaled step moves most weights by about lr (1e-3); the
    # fused and foreach kernels round differently, which Adam amplifies to ~1e-5 where a gradient is near 0
    for a, b in zip(fused_params, ref_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_clip_by_value_unscales_fp16_gradients_once():
    """Clipping by value on a fused AdamW under a GradScaler: the gradients are unscaled, then clipped, and the
    scaler's step does not unscale them again (the same update as torch's documented unscale-clip-step)."""
    from model.module import clip_unscaled

    params = {}
    for fused in (True, False):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 8))
        opt = torch.optim.SGD([w], lr=1.0, fused=fused or None)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale((w * torch.arange(8.0)).sum()).backward()  # gradients 0..7, scaled by 1024
        if fused:
            clip_unscaled(opt, scaler, 2.0, by_value=True)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_value_([w], 2.0)
        assert w.grad.tolist() == [0.0, 1.0] + [2.0] * 6
        scaler.step(opt)
        params[fused] = w.detach().clone()
    torch.testing.assert_close(params[True], params[False])
    torch.testing.assert_close(params[True], torch.linspace(-1, 1, 8) - torch.tensor([0.0, 1.0] + [2.0] * 6))


def _cuda_batches(n, batch, side, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batches((torch.randn(batch, 3, side, side, generator=g).cuda(),
                    torch.randint(0, classes, (batch,), generator=g).cuda()) for _ in range(n))


class _NoSync(pl.Callback):
    """Makes any host-device sync an error inside training and validation steps after the first two."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= 2:
            torch.cuda.set_sync_debug_mode("error")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("default")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            torch.cuda.set_sync_debug_mode("error")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("precision,mixing,clip", [("16-mixed", {}, None), ("bf16-mixed", {}, None),
                                                   ("16-mixed", {}, 1.0), ("bf16-mixed", {}, 1.0),
                                                   ("16-mixed", {"mixup_alpha": 0.2, "cutmix_alpha": 1.0,
                                                                 "label_smoothing": 0.1}, 1.0)])
def test_gpu_steps_never_wait_for_the_gpu(precision, mixing, clip):
    """16-mixed (GradScaler with fused AdamW), bf16-mixed, each with and without --clip-grad-norm, and the
    mixing recipe: no step synchronises, and a clipped step's gradients are within the norm."""
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    module = _ClipSeen(tiny_settings(precision=precision, **mixing), seed=0, classes=CLASSES)
    module.seen = []
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision=precision, max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         log_every_n_steps=1000, callbacks=[_NoSync()], num_sanity_val_steps=0,
                         gradient_clip_val=clip, gradient_clip_algorithm="norm")
    trainer.fit(module, train_dataloaders=_cuda_batches(8, 16, 64, 3), val_dataloaders=_cuda_batches(3, 16, 64, 3))
    assert trainer.global_step == 8 and module.epoch_metrics[0]["train_samples"] == 128
    assert trainer.optimizers[0].defaults["fused"]  # built for CUDA
    if clip:
        finite = [n for n in module.norms if n == n]
        assert finite and max(finite) <= clip * (1 + 1e-3), module.norms


@pytest.mark.gpu
def test_vit_b16_at_batch_128_fits_a_t4_beside_dali():
    """ViT-B/16, batch 128, 16-mixed (the T4 recipe): torch's peak stays under 13 GiB, leaving a 16 GB
    T4 room for DALI's pool, nvJPEG and the CUDA context."""
    torch.cuda.reset_peak_memory_stats()
    module = ImageClassifier(tiny_settings(model="vit-b16-random", precision="16-mixed"), seed=0, classes=list("abc"))
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="16-mixed", max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=_cuda_batches(3, 128, 224, 3))
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"ViT-B/16 batch 128 16-mixed: peak {peak:.2f} GiB allocated by torch")
    assert peak < 13.0, peak


def test_divergence_is_counted_on_the_device_and_stops_only_a_loss_that_stays_non_finite(monkeypatch):
    """Each step only counts non-finite losses on the device (no read back: any host read fails here); the
    check then says nothing for a skipped step (one NaN loss, weights whole: fp16's GradScaler), and names the
    step it began and the likely causes once the weights are not finite, or after PATIENCE in a row."""
    from model.module import PATIENCE, TrainingDiverged

    module = ImageClassifier(tiny_settings(precision="16-mixed", lr=5e-2), seed=0, classes=CLASSES)
    module.configure_model()
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)

    def watch(*losses):
        def no_host_read(*a, **k):
            raise AssertionError("a training step read a number back from the device")

        with monkeypatch.context() as m:
            for name in ("__bool__", "__int__", "__float__", "item", "tolist", "cpu"):
                m.setattr(torch.Tensor, name, no_host_read)
            for loss in losses:
                module._watch(loss)

    watch(one, nan, one)
    assert module.divergence() is None
    watch(nan, nan)
    assert module.divergence() is None  # not finite twice, but the weights are whole: it may recover
    watch(*[nan] * (PATIENCE - 2))
    assert f"{PATIENCE} batches in a row" in module.divergence()
    watch(one, nan)
    with torch.no_grad():
        next(module.model.parameters()).fill_(float("nan"))
    reason = module.divergence()
    assert "not finite (NaN or inf) since step 1" in reason and "the weights are no longer finite" in reason
    assert "--lr 0.05 is too high" in reason and "fp16 overflow (--precision bf16-mixed" in reason
    assert "--clip-grad-norm 1.0" in reason and "--resume never" in reason
    module._trainer = type("T", (), {"world_size": 1, "global_step": 1})()
    with pytest.raises(TrainingDiverged, match="training diverged"):
        module.check_finite()
