#!/usr/bin/env python3
"""How well a pack's reader reshuffles between epochs, measured through the real DALI loader.

Writes N real-photo samples (tiny crops of scikit-image's photographs, each sample its own label)
into S shards of equal count in a seeded order, as `pack` does, then reads E training epochs with
DALI's CPU pipeline on one or more ranks and reports, over consecutive epochs:

- |Spearman| of each sample's position in one epoch against the next (0: unrelated orders); a
  position is the index in its rank's order, the step at which the sample is trained;
- the share of the first tenth of one epoch that is also in the next one's first tenth (random: 10%);
- the distinct shards per batch (how much a batch mixes), and whether each epoch saw each sample once.

    python tools/shuffle_quality.py [--samples 3000] [--shards 60] [--epochs 4] [--batch 32]
    PYTHONPATH=/path/to/other/checkout python tools/shuffle_quality.py ...   # another version's reader

The reader measured is whatever `dali_pipe` imports (this checkout, or PYTHONPATH's).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def write_shards(folder: Path, samples: int, shards: int, seed: int):
    """S tars of samples/S real photos each, in a seeded order, with their DALI index files."""
    import random

    from dali_pipe.demo import make_photo_dataset
    from dali_pipe.pack import ShardWriter

    photos = make_photo_dataset(folder / "photos", classes=6, per_class=-(-samples // 6), side=(24, 40))
    rels = (photos / "dataset.tsv").read_text().splitlines()[1:][:samples]
    order = list(range(samples))
    random.Random(seed).shuffle(order)
    per = samples // shards
    paths, index_paths = [], []
    for s in range(shards):
        w = ShardWriter(folder, f"train-{s:06d}")
        for k, i in enumerate(order[s * per:(s + 1) * per]):
            w.add(f"s{i:05d}", (photos / rels[i]).read_bytes(), i, k)
        meta = w.close()
        paths.append(str(folder / meta["name"]))
        index_paths.append(str(folder / meta["index"]))
    return paths, index_paths, per * shards, {i: s for s in range(shards) for i in order[s * per:(s + 1) * per]}


def read_epochs(paths, index_paths, n, *, epochs, batch, world, seed):
    from dali_pipe.config import PipelineSettings
    from dali_pipe.loader import DaliLoader
    from dali_pipe.pipeline import Augment, PipelineOptions, build_pipeline, resources_for_rank
    from dali_pipe.samples import Shards
    from dali_pipe.spec import ImageSpec

    spec = ImageSpec(8, 8, (0.5,) * 3, (0.5,) * 3)
    settings = PipelineSettings(device="cpu", num_threads=2)
    shards = Shards(tuple(paths), tuple(index_paths), n)
    loaders = []
    for rank in range(world):
        opts = PipelineOptions(batch_size=batch, device="cpu", resources=resources_for_rank(settings),
                               augment=Augment.from_settings(settings), seed=seed, shard_id=rank, num_shards=world)
        loaders.append(DaliLoader(lambda ck, o=opts: build_pipeline(shards, spec, o, training=True, checkpoint=ck),
                                  training=True))
    out = []  # per epoch: per rank, the batches' labels
    for _ in range(epochs):
        out.append([[y.tolist() for _, y in ld] for ld in loaders])
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def quality(epochs: list[list[list[list[int]]]], shard_of: dict[int, int]) -> dict:
    """epochs[e][rank] = that rank's batches of labels. A sample's position is its index in its rank's
    order (the step at which it is trained, whichever rank trains it)."""
    rhos, overlaps = [], []
    pos = [{x: i for rank in epoch for i, x in enumerate(x for b in rank for x in b)} for epoch in epochs]
    share = [min(sum(len(b) for b in rank) for rank in epoch) for epoch in epochs]
    for e in range(len(epochs) - 1):
        common = sorted(set(pos[e]) & set(pos[e + 1]))
        rhos.append(abs(spearman(np.array([pos[e][x] for x in common]), np.array([pos[e + 1][x] for x in common]))))
        first = {x for x, i in pos[e].items() if i < share[e] // 10}
        nxt = {x for x, i in pos[e + 1].items() if i < share[e + 1] // 10}
        overlaps.append(len(first & nxt) / max(1, len(first)))
    mix = [len({shard_of[x] for x in bt}) for epoch in epochs for rank in epoch for bt in rank]
    return {"spearman_abs": rhos, "first_tenth_overlap": overlaps, "spearman_abs_mean": float(np.mean(rhos)),
            "first_tenth_overlap_mean": float(np.mean(overlaps)), "shards_per_batch_mean": float(np.mean(mix))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--shards", type=int, default=60)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=None, help="folder for the shards (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    import dali_pipe

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.work or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        paths, index_paths, n, shard_of = write_shards(folder, args.samples, args.shards, args.seed)
        epochs = read_epochs(paths, index_paths, n, epochs=args.epochs, batch=args.batch, world=args.world,
                             seed=args.seed)
    once = all(len(set(x for r in epoch for b in r for x in b)) == sum(len(b) for r in epoch for b in r)
               for epoch in epochs)
    rng = np.random.default_rng(args.seed)
    per = sum(len(b) for b in epochs[0][0])
    files = []  # a whole-list shuffle of plain files, split across ranks the same way
    for _ in range(args.epochs):
        o = list(rng.permutation(n))
        files.append([[o[r * (n // args.world):][:per][i:i + args.batch] for i in range(0, per, args.batch)]
                      for r in range(args.world)])
    res = {"reader": str(Path(dali_pipe.__file__).parent), "samples": n, "shards": args.shards, "batch": args.batch,
           "world": args.world, "epochs": args.epochs, "each_sample_once_per_epoch": once,
           "packs": quality(epochs, shard_of), "whole_list_shuffle": quality(files, shard_of)}
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
