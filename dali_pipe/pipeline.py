"""The DALI pipeline: one definition, built for the GPU (`device="gpu"`) or the CPU (`device="cpu"`),
and `resources_for_rank()`, the one place that sizes its threads, queues and decoder memory.

On the GPU, nvJPEG decodes (`device="mixed"`): the DALI CPU threads read the bytes and do the Huffman
decoding (a GPU's hardware JPEG decoder, on A100 and H100, takes its share of the JPEGs whole), the GPU the
rest of the decode; then the GPU resizes, augments and normalises, and images and labels come out on the GPU.
Chroma is upsampled as libjpeg-turbo does (`decoder_args`), so both devices decode to the same pixels. The
training crop is a random-crop ROI decode on the CPU, and wherever nvImageCodec runs one on the GPU with that
upsampling; nvImageCodec 0.9 refuses it under every nvJPEG this project installs (12.4, 13.3.2), so on the GPU
it is a whole-image decode and `fn.random_resized_crop`: dali_pipe/decoder.py has the rule, docs/training.md
what each costs. On the CPU the same graph runs with CPU operators, which is how the tests and CPU-only
machines use it.

Training augmentation, all on the device that decodes: random-resized crop (`--crop-scale`),
flip, an optional policy from `nvidia.dali.auto_aug` (`--auto-augment rand|trivial|auto`), and
random erasing after normalisation (`--random-erase`). Validation is never augmented. Mixup and
cutmix mix whole batches, so they run in the training step (model/mixing.py).
"""
from __future__ import annotations

import os
import random
import re
import sys
import tempfile
import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from .config import PipelineSettings, cores
from .decoder import training_roi_decode
from .errors import dali_missing
from .samples import Files, Shards, strings
from .shards.reader import ShardReader
from .spec import ImageSpec

READER_NAME = "Reader"
MAX_THREADS = 8  # DALI's own examples use 4 threads per GPU; more buys nothing once nvJPEG decodes
# nvJPEG pre-allocation hints when the flags leave them unset: DALI's own defaults (16 MiB device,
# 8 MiB pinned host, per thread). DALI's ResNet-50 example uses 211/140 MB for ImageNet, which
# at cores-1 threads on a 48-vCPU, 4-GPU host reserves ~10 GB of each 16 GB T4.
DALI_DEVICE_PADDING = 16 << 20
DALI_HOST_PADDING = 8 << 20
QUEUE_DEPTH = {True: 3, False: 2}  # training: 3 batches ahead absorb jitter; validation: 2 suffice


@dataclass(frozen=True)
class Resources:
    """What one rank's pipeline may use."""
    num_threads: int  # DALI CPU worker threads (file reads; decoding too on "cpu")
    prefetch_queue_depth: int  # batches prepared ahead of the consumer
    device_memory_padding: int  # nvJPEG device buffer pre-allocation per thread (bytes)
    host_memory_padding: int  # nvJPEG pinned host buffer pre-allocation per thread (bytes)
    hw_decoder_load: float  # share of JPEGs for the hardware JPEG decoder (A100/H100); --hw-decoder-load
    hybrid_huffman_threshold: int | None  # pixels above which nvJPEG's hybrid Huffman decoder runs; None: DALI's


def resources_for_rank(settings: PipelineSettings, *, local_world_size: int = 1, training: bool = True,
                       available_cores: int | None = None) -> Resources:
    """Threads: the cores each local rank gets, minus one for its training loop, capped at
    MAX_THREADS (or --num-threads). Queue depth per split. Decoder padding: DALI's defaults unless
    --decoder-device-padding / --decoder-host-padding say otherwise."""
    n = available_cores or cores()
    threads = settings.num_threads or max(1, min(MAX_THREADS, n // max(1, local_world_size) - 1))
    return Resources(num_threads=threads, prefetch_queue_depth=QUEUE_DEPTH[training],
                     device_memory_padding=settings.decoder_device_padding or DALI_DEVICE_PADDING,
                     host_memory_padding=settings.decoder_host_padding or DALI_HOST_PADDING,
                     hw_decoder_load=settings.hw_decoder_load,
                     hybrid_huffman_threshold=settings.hybrid_huffman_threshold)


class FileList:
    """Files and labels handed to DALI's reader as its `file_list` (one "path label" line each), a temporary file
    unlinked at once and read through /proc/self/fd, so a killed run leaves nothing behind. At 1 M files a
    Python list for `files=` took 0.75 GB more peak RSS and 1.9 s more to build than this (DALI keeps the list
    as Python objects and copies it into its operator spec); the reader's order, its shuffles and its
    checkpoints are the same either way (a checkpoint of one restores into the other: tests/test_pipeline.py)."""

    def __init__(self, handle):
        self._handle = handle
        self.path = f"/proc/self/fd/{handle.fileno()}"

    def close(self) -> None:
        self._handle.close()


def file_list(files: np.ndarray, labels: np.ndarray, chunk: int = 100_000):
    """The open file list of `files` and `labels` (FileList's), or None where DALI's parser would misread a path:
    it splits each line at its last whitespace and trims what precedes it, so a name that ends in whitespace or
    holds a line break cannot be listed (those go to `files=`). A name that is not UTF-8 (an object column) is
    written as its bytes, which DALI opens as they are (`files=` refuses such a name: "Unsupported argument type").
    None also where /proc/self/fd does not exist (not Linux)."""
    if not len(files) or not os.path.isdir("/proc/self/fd"):
        return None
    handle = tempfile.TemporaryFile("w+", encoding="utf-8", errors="surrogateescape", prefix="dali-pipe-files-")
    if files.dtype == object:
        names = files.tolist()
        if any(n != n.rstrip() or "\n" in n for n in names):
            handle.close()
            return None
        handle.write("".join(f"{n} {int(label)}\n" for n, label in zip(names, labels.tolist())))
        handle.flush()
        return FileList(handle)
    if np.any(np.strings.rstrip(files) != files) or np.any(np.strings.find(files, "\n") >= 0):
        handle.close()
        return None
    text = labels.astype(np.int64).astype(str).astype(files.dtype)
    for i in range(0, len(files), chunk):  # in chunks: the lines of a million files at once are 0.1 GB more
        handle.write("".join(np.strings.add(np.strings.add(np.strings.add(files[i:i + chunk], " "),
                                                           text[i:i + chunk]), "\n").tolist()))
    handle.flush()
    return FileList(handle)


@dataclass(frozen=True)
class Augment:
    """The training augmentation (from PipelineSettings; see its docs)."""
    crop_scale: tuple[float, float]
    auto_augment: str
    ra_num_ops: int
    ra_magnitude: int
    random_erase: float

    @classmethod
    def from_settings(cls, s: PipelineSettings) -> "Augment":
        return cls(tuple(s.crop_scale), s.auto_augment, s.ra_num_ops, s.ra_magnitude, s.random_erase)


ERASE_AREA, ERASE_LOG_RATIO = (0.02, 0.33), (-1.2040, 1.1939)  # torchvision's RandomErasing: scale, log(0.3), log(3.3)


@dataclass(frozen=True)
class PipelineOptions:
    """Everything one rank's pipeline is built with, besides the file list and the image spec."""
    batch_size: int  # samples per batch on this rank
    device: str  # "gpu": mixed decode + GPU ops, outputs on the GPU; "cpu": all on CPU
    resources: Resources
    augment: Augment
    device_id: int | None = None  # CUDA device for "gpu": the Trainer's root device (DaliDataModule.options)
    seed: int = 0  # sample-order and augmentation seed (the augmentation adds shard_id)
    shard_id: int = 0  # global rank
    num_shards: int = 1  # world size
    fancy_upsampling: bool = True  # GPU: chroma upsampled as libjpeg-turbo does (decoder_args); False only to time it
    # training: a random-crop ROI decode (True), or a whole decode then fn.random_resized_crop (False); None: the
    # ROI decode wherever nvImageCodec runs it on the GPU (decoder.training_roi_decode); set only to time or test
    roi_decode: bool | None = None


def seeded_order(n: int, seed: int) -> list[int]:
    """A permutation of range(n) that depends only on the seed. DALI's `shuffle_after_epoch`
    permutes with a fixed seed and the epoch number; applying it on top of this base permutation
    makes each epoch's order depend on --seed and the epoch, nothing else."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def shard_reader(source: Shards, opts: PipelineOptions, *, training: bool, store=None):
    """The external_source callable over `source` for this rank (dali_pipe/shards/reader.py)."""
    return ShardReader(source, batch=opts.batch_size, seed=opts.seed, rank=opts.shard_id, world=opts.num_shards,
                       training=training, store=store)


def build_pipeline(source, spec: ImageSpec, opts: PipelineOptions, *, training: bool,
                   checkpoint: str | None = None):
    """Build (not yet run) a DALI pipeline over `source` (Files, Shards, or a ShardReader over
    Shards), restored from a DALI `checkpoint` when given (checkpointing is always on; DALI
    documents no cost for it).

    Files, training: `shuffle_after_epoch`, so DALI permutes the whole list before every epoch,
    the same way on every rank, and each rank reads its slice: the ranks' shards are disjoint and
    cover the data. DALI pads each rank's share (`pad_last_batch`) so epochs have clean
    boundaries; the loader trims the padding and, for training, the partial batch (loader.py).

    Shards: the encoded bytes and labels come from a ShardReader through `fn.external_source`
    (batch mode, with DALI's BatchInfo): the rank's epoch plan (dali_pipe/shards/plan.py) draws a
    new shard and sample order from (--seed, epoch) every epoch, skips `Shards.excluded`, and
    yields exactly the batches the loader keeps. The pipeline carries the reader as
    `pipe.shard_reader` (the loader's length). Both keep each sample once per epoch
    (tests/test_loader.py, tests/test_packed.py).
    """
    if opts.device not in ("gpu", "cpu"):
        raise ValueError(f"device must be 'gpu' or 'cpu', got {opts.device!r}")
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ModuleNotFoundError as e:  # the library's first DALI use: name the extra to install
        raise dali_missing(e) or e from None

    if isinstance(source, Shards):
        source = shard_reader(source, opts, training=training)
    listed = None  # the file list DALI reads (an unlinked file), kept open as long as the pipeline
    if isinstance(source, Files):  # made here, outside the pipeline's definition (a loop inside it runs under
        # DALI's AutoGraph, on for the conditionals: 6 of 7.3 s for 900k labels), from columns where given
        files, labels = strings(source.files), np.asarray(source.labels, dtype=np.int64)
        if training:
            order = np.asarray(seeded_order(len(files), opts.seed), dtype=np.int64)
            files, labels = files[order], labels[order]
        listed = file_list(files, labels)
        source = Files(files.tolist(), labels.tolist()) if listed is None else listed
    res = opts.resources
    aug = opts.augment
    roi = opts.roi_decode if opts.roi_decode is not None else training_roi_decode(opts.device, opts.fancy_upsampling)
    if training and checkpoint is not None and opts.roi_decode is None:
        roi = _resumed_decode(checkpoint, roi)

    @pipeline_def(enable_checkpointing=True, enable_conditionals=training)
    def image_pipeline():
        jpegs, lab = _read(source, opts, training)
        decoder, hints = decoder_args(opts)
        interp = {"nearest": types.INTERP_NN, "linear": types.INTERP_LINEAR, "cubic": types.INTERP_CUBIC,
                  "lanczos": types.INTERP_LANCZOS3}[spec.interp]
        mean = [m * 255 for m in spec.mean]
        std = [s * 255 for s in spec.std]
        if training:
            crop = dict(random_area=list(aug.crop_scale), random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10)
            if roi:  # only the crop is decoded
                images = fn.decoders.image_random_crop(jpegs, device=decoder, output_type=types.RGB, **crop, **hints)
                images = fn.resize(images, resize_x=spec.width, resize_y=spec.height,
                                   interp_type=interp, antialias=True)
            else:  # the same crop distribution, cut from the whole decoded image
                images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB, **hints)
                images = fn.random_resized_crop(images, size=[spec.height, spec.width], interp_type=interp,
                                                antialias=True, **crop)
            images = _auto_augment(images, aug, (spec.height, spec.width))
            images = fn.crop_mirror_normalize(
                images, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std,
                mirror=fn.random.coin_flip(probability=0.5))
            if aug.random_erase > 0:
                images = _random_erase(images, aug.random_erase)
        else:
            images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB, **hints)
            if spec.resize_shorter:  # shorter side to resize_shorter, then a center crop
                size, crop = dict(resize_shorter=spec.resize_shorter), dict(crop=(spec.height, spec.width))
            else:  # straight to height x width (ViT)
                size, crop = dict(resize_x=spec.width, resize_y=spec.height), {}
            images = fn.resize(images, **size, interp_type=interp, antialias=True)
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std,
                                              **crop)
        if opts.device == "gpu":
            lab = lab.gpu()
        return images, lab

    pipe = image_pipeline(
        batch_size=opts.batch_size, num_threads=res.num_threads,
        device_id=opts.device_id if opts.device == "gpu" else None,
        seed=opts.seed + opts.shard_id, prefetch_queue_depth=res.prefetch_queue_depth, checkpoint=checkpoint)
    pipe.shard_reader = None if isinstance(source, (Files, FileList)) else source
    if listed is not None:
        weakref.finalize(pipe, listed.close)
    pipe.training_decode = ("roi" if roi else "whole") if training else None
    return pipe


_NOTED: set[bool] = set()


def _resumed_decode(checkpoint, roi: bool) -> bool:
    """The training decode a DALI checkpoint was taken with (its graph names the crop's operator), which a restore
    needs: DALI restores a checkpoint only into the graph that wrote it. A run begun with the other decode (by an
    earlier version, or where nvImageCodec's rule differs) resumes with its own, exactly, and says so once."""
    text = checkpoint.encode("latin-1", "replace") if isinstance(checkpoint, str) else bytes(checkpoint)
    taken = True if b"ImageRandomCrop" in text else False if b"RandomResizedCrop" in text else roi
    if taken != roi and taken not in _NOTED:
        _NOTED.add(taken)
        cost = "; where nvImageCodec refuses it on the GPU, the crops are decoded on the CPU until the run ends"
        print(f"resume: this run's data position was saved with the {'ROI' if taken else 'whole-image'} training "
              f"decode, so it resumes with that decode (exactly, as it began){cost if taken else ''}", file=sys.stderr)
    return taken


def decoder_args(opts: PipelineOptions) -> tuple[str, dict]:
    """The decoder's device ("mixed": nvJPEG on the GPU, or "cpu") and its arguments, for both decoders
    (decoders.image, decoders.image_random_crop). On the GPU, `jpeg_fancy_upsampling` (DALI's default is off)
    makes nvJPEG upsample the chroma of 4:2:0 and 4:2:2 JPEGs as libjpeg-turbo does, which is what the CPU
    decoder and PIL do, so a model trained on GPU-decoded images is evaluated and serves on the pixels it saw
    (tests/test_pipeline.py; its cost is timed by tools/gpu_check.sh).

    `preallocate_width_hint` / `preallocate_height_hint` stay unset: they size the hardware decoder's pool for
    the *source* JPEGs (batch x width x height, 4:4:4), which neither the image spec (the output size) nor the
    listing knows; nvImageCodec creates the pool even at DALI's 1x1 (hw_decoder.cpp: the pool itself "due to
    considerable performance benefit - >20% for 8GPU training"), nvJPEG sizes its buffers to the images as they
    come, and a T4 has no hardware decoder."""
    if opts.device != "gpu":
        return "cpu", {}
    res = opts.resources
    hints = dict(device_memory_padding=res.device_memory_padding, host_memory_padding=res.host_memory_padding,
                 hw_decoder_load=res.hw_decoder_load, jpeg_fancy_upsampling=opts.fancy_upsampling)
    if res.hybrid_huffman_threshold is not None:
        hints["hybrid_huffman_threshold"] = res.hybrid_huffman_threshold
    return "mixed", hints


def _read(source, opts: PipelineOptions, training: bool):
    """The reader node: (encoded images, integer labels), sharded by rank. Files: DALI's file
    reader, padded to full batches. Shards: the ShardReader, through external_source."""
    from nvidia.dali import fn, types

    if isinstance(source, (Files, FileList)):
        listing = dict(file_list=source.path) if isinstance(source, FileList) else dict(files=source.files,
                                                                                       labels=source.labels)
        return fn.readers.file(
            **listing, name=READER_NAME,
            shard_id=opts.shard_id, num_shards=opts.num_shards, pad_last_batch=True,
            shuffle_after_epoch=training)
    return fn.external_source(source=source, num_outputs=2, batch=True, batch_info=True,
                              dtype=[types.UINT8, types.INT32], ndim=[1, 0])


def _auto_augment(images, aug: Augment, shape: tuple[int, int]):
    """The --auto-augment policy on uint8 HWC images (needs the pipeline's conditionals)."""
    if aug.auto_augment == "none":
        return images

    from nvidia.dali.auto_aug import auto_augment, rand_augment, trivial_augment

    # auto_aug still calls a few operators by their old experimental names, and DALI announces each alias with a
    # DeprecationWarning after resetting the warning filters itself (simplefilter("default") in its own
    # catch_warnings), so no filter silences it. Here, where they arise: record the warnings, drop those notices
    # (their message spans two lines, hence re.S), and hand every other warning on as it was.
    alias = re.compile(r"experimental\..*moved out from the experimental phase", re.S)
    with warnings.catch_warnings(record=True) as caught:
        if aug.auto_augment == "rand":
            images = rand_augment.rand_augment(images, n=aug.ra_num_ops, m=aug.ra_magnitude, shape=shape)
        elif aug.auto_augment == "trivial":
            images = trivial_augment.trivial_augment_wide(images, shape=shape)
        else:
            images = auto_augment.auto_augment(images, policy_name="image_net", shape=shape)
    for w in caught:
        if not (issubclass(w.category, DeprecationWarning) and alias.search(str(w.message))):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return images


def _random_erase(images, p: float):
    """torchvision's RandomErasing on normalised CHW images: with probability p, one rectangle of
    2-33% of the area, aspect ratio 0.3-3.3, filled with 0 (the mean)."""
    from nvidia.dali import fn
    from nvidia.dali import math as dmath

    area = fn.random.uniform(range=ERASE_AREA)
    ratio = dmath.exp(fn.random.uniform(range=ERASE_LOG_RATIO))
    h = dmath.min(dmath.sqrt(area * ratio), 1.0)
    w = dmath.min(dmath.sqrt(area / ratio), 1.0)
    shape = fn.stack(h, w)
    anchor = fn.random.uniform(range=(0.0, 1.0), shape=2) * (1.0 - shape)
    if fn.random.coin_flip(probability=p):
        images = fn.erase(images, anchor=anchor, shape=shape, axis_names="HW", normalized_anchor=True,
                          normalized_shape=True, fill_value=0.0)
    return images
