"""A diagnosis that prescribes: when the loader is input-bound on large photos, measure what packing
would give on the user's own files.

Large photos cap a small machine however fast its GPU is: their JPEG decode (on a T4 the Huffman
stage runs on the CPU) dominates. When the median image is above LARGE_PIXELS, `pack_gain` packs a
sample of SAMPLE of them with --max-side 384 into a temporary folder and times the DALI training
pipeline over the raw sample and over the packed one, on the same cores: the two ceilings are
measured, not guessed.
"""
from __future__ import annotations

import dataclasses
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from .loader import DaliLoader
from .manifest import Manifest
from .pack import pack_manifest
from .pipeline import Augment, PipelineOptions, build_pipeline, resources_for_rank
from .samples import Files
from .shards.packs import open_packed

LARGE_PIXELS = 1_000_000
SAMPLE = 64
MAX_SIDE = 384


def median_pixels(paths: list[str], n: int = SAMPLE) -> float:
    """Median width x height over (up to) n images, read from their headers."""
    from PIL import Image

    sizes = []
    for p in paths[:n]:
        try:
            with Image.open(p) as im:
                sizes.append(im.size[0] * im.size[1])
        except Exception:
            continue
    return float(statistics.median(sizes)) if sizes else 0.0


def _images_per_sec(source, spec, opts, passes: int = 2) -> float:
    loader = DaliLoader(lambda ck: build_pipeline(source, spec, opts, training=True, checkpoint=ck), training=True)
    list(loader)  # warm-up: allocations, first decode
    start, n = time.perf_counter(), 0
    for _ in range(passes):
        n += sum(len(y) for _, y in loader)
    return n / (time.perf_counter() - start)


def pack_gain(manifest, spec, pipeline_settings, *, batch_size: int, cores: int) -> tuple[float, float, int]:
    """(raw images/s, packed images/s, sample size): DALI's training pipeline on SAMPLE of the
    manifest's training images, raw and packed at MAX_SIDE, on the same cores."""
    train = manifest.train[:SAMPLE]
    sample = Manifest(manifest.root, manifest.classes, train, [])
    batch = max(1, min(batch_size, len(train) // 2))
    opts = PipelineOptions(batch_size=batch, device=pipeline_settings.device,
                           resources=resources_for_rank(pipeline_settings, training=True, available_cores=cores + 1),
                           augment=Augment.from_settings(pipeline_settings),
                           device_id=0 if pipeline_settings.device == "gpu" else None)
    raw = _images_per_sec(Files([s.path for s in train], [s.label for s in train]), spec, opts)
    with tempfile.TemporaryDirectory(prefix="dali_pipe-pack-sample-") as tmp:
        pack_manifest(sample, Path(tmp), max_side=MAX_SIDE, quality=90, shard_size=1 << 40, workers=cores, seed=0,
                      bad={}, progress=False)
        packed = _images_per_sec(dataclasses.replace(open_packed(tmp, tmp).train), spec, opts)
    return raw, packed, len(train)


def pack_command(data: str | None) -> tuple[str, str]:
    """(the command that packs --data, the --data to train on then): DATA-packed beside DATA, local or
    s3://, so that it can be run as printed; DATA and PACKED as words when --data is not known."""
    if not data:
        return f"python -m dali_pipe pack DATA PACKED --max-side {MAX_SIDE}", "PACKED"
    packed = data.rstrip("/") + "-packed"
    return f"python -m dali_pipe pack {shlex.quote(data)} {shlex.quote(packed)} --max-side {MAX_SIDE}", packed


def prescription(manifest, spec, pipeline_settings, *, batch_size: int, cores: int, data: str | None = None
                 ) -> str | None:
    """The advice line, or None when the photos are not large (packing would not pay). `data`: the --data
    the run read, which the command it prescribes packs."""
    paths = [s.path for s in manifest.train]
    pixels = median_pixels(paths)
    if pixels <= LARGE_PIXELS:
        return None
    raw, packed_rate, n = pack_gain(manifest, spec, pipeline_settings, batch_size=batch_size, cores=cores)
    command, packed = pack_command(data)
    return (f"input-bound on large photos (median {pixels / 1e6:.1f} Mpx); packing with --max-side {MAX_SIDE} raises "
            f"the loader ceiling from {raw:.0f} to about {packed_rate:.0f} images/s on these {cores} core(s) (measured on "
            f"{n} of your images): {command}, then --data {shlex.quote(packed)}.")
