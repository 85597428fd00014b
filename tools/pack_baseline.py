#!/usr/bin/env python3
"""The hand-written pack that `python -m dali_pipe pack` is measured against (issue #45): what a user writes in
forty lines with multiprocessing, PIL and webdataset.ShardWriter, at the same settings (the longer side at most
--max-side, Lanczos, JPEG --quality, shards of --shard-size bytes, the samples shuffled by --seed, a process a
core). Not a straw man: an RGB JPEG already within --max-side is copied as it is (as pack does), the pool's
chunks are large, and nothing is checked, hashed or made resumable.

    python tools/pack_baseline.py DATA DST [--max-side 384 --quality 90 --shard-size 150000000 --workers 2]  (pack's defaults)

DATA holds dataset.tsv (image_path, optional label; else the parent folder). Prints one JSON line: images,
seconds, images/s, shards.
"""
import argparse
import csv
import io
import json
import os
import random
import time
from multiprocessing import Pool
from pathlib import Path

import webdataset as wds
from PIL import Image


def load(job):
    key, path, label, max_side, quality = job
    with open(path, "rb") as f:
        raw = f.read()
    im = Image.open(io.BytesIO(raw))
    if im.format == "JPEG" and im.mode == "RGB" and max(im.size) <= max_side:
        return key, raw, label
    im = im.convert("RGB")
    if max(im.size) > max_side:
        im.thumbnail((max_side, max_side), Image.LANCZOS)
    out = io.BytesIO()
    im.save(out, format="JPEG", quality=quality)
    return key, out.getvalue(), label


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("data", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--max-side", type=int, default=384)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--shard-size", type=int, default=150_000_000)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    start = time.perf_counter()
    with open(a.data / "dataset.tsv", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    labels = [r.get("label") or r["image_path"].split("/")[-2] for r in rows]
    classes = {c: i for i, c in enumerate(sorted(set(labels)))}
    jobs = [(f"{i:09d}", str(a.data / r["image_path"]), classes[c], a.max_side, a.quality)
            for i, (r, c) in enumerate(zip(rows, labels))]
    random.Random(a.seed).shuffle(jobs)
    a.dst.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(a.dst / "train-%06d.tar"), maxsize=a.shard_size, maxcount=10**9, verbose=0) as sink, \
            Pool(a.workers) as pool:
        for key, jpeg, label in pool.imap(load, jobs, chunksize=64):
            sink.write({"__key__": key, "jpg": jpeg, "cls": str(label).encode()})
        shards = sink.shard
    took = time.perf_counter() - start
    print(json.dumps({"images": len(jobs), "seconds": round(took, 2), "images_per_s": round(len(jobs) / took, 1),
                      "shards": shards}))


if __name__ == "__main__":
    main()
