"""LightningDataModule: manifest -> (S3 sync) -> scan -> DALI pipelines -> epoch-exact loaders.

- `prepare_data` (once per node, other ranks wait): sync from S3 when `data` is an s3:// URI,
  then the pre-flight scan, whose verdicts are cached and whose report goes to OUT.
- `setup`: after the distributed environment exists, read the manifest, drop the bad files
  (cache hits only, no decoding) and build the pipelines: on the Trainer's CUDA device, sharded by
  global rank, sized by `resources_for_rank`. The loaders are not torch DataLoaders, so
  Lightning adds no sampler.
- `state_dict` / `load_state_dict`: every rank's loader position, with the run's data fingerprint;
  a checkpoint of other data (files, classes, image size, batch size, processes, seed) or of other
  augmentations (the pipeline's recipe settings) is refused, right after Lightning reads it and before
  any of it (weights, optimizer, loops) is restored (`check_before_restore`).

This class takes the settings objects (the CLI builds it from them); the keyword form that users
call, `dali_pipe.DaliDataModule(data=..., batch_size=...)`, is its subclass in `dali_pipe/api.py`.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import pytorch_lightning as pl
from lightning_fabric.plugins import CheckpointIO

from .config import DataSettings, PipelineSettings, recipe_names, resolve_device
from .dataset import (
    check_batch,
    data_line,
    differences,
    drop_note,
    fingerprint,
    no_training,
    prepare,
    read,
    scan_manifest,
)
from .errors import RunMismatchError, UserError
from .loader import DaliLoader, ReaderChanged
from .manifest import Manifest
from .naming import named
from .pipeline import Augment, PipelineOptions, build_pipeline, resources_for_rank, shard_reader
from .samples import Files, Sample, Samples, Shards
from .scan import ScanResult
from .shards.cache import StreamCache, stream_bound, stream_folder
from .shards.shardset import ShardSet
from .shards.verdicts import Remote, is_remote
from .spec import ImageSpec


class NotPreparedError(UserError):
    """The data was asked about before prepare_data() read it, or a loader before setup() built it; the
    message names the call that is missing."""


class EmptySplitError(UserError):
    """trainer.test or trainer.predict asked for the validation split, and it has no samples."""


class DeviceMismatchError(UserError):
    """device='gpu' for a Trainer that runs on the CPU."""


class DaliDataModule(pl.LightningDataModule):
    """The DALI loaders for Lightning, built from resolved settings (see `dali_pipe.DaliDataModule` for
    the keyword form). `output` is where reports go (None: the Trainer's default_root_dir); a device of
    "auto" follows the Trainer's accelerator once one is attached; `manifest`: the local dataset's, when the
    caller has read it already (it is then not read again)."""

    def __init__(self, data: DataSettings, pipeline: PipelineSettings, spec: ImageSpec, output: Path | None = None,
                 manifest: Manifest | None = None):
        super().__init__()
        self.data, self.pipeline, self.spec = data, pipeline, spec
        self._output = None if output is None else Path(output)
        self._described = manifest
        self.manifest: Manifest | None = None
        self._train = self._val = None
        self._prepared = False
        self.scan_result: ScanResult | None = None  # what prepare_data's scan found (the main process's)
        self.spans: dict[str, tuple[float, float]] = {}  # perf_counter (start, end) of prepare_data and setup
        self.announce = False  # prepare_data() prints data_line(), setup() drop_note() (the CLI's summary says both)
        self.style = "flag"  # how the user names settings in what is printed (config.named: "keyword", the library)
        self.labels = True  # False: shards are read without their cls, and may have none (predict)
        self._digest: str | None = None

    @property
    def output(self) -> Path:
        """Where reports go (bad_images.tsv): as given, else the Trainer's default_root_dir, else the
        current directory (Lightning's own default root); without a given output, only a report that
        lists something is written."""
        if self._output is not None:
            return self._output
        return Path(self.trainer.default_root_dir) if self.trainer is not None else Path.cwd()

    @property
    def device(self) -> str:
        """Where DALI decodes: "gpu" or "cpu" as set; "auto" follows the attached Trainer (its CUDA
        accelerator: gpu, else cpu), and without one picks the GPU when CUDA is available."""
        want, t = self.pipeline.device, self.trainer
        if t is None:
            return resolve_device(want)
        from pytorch_lightning.accelerators import CUDAAccelerator

        on_gpu = isinstance(t.accelerator, CUDAAccelerator)
        if want == "gpu" and not on_gpu:
            raise DeviceMismatchError(f"device='gpu', but the Trainer runs on {type(t.accelerator).__name__}; pass "
                                      "device='auto' to follow the Trainer, or Trainer(accelerator='gpu')")
        return ("gpu" if on_gpu else "cpu") if want == "auto" else want

    @property
    def classes(self) -> list[str]:
        """The label names in class-index order (a batch's label i is classes[i]): known after prepare_data(),
        so a model can be sized from them before training."""
        return self._read().classes

    def _read(self) -> Manifest | ShardSet:
        if self.manifest is None:
            raise NotPreparedError("the classes are known once the data is read: call dm.prepare_data() first "
                                   "(trainer.fit calls it too)")
        return self.manifest

    def fingerprint(self, world_size: int | None = None) -> dict:
        """What a resumed run must share with the checkpoint's: the data (files, labels, split), the classes,
        the image size, the number of processes, and the data and pipeline settings that change what the
        weights become (batch size, seed, crop and augmentations: config.py's identity=RECIPE)."""
        if self._digest is None:  # a hash over every sample: once, not at every checkpoint
            self._digest = self._read().digest()
        return fingerprint(self._digest, self.classes, (self.spec.height, self.spec.width),
                           world_size or self._rank()[1], self.data, self.pipeline)

    def _rank(self) -> tuple[int, int, int, int]:
        """(global rank, world size, local rank, processes on this node)."""
        t = self.trainer
        if t is None:
            return 0, 1, 0, 1
        return t.global_rank, t.world_size, t.local_rank, max(1, t.world_size // t.num_nodes)

    def prepare_data(self) -> None:
        """Sync s3:// data, scan and write the report, once per node (a second call, such as Lightning's
        after the CLI's, does nothing). In a process Lightning launched for another local rank (it starts
        them inside `fit`, after the node's main process has prepared) it only reads the manifest; with a
        launcher that starts every rank at once (torchrun), let `fit` call it for s3:// data, since Lightning
        then waits for the main process before the others read."""
        if self._prepared:
            return
        start = time.perf_counter()
        if os.environ.get("LOCAL_RANK", "0") != "0":
            self._read_manifest()
        else:
            threads = resources_for_rank(self.pipeline, local_world_size=self._rank()[3]).num_threads
            self.manifest, self.scan_result = prepare(self.data, self.output, num_threads=threads,
                                                      report_empty=self._output is not None, labels=self.labels,
                                                      manifest=self._described)
            if self.announce:  # once: a second call (Lightning's, after the user's) returns above
                print(data_line(self.manifest, self.data.scan, self.scan_result), flush=True)
        self._prepared = True
        self.spans["prepare_data"] = (start, time.perf_counter())

    def _read_manifest(self) -> None:
        if self.manifest is None:
            manifest = self._described or read(self.data, labels=self.labels)
            if isinstance(manifest, ShardSet):
                self.manifest = manifest
            else:
                result = scan_manifest(manifest, self.data, num_threads=1, progress=False)
                self.manifest = manifest.without(set(result.bad))

    def setup_manifest(self, world_size: int | None = None) -> Manifest:
        """The manifest without the bad files (scan cache hits only, no decoding), checked against
        the batch size for `world_size` ranks (default: the trainer's)."""
        self._read_manifest()
        check_batch(len(self.manifest.train), self.data.batch_size, world_size or self._rank()[1],
                    no_training(self.data.data, self.manifest))
        return self.manifest

    def setup(self, stage: str | None = None) -> None:
        """Build this rank's pipelines (after the distributed environment exists); for `fit`, have the
        checkpoint to resume checked against this run before Lightning restores any of it."""
        if stage == "fit" and self.trainer is not None:
            check_before_restore(self.trainer, type(self).__qualname__, self._check_checkpoint)
        if self._train is not None:
            return
        start = time.perf_counter()
        self.setup_manifest()
        rank, world = self._rank()[:2]
        note = drop_note(len(self.manifest.train), self.data.batch_size, world) if self.announce and rank == 0 else None
        if note:
            print(named(note, self.style), file=sys.stderr, flush=True)
        try:
            train = self.loader(self.manifest.train, training=True, check_cache=False)
            val = self.loader(self.manifest.val, training=False, check_cache=False) if self.manifest.val else None
            if getattr(self, "_stream", None) is not None:
                self._stream.check()  # once both readers are known: a refusal asks for enough for both
        except BaseException:
            self.teardown()  # no fetching goes on for loaders that will never run
            raise
        self._train, self._val = train, val
        self.spans["setup"] = (start, time.perf_counter())

    def loader(self, samples: list[Sample] | Shards, *, training: bool, check_cache: bool = True):
        """An epoch-exact DALI loader over `samples` (files, or shards through their epoch plan) for this rank.
        `check_cache`: refuse now a --stream-cache too small for the readers registered so far (setup checks
        once, after registering the training and the validation reader)."""
        opts = self.options(training=training)
        if isinstance(samples, Shards):
            store = self._stream_view(samples)
            source = shard_reader(samples, opts, training=training, store=store)
            if store is not None:
                store.register(source, check=check_cache)  # refuses a --stream-cache too small for the plans
        else:
            samples = Samples.of(samples)
            source = Files(samples.paths, samples.labels)
        return DaliLoader(lambda checkpoint: build_pipeline(source, self.spec, opts, training=training,
                                                            checkpoint=checkpoint), training=training)

    def options(self, *, training: bool) -> PipelineOptions:
        """This rank's pipeline options. DALI runs on the Trainer's own CUDA device (its strategy's root
        device), whatever form `devices=` took: cuda:2 and cuda:3 for devices=[2, 3] or "2,3", not the local
        ranks 0 and 1; without a Trainer, device 0."""
        rank, world, _, local_world = self._rank()
        device = self.device
        return PipelineOptions(
            batch_size=self.data.batch_size, device=device,
            resources=resources_for_rank(self.pipeline, local_world_size=local_world, training=training),
            augment=Augment.from_settings(self.pipeline), device_id=self._device_id() if device == "gpu" else None,
            seed=self.data.seed, shard_id=rank, num_shards=world)

    def _device_id(self) -> int:
        root = self.trainer.strategy.root_device if self.trainer is not None else None
        if root is not None and root.type == "cuda" and root.index is not None:
            return root.index
        return self._rank()[2] if self.trainer is not None else 0

    def _stream_view(self, shards: Shards):
        """The streaming cache's view for shards read from S3 or HTTP(S) (None when all are local). One cache
        per rank, in CACHE_DIR/stream/BUCKET/PREFIX/rank-N (HTTP: CACHE_DIR/stream/http/DIGEST/rank-N),
        shared by its loaders."""
        if not any(is_remote(p) for p in shards.paths):
            return None
        if getattr(self, "_stream", None) is None:
            rank, _, _, local_world = self._rank()
            folder = stream_folder(self.data.data, self.data.cache_dir) / f"rank-{rank}"
            remotes = [Remote(p, z, h, xxh3=x) for split in (self.manifest.train, self.manifest.val, shards)
                       for p, z, h, x in zip(split.paths, split.sizes or (None,) * len(split.paths),
                                             split.sha256 or (None,) * len(split.paths),
                                             split.xxh3 or (None,) * len(split.paths)) if is_remote(p)]
            remotes = list({r.url: r for r in remotes}.values())
            self._stream = StreamCache(folder, remotes, stream_bound(self.data.stream_cache, folder, local_world),
                                       local_ranks=local_world)
        return self._stream.view(shards)

    def teardown(self, stage: str | None = None) -> None:
        """Stop the streaming cache's fetches (its landed shards stay for a rerun)."""
        if getattr(self, "_stream", None) is not None:
            self._stream.close()
            self._stream = None

    # -- resume: each rank's loader position lives in the Lightning checkpoint -----------------
    def state_dict(self) -> dict:
        """Every rank's training-loader state (gathered to rank 0, which writes the checkpoint), with the
        run's fingerprint."""
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
        return {"loaders": states, "fingerprint": self.fingerprint()}

    def _check_checkpoint(self, checkpoint: dict) -> None:
        """Refuse a checkpoint of another run (RunMismatchError naming each difference)."""
        saved = (checkpoint.get(type(self).__qualname__) or {}).get("fingerprint")
        if saved is None:
            return
        diff = differences(saved, self.fingerprint(), optional=LIBRARY_OPTIONAL)
        if diff:
            raise RunMismatchError("the checkpoint to resume belongs to another run:\n  " + "\n  ".join(diff) +
                                   "\n  Resume it with the settings it was written with, or start this run "
                                   "without it (another checkpoint directory, or fit without ckpt_path).")

    def load_state_dict(self, state: dict) -> None:
        """Continue this rank's epoch where the checkpoint left it (same permutation, same position). A
        checkpoint of another run (other data, classes, image size, processes, batch size, seed or
        augmentations) was refused before anything was restored (setup's check; checked here again for a
        Trainer whose checkpoint IO was replaced after setup)."""
        if self.trainer is None or fitting(self.trainer):
            self._check_checkpoint({type(self).__qualname__: state})
        loaders = state.get("loaders")
        rank, world = self._rank()[:2]
        if not loaders or len(loaders) != world:
            print("resume: the checkpoint has no loader position for this world size; the data order of the "
                  "resumed epoch restarts from its beginning", file=sys.stderr)
            return

        try:
            self._train.restore(loaders[rank])
        except ReaderChanged as e:
            print(f"resume: {e}; the data order of the resumed epoch restarts from its beginning", file=sys.stderr)

        # Lightning looks for state_dict on the loader itself; ours is restored through this DataModule
        warnings.filterwarnings("ignore", message=r".*before the epoch ended and your dataloader is not resumable")

    def _built(self, call: str) -> None:
        """NotPreparedError naming what is missing when a loader is asked for before setup() built them."""
        if self._train is None:
            first = "dm.prepare_data(), then dm.setup()" if self.manifest is None else "dm.setup()"
            raise NotPreparedError(f"dm.{call}() was called before the loaders were built: call {first} first "
                                   "(trainer.fit, validate, test and predict call both themselves)")

    def train_dataloader(self):
        self._built("train_dataloader")
        return self._train

    def val_dataloader(self):
        self._built("val_dataloader")
        if self._val is not None:
            return self._val

        # no validation data (--val-fraction 0, or no val rows): Lightning skips the loop on an empty list and
        # warns that its length is zero, which here is meant (the start-up summary said "0 val images")
        warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")
        return []

    def test_dataloader(self):
        """`trainer.test`: the validation split, unaugmented, every sample once (there is no third split)."""
        return self._eval_split("test")

    def predict_dataloader(self):
        """`trainer.predict`: the validation split, unaugmented, every sample once, in the order of
        `dm.manifest.val` (with several processes, each rank a contiguous part of it), so that the
        outputs map back to its files: a prediction writer (BasePredictionWriter) gets each batch's
        positions in that order as its `batch_indices`."""
        loader = self._eval_split("predict")
        rank, world = self._rank()[:2]
        return IndexedBatches(loader, split_positions(len(self.manifest.val), rank, world, self.data.batch_size,
                                                      len(loader)))

    def _eval_split(self, stage: str):
        self._built(f"{stage}_dataloader")
        if self._val is None:
            raise EmptySplitError(f"nothing to {stage}: the validation split is empty; give the DataModule a "
                                  "val_fraction= above 0, or val rows in dataset.tsv's split column")
        return self._val


def split_positions(n: int, rank: int, world: int, batch: int, batches: int) -> list[list[int]]:
    """Positions in an evaluation split of n samples of each of `batches` batches that `rank` of `world` reads:
    its contiguous share [n*rank//world, n*(rank+1)//world) (DALI's file reader shards so, and so does the
    shard plan's evaluation), in order, `batch` at a time; a rank whose share is one short ends with an empty
    batch, as its loader does."""
    lo, hi = n * rank // world, n * (rank + 1) // world
    return [list(range(min(lo + b * batch, hi), min(lo + (b + 1) * batch, hi))) for b in range(batches)]


class IndexedBatches:
    """A loader's batches, each with its positions in the split, where Lightning's predict loop reads them for
    prediction writers: the `batch_sampler` it wraps around a torch DataLoader's own (its
    _IndexBatchSamplerWrapper, Lightning's one hook for this; without it, as before, batch_indices are empty)."""

    def __init__(self, loader, positions: list[list[int]]):
        self.loader, self.positions = loader, positions
        self.batch_size = loader.batch_size
        try:
            from pytorch_lightning.overrides.distributed import _IndexBatchSamplerWrapper
        except ImportError:  # another Lightning: prediction writers get no batch_indices
            self.batch_sampler = None
        else:
            self.batch_sampler = _IndexBatchSamplerWrapper(_Positions(positions))

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        seen = iter(self.batch_sampler) if self.batch_sampler is not None else None
        for batch in self.loader:
            if seen is not None:
                next(seen, None)  # the wrapper records this batch's positions, as it does for a DataLoader
            yield batch


class _Positions:
    """The batch sampler behind IndexedBatches: the positions of each batch."""

    def __init__(self, positions: list[list[int]]):
        self.positions = positions

    def __iter__(self):
        return iter(self.positions)

    def __len__(self) -> int:
        return len(self.positions)


LIBRARY_OPTIONAL = frozenset(recipe_names(("pipeline",)))  # what checkpoints written before they counted lack


class CheckedLoad(CheckpointIO):
    """A Trainer's checkpoint IO with checks: each checkpoint it loads goes through every check (which may
    raise) before Lightning restores any part of it. Lightning 2.6 reads the file through the strategy's
    checkpoint IO first, then restores the LightningModule (its on_load_checkpoint hook, then its weights),
    and only then the DataModule and the callbacks: a check in a DataModule's or a callback's
    load_state_dict comes after the user's weights were overwritten. Saving and the rest are the wrapped
    IO's (Lightning's TorchCheckpointIO, or the user's own)."""

    def __init__(self, inner, trainer):
        self.inner, self.trainer = inner, trainer
        self.checks: dict[str, object] = {}  # name -> check(checkpoint dict)

    def load_checkpoint(self, path, *args, **kwargs):
        checkpoint = self.inner.load_checkpoint(path, *args, **kwargs)
        if fitting(self.trainer):  # a resume; validate/test/predict read only the weights of a checkpoint
            for check in self.checks.values():
                check(checkpoint)
        return checkpoint

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def fitting(trainer) -> bool:
    """Whether `trainer` is in `fit` (a checkpoint it loads is a resume), not validate, test or predict."""
    return getattr(getattr(trainer, "state", None), "fn", None) == "fit"


def check_before_restore(trainer, name: str, check) -> None:
    """Have `check(checkpoint)` run on every checkpoint `trainer` loads to resume `fit`, before any of it is
    restored (once per name: a second call replaces the first)."""
    io = trainer.strategy.checkpoint_io
    if not isinstance(io, CheckedLoad):
        io = CheckedLoad(io, trainer)
        trainer.strategy.checkpoint_io = io
    io.checks[name] = check
