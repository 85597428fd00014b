"""dali_pipe: keep the GPU busy when training an image classifier from files in S3.

From your own Lightning code:

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    import dali_pipe

    dm = dali_pipe.DaliDataModule(data="s3://bucket/prefix", model="google/vit-base-patch16-224", batch_size=64)
    dm.prepare_data()                               # sync, scan, report; dm.classes is known from here
    module = MyModule(num_classes=len(dm.classes))
    trainer = pl.Trainer(max_epochs=10, callbacks=[
        ModelCheckpoint(dirpath="ckpt", save_last=True, every_n_train_steps=500),
        dali_pipe.SpotSafeCheckpoint(),             # SIGTERM/Ctrl-C: save after this step, exit 0/130
        dali_pipe.MonitorCallback()])               # where the time goes, with verdicts and fixes
    trainer.fit(module, datamodule=dm, ckpt_path="last")   # a rerun continues at the next sample

Public names (`__all__`; each documented, `help(dali_pipe.NAME)`):

    DaliDataModule      the LightningDataModule: DALI decode and augmentation, exact resume
    SpotSafeCheckpoint  callback: on SIGTERM or Ctrl-C every rank finishes its step, saves last.ckpt, stops
    RunFingerprint      callback: your own keys in the check that a resumed checkpoint is this run's
    MonitorCallback     callback: MONITOR verdicts and a time budget for your model
    benchmark           your module fed by DALI, the classic DataLoader and synthetic data, side by side
    UserError, UsageError, RunMismatchError   what the library raises for bad input

Data flows one way through the modules behind them:
  manifest (dataset.tsv) -> sync (S3 -> local disk) -> scan (bad files out)
    -> pipeline (DALI graph) -> loader (epoch-exact iterator) -> datamodule (Lightning)
  side paths: baseline (classic DataLoader), monitor + benchmark (timing), cli/ (the commands).
Importing the package is cheap: torch, DALI and Lightning load when a public name is first used.
"""
from __future__ import annotations

import importlib

__all__ = ["DaliDataModule", "SpotSafeCheckpoint", "RunFingerprint", "MonitorCallback", "benchmark", "UserError",
           "UsageError", "RunMismatchError"]

_WHERE = {"DaliDataModule": "api", "SpotSafeCheckpoint": "api", "RunFingerprint": "api", "MonitorCallback": "monitor",
          "benchmark": "benchrun", "UserError": "errors", "UsageError": "config", "RunMismatchError": "errors"}


def __getattr__(name: str):
    """Import a public name's module on first use (PEP 562), so `import dali_pipe` stays cheap."""
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
