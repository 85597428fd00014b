#!/usr/bin/env python3
"""Gzipped shards against plain ones, measured: the same real-photo samples written by webdataset's
ShardWriter as `.tar` and as `.tar.gz`, opened as training opens them (`inputs.read`:
index, check, and for .tar.gz the one decompression into CACHE/gunzip), opened again (a rerun: cached
verdicts), and read once through the shard reader (the bytes DALI is handed, in the epoch plan's
order); with the disk each takes (the data as stored, what the cache dir holds after, and the two
together).

Rounds alternate the order of the two forms; each round starts from an empty cache dir.

    python tools/bench_gz.py [--images 800] [--per-shard 100] [--side 320 480] [--repeat 5] [--output OUT]

Prints a table (medians, min-max over the rounds, and the per-round gz/tar ratio) and writes
OUT/bench-gz.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dali_pipe.config import DataSettings  # noqa: E402
from dali_pipe.demo import make_photo_dataset  # noqa: E402
from dali_pipe.inputs import read  # noqa: E402
from dali_pipe.shards.reader import ShardReader  # noqa: E402


class _Info:
    def __init__(self, epoch: int, iteration: int):
        self.epoch_idx, self.iteration = epoch, iteration


def _write(photos: list[Path], pattern: Path, per_shard: int) -> None:
    import webdataset as wds

    pattern.parent.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(pattern), maxcount=per_shard, verbose=0) as w:
        for i, p in enumerate(photos):
            w.write({"__key__": f"s{i:06d}", "jpg": p.read_bytes(), "cls": i % 4})


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _round(folder: Path, cache: Path) -> dict:
    data = DataSettings(data=str(folder), cache_dir=str(cache), scan="fast", val_fraction=0.0)
    t0 = time.perf_counter()
    s = read(data)
    t1 = time.perf_counter()
    read(data)
    t2 = time.perf_counter()
    reader = ShardReader(s.train, batch=32, seed=0, rank=0, world=1, training=True)
    n = 0
    for k in range(reader.batches):
        images, _ = reader(_Info(0, k))
        n += sum(len(x) for x in images)
    reader.close()
    t3 = time.perf_counter()
    return {"first_open_s": t1 - t0, "rerun_open_s": t2 - t1, "read_s": t3 - t2, "read_mb": n / 1e6,
            "data_mb": _size(folder) / 1e6, "cache_mb": _size(cache) / 1e6,
            "disk_mb": (_size(folder) + _size(cache)) / 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=800)
    ap.add_argument("--per-shard", type=int, default=100)
    ap.add_argument("--side", type=int, nargs=2, default=(320, 480), help="photo sides (min, max) in pixels")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--output", default=".")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-gz-"))
    try:
        photos = sorted(make_photo_dataset(work / "photos", classes=4, per_class=a.images // 4,
                                           side=tuple(a.side)).glob("*/*.jpg"))
        forms = {"tar": work / "tar", "gz": work / "gz"}
        _write(photos, forms["tar"] / "shard-%06d.tar", a.per_shard)
        _write(photos, forms["gz"] / "shard-%06d.tar.gz", a.per_shard)
        rounds = []
        for r in range(a.repeat):
            row = {}
            for form in (("tar", "gz") if r % 2 == 0 else ("gz", "tar")):
                cache = work / f"cache-{form}"
                shutil.rmtree(cache, ignore_errors=True)
                row[form] = _round(forms[form], cache)
            rounds.append(row)
            print(f"round {r + 1}/{a.repeat}: " + ", ".join(
                f"{f} first {row[f]['first_open_s']:.2f} s" for f in ("tar", "gz")), file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def stats(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    keys = ("first_open_s", "rerun_open_s", "read_s", "data_mb", "cache_mb", "disk_mb")
    out = {"images": a.images, "per_shard": a.per_shard, "side": list(a.side), "repeat": a.repeat,
           "read_mb": rounds[0]["tar"]["read_mb"],
           "tar": {k: stats([r["tar"][k] for r in rounds]) for k in keys},
           "gz": {k: stats([r["gz"][k] for r in rounds]) for k in keys},
           "ratio_gz_over_tar": {k: stats([r["gz"][k] / max(r["tar"][k], 1e-9) for r in rounds]) for k in keys}}
    print(f"{a.images} photos ({out['read_mb']:.1f} MB of JPEG) in shards of {a.per_shard}, {a.repeat} rounds "
          "(median, min-max):")
    print(f"{'':14} {'.tar':>22} {'.tar.gz':>22} {'gz / tar':>20}")
    for k in keys:
        t, g, q = out["tar"][k], out["gz"][k], out["ratio_gz_over_tar"][k]
        print(f"{k:14} {t['median']:9.3f} ({t['min']:.3f}-{t['max']:.3f}) {g['median']:9.3f} ({g['min']:.3f}-"
              f"{g['max']:.3f}) {q['median']:7.2f}x ({q['min']:.2f}-{q['max']:.2f})")
    dest = Path(a.output) / "bench-gz.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
