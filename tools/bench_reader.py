#!/usr/bin/env python3
"""Our shard reader against DALI's own `fn.readers.webdataset`, on the same pack, side by side.

Both arms read the same local pack in a CPU pipeline with the same DALI threads; the only difference is the
reader node: ours is the training ShardReader through `fn.external_source` (the epoch plan, as training builds
it: `DaliDataModule.options` and `pipeline.shard_reader`), DALI's is `fn.readers.webdataset` with its
per-epoch shuffle (`shuffle_after_epoch`, which reshuffles the shard order each epoch, plus `random_shuffle`,
a buffer of `--initial-fill` samples) over the pack's own DALI index files. Two modes, each timed in rounds
that alternate the arms' order:

- `read`: the reader alone (the encoded bytes out of the pipeline): its own ceiling;
- `decode`: then what training does after it on the CPU: the random-crop ROI decode, resize to 224 and
  normalise (the same calls for both arms, `pipeline.decoder_args` included).

It also checks what each reader delivers over one epoch (every sample once?), by reading each sample's `json`
member (unique per sample in a pack), and whether DALI's reader takes a pipeline checkpoint.

    python tools/bench_reader.py [--pack PACK] [--batch 32] [--threads 2] [--cpus 2] [--rounds 3]
        [--batches 40] [--output OUT]

Without --pack it makes one: 672 real photos at 400-600 px (dali_pipe/demo.py), packed as they are in 2 MB
shards (about 20). Writes
OUT/bench-reader.json and prints a table (images/s median and min-max over the rounds; the ratio per round).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dali_pipe.benchrun import pin_cpus  # noqa: E402
from dali_pipe.config import DataSettings, PipelineSettings  # noqa: E402
from dali_pipe.datamodule import DaliDataModule  # noqa: E402
from dali_pipe.pipeline import decoder_args, shard_reader  # noqa: E402
from dali_pipe.spec import ImageSpec  # noqa: E402

SPEC = ImageSpec(224, 224, (0.5,) * 3, (0.5,) * 3)


def make_pack(folder: Path) -> Path:
    from dali_pipe.cli.commands import main
    from dali_pipe.demo import make_photo_dataset

    raw = make_photo_dataset(folder / "raw", classes=7, per_class=96, side=(400, 600))
    main(["pack", str(raw), str(folder / "pack"), "--workers", "2", "--val-fraction", "0", "--shard-size", "2MB"])
    return folder / "pack"


def pipeline(arm: str, mode: str, shards, opts, *, initial_fill: int):
    """One CPU pipeline: `arm` ("ours" or "dali") reads, then `mode` ("read" or "decode")."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(enable_checkpointing=True)
    def graph():
        if arm == "ours":
            jpegs, labels = fn.external_source(source=shard_reader(shards, opts, training=True), num_outputs=2,
                                               batch=True, batch_info=True, dtype=[types.UINT8, types.INT32],
                                               ndim=[1, 0])
        else:  # labels: the cls member's bytes (parsing them would only add work to this arm)
            jpegs, labels = fn.readers.webdataset(paths=list(shards.paths), index_paths=list(shards.index_paths),
                                                  ext=["jpg", "cls"], missing_component_behavior="error",
                                                  shuffle_after_epoch=True, random_shuffle=True,
                                                  initial_fill=initial_fill, pad_last_batch=True, name="Reader")
        if mode == "read":
            return jpegs, labels
        device, hints = decoder_args(opts)
        images = fn.decoders.image_random_crop(jpegs, device=device, output_type=types.RGB, random_area=[0.08, 1.0],
                                               random_aspect_ratio=[3 / 4, 4 / 3], num_attempts=10, **hints)
        images = fn.resize(images, resize_x=SPEC.width, resize_y=SPEC.height, interp_type=types.INTERP_LINEAR,
                           antialias=True)
        return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=[127.5] * 3,
                                        std=[127.5] * 3, mirror=fn.random.coin_flip(probability=0.5)), labels

    pipe = graph(batch_size=opts.batch_size, num_threads=opts.resources.num_threads, device_id=None,
                 seed=opts.seed, prefetch_queue_depth=opts.resources.prefetch_queue_depth)
    pipe.build()
    return pipe


def timed(pipe, batches: int, batch_size: int, warmup: int = 3) -> float:
    """images/s over `batches` batches after `warmup`, across epoch ends (ours ends each epoch with
    StopIteration and a reset, as the loader does; DALI's reader runs on)."""
    def one():
        try:
            pipe.run()
        except StopIteration:
            pipe.reset()
            pipe.run()

    for _ in range(warmup):
        one()
    t0 = time.perf_counter()
    for _ in range(batches):
        one()
    return batches * batch_size / (time.perf_counter() - t0)


def epoch_keys(arm: str, shards, opts, *, initial_fill: int) -> dict:
    """Over the first epoch's batches (the samples / batch size full batches both deliver per epoch): how many
    distinct samples came, and how many came more than once."""
    from nvidia.dali import fn, pipeline_def, types

    if arm == "ours":  # the plan names (shard, entry) per position: the ShardReader's own bookkeeping
        reader = shard_reader(shards, opts, training=True)
        plan = reader.plan(0)
        seen = [(int(s), int(e)) for s, e in zip(plan.shard[:reader.batches * opts.batch_size],
                                                 plan.entry[:reader.batches * opts.batch_size])]
    else:
        @pipeline_def(batch_size=opts.batch_size, num_threads=1, device_id=None, seed=opts.seed)
        def keys():
            outs = fn.readers.webdataset(paths=list(shards.paths), index_paths=list(shards.index_paths),
                                         ext=["json"], missing_component_behavior="error", shuffle_after_epoch=True,
                                         random_shuffle=True, initial_fill=initial_fill, pad_last_batch=True,
                                         name="Reader", dtypes=[types.UINT8])
            return outs[0] if isinstance(outs, (list, tuple)) else outs

        pipe = keys()
        pipe.build()
        seen = []
        for _ in range(shards.samples // opts.batch_size):
            (out,) = pipe.run()
            seen += [bytes(out.at(i)) for i in range(len(out))]
    distinct = len(set(seen))
    return {"delivered": len(seen), "distinct": distinct, "repeated": len(seen) - distinct,
            "samples": shards.samples}


def checkpoint_ok(shards, opts, initial_fill: int) -> str:
    try:
        pipe = pipeline("dali", "read", shards, opts, initial_fill=initial_fill)
        pipe.run()
        pipe.checkpoint()
        return "ok"
    except Exception as e:  # what DALI says, for the report
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pack", help="a local pack (default: made from demo photos)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="DALI CPU threads")
    ap.add_argument("--cpus", type=int, default=None, help="pin to this many cores (default: all allowed)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=40, help="timed batches per arm, mode and round")
    ap.add_argument("--initial-fill", type=int, default=1024, help="DALI's random_shuffle buffer")
    ap.add_argument("--output", default="bench-reader")
    a = ap.parse_args(argv)
    cores = pin_cpus(a.cpus)
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pack = Path(a.pack) if a.pack else make_pack(Path(tmp))
        dm = DaliDataModule(DataSettings(data=str(pack), batch_size=a.batch, cache_dir=str(Path(tmp) / "cache"),
                                         scan="off", val_fraction=0),
                            PipelineSettings(device="cpu", num_threads=a.threads), SPEC, out)
        dm.prepare_data()
        shards = dm.manifest.train
        opts = dm.options(training=True)
        print(f"bench-reader: {shards.samples} samples in {len(shards.paths)} shards ({pack}), batch {a.batch}, "
              f"{a.threads} DALI thread(s), {len(cores)} core(s), {a.rounds} round(s) of {a.batches} batches",
              flush=True)
        for path in shards.paths:  # both arms then read from the page cache, the first one too
            Path(path).read_bytes()
        rounds: dict[str, dict[str, list[float]]] = {m: {"ours": [], "dali": []} for m in ("read", "decode")}
        for r in range(a.rounds):
            for mode in ("read", "decode"):
                for arm in (("ours", "dali") if r % 2 == 0 else ("dali", "ours")):
                    pipe = pipeline(arm, mode, shards, opts, initial_fill=a.initial_fill)
                    rounds[mode][arm].append(timed(pipe, a.batches, a.batch))
                    del pipe
            print(f"round {r + 1}/{a.rounds}: " + "; ".join(
                f"{m} ours {rounds[m]['ours'][-1]:.0f}, dali {rounds[m]['dali'][-1]:.0f} images/s"
                for m in ("read", "decode")), flush=True)
        coverage = {arm: epoch_keys(arm, shards, opts, initial_fill=a.initial_fill) for arm in ("ours", "dali")}
        report = {"samples": shards.samples, "shards": len(shards.paths), "batch": a.batch, "threads": a.threads,
                  "cpus": len(cores), "rounds": a.rounds, "batches": a.batches, "initial_fill": a.initial_fill,
                  "images_per_sec": {}, "ours_vs_dali": {}, "first_epoch": coverage,
                  "dali_checkpoint": checkpoint_ok(shards, opts, a.initial_fill),
                  "load": os.getloadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        print("\n| mode | ours images/s | dali images/s | ours / dali, per round |\n|---|---|---|---|")
        for mode, arms in rounds.items():
            ratio = [x / y for x, y in zip(arms["ours"], arms["dali"])]
            report["images_per_sec"][mode] = {arm: {"median": statistics.median(v), "min": min(v), "max": max(v),
                                                    "rounds": v} for arm, v in arms.items()}
            report["ours_vs_dali"][mode] = {"median": statistics.median(ratio), "min": min(ratio), "max": max(ratio),
                                            "rounds": ratio}
            o, d = (report["images_per_sec"][mode][k] for k in ("ours", "dali"))
            print(f"| {mode} | {o['median']:.0f} ({o['min']:.0f}-{o['max']:.0f}) | {d['median']:.0f} "
                  f"({d['min']:.0f}-{d['max']:.0f}) | {statistics.median(ratio):.2f}x "
                  f"({', '.join(f'{x:.2f}' for x in ratio)}) |")
        for arm, c in coverage.items():
            print(f"first epoch, {arm}: {c['delivered']} samples delivered, {c['distinct']} distinct of "
                  f"{c['samples']}, {c['repeated']} repeated")
        print(f"DALI reader checkpoint: {report['dali_checkpoint']}; load average {report['load'][0]:.1f}")
        (out / "bench-reader.json").write_text(json.dumps(report, indent=1))
        print(f"wrote {out / 'bench-reader.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
