#!/usr/bin/env python3
"""Train a ViT image classifier from a dataset.tsv of JPEGs (local or S3) with a DALI pipeline.

    python train.py                                   # demo: tiny ViT on generated photos, CPU ok
    python train.py --data DIR --model tiny --epochs 2 --device cpu --output OUT
    python train.py --data s3://bucket/prefix --model google/vit-base-patch16-224
    python train.py --benchmark --data DIR --model none --output OUT
    SAGEMAKER_BASE_DIR=/opt/ml python train.py train  # SageMaker container contract

A CLI that is also a library: tests call `main([...])`.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed")
DEVICES = ("auto", "gpu", "cpu")
LOADERS = ("dali", "baseline", "synthetic")
DEMO_LR, FINETUNE_LR = 1e-3, 5e-5


class Invalid:
    """A flag value that did not parse; collected by validate() so every problem is listed at once."""

    def __init__(self, value: str, expected: str):
        self.value, self.expected = value, expected


def _typed(conv, expected: str):
    def parse(s: str):
        try:
            return conv(s)
        except (TypeError, ValueError):
            return Invalid(s, expected)
    parse.__name__ = expected
    return parse


def _bool(s: str) -> bool:
    v = str(s).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(s)


def _devices(s: str):
    return "auto" if s == "auto" else int(s)


def _cores() -> int:
    return len(os.sched_getaffinity(0))


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one clear message, exit 2 in the CLI, output/failure under
    SageMaker) instead of exiting from deep inside the parser."""

    def error(self, message: str):
        raise UsageError(f"{message} (see python train.py --help)")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show '(default: X)' except where the default is computed and the help says how."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def get_args_parser() -> argparse.ArgumentParser:
    from dali_pipe.scan import MODES

    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=_DefaultsFormatter)
    p.add_argument("mode", nargs="?", choices=["train"], help="'train': run as a SageMaker training job "
                   "(reads SAGEMAKER_BASE_DIR, default /opt/ml)")
    p.add_argument("--data", default=None, help="dataset root holding dataset.tsv, or s3://bucket/prefix; "
                   "default: a generated demo set of real photos")
    p.add_argument("--model", default=None, help="hub id, local save_pretrained dir, 'tiny', 'vit-b16-random', "
                   "or 'none' (benchmark: loaders only); default: tiny for the demo set, else google/vit-base-patch16-224")
    p.add_argument("--epochs", type=_typed(int, "an integer"), default=5, help="training epochs")
    p.add_argument("--max-steps", type=_typed(int, "an integer"), default=-1, help="stop after this many optimizer steps (-1: no limit)")
    p.add_argument("--batch-size", type=_typed(int, "an integer"), default=32, help="images per batch per GPU/process")
    p.add_argument("--lr", type=_typed(float, "a number"), default=None, help=f"peak learning rate; default {DEMO_LR} for built-in models, {FINETUNE_LR} for pretrained")
    p.add_argument("--precision", default="auto", help=f"{'|'.join(PRECISIONS)}; auto: bf16-mixed on sm80+, 16-mixed on older GPUs (T4), 32-true on CPU")
    p.add_argument("--device", default="auto", help="auto|gpu|cpu; auto picks the GPU when CUDA is available")
    p.add_argument("--devices", type=_typed(_devices, "an integer or 'auto'"), default=1, help="GPUs (or CPU processes) per node; 'auto': all local GPUs")
    p.add_argument("--num-nodes", type=_typed(int, "an integer"), default=1, help="nodes in a multi-node run")
    p.add_argument("--num-threads", type=_typed(int, "an integer"), default=None, help="DALI CPU threads per process; default: cores available minus one (benchmark: all --cpus cores, as many as the baseline's workers)")
    p.add_argument("--val-fraction", type=_typed(float, "a number"), default=0.1, help="validation share per class when the manifest has no split column")
    p.add_argument("--seed", type=_typed(int, "an integer"), default=0, help="seed for the split, augmentation and model init")
    p.add_argument("--output", default="runs/train", help="output dir: model (save_pretrained form), bad_images.tsv, logs, benchmark files")
    p.add_argument("--log-dir", default=None, help="TensorBoard dir; default OUTPUT/tensorboard")
    p.add_argument("--cache-dir", default=None, help="where s3:// data is synced and scan verdicts are cached; default $DALI_PIPE_CACHE or ~/.cache/dali_pipe (SageMaker: /tmp/dali_pipe, on NVMe)")
    p.add_argument("--scan", default="fast", help=f"pre-flight image scan: {'|'.join(MODES)}")
    p.add_argument("--max-pixels", type=_typed(int, "an integer"), default=89_478_485, help="reject images with more pixels (decompression bombs)")
    p.add_argument("--max-bad-fraction", type=_typed(float, "a number"), default=0.05, help="abort when a larger share of images is bad")
    p.add_argument("--skip-missing", type=_typed(_bool, "true or false"), nargs="?", const=True, default=False, help="train without files listed but missing (reported)")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoints (resumed from when present); default OUTPUT/checkpoints (SageMaker: /opt/ml/checkpoints)")
    p.add_argument("--checkpoint-every-steps", type=_typed(int, "an integer"), default=0, help="also checkpoint every N optimizer steps (0: only at the end and on SIGTERM)")
    p.add_argument("--monitor", type=_typed(_bool, "true or false"), nargs="?", const=True, default=False, help="log GPU utilization and data-wait during training and print a diagnosis")
    p.add_argument("--benchmark", type=_typed(_bool, "true or false"), nargs="?", const=True, default=False, help="benchmark mode: time loaders side by side instead of training")
    p.add_argument("--loaders", default="dali,baseline,synthetic", help=f"benchmark: comma-separated subset of {','.join(LOADERS)}")
    p.add_argument("--steps", type=_typed(int, "an integer"), default=50, help="benchmark: timed steps per loader")
    p.add_argument("--warmup", type=_typed(int, "an integer"), default=10, help="benchmark: untimed warm-up steps per loader")
    p.add_argument("--cpus", type=_typed(int, "an integer"), default=None, help="benchmark: pin the process and its workers to this many cores (default: all)")
    return p


def validate_args(args: argparse.Namespace) -> list[str]:
    """Every problem with the flags, each naming the flag, the bad value and what is allowed."""
    from dali_pipe.scan import MODES

    problems = [f"--{k.replace('_', '-')}: {v.value!r} is not {v.expected}"
                for k, v in vars(args).items() if isinstance(v, Invalid)]
    bad = {k for k, v in vars(args).items() if isinstance(v, Invalid)}

    def need(name: str, ok, msg: str):
        """Record `msg` for --name unless its value already failed to parse or `ok(value)` holds."""
        value = getattr(args, name)
        if name not in bad and not ok(value):
            problems.append(f"--{name.replace('_', '-')}: {value!r} {msg}")

    need("epochs", lambda v: v >= 1, "must be at least 1")
    need("max_steps", lambda v: v == -1 or v >= 1, "must be -1 (no limit) or at least 1")
    need("batch_size", lambda v: v >= 1, "must be at least 1")
    need("lr", lambda v: v is None or v > 0, "must be positive")
    need("precision", lambda v: v in PRECISIONS, f"is not one of {', '.join(PRECISIONS)}")
    need("device", lambda v: v in DEVICES, f"is not one of {', '.join(DEVICES)}")
    need("devices", lambda v: v == "auto" or v >= 1, "must be at least 1 or 'auto'")
    need("num_nodes", lambda v: v >= 1, "must be at least 1")
    need("num_threads", lambda v: v is None or v >= 1, "must be at least 1")
    need("val_fraction", lambda v: 0 <= v < 1, "must be in [0, 1)")
    need("scan", lambda v: v in MODES, f"is not one of {', '.join(MODES)}")
    need("max_pixels", lambda v: v >= 1, "must be at least 1")
    need("max_bad_fraction", lambda v: 0 <= v <= 1, "must be in [0, 1]")
    need("checkpoint_every_steps", lambda v: v >= 0, "must be 0 (off) or positive")
    need("steps", lambda v: v >= 1, "must be at least 1")
    need("warmup", lambda v: v >= 0, "must be 0 or more")
    need("cpus", lambda v: v is None or 1 <= v <= _cores(), f"must be between 1 and {_cores()} (the cores this process may use)")
    unknown = [x for x in str(args.loaders).split(",") if x not in LOADERS]
    need("loaders", lambda v: v and not unknown, f"has unknown loader(s) {unknown}; choose from {', '.join(LOADERS)}")
    if args.model == "none" and not args.benchmark:
        problems.append("--model: 'none' only makes sense with --benchmark (it times the loaders without a model)")
    if args.data and not args.data.startswith("s3://"):
        if not Path(args.data).is_dir():
            problems.append(f"--data: {args.data!r} is not a directory; pass the folder that holds dataset.tsv, or s3://bucket/prefix")
        elif not (Path(args.data) / "dataset.tsv").is_file():
            problems.append(f"--data: {args.data!r} has no dataset.tsv; put the manifest (an image_path column) at the dataset root")
    if args.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            problems.append("--device: 'gpu' but no CUDA GPU is visible; use --device cpu (or auto)")
    return problems


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return device


def resolve_precision(precision: str, device: str) -> str:
    """auto: bf16-mixed where the GPU has native bf16 (sm80+), 16-mixed on older GPUs, 32-true on CPU."""
    if precision != "auto":
        return precision
    if device == "cpu":
        return "32-true"
    import torch

    return "bf16-mixed" if torch.cuda.get_device_capability()[0] >= 8 else "16-mixed"


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on other flags, once, before anything uses them."""
    from dali_pipe.datamodule import default_cache_dir
    from model.vit import BUILTIN, DEFAULT_MODEL, TINY

    args.cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if args.data is None:
        from dali_pipe.demo import make_photo_dataset

        args.data = str(make_photo_dataset(args.cache_dir / "demo-photos", classes=4, per_class=100,
                                           seed=args.seed))
        args.model = args.model or TINY
        print(f"demo: no --data given; training on generated photos in {args.data}")
    args.model = args.model or DEFAULT_MODEL
    if args.lr is None:
        args.lr = DEMO_LR if args.model in BUILTIN else FINETUNE_LR
    if not args.benchmark:  # the benchmark sizes threads after pinning --cpus
        args.num_threads = args.num_threads or max(1, _cores() - 1)
    args.device = resolve_device(args.device)
    args.precision = resolve_precision(args.precision, args.device)
    args.output = Path(args.output)
    args.log_dir = Path(args.log_dir) if args.log_dir else args.output / "tensorboard"
    args.checkpoint_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else args.output / "checkpoints"
    return args


def data_config(args: argparse.Namespace):
    from dali_pipe.datamodule import DataConfig

    return DataConfig(data=args.data, output=args.output, batch_size=args.batch_size, device=args.device,
                      num_threads=args.num_threads, val_fraction=args.val_fraction, seed=args.seed,
                      cache_dir=args.cache_dir, scan=args.scan, max_pixels=args.max_pixels,
                      max_bad_fraction=args.max_bad_fraction, skip_missing=args.skip_missing)


def train(args: argparse.Namespace) -> dict:
    """Fit the model and write it to OUTPUT in save_pretrained form. Returns the last epoch's metrics."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from dali_pipe.datamodule import DaliDataModule
    from dali_pipe.spec import ImageSpec
    from model.checkpoint import SpotSafeCheckpoint, resume_path
    from model.module import ViTClassifier
    from model.progress import PlainProgress
    from model.vit import load_processor

    pl.seed_everything(args.seed, workers=True, verbose=False)
    processor = load_processor(args.model)
    dm = DaliDataModule(data_config(args), ImageSpec.from_processor(processor))
    module = ViTClassifier(args.model, lr=args.lr)
    ckpt = SpotSafeCheckpoint(args.checkpoint_dir, every_steps=args.checkpoint_every_steps)
    progress_bar = sys.stderr.isatty()
    callbacks = [ckpt] if progress_bar else [ckpt, PlainProgress()]
    if args.monitor:
        from dali_pipe.monitor import MonitorCallback

        callbacks.append(MonitorCallback(args.output))
    world = (args.devices if args.devices != "auto" else max(1, _gpu_count())) * args.num_nodes
    trainer = pl.Trainer(
        accelerator=args.device, devices=args.devices, num_nodes=args.num_nodes,
        strategy="ddp" if world > 1 else "auto", precision=args.precision,
        max_epochs=args.epochs, max_steps=args.max_steps, use_distributed_sampler=False,
        logger=TensorBoardLogger(str(args.log_dir), name="", version=""), enable_checkpointing=False,
        callbacks=callbacks, log_every_n_steps=10, enable_progress_bar=progress_bar,
        enable_model_summary=False)
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=resume_path(args.checkpoint_dir))
    except SIGTERMException:
        pass  # SpotSafeCheckpoint saved; report below and exit 0
    if ckpt.interrupted:
        print(f"stopped by SIGTERM; checkpoint saved to {args.checkpoint_dir}. Rerun the same command to resume.")
        return {"interrupted": True, "global_step": trainer.global_step}
    if trainer.is_global_zero:
        save_model(module, processor, args.output)
        print(f"model, image processor and label map written to {args.output}")
        print(f"TensorBoard logs in {args.log_dir}")
        print(f"TRAINED global_step={trainer.global_step}")
    last = module.epoch_metrics[-1] if module.epoch_metrics else {}
    return {**last, "global_step": trainer.global_step}


def save_model(module, processor, out: Path) -> None:
    """save_pretrained form (config.json with id2label, weights, preprocessor_config.json) + label_map.json."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    module.model.save_pretrained(out)
    processor.save_pretrained(out)
    (out / "label_map.json").write_text(json.dumps(module.model.config.id2label, indent=1, sort_keys=True))


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        from dali_pipe.sagemaker import run_sagemaker

        return run_sagemaker(argv[1:], main)
    args = get_args_parser().parse_args(argv)
    problems = validate_args(args)
    if problems:
        raise UsageError("invalid arguments:\n  " + "\n  ".join(problems))
    args = resolve_defaults(args)
    if args.benchmark:
        from dali_pipe.benchmark import run_benchmark

        return run_benchmark(args)
    return train(args)


class UsageError(ValueError):
    """Bad flags; the message lists every problem."""


def cli() -> int:
    """Entry point: user errors become one clear message and exit status 2, not a traceback."""
    import warnings

    from dali_pipe.errors import user_errors

    # Lightning 2.6 on torch 2.13 warns about its own pytree use; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    try:
        main()
    except (UsageError, *user_errors()) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
