#!/usr/bin/env python3
"""Start-up at ImageNet scale: time and peak RSS of each stage this project adds before the first training step,
next to plain DALI's reader over the same files, in one run.

    python tools/scale.py --files 1000000 --work /tmp/scale          # about 10 minutes on 2 cores
    python tools/scale.py --files 10000,100000 --work /tmp/scale --json docs/scale.json

For each size N it builds (once, kept in --work) a dataset.tsv of N files in 1000 class folders, each a hard link
to one of a few hundred real photographs (dali_pipe.demo's, 64-160 px JPEGs): start-up costs depend on the number
of files, not on their pixels. Then, each in a fresh process (peak RSS from that process's rusage):

- plain DALI: `fn.readers.file(file_root=...)` over the class folders, CPU decode, time to its first batch;
- plain DALI in Lightning: that reader through DALIGenericIterator into the same tiny ViT as `--model tiny`, time
  to its first step: what a user writing plain DALI into Lightning pays (torch, Lightning, transformers, the model);
- stages: read_manifest (cold, then warm), the scan (cold, then warm), digest (kept by read_manifest in the cache dir
  where nothing is bad or missing: then ~0 s, its cost in the cold read), the training pipeline built and its first batch;
- train.py (`--model tiny --device cpu --val-fraction 0 --max-steps 5`), time to its first step: a first run
  (cold caches, stopped by SIGTERM at its first step as a spot reclaim would), its resume, "nothing to do" (the
  finished run's rerun, time to exit), and a fresh run with warm caches.

Times are wall seconds on whatever machine runs it; run it on an idle machine and say its load.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 1000


def make_dataset(root: Path, n: int, photos: Path) -> Path:
    """root/dataset.tsv and n hard links in CLASSES folders (kept: a second run reuses them)."""
    tsv = root / "dataset.tsv"
    if tsv.is_file() and sum(1 for _ in open(tsv)) == n + 1:
        return root
    shutil.rmtree(root, ignore_errors=True)
    src = sorted(str(p) for p in photos.rglob("*.jpg"))
    root.mkdir(parents=True)
    t = time.perf_counter()
    with open(tsv, "w") as f:
        f.write("image_path\n")
        for i in range(n):
            c = f"c{i % CLASSES:04d}"
            if i < CLASSES:
                (root / c).mkdir()
            os.link(src[i % len(src)], root / c / f"{i:07d}.jpg")
            f.write(f"{c}/{i:07d}.jpg\n")
            if i and i % 200_000 == 0:
                print(f"  made {i} of {n} files ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    return root


def photos(work: Path) -> Path:
    """A few hundred real photographs (dali_pipe.demo: crops of skimage's photos), made once."""
    folder = work / "photos"
    if not (folder / "dataset.tsv").is_file():
        sys.path.insert(0, str(ROOT))
        from dali_pipe.demo import make_photo_dataset

        make_photo_dataset(folder, classes=6, per_class=50, side=(64, 160))
    return folder


def child(args: list[str], *, env: dict | None = None, stop_at_first_step: bool = False) -> dict:
    """Run a Python child; its peak RSS (rusage) and wall time, what it printed as `SCALE {json}` lines."""
    t = time.time()
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **(env or {}), "SCALE_LAUNCHED": repr(t),
                              "SCALE_STOP": "1" if stop_at_first_step else ""}, cwd=ROOT)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.time() - t
    found = {}
    for line in out.splitlines():
        if line.startswith("SCALE "):
            found.update(json.loads(line[6:]))
    found.update(wall=round(wall, 2), peak_rss_mb=round(usage.ru_maxrss / 1024), status=os.waitstatus_to_exitcode(status))
    if found["status"] != 0:
        found["tail"] = out[-2000:]
    return found


# -- what the children run ---------------------------------------------------------------------------
PLAIN_DALI = r"""
import json, sys, time
from nvidia.dali import fn, pipeline_def, types
@pipeline_def(batch_size=32, num_threads=2, device_id=None)
def p():
    jpegs, labels = fn.readers.file(file_root=sys.argv[1], random_shuffle=True, name="Reader")
    images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
    return fn.resize(images, resize_x=224, resize_y=224), labels
pipe = p(); pipe.build(); pipe.run()
print("SCALE " + json.dumps({"first_batch": round(time.time() - float(sys.argv[2]), 2)}))
"""

PLAIN_LIGHTNING = r"""
import json, os, sys, time
import pytorch_lightning as pl
import torch
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
from transformers import ViTConfig, ViTForImageClassification
# what a user writes with plain DALI into Lightning: the same reader as above, the same tiny ViT as --model tiny
@pipeline_def(batch_size=32, num_threads=2, device_id=None)
def p():
    jpegs, labels = fn.readers.file(file_root=sys.argv[1], random_shuffle=True, name="Reader")
    images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
    images = fn.crop_mirror_normalize(fn.resize(images, resize_x=64, resize_y=64), dtype=types.FLOAT,
                                      output_layout="CHW", mean=[127.5] * 3, std=[127.5] * 3)
    return images, labels
class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.vit = ViTForImageClassification(ViTConfig(image_size=64, patch_size=8, hidden_size=96, num_hidden_layers=3,
                                                       num_attention_heads=3, intermediate_size=192, num_labels=1000))
    def training_step(self, batch, i):
        x, y = batch[0]["images"], batch[0]["labels"].squeeze(-1).long()
        return self.vit(pixel_values=x, labels=y).loss
    def on_train_batch_end(self, *args):
        if not hasattr(self, "done"):
            self.done = True
            print("SCALE " + json.dumps({"first_step": round(time.time() - float(os.environ["SCALE_LAUNCHED"]), 2)}),
                  flush=True)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)
pipe = p()
loader = DALIGenericIterator(pipe, ["images", "labels"], reader_name="Reader", last_batch_policy=LastBatchPolicy.DROP)
pl.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
           enable_model_summary=False).fit(Model(), loader)
"""

STAGES = r"""
import json, os, resource, sys, time
sys.path.insert(0, os.getcwd())
t0 = float(os.environ["SCALE_LAUNCHED"])
out = {}
def mark(name, t):
    out[name] = {"s": round(time.perf_counter() - t, 2), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    return time.perf_counter()
from pathlib import Path
from dali_pipe.config import DataSettings
from dali_pipe.dataset import scan_manifest
from dali_pipe.manifest import read_manifest
from dali_pipe.pipeline import Augment, PipelineOptions, build_pipeline, resources_for_rank
from dali_pipe.samples import Files
from dali_pipe.config import PipelineSettings
from dali_pipe.spec import ImageSpec
root, cache = sys.argv[1], sys.argv[2]
out["imports"] = {"s": round(time.time() - t0, 2), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
t = time.perf_counter()
kept = (Path(cache) / "manifests").exists()
m = read_manifest(root, val_fraction=0.1, seed=0, skip_missing=False, cache_dir=cache)
t = mark(f"read_manifest ({'warm' if kept else 'cold'})", t)
m = read_manifest(root, val_fraction=0.1, seed=0, skip_missing=False, cache_dir=cache); t = mark("read_manifest (warm)", t)
data = DataSettings(data=root, cache_dir=cache)
r = scan_manifest(m, data, num_threads=1, progress=False); t = mark(f"scan ({'cold' if r.checked else 'warm'})", t)
r = scan_manifest(m, data, num_threads=1, progress=False); t = mark("scan (warm)", t)
m = m.without(r.bad); d = m.digest(); t = mark("digest", t)
ps = PipelineSettings()
opts = PipelineOptions(batch_size=32, device="cpu", resources=resources_for_rank(ps), augment=Augment.from_settings(ps))
pipe = build_pipeline(Files(m.train.paths, m.train.labels), ImageSpec(224, 224, (0.5,) * 3, (0.5,) * 3), opts,
                      training=True)
pipe.build(); pipe.run(); t = mark("pipeline built, first batch", t)
print("SCALE " + json.dumps({"stages": out}))
"""

TRAIN = r"""
import json, os, signal, sys, time
sys.path.insert(0, os.getcwd())
import pytorch_lightning as pl
import dali_pipe.cli.fit as fit
class First(pl.Callback):
    def on_train_batch_end(self, trainer, *args):
        if getattr(self, "done", False):
            return
        self.done = True
        print("SCALE " + json.dumps({"first_step": round(time.time() - float(os.environ["SCALE_LAUNCHED"]), 2)}), flush=True)
        if os.environ.get("SCALE_STOP"):
            os.kill(os.getpid(), signal.SIGTERM)
make = fit.make_trainer
fit.make_trainer = lambda s, callbacks, **kw: make(s, callbacks + [First()], **kw)
from dali_pipe.cli import main
main(sys.argv[1:])
"""


def measure(n: int, work: Path, repeat: int) -> dict:
    root = make_dataset(work / f"data-{n}", n, photos(work))
    runs = work / f"runs-{n}"
    shutil.rmtree(runs, ignore_errors=True)
    result: dict = {"files": n, "plain_dali": [], "plain_lightning": [], "stages": [], "train": {}}
    for _ in range(repeat):
        result["plain_dali"].append(child(["-c", PLAIN_DALI, str(root), repr(time.time())]))
        result["plain_lightning"].append(child(["-c", PLAIN_LIGHTNING, str(root)]))
    cache = runs / "cache-stages"
    for _ in range(repeat):
        result["stages"].append(child(["-c", STAGES, str(root), str(cache)]))
    common = ["--data", str(root), "--model", "tiny", "--device", "cpu", "--val-fraction", "0", "--max-steps", "5",
              "--batch-size", "32", "--cache-dir", str(runs / "cache")]
    run = common + ["--output", str(runs / "out"), "--checkpoint-dir", str(runs / "ckpt")]
    steps = [("first run (cold), SIGTERM at step 1", run, True), ("resume after SIGTERM", run, False),
             ("nothing to do", run, False)]
    steps += [(f"warm start #{i + 1}", common + ["--output", str(runs / f"warm{i}"), "--checkpoint-dir",
                                                 str(runs / f"warm{i}-ckpt")], True) for i in range(repeat)]
    for name, args, stop in steps:
        print(f"  {n} files: {name}", file=sys.stderr, flush=True)
        if name == "nothing to do":  # train.py itself: its rerun decides before torch and Lightning load
            result["train"][name] = child([str(ROOT / "train.py"), *args])
        else:
            result["train"][name] = child(["-c", TRAIN, *args], stop_at_first_step=stop)
    return result


def show(r: dict) -> None:
    n = r["files"]
    dali = [x.get("first_batch") for x in r["plain_dali"]]
    dali_rss = [x["peak_rss_mb"] for x in r["plain_dali"]]
    print(f"\n{n} files | plain DALI: first batch {dali} s, peak RSS {dali_rss} MB")
    pl_ = [x.get("first_step") for x in r["plain_lightning"]]
    pl_rss = [x["peak_rss_mb"] for x in r["plain_lightning"]]
    print(f"  plain DALI in Lightning (tiny ViT): first step {pl_} s, peak RSS {pl_rss} MB")
    print("  stages (each run in a fresh process; seconds, peak RSS so far):")
    for name in r["stages"][0].get("stages", {}):
        vals = [f"{x['stages'][name]['s']} s / {x['stages'][name]['peak_rss_mb']} MB" for x in r["stages"]
                if name in x.get("stages", {})]
        print(f"    {name:32s} {' | '.join(vals)}")
    print("  train.py:")
    for name, x in r["train"].items():
        when = (f"first step at {x['first_step']} s" if "first_step" in x else f"exit at {x['wall']} s")
        extra = (f" (+{x['first_step'] - min(pl_):.1f} s over plain DALI in Lightning)"
                 if "first_step" in x and pl_ and all(pl_) else "")
        more = f" (+{x['peak_rss_mb'] - min(pl_rss)} MB)" if pl_rss and "first_step" in x else ""
        print(f"    {name:40s} {when}{extra}, peak RSS {x['peak_rss_mb']} MB{more}, status {x['status']}")
        if x["status"] != 0:
            print("      " + x.get("tail", "")[-800:].replace("\n", "\n      "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--files", default="1000000", help="comma-separated sizes (default 1000000)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dali-pipe-scale",
                    help="where the datasets (hard links) and runs go; kept for a rerun")
    ap.add_argument("--repeat", type=int, default=2, help="plain DALI, stages and warm starts, each this many times")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    results = []
    for n in (int(x) for x in a.files.split(",")):
        results.append(measure(n, a.work, a.repeat))
        show(results[-1])
    meta = {"cores": len(os.sched_getaffinity(0)), "load_before": [round(x, 2) for x in load],
            "date": time.strftime("%Y-%m-%d"), "self_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    print(f"\n{meta['cores']} cores; load average before: {meta['load_before']}")
    if a.json:
        a.json.write_text(json.dumps({"machine": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
