"""The DALI pipeline: one definition, built for the GPU (`device="gpu"`) or the CPU (`device="cpu"`).

On the GPU the CPU only reads file bytes: nvJPEG decodes (`device="mixed"`, a random-crop ROI
decode for training), the GPU resizes, flips and normalises, and images and labels come out on
the GPU. On the CPU the same graph runs with CPU operators, which is how the tests and CPU-only
machines use it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .spec import ImageSpec

READER_NAME = "Reader"


def default_num_threads() -> int:
    """CPU threads for DALI: the cores this process may use, minus one for the training loop."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


@dataclass(frozen=True)
class PipelineOptions:
    batch_size: int  # samples per batch on this rank
    device: str = "gpu"  # "gpu": mixed decode + GPU ops, outputs on the GPU; "cpu": all on CPU
    device_id: int | None = 0  # CUDA device (local rank); None for CPU pipelines
    num_threads: int = 1  # DALI CPU worker threads (file reads; decoding too on "cpu")
    seed: int = 0  # augmentation seed (+ shard_id); the epoch shuffle uses DALI's fixed reader seed
    shard_id: int = 0  # global rank
    num_shards: int = 1  # world size
    prefetch_queue_depth: int = 3  # batches DALI prepares ahead of the training step (3 absorbs jitter)
    hw_decoder_load: float = 0.65  # share of JPEGs sent to the A100/H100 hardware decoder, if any
    # Pre-allocation hints for the mixed decoder (bytes); they avoid re-allocations in the first
    # iterations. DALI's ResNet-50 example uses these values for ImageNet-size JPEGs.
    device_memory_padding: int = 211_025_920
    host_memory_padding: int = 140_544_512


def build_pipeline(files: list[str], labels: list[int], spec: ImageSpec, opts: PipelineOptions,
                   *, training: bool):
    """Build (not yet run) a DALI pipeline over `files` with integer `labels`.

    Training reads with `shuffle_after_epoch`: DALI permutes the whole list before every epoch,
    with a fixed seed that is the same on every rank, and each rank reads its slice, so the ranks'
    shards are disjoint and cover the data. (A `random_shuffle` buffer would mix the shard padding
    into the epoch.) Shards are padded (`pad_last_batch`) so epochs have clean boundaries; the
    loader trims the padding and, for training, the partial batch (see loader.py).
    """
    if opts.device not in ("gpu", "cpu"):
        raise ValueError(f"device must be 'gpu' or 'cpu', got {opts.device!r}")
    from nvidia.dali import fn, pipeline_def, types

    labels = [int(x) for x in labels]

    @pipeline_def
    def image_pipeline():
        jpegs, lab = fn.readers.file(
            files=files, labels=labels, name=READER_NAME,
            shard_id=opts.shard_id, num_shards=opts.num_shards, pad_last_batch=True,
            shuffle_after_epoch=training)
        decoder = "mixed" if opts.device == "gpu" else "cpu"
        hints = dict(device_memory_padding=opts.device_memory_padding,
                     host_memory_padding=opts.host_memory_padding,
                     hw_decoder_load=opts.hw_decoder_load) if decoder == "mixed" else {}
        mean = [m * 255 for m in spec.mean]
        std = [s * 255 for s in spec.std]
        if training:
            images = fn.decoders.image_random_crop(
                jpegs, device=decoder, output_type=types.RGB,
                random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10, **hints)
            images = fn.resize(images, resize_x=spec.width, resize_y=spec.height,
                               interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.crop_mirror_normalize(
                images, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std,
                mirror=fn.random.coin_flip(probability=0.5))
        else:
            images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB, **hints)
            if spec.resize_shorter:  # shorter side to resize_shorter, then a center crop
                size, crop = dict(resize_shorter=spec.resize_shorter), dict(crop=(spec.height, spec.width))
            else:  # straight to height x width (ViT)
                size, crop = dict(resize_x=spec.width, resize_y=spec.height), {}
            images = fn.resize(images, **size, interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std,
                                              **crop)
        if opts.device == "gpu":
            lab = lab.gpu()
        return images, lab

    return image_pipeline(
        batch_size=opts.batch_size, num_threads=opts.num_threads,
        device_id=opts.device_id if opts.device == "gpu" else None,
        seed=opts.seed + opts.shard_id, prefetch_queue_depth=opts.prefetch_queue_depth)
