#!/usr/bin/env python3
"""Streamed against synced packs, measured: DALI reading a pack streamed from S3 through the bounded
shard cache (`--packed-s3 stream`) against DALI reading the same pack from local disk (what a sync
leaves), side by side in one benchmark run per per-request latency; the peak size of the cache dir;
and the time to the first batch when the pack is much larger than the cache.

Starts moto's S3 server in its own process on 127.0.0.1, on a core of its own (the last one; the
loaders get the others, `--cpus`), delaying each request by the latency to stand in for S3's time to
first byte (tools/s3server.py), uploads the pack, and runs
`train.py --benchmark --data s3://bench/packed --packed-s3 stream --stream-cache SIZE --packed PACK
--loaders dali,packed` (so 'dali' streams and 'packed' reads local disk), sampling the size of the
stream cache folder every 20 ms.

    python tools/bench_stream.py PACK [--latency-ms 0 20 50] [--repeat 3] [--stream-cache 25MB]
        [--first-step BIG_PACK --first-step-cache 5MB] [--output OUT] [-- more benchmark flags]

Writes OUT/bench-stream.json and prints a table (medians and min-max over the rounds).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dali_pipe.config import parse_size  # noqa: E402

SERVER = """
import os, sys, time
if {cpus!r}:
    os.sched_setaffinity(0, {cpus!r})
sys.path.insert(0, {tools!r})
from s3server import delayed_server
s = delayed_server({delay})
print(s.get_host_and_port()[1], flush=True)
time.sleep(10**6)
"""
UPLOAD = """
import sys; from pathlib import Path; sys.path.insert(0, {root!r})
from dali_pipe.s3 import make_client
c = make_client(8)
if 'bench' not in [b['Name'] for b in c.list_buckets().get('Buckets', [])]:
    c.create_bucket(Bucket='bench')
for f in Path({pack!r}).iterdir():
    if f.is_file() and not f.name.startswith('.'):
        c.upload_file(str(f), 'bench', {prefix!r} + '/' + f.name)
"""
FIRST = """
import os, sys, time, json; t0 = time.perf_counter(); sys.path.insert(0, {root!r})
os.sched_setaffinity(0, {cpus!r})
from pathlib import Path
from dali_pipe.config import DataSettings, PipelineSettings
from dali_pipe.datamodule import DaliDataModule
from dali_pipe.spec import ImageSpec
dm = DaliDataModule(DataSettings(data={data!r}, batch_size=32, cache_dir={cache!r}, packed_s3={mode!r},
                                 stream_cache={bound}), PipelineSettings(device='cpu'), ImageSpec(224, 224, (0.5,) * 3,
                                 (0.5,) * 3), Path({out!r}))
dm.prepare_data(); dm.setup_manifest()
x, y = next(iter(dm.loader(dm.manifest.train, training=True)))
print(json.dumps({{"seconds": time.perf_counter() - t0, "batch": len(y)}}), flush=True)
"""


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


class Peak:
    """The largest size of a folder, sampled every 20 ms while in use."""

    def __init__(self, folder: Path):
        self.folder, self.peak, self._done = folder, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._done.wait(0.02):
            try:
                self.peak = max(self.peak, folder_bytes(self.folder))
            except OSError:  # a file evicted while listed
                pass

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._t.join()


def split_cores() -> tuple[list[int], list[int]]:
    """(the loaders' cores, the server's): S3 is another machine, so the test server gets a core of its
    own where there are two or more; the loaders get the rest."""
    cores = sorted(os.sched_getaffinity(0))
    return (cores[:-1], cores[-1:]) if len(cores) > 1 else (cores, [])


def server(latency_ms: float):
    code = SERVER.format(tools=str(ROOT / "tools"), delay=latency_ms / 1000, cpus=split_cores()[1])
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    return proc, env


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def throughput(args, extra, latency: float, out: Path) -> dict:
    """One benchmark run (--repeat rounds) at one latency: streamed vs local, and the cache's peak."""
    proc, env = server(latency)
    try:
        subprocess.run([sys.executable, "-c", UPLOAD.format(root=str(ROOT), pack=args.pack, prefix="packed")],
                       check=True, env=env)
        cache = out / "cache"
        with Peak(cache / "stream") as peak:
            subprocess.run([sys.executable, str(ROOT / "train.py"), "--benchmark", "--data", "s3://bench/packed",
                            "--packed-s3", "stream", "--stream-cache", args.stream_cache, "--packed", args.pack,
                            "--loaders", "dali,packed", "--model", "none", "--repeat", str(args.repeat),
                            "--output", str(out), "--cache-dir", str(cache), "--cpus", str(len(split_cores()[0])),
                            *extra], check=True, env=env)
    finally:
        proc.terminate()
    report = json.loads((out / "benchmark.json").read_text())
    ratio = [1 / r for r in report["ratios"]["packed_vs_dali"]["rounds"]]  # streamed / local, per round
    return {"latency_ms": latency, "streamed": report["loaders"]["dali"]["images_per_sec_rounds"]["rounds"],
            "synced": report["loaders"]["packed"]["images_per_sec_rounds"]["rounds"],
            "streamed_vs_synced": spread(ratio),
            "cache_peak_bytes": peak.peak, "busy_cores": [d for d in report["diagnosis"] if "busy" in d]}


def first_step(args, latency: float, out: Path) -> dict:
    """Seconds from nothing local to the first batch: streamed through a small cache, and synced whole."""
    proc, env = server(latency)
    try:
        subprocess.run([sys.executable, "-c", UPLOAD.format(root=str(ROOT), pack=args.first_step, prefix="big")],
                       check=True, env=env)
        size = folder_bytes(Path(args.first_step))
        times: dict[str, list[float]] = {"stream": [], "sync": []}
        peaks = []
        for r in range(args.repeat):
            for mode in ("stream", "sync") if r % 2 == 0 else ("sync", "stream"):
                cache = out / f"first-{mode}-{r}"
                code = FIRST.format(root=str(ROOT), data="s3://bench/big", cache=str(cache), mode=mode,
                                    cpus=split_cores()[0], bound=parse_size(args.first_step_cache), out=str(out / "o"))
                with Peak(cache / "stream") as peak:
                    res = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True,
                                         text=True)
                times[mode].append(json.loads(res.stdout.strip().splitlines()[-1])["seconds"])
                if mode == "stream":
                    peaks.append(peak.peak)
    finally:
        proc.terminate()
    return {"latency_ms": latency, "pack_bytes": size, "stream_cache": args.first_step_cache,
            "stream_seconds": spread(times["stream"]), "sync_seconds": spread(times["sync"]),
            "stream_cache_peak_bytes": max(peaks)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pack", help="a pack (python -m dali_pipe pack)")
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--stream-cache", default="25MB", help="the streamed loader's --stream-cache")
    p.add_argument("--first-step", default=None, help="a pack much larger than --first-step-cache")
    p.add_argument("--first-step-cache", default="5MB")
    p.add_argument("--output", default="runs/bench-stream")
    args, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    results = {"pack": args.pack, "pack_bytes": folder_bytes(Path(args.pack)), "stream_cache": args.stream_cache,
               "throughput": [], "first_step": []}
    for latency in args.latency_ms:
        results["throughput"].append(throughput(args, extra, latency, out / f"{latency:g}ms"))
        if args.first_step:
            results["first_step"].append(first_step(args, latency, out / f"{latency:g}ms-first"))
        (out / "bench-stream.json").write_text(json.dumps(results, indent=1))
    print(f"\npack {results['pack_bytes'] / 1e6:.1f} MB, --stream-cache {args.stream_cache}, {args.repeat} rounds")
    print("| latency | streamed images/s | synced images/s | streamed / synced | cache peak |")
    print("|---|---|---|---|---|")
    for r in results["throughput"]:
        s, y, q = spread(r["streamed"]), spread(r["synced"]), r["streamed_vs_synced"]
        print(f"| {r['latency_ms']:g} ms | {s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f}) | {y['median']:.0f} "
              f"({y['min']:.0f}-{y['max']:.0f}) | {q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f}) | "
              f"{r['cache_peak_bytes'] / 1e6:.1f} MB |" + (" busy cores" if r["busy_cores"] else ""))
    for r in results["first_step"]:
        s, y = r["stream_seconds"], r["sync_seconds"]
        print(f"first batch at {r['latency_ms']:g} ms, {r['pack_bytes'] / 1e6:.0f} MB pack: streamed through "
              f"{r['stream_cache']} {s['median']:.1f} s ({s['min']:.1f}-{s['max']:.1f}), cache peak "
              f"{r['stream_cache_peak_bytes'] / 1e6:.1f} MB; synced {y['median']:.1f} s ({y['min']:.1f}-{y['max']:.1f})")
    print(f"bench_stream: {time.perf_counter() - t:.0f} s; wrote {out / 'bench-stream.json'}")


if __name__ == "__main__":
    main()
