"""LightningDataModule: manifest -> (S3 sync) -> scan -> DALI pipelines -> epoch-exact loaders.

- `prepare_data` (once per node, other ranks wait): sync from S3 when `data` is an s3:// URI,
  then the pre-flight scan, whose verdicts are cached and whose report goes to OUT.
- `setup`: after the distributed environment exists, read the manifest, drop the bad files
  (cache hits only, no decoding) and build the pipelines: `device_id` = local rank, sharded by
  global rank. The loaders are not torch DataLoaders, so Lightning adds no sampler.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytorch_lightning as pl

from .manifest import Manifest, read_manifest
from .pipeline import PipelineOptions, build_pipeline, default_num_threads
from .scan import scan, write_report
from .spec import ImageSpec


class ScanError(RuntimeError):
    """Too many bad images; the message points at the report."""


def default_cache_dir() -> Path:
    """Where S3 data and the scan cache live: $DALI_PIPE_CACHE, else ~/.cache/dali_pipe."""
    return Path(os.environ.get("DALI_PIPE_CACHE", Path.home() / ".cache" / "dali_pipe"))


@dataclass
class DataConfig:
    data: str  # dataset root holding dataset.tsv, or s3://bucket/prefix
    output: Path  # run output dir; bad_images.tsv is written here
    batch_size: int = 32  # per rank
    device: str = "gpu"  # "gpu" or "cpu": where DALI decodes and outputs
    num_threads: int = field(default_factory=default_num_threads)  # DALI CPU threads per rank
    val_fraction: float = 0.1  # used when the manifest has no split column
    seed: int = 0  # split and augmentation seed
    cache_dir: Path = field(default_factory=default_cache_dir)  # S3 sync target + scan cache
    scan: str = "fast"  # off | fast | full
    max_pixels: int = 89_478_485  # images above this many pixels are rejected by the scan
    max_bad_fraction: float = 0.05  # abort when more than this share of files is bad
    skip_missing: bool = False  # train without files the manifest lists but the disk lacks


def resolve_root(cfg: DataConfig) -> Path:
    """The local dataset root: the directory itself, or the sync target of an s3:// URI."""
    if cfg.data.startswith("s3://"):
        from .sync import local_target

        return local_target(cfg.data, cfg.cache_dir)
    return Path(cfg.data)


def checked_manifest(cfg: DataConfig, *, progress: bool = True, write: bool = True) -> Manifest:
    """Read the manifest and drop the files the scan rejects; abort over --max-bad-fraction."""
    root = resolve_root(cfg)
    manifest = read_manifest(root, val_fraction=cfg.val_fraction, seed=cfg.seed, skip_missing=cfg.skip_missing)
    if cfg.skip_missing and manifest.missing and write:
        print(f"--skip-missing: training without {len(manifest.missing)} listed file(s) that are missing, "
              f"e.g. {manifest.missing[0]!r}", file=sys.stderr)
    files = [s.path for s in manifest.train + manifest.val]
    result = scan(files, cfg.scan, max_pixels=cfg.max_pixels, num_threads=cfg.num_threads,
                  cache_path=cfg.cache_dir / "scan-cache.json", progress=progress)
    if write and (cfg.scan != "off" or manifest.missing):
        missing = {str(root.resolve() / rel): "missing on disk (listed in dataset.tsv; --skip-missing)"
                   for rel in manifest.missing}
        report = write_report({**result.bad, **missing}, root.resolve(), Path(cfg.output))
        if result.bad or missing:
            print(f"scan: excluded {len(result.bad) + len(missing)} of {len(files) + len(missing)} file(s); "
                  f"reasons in {report}", file=sys.stderr)
    if files and len(result.bad) / len(files) > cfg.max_bad_fraction:
        example = next(iter(sorted(result.bad.items())))
        raise ScanError(f"{len(result.bad)} of {len(files)} images are bad "
                        f"({len(result.bad) / len(files):.1%} > --max-bad-fraction {cfg.max_bad_fraction}), "
                        f"e.g. {example[0]}: {example[1]}. See {Path(cfg.output) / 'bad_images.tsv'}; fix or "
                        "remove them, or raise --max-bad-fraction.")
    return manifest.without(set(result.bad))


def prepare(cfg: DataConfig) -> Manifest:
    """Once per node: sync from S3 when `data` is an s3:// URI, then scan (verdicts cached, report to OUT)."""
    if cfg.data.startswith("s3://"):
        from .sync import sync

        sync(cfg.data, resolve_root(cfg))
    return checked_manifest(cfg)


class DaliDataModule(pl.LightningDataModule):
    def __init__(self, cfg: DataConfig, spec: ImageSpec):
        super().__init__()
        self.cfg, self.spec = cfg, spec
        self.manifest: Manifest | None = None
        self._train = self._val = None

    @property
    def classes(self) -> list[str]:
        return self.manifest.classes

    def prepare_data(self) -> None:
        prepare(self.cfg)

    def setup(self, stage: str | None = None) -> None:
        if self.manifest is not None:
            return
        self.manifest = checked_manifest(self.cfg, progress=False, write=False)
        trainer = self.trainer
        rank, world, local_rank = ((trainer.global_rank, trainer.world_size, trainer.local_rank)
                                   if trainer is not None else (0, 1, 0))
        opts = PipelineOptions(batch_size=self.cfg.batch_size, device=self.cfg.device,
                               device_id=local_rank if self.cfg.device == "gpu" else None,
                               num_threads=self.cfg.num_threads, seed=self.cfg.seed,
                               shard_id=rank, num_shards=world)
        self._train = self._loader(self.manifest.train, opts, training=True)
        self._val = self._loader(self.manifest.val, opts, training=False) if self.manifest.val else None

    def _loader(self, samples, opts: PipelineOptions, *, training: bool):
        from .loader import DaliLoader

        n = len(samples)
        if training and n // opts.num_shards < opts.batch_size:
            raise ValueError(f"--batch-size {opts.batch_size} is larger than the {n // opts.num_shards} training "
                             f"images each of the {opts.num_shards} rank(s) gets; lower --batch-size.")
        pipe = build_pipeline([s.path for s in samples], [s.label for s in samples], self.spec, opts,
                              training=training)
        return DaliLoader(pipe, training=training)

    def train_dataloader(self):
        return self._train

    def val_dataloader(self):
        return self._val if self._val is not None else []
