#!/usr/bin/env python3
"""A Hugging Face Parquet dataset against the same images packed, measured in one benchmark run.

Makes IMAGES real photos (dali_pipe.demo, JPEGs within the pack's --max-side, so the pack copies each one
byte for byte and both sources hold the very same bytes), writes them as Parquet with the `datasets`
library itself (the Hub's layout: data/train-*.parquet, datasets' row groups of 100 images), packs the
same folder (`python -m dali_pipe pack`), then runs

    train.py --benchmark --data PARQUET --packed PACK --loaders dali,packed --repeat N ...

in which the 'dali' loader reads the Parquet row groups through the shard reader and 'packed' the pack's
tars, alternating within each round. Prints the per-round ratio Parquet / pack (median, min-max).

    python tools/bench_parquet.py [--images 800] [--repeat 5] [--output runs/bench-parquet] [-- more flags]

(`datasets` is in the test extra.) Writes OUT/benchmark.json and benchmark.png (the benchmark's own).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parquet_from(photos: Path, dest: Path) -> Path:
    import datasets

    files = sorted(photos.glob("*/*.jpg"))
    names = sorted({p.parent.name for p in files})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": p.read_bytes(), "path": p.name} for p in files],
                                     "label": [names.index(p.parent.name) for p in files]}, features=features)
    (dest / "data").mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(dest / "data" / "train-00000-of-00001.parquet"))
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=800)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--output", default="runs/bench-parquet")
    p.add_argument("rest", nargs="*", help="more benchmark flags (after --)")
    a = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from dali_pipe.demo import make_photo_dataset

    out = Path(a.output)
    photos = make_photo_dataset(out / "photos", classes=4, per_class=a.images // 4, side=(300, 384))
    parquet = parquet_from(photos, out / "parquet")
    pack = out / "pack"
    subprocess.run([sys.executable, "-m", "dali_pipe", "pack", str(photos), str(pack), "--max-side", "384"], cwd=ROOT,
                   check=True)
    subprocess.run([sys.executable, "train.py", "--benchmark", "--data", str(parquet), "--packed", str(pack),
                    "--loaders", "dali,packed", "--model", "none", "--repeat", str(a.repeat), "--val-fraction", "0",
                    "--output", str(out), *a.rest], cwd=ROOT, check=True)
    r = json.loads((out / "benchmark.json").read_text())["ratios"]["packed_vs_dali"]
    inv = [1 / x for x in r["rounds"]]
    print(f"Parquet / pack images/s: median {statistics.median(inv):.3f} (min {min(inv):.3f}, max {max(inv):.3f}) "
          f"over {len(inv)} rounds")


if __name__ == "__main__":
    main()
