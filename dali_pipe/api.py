"""The public API behind `from dali_pipe import ...` (listed in dali_pipe/__init__.py).

- `DaliDataModule`: the DataModule from keyword settings. Its keywords are the CLI's flags with
  underscores, checked by `validate` and filled by `resolve` as the CLI does (the same
  UsageError text, the same defaults); the model's image processor gives the input size, mean and
  std. Then it is the very class the CLI builds from its settings objects (dali_pipe/datamodule.py).
- `SpotSafeCheckpoint`: the CLI's SIGTERM and Ctrl-C behaviour for any Trainer (model/checkpoint.py's callback,
  with the periodic and final saves left to Lightning's ModelCheckpoint).
- `RunFingerprint`: your own keys in the resume check the DataModule already does for the data.
- `MonitorCallback` (monitor.py) and `benchmark` (benchrun.py) are exported as they are.

This module sits above model/ and the data stages (it may import both); nothing below imports it.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import os
import sys
import textwrap
import types
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, Optional, Union

import pytorch_lightning as pl

from model.checkpoint import SpotSafeCheckpoint as _SpotSafeCheckpoint
from model.loading import load_processor

from .config import (
    DEFAULT_MODEL,
    FIELDS,
    DataSettings,
    PipelineSettings,
    flag_of,
    resolve,
    settings_from_keywords,
    validate,
)
from .datamodule import DaliDataModule as _SettingsDataModule
from .datamodule import check_before_restore
from .demo import demo_dataset
from .errors import RunMismatchError, UserError
from .inputs import data_problem
from .naming import named
from .spec import ImageSpec

_KEYWORDS = [f.name for cls in (DataSettings, PipelineSettings) for f in dataclasses.fields(cls)]
_SPEC_KEYWORDS = ("model", "image_size", "mean", "std", "interpolation")
_ELSEWHERE = {  # train.py flags that a DataModule does not take: where they go in your own code
    "lr": "optimizer: your LightningModule's configure_optimizers sets it",
    "weight_decay": "optimizer: your LightningModule's configure_optimizers sets it",
    "warmup_fraction": "schedule: your LightningModule's configure_optimizers sets it",
    "label_smoothing": "loss: your LightningModule's training_step sets it",
    "mixup_alpha": "batch (mixup, on the device): your LightningModule's training_step applies it",
    "cutmix_alpha": "batch (cutmix, on the device): your LightningModule's training_step applies it",
    "epochs": "run: pass Trainer(max_epochs=...)", "max_steps": "run: pass Trainer(max_steps=...)",
    "precision": "run: pass Trainer(precision=...)", "grad_accum": "run: pass Trainer(accumulate_grad_batches=...)",
    "clip_grad_norm": "run: pass Trainer(gradient_clip_val=...)", "devices": "run: pass Trainer(devices=...)",
    "num_nodes": "run: pass Trainer(num_nodes=...)",
    "checkpoint_every_steps": "run: pass ModelCheckpoint(every_n_train_steps=...)",
    "monitor": "run: add dali_pipe.MonitorCallback() to the Trainer's callbacks",
}
INTERPOLATIONS = ("nearest", "linear", "cubic", "lanczos")
ALIASES = {"bilinear": "linear", "bicubic": "cubic"}  # PIL's and timm's names for two of them
KEYWORD_NAMES = [*_KEYWORDS, "model", "output"]  # what our messages name by flag, and the library by keyword


@contextmanager
def keywords():
    """A UserError raised inside names the settings as the library takes them (batch_size=64), not as the CLI's
    flags (--batch-size 64): our messages are written once, with flags (config.named)."""
    try:
        yield
    except UserError as e:
        e.args = (named(str(e), "keyword", KEYWORD_NAMES),) + e.args[1:]
        raise


def _spec_problems(image_size, mean, std, interpolation) -> list[str]:
    out = []
    sizes = image_size if isinstance(image_size, (tuple, list)) else (image_size,)
    if not (1 <= len(sizes) <= 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes)):
        out.append(f"image_size: {image_size!r} is not a size in pixels (an integer, or (height, width))")
    for key, value, positive in (("mean", mean, False), ("std", std, True)):
        if value is None:
            out.append(f"{key}: required with image_size= (per channel, on the [0, 1] scale, as the model was trained "
                       "with); or pass model= to read it from the model's image processor")
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        if not (len(values) in (1, 3) and all(isinstance(v, (int, float)) and (v > 0 or not positive) for v in values)):
            out.append(f"{key}: {value!r} is not 1 or 3 {'positive ' if positive else ''}numbers")
    if interpolation not in INTERPOLATIONS and interpolation not in ALIASES:
        out.append(f"interpolation: {interpolation!r} is not one of {', '.join(INTERPOLATIONS + tuple(ALIASES))}")
    return out


TIMM_CROP_PCT = 0.875  # timm's DEFAULT_CROP_PCT: its evaluation transform's crop when a config has none


def timm_spec(config) -> tuple[ImageSpec | None, list[str]]:
    """The ImageSpec of a timm data config, as `timm.data.resolve_data_config` returns it (input_size (3, H, W),
    mean, std, interpolation, crop_pct, crop_mode), and the problems with it. Validation then does what timm's
    evaluation transform does: the shorter side resized to floor(size / crop_pct) with that interpolation, then
    a center crop of the input size; training crops at the input size with the same interpolation."""
    if not isinstance(config, dict):
        return None, [f"data_config: {config!r} is not a dict (timm.data.resolve_data_config(model=...) returns one)"]
    problems = []
    size = config.get("input_size")
    if not (isinstance(size, (tuple, list)) and len(size) == 3 and size[0] == 3 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in size)):
        problems.append(f"data_config: input_size {size!r} is not (3, height, width) in pixels")
    elif size[1] != size[2]:
        problems.append(f"data_config: input_size {tuple(size)!r} is not square; timm's evaluation crop keeps the "
                        "aspect ratio there (ResizeKeepRatio), which the pipeline does not do: pass image_size= "
                        "instead")
    interp = config.get("interpolation", "bilinear")
    if interp not in INTERPOLATIONS and interp not in ALIASES:
        problems.append(f"data_config: interpolation {interp!r} is not one of bilinear, bicubic, nearest, lanczos "
                        "(the ones DALI resamples with)")
    crop_pct = config.get("crop_pct") or TIMM_CROP_PCT
    if not (isinstance(crop_pct, (int, float)) and 0 < crop_pct <= 1):
        problems.append(f"data_config: crop_pct {crop_pct!r} is not in (0, 1]")
    if config.get("crop_mode", "center") != "center":
        problems.append(f"data_config: crop_mode {config['crop_mode']!r}: only 'center' (timm's default) is done")
    for key, positive in (("mean", False), ("std", True)):
        value = config.get(key)
        values = value if isinstance(value, (tuple, list)) else (value,)
        if not (len(values) in (1, 3) and all(isinstance(v, (int, float)) and not isinstance(v, bool) and
                                              (v > 0 or not positive) for v in values)):
            problems.append(f"data_config: {key} {value!r} is not 1 or 3 {'positive ' if positive else ''}numbers")
    if problems:
        return None, problems
    side = int(size[1])
    return ImageSpec(side, side, _triple(config["mean"]), _triple(config["std"]),
                     resize_shorter=math.floor(side / crop_pct), interp=ALIASES.get(interp, interp)), []


def _triple(v) -> tuple[float, float, float]:
    values = tuple(float(x) for x in (v if isinstance(v, (tuple, list)) else (v,)))
    return values * 3 if len(values) == 1 else values


class DaliDataModule(_SettingsDataModule):
    def __init__(self, data: str | os.PathLike | None = None, *, model: str | None = None, image_size=None,
                 mean=None, std=None, interpolation: str = "linear", data_config: dict | None = None,
                 output: str | os.PathLike | None = None, **settings):
        """Check and resolve the keywords as the CLI does its flags (see the class documentation)."""
        for key in settings:
            if key in FIELDS and key not in _KEYWORDS:
                raise TypeError(f"unexpected keyword argument {key!r}: {flag_of(key)} is a train.py setting of the "
                                f"{_ELSEWHERE.get(key, 'model or the run, not of the data')}; the DataModule takes "
                                f"the data and pipeline settings: {', '.join(k for k in _KEYWORDS if k != 'data')}")
        with keywords():
            values = {"data": str(data) if isinstance(data, os.PathLike) else data, **settings}
            s = settings_from_keywords(values, _KEYWORDS)
            problems, spec = [], None
            given = [k for k, v in (("model", model), ("image_size", image_size), ("data_config", data_config)) if
                     v is not None]
            if len(given) > 1:
                problems.append(f"{' / '.join(given)}: pass one of them (model= reads the input size, mean, std and "
                                "resize rule from its image processor; image_size= with mean= and std= gives them; "
                                "data_config= takes timm's)")
            if image_size is not None:
                problems += _spec_problems(image_size, mean, std, interpolation)
            elif mean is not None or std is not None:
                problems.append("mean / std: they go with image_size=; with model= they come from its image "
                                "processor, with data_config= from timm's config")
            if data_config is not None:
                spec, more = timm_spec(data_config)
                problems += more
            s.model.model = model
            validate(s, ("data", "pipeline", "--model"), problems, data_check=data_problem)
            device = s.pipeline.device
            s = resolve(s)
            s.pipeline.device = device  # "auto" follows the Trainer's accelerator once one is attached
            if s.data.data is None:
                s.data.data = str(demo_dataset(s.data.cache_dir, seed=s.data.seed))
            if image_size is not None:
                sizes = tuple(image_size) if isinstance(image_size, (tuple, list)) else (image_size,)
                spec = ImageSpec(sizes[0], sizes[-1], _triple(mean), _triple(std),
                                 interp=ALIASES.get(interpolation, interpolation))
            elif spec is None:
                spec = ImageSpec.from_processor(load_processor(s.model.model))
        super().__init__(s.data, s.pipeline, spec, None if output is None else Path(output))
        self.model_name = s.model.model if image_size is None and data_config is None else None
        self.announce, self.style = True, "keyword"

    def prepare_data(self) -> None:
        with keywords():
            super().prepare_data()

    def setup(self, stage: str | None = None) -> None:
        with keywords():
            super().setup(stage)


def _keyword_type(name: str):
    """The type a keyword takes, from its setting: the field's type, its choices as a Literal (so that a
    LightningCLI or jsonargparse checks them), and str beside int where the CLI reads text (sizes: "64MB")."""
    _, f, tp = FIELDS[name]
    union = typing.get_origin(tp) in (Union, types.UnionType)
    args = typing.get_args(tp) if union else (tp,)
    optional = type(None) in args
    base = [a for a in args if a is not type(None)]
    if f.metadata["choices"]:
        base = [Literal[tuple(f.metadata["choices"])]]
    elif f.metadata["parse"]:
        base = [*base, str]
    out = Union[tuple(base)] if len(base) > 1 else base[0]
    return Optional[out] if optional else out


SPEC_TYPES = {  # the keywords that are not settings of config.py
    "data": Optional[Union[str, os.PathLike]], "model": Optional[str],
    "image_size": Optional[Union[int, tuple[int, int]]], "mean": Optional[Union[float, tuple[float, float, float]]],
    "std": Optional[Union[float, tuple[float, float, float]]],
    "interpolation": Literal[INTERPOLATIONS + tuple(ALIASES)], "data_config": Optional[dict],
    "output": Optional[Union[str, os.PathLike]]}


def _signature() -> inspect.Signature:
    """The keyword signature, typed (help() and LightningCLI read it): the settings' from config.py."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD),
              P("data", P.POSITIONAL_OR_KEYWORD, default=None, annotation=SPEC_TYPES["data"])]
    params += [P(k, P.KEYWORD_ONLY, default=d, annotation=SPEC_TYPES[k])
               for k, d in (("model", None), ("image_size", None), ("mean", None), ("std", None),
                            ("interpolation", "linear"), ("data_config", None), ("output", None))]
    params += [P(k, P.KEYWORD_ONLY, default=FIELDS[k][1].default, annotation=_keyword_type(k))
               for k in _KEYWORDS if k != "data"]
    return inspect.Signature(params, return_annotation=None)


LIBRARY_HELP = {  # where the DataModule reads a setting otherwise than the training command
    "seed": "seed for the split, the sample order and the augmentation (your model's init is yours)",
    "device": "where DALI decodes: auto follows the Trainer's accelerator (its GPU, else the CPU); gpu or cpu",
}


def _keyword_docs() -> str:
    lines = []
    for k in _KEYWORDS:
        if k == "data":
            continue
        f = FIELDS[k][1]
        text = f"{k}={f.default!r} ({flag_of(k)}): {LIBRARY_HELP.get(k, f.metadata['help'])}"
        lines += textwrap.wrap(text, 100, initial_indent="    ", subsequent_indent="        ", break_on_hyphens=False)
    return "\n".join(lines)


DaliDataModule.__init__.__signature__ = _signature()
DaliDataModule.__init__.__annotations__ = {p.name: p.annotation for p in _signature().parameters.values()
                                           if p.annotation is not inspect.Parameter.empty} | {"return": None}
DaliDataModule.__doc__ = f"""Feed your own LightningModule from class folders, a dataset.tsv, a pack, shards, a Hugging Face
dataset or S3, through DALI.

    from dali_pipe import DaliDataModule
    dm = DaliDataModule(data="s3://bucket/prefix", model="google/vit-base-patch16-224", batch_size=64)
    dm.prepare_data()                 # sync, scan, report (once per node)
    dm.classes                        # the label names, known before the model is built
    trainer.fit(my_module, datamodule=dm)

Batches are `(images, labels)`: images (B, 3, H, W) float32, normalised as the model expects, labels
(B,) int64 class indices into `dm.classes`; on the GPU when DALI decodes there (device "gpu", or
"auto" with a GPU Trainer), else on the CPU (Lightning then moves them to the module's device).

Every epoch trains each sample at most once and drops each process's last partial batch (a note
says so when that exceeds 10% of the images); validation sees every sample exactly once, and so do
`trainer.test` and `trainer.predict`, which read the validation split too (predict in the order of
`dm.manifest.val`, whose entries name the files; a prediction writer's `batch_indices` are positions
in it, also under DDP, where each rank reads a contiguous share). With several processes (DDP) each
rank reads its own shard, from the Trainer's ranks. The state saved in a Lightning checkpoint holds every
rank's loader position, so with a `ModelCheckpoint(save_last=True, every_n_train_steps=N)` a
rerun's `trainer.fit(..., ckpt_path="last")` continues mid-epoch at the same sample with the same augmentation; a checkpoint of other data
(files, labels, split, classes, image size, batch size, processes or seed) or other augmentations
(crop_scale, auto_augment, ra_num_ops, ra_magnitude, random_erase) is refused (RunMismatchError)
right after Lightning reads it, before anything (your module's weights, the optimizer, the loops) is
restored.

Arguments (the CLI's flags with underscores, typed; defaults and checks are the CLI's, from
dali_pipe/config.py; a bad value raises UsageError listing every problem, named by keyword):

    data=None (--data): the images, a folder or s3://bucket/prefix of the same (docs/data.md has the table):
        class subfolders (ImageFolder, as torchvision reads it; train/ + val/ of them is ImageNet's split),
        a dataset.tsv folder, a pack (python -m dali_pipe pack), WebDataset .tar shards (or a brace
        pattern), a Hugging Face dataset's Parquet files or save_to_disk folder; None: a generated demo set
        of real photographs
    model=None (--model): the transformers model whose image processor gives the input size, mean,
        std and resize rule: a hub id, a save_pretrained folder, or 'tiny' / 'vit-b16-random'
        (built in); None: as the CLI ({DEFAULT_MODEL}, or tiny for the demo set)
    image_size=None, mean=None, std=None, interpolation='linear': instead of model=, the input size
        (an int or (height, width)) and the per-channel mean and std on the [0, 1] scale;
        interpolation nearest, linear (bilinear), cubic (bicubic) or lanczos
    data_config=None: instead of model=, timm's data config as timm.data.resolve_data_config returns
        it (input_size, mean, std, interpolation, crop_pct, crop_mode 'center'): validation resizes the
        shorter side to floor(size / crop_pct) and crops the center, as timm's evaluation transform does
    output=None: where reports go (bad_images.tsv); None: the Trainer's default_root_dir
{_keyword_docs()}
"""


class SpotSafeCheckpoint(_SpotSafeCheckpoint):
    """Spot-safe stop on SIGTERM (spot reclaim, `docker stop`) for any Trainer.

        trainer = pl.Trainer(callbacks=[ModelCheckpoint(dirpath=CKPT, save_last=True, every_n_train_steps=500),
                                        dali_pipe.SpotSafeCheckpoint()])
        trainer.fit(module, datamodule=dm, ckpt_path="last")

    On SIGTERM the current training step finishes, every rank agrees (a CPU all-reduce after each step,
    no GPU sync), `last.ckpt` is written under a temporary name and renamed (a kill mid-save leaves
    the previous one whole), and `fit` ends with SystemExit(0): the script exits 0 and a rerun with
    `ckpt_path="last"` continues at the next sample. A SIGTERM during validation lets it finish first.
    Ctrl-C (SIGINT) does the same and ends with SystemExit(130); a second Ctrl-C stops at once.

    `dirpath`: where last.ckpt goes; default: the ModelCheckpoint's dirpath (so ckpt_path="last" finds
    it), else default_root_dir/checkpoints. Periodic and final saves stay the ModelCheckpoint's. Give
    that ModelCheckpoint a dirpath: without one it saves into the logger's version_N folder, which a
    rerun numbers anew (ckpt_path="last" would not find it); a note says so before training, and the
    SIGTERM line then names the path to resume from.
    """

    SAVES_FINAL = False  # the final save is the ModelCheckpoint's (save_last=True), also at max_steps

    def __init__(self, dirpath: str | os.PathLike | None = None):
        super().__init__(Path(dirpath or "."), every_steps=0)
        self._dirpath = None if dirpath is None else Path(dirpath)
        self._versioned = False  # last.ckpt goes to a folder that a rerun's ckpt_path="last" does not search

    def _where(self, trainer) -> Path:
        if self._dirpath is not None:
            return self._dirpath
        cb = trainer.checkpoint_callback
        if getattr(cb, "dirpath", None):
            return Path(cb.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def save(self, trainer) -> None:
        self.dir = self._where(trainer)
        super().save(trainer)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._versioned = stage == "fit" and self._dirpath is None and _versioned_folder(trainer)
        if self._versioned and trainer.is_global_zero:
            print("SpotSafeCheckpoint: the ModelCheckpoint has no dirpath, so it saves into the logger's version "
                  "folder (lightning_logs/version_N/checkpoints), numbered anew in every run: a rerun's "
                  'fit(ckpt_path="last") would not find this run\'s last.ckpt. Give it a folder of its own, '
                  "ModelCheckpoint(dirpath=...), or the logger a version name (version='run1')", file=sys.stderr,
                  flush=True)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        pass  # the run's fingerprint is the DataModule's state (and RunFingerprint's)

    def on_train_end(self, trainer, pl_module) -> None:
        pass  # the final save is the ModelCheckpoint's (save_last=True)

    def _stop(self, trainer) -> None:
        if trainer.is_global_zero:
            path = self.dir / "last.ckpt"
            found = getattr(trainer.checkpoint_callback, "dirpath", None)  # where ckpt_path="last" looks
            how = '"last"' if found and Path(found) == self.dir and not self._versioned else f'"{path}"'
            what = "Ctrl-C" if self.stopped_by == "SIGINT" else "SIGTERM"
            print(f"{what}: checkpoint saved to {path} at step {trainer.global_step}; run the same script "
                  f"again to resume (trainer.fit(..., ckpt_path={how}))", file=sys.stderr, flush=True)
        super()._stop(trainer)


def _versioned_folder(trainer) -> bool:
    """Whether the Trainer's ModelCheckpoint will save into its logger's version folder, which a rerun's
    logger numbers anew: no dirpath given (Lightning fills it in after this callback's setup), and a
    logger whose version is a number (its next free one, unless version=N was given: then the SIGTERM
    line names the path instead of "last", which is still right)."""
    cb = trainer.checkpoint_callback
    if cb is None or getattr(cb, "dirpath", None) is not None or not trainer.loggers:
        return False
    logger = trainer.loggers[0]  # Lightning's CSV and TensorBoard loggers: version_N, the next free N (an int)
    return hasattr(logger, "_get_next_version") and isinstance(logger.version, int)


class RunFingerprint(pl.Callback):
    """Refuse to resume a checkpoint written with other values of your own keys.

        trainer = pl.Trainer(callbacks=[..., dali_pipe.RunFingerprint(model=MODEL_NAME, width=512)])

    DaliDataModule already refuses another run's checkpoint for the data (files, labels, split,
    classes, image size, batch size, processes, seed). This callback adds what only your code knows
    (the model, its shape, anything a resumed run must share); values must be JSON-like (str, numbers,
    lists, dicts). Each checkpoint carries them; `fit(..., ckpt_path=...)` with other values stops
    before training with RunMismatchError naming each difference, before anything (your module's
    weights, the optimizer, the loops) is restored.
    """

    def __init__(self, **keys):
        self.keys = keys

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":  # checked as Lightning reads the checkpoint, before it restores the module's weights
            check_before_restore(trainer, self.state_key, self._check)

    def _check(self, checkpoint: dict) -> None:
        state = (checkpoint.get("callbacks") or {}).get(self.state_key)
        if state is not None:
            self.load_state_dict(state)

    def state_dict(self) -> dict:
        return {"keys": self.keys}

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get("keys", {})
        diff = [f"{k}: {saved.get(k)!r} in the checkpoint, {self.keys.get(k)!r} now"
                for k in sorted(set(saved) | set(self.keys)) if saved.get(k) != self.keys.get(k)]
        if diff:
            raise RunMismatchError("the checkpoint to resume belongs to another run:\n  " + "\n  ".join(diff) +
                                   "\n  Resume it with the values it was written with, or start this run without "
                                   "it (another checkpoint directory, or fit without ckpt_path).")
