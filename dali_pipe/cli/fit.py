"""The training command: DataModule + classifier + Trainer, then the model in save_pretrained form."""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

from ..config import Settings


def quiet_known_noise() -> None:
    """Warnings a user can do nothing about (Lightning's own internals on this torch)."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


def world_size(s: Settings) -> int:
    if s.run.devices != "auto":
        return s.run.devices * s.run.num_nodes
    import torch

    return max(1, torch.cuda.device_count()) * s.run.num_nodes


def make_trainer(s: Settings, callbacks: list, *, logger=True, **overrides):
    """The one Trainer configuration training and the benchmark share."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger

    if logger is True:
        logger = TensorBoardLogger(s.run.log_dir, name="", version="")
    world = world_size(s)
    kw = dict(accelerator=s.pipeline.device, devices=s.run.devices, num_nodes=s.run.num_nodes,
              strategy="ddp" if world > 1 else "auto", precision=s.model.precision,
              max_epochs=s.model.epochs, max_steps=s.model.max_steps, use_distributed_sampler=False,
              logger=logger, enable_checkpointing=False, callbacks=callbacks, log_every_n_steps=10,
              enable_progress_bar=True, enable_model_summary=False)
    kw.update(overrides)
    return pl.Trainer(**kw)


def run(s: Settings) -> dict:
    """Fit the model and write it to OUTPUT in save_pretrained form. Returns the last epoch's metrics."""
    import pytorch_lightning as pl
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from model.checkpoint import SpotSafeCheckpoint, resume_path
    from model.module import ImageClassifier
    from model.progress import PlainProgressBar
    from model.vit import load_processor

    from ..datamodule import DaliDataModule
    from ..spec import ImageSpec

    quiet_known_noise()
    out = Path(s.run.output)
    pl.seed_everything(s.data.seed, workers=True, verbose=False)
    processor = load_processor(s.model.model)
    dm = DaliDataModule(s.data, s.pipeline, ImageSpec.from_processor(processor), out)
    module = ImageClassifier(s.model)
    ckpt = SpotSafeCheckpoint(s.run.checkpoint_dir, every_steps=s.run.checkpoint_every_steps)
    callbacks = [ckpt] if sys.stderr.isatty() else [ckpt, PlainProgressBar()]  # tqdm on a terminal, lines in logs
    if s.run.monitor:
        from ..monitor import MonitorCallback

        callbacks.append(MonitorCallback(out))
    trainer = make_trainer(s, callbacks)
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume_path(s.run.checkpoint_dir))
    except SIGTERMException:
        pass  # SpotSafeCheckpoint saved; report below and exit 0
    if ckpt.interrupted:
        print(f"stopped by SIGTERM; checkpoint saved to {s.run.checkpoint_dir}. Rerun the same command to resume.")
        return {"interrupted": True, "global_step": trainer.global_step}
    if trainer.is_global_zero:
        save_model(module, processor, out)
        print(f"model, image processor and label map written to {out}")
        print(f"TensorBoard logs in {s.run.log_dir}")
        print(f"TRAINED global_step={trainer.global_step}")
    last = module.epoch_metrics[-1] if module.epoch_metrics else {}
    return {**last, "global_step": trainer.global_step}


def save_model(module, processor, out: Path) -> None:
    """save_pretrained form (config.json with id2label, weights, preprocessor_config.json) + label_map.json."""
    out.mkdir(parents=True, exist_ok=True)
    module.model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "label_map.json").write_text(json.dumps(module.model.config.id2label, indent=1, sort_keys=True))
