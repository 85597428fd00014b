"""LightningDataModule: manifest -> (S3 sync) -> scan -> DALI pipelines -> epoch-exact loaders.

- `prepare_data` (once per node, other ranks wait): sync from S3 when `data` is an s3:// URI,
  then the pre-flight scan, whose verdicts are cached and whose report goes to OUT.
- `setup`: after the distributed environment exists, read the manifest, drop the bad files
  (cache hits only, no decoding) and build the pipelines: `device_id` = local rank, sharded by
  global rank, sized by `resources_for_rank`. The loaders are not torch DataLoaders, so
  Lightning adds no sampler.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytorch_lightning as pl

from .config import DataSettings, PipelineSettings
from .errors import UserError
from .manifest import Manifest, Sample, read_manifest
from .pipeline import Augment, Files, PipelineOptions, Shards, build_pipeline, resources_for_rank
from .scan import ScanResult, scan, write_report
from .shards.source import ShardSet, source_kind
from .spec import ImageSpec


class ScanError(UserError):
    """Too many bad images; the message points at the report."""


class BatchTooLargeError(UserError):
    """The batch is larger than one rank's share of the training data."""


def local_root(data: DataSettings) -> Path:
    """The local dataset root: the directory itself, or the sync target of an s3:// URI."""
    if data.data.startswith("s3://"):
        from .sync import local_target

        return local_target(data.data, Path(data.cache_dir))
    return Path(data.data)


def read(data: DataSettings) -> Manifest | ShardSet:
    """The manifest of the (local) dataset, split as the settings say; or the shards at --data (a pack,
    or shards written by others), checked (shards/source.py; cached verdicts)."""
    if source_kind(data.data, data.cache_dir) != "files":
        from .shards.source import open_shards

        return open_shards(data)
    return read_manifest(local_root(data), val_fraction=data.val_fraction, seed=data.seed,
                         skip_missing=data.skip_missing)


def scan_manifest(manifest: Manifest, data: DataSettings, *, num_threads: int, progress: bool) -> ScanResult:
    """Scan every file of the manifest (verdicts cached under the cache dir)."""
    return scan([s.path for s in manifest.train + manifest.val], data.scan, max_pixels=data.max_pixels,
                num_threads=num_threads, cache_path=Path(data.cache_dir) / "scan-cache.json", progress=progress)


def missing_reasons(manifest: Manifest) -> dict[str, str]:
    """{absolute path: reason} for the files the manifest lists but the disk lacks (--skip-missing)."""
    root = manifest.root.resolve()
    return {str(root / rel): "missing on disk (listed in dataset.tsv; --skip-missing)" for rel in manifest.missing}


def report(manifest: Manifest, result: ScanResult, data: DataSettings, output: Path) -> None:
    """Write OUT/bad_images.tsv (bad and, with --skip-missing, missing files) and say what was excluded."""
    if data.skip_missing and manifest.missing:
        print(f"--skip-missing: training without {len(manifest.missing)} listed file(s) that are missing, "
              f"e.g. {manifest.missing[0]!r}", file=sys.stderr)
    if data.scan == "off" and not manifest.missing:
        return
    missing = missing_reasons(manifest)
    path = write_report({**result.bad, **missing}, manifest.root.resolve(), output)
    if result.bad or missing:
        print(f"scan: excluded {len(result.bad) + len(missing)} of {result.total + len(missing)} file(s); "
              f"reasons in {path}", file=sys.stderr)


def check_bad_fraction(result: ScanResult, data: DataSettings, output: Path) -> None:
    """Abort when more than --max-bad-fraction of the files are bad."""
    if result.total and len(result.bad) / result.total > data.max_bad_fraction:
        path, reason = next(iter(sorted(result.bad.items())))
        raise ScanError(f"{len(result.bad)} of {result.total} images are bad "
                        f"({len(result.bad) / result.total:.1%} > --max-bad-fraction {data.max_bad_fraction}), "
                        f"e.g. {path}: {reason}. See {output / 'bad_images.tsv'}; fix or remove them, or raise "
                        "--max-bad-fraction.")


def prepare(data: DataSettings, output: Path, *, num_threads: int) -> tuple[Manifest, ScanResult]:
    """Once per node: sync s3:// data, scan, write the report, enforce --max-bad-fraction.
    Returns the manifest without the bad files, and the scan's result."""
    from .config import SyncSettings

    if source_kind(data.data, data.cache_dir) != "files":  # shards: fetch a pack, index others', check members
        from .shards import source

        shards = source.prepare_shards(data, num_threads=num_threads, workers=SyncSettings.workers)
        source.report(shards, data.scan, output)
        result = shards.scan_result()
        check_bad_fraction(result, data, output)
        return shards, result
    if data.data.startswith("s3://"):
        from .sync import sync

        sync(data.data, local_root(data), workers=SyncSettings.workers, skip_missing=data.skip_missing)
    manifest = read(data)
    result = scan_manifest(manifest, data, num_threads=num_threads, progress=True)
    report(manifest, result, data, output)
    check_bad_fraction(result, data, output)
    return manifest.without(set(result.bad)), result


def check_batch(n: int, batch_size: int, num_shards: int) -> None:
    """Training keeps full batches only: each rank's share must hold at least one."""
    if n // num_shards < batch_size:
        raise BatchTooLargeError(f"--batch-size {batch_size} is larger than the {n // num_shards} training "
                                 f"images each of the {num_shards} rank(s) gets; lower --batch-size.")


class DaliDataModule(pl.LightningDataModule):
    def __init__(self, data: DataSettings, pipeline: PipelineSettings, spec: ImageSpec, output: Path):
        super().__init__()
        self.data, self.pipeline, self.spec, self.output = data, pipeline, spec, Path(output)
        self.manifest: Manifest | None = None
        self._train = self._val = None
        self._prepared = False
        self.scan_result: ScanResult | None = None  # what prepare_data's scan found (the main process's)

    @property
    def classes(self) -> list[str]:
        return self.manifest.classes

    def _rank(self) -> tuple[int, int, int, int]:
        """(global rank, world size, local rank, processes on this node)."""
        t = self.trainer
        if t is None:
            return 0, 1, 0, 1
        return t.global_rank, t.world_size, t.local_rank, max(1, t.world_size // t.num_nodes)

    def prepare_data(self) -> None:
        """Sync, scan and report once (a second call, such as Lightning's after the CLI's, does nothing)."""
        if self._prepared:
            return
        threads = resources_for_rank(self.pipeline, local_world_size=self._rank()[3]).num_threads
        self.manifest, self.scan_result = prepare(self.data, self.output, num_threads=threads)
        self._prepared = True

    def setup_manifest(self, world_size: int | None = None) -> Manifest:
        """The manifest without the bad files (scan cache hits only, no decoding), checked against
        the batch size for `world_size` ranks (default: the trainer's)."""
        if self.manifest is None:
            manifest = read(self.data)
            if isinstance(manifest, ShardSet):
                self.manifest = manifest
            else:
                result = scan_manifest(manifest, self.data, num_threads=1, progress=False)
                self.manifest = manifest.without(set(result.bad))
        check_batch(len(self.manifest.train), self.data.batch_size, world_size or self._rank()[1])
        return self.manifest

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        self.setup_manifest()
        self._train = self.loader(self.manifest.train, training=True)
        self._val = self.loader(self.manifest.val, training=False) if self.manifest.val else None

    def loader(self, samples: list[Sample], *, training: bool):
        """An epoch-exact DALI loader over `samples` for this rank."""
        from .loader import DaliLoader

        rank, world, local_rank, local_world = self._rank()
        gpu = self.pipeline.device == "gpu"
        opts = PipelineOptions(
            batch_size=self.data.batch_size, device=self.pipeline.device,
            resources=resources_for_rank(self.pipeline, local_world_size=local_world, training=training),
            augment=Augment.from_settings(self.pipeline), device_id=local_rank if gpu else None,
            seed=self.data.seed, shard_id=rank, num_shards=world)
        source = (samples if isinstance(samples, Shards)
                  else Files([s.path for s in samples], [s.label for s in samples]))
        return DaliLoader(lambda checkpoint: build_pipeline(source, self.spec, opts, training=training,
                                                            checkpoint=checkpoint), training=training)

    # -- resume: each rank's loader position lives in the Lightning checkpoint -----------------
    def state_dict(self) -> dict:
        """Every rank's training-loader state (gathered to rank 0, which writes the checkpoint)."""
        if self._train is None:
            return {}
        mine = self._train.state()
        world = self._rank()[1]
        if world > 1:
            import torch.distributed as dist

            states = [None] * world
            dist.all_gather_object(states, mine)
        else:
            states = [mine]
        return {"loaders": states}

    def load_state_dict(self, state: dict) -> None:
        """Continue this rank's epoch where the checkpoint left it (same permutation, same position)."""
        loaders = state.get("loaders")
        rank, world = self._rank()[:2]
        if not loaders or len(loaders) != world:
            print("resume: the checkpoint has no loader position for this world size; the data order of the "
                  "resumed epoch restarts from its beginning", file=sys.stderr)
            return
        self._train.restore(loaders[rank])

    def train_dataloader(self):
        return self._train

    def val_dataloader(self):
        return self._val if self._val is not None else []
