#!/usr/bin/env python3
"""Measure `python -m dali_pipe sync` against `aws s3 sync` on the same local S3 server, in one run.

Starts moto's S3 server on 127.0.0.1, uploads a dataset of real photos (generated from
scikit-image's photographs), then syncs it to fresh local folders with each tool, alternating,
and prints the wall times and the ratio. Both read the same bucket through the same endpoint.
`--latency-ms` delays every request in the server, to stand in for S3's per-request latency
(loopback answers in microseconds; S3 takes tens of milliseconds to the first byte).

    python tools/bench_sync.py [--files 420] [--side 600 900] [--rounds 2] [--workers 32] [--latency-ms 0 20]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=420, help="number of JPEGs (7 classes)")
    p.add_argument("--side", type=int, nargs=2, default=(600, 900), help="longer side range in px")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workers", type=int, default=32, help="dali_pipe sync threads")
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0],
                   help="per-request server delays to measure at, one pass each")
    args = p.parse_args()
    from s3server import delayed_server

    from dali_pipe.demo import make_photo_dataset
    from dali_pipe.sync import make_client

    work = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    src = make_photo_dataset(work / "src", classes=7, per_class=args.files // 7, side=tuple(args.side))
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = delayed_server()
    url = "http://%s:%d" % server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    client = make_client(16)
    client.create_bucket(Bucket="bench")
    files = [q for q in src.rglob("*") if q.is_file()]
    for q in files:
        client.put_object(Bucket="bench", Key=f"ds/{q.relative_to(src)}", Body=q.read_bytes())
    total = sum(q.stat().st_size for q in files)
    print(f"{len(files)} objects, {total / 1e6:.1f} MB on {url}")
    aws = shutil.which("aws") or str(Path(sys.executable).parent / "aws")

    def command(name, dest):
        if name.startswith("aws"):
            return [aws, "s3", "sync", "--only-show-errors", "s3://bench/ds", str(dest), "--endpoint-url", url]
        return [sys.executable, "-m", "dali_pipe", "sync", "s3://bench/ds", str(dest), "--no-progress",
                "--workers", str(args.workers)]

    for latency in args.latency_ms:
        server.delay = latency / 1000
        times = {"aws s3 sync": [], "dali_pipe sync": []}
        for r in range(args.rounds):
            for name in (list(times) if r % 2 == 0 else list(reversed(times))):
                dest = work / f"{name.split()[0]}_{latency}_{r}"
                t = time.perf_counter()
                subprocess.run(command(name, dest), check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                times[name].append(time.perf_counter() - t)
                n = len([q for q in dest.rglob("*") if q.is_file() and not q.name.startswith(".")])
                print(f"latency {latency:g} ms, round {r}: {name:15s} {times[name][-1]:6.2f} s  ({n} files)")
        for name in times:  # a rerun with nothing to do
            t = time.perf_counter()
            subprocess.run(command(name, work / f"{name.split()[0]}_{latency}_0"), check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
            print(f"latency {latency:g} ms, no-op rerun: {name:15s} {time.perf_counter() - t:6.2f} s")
        best = {k: min(v) for k, v in times.items()}
        print(f"latency {latency:g} ms, best of {args.rounds}: aws s3 sync {best['aws s3 sync']:.2f} s, "
              f"dali_pipe sync {best['dali_pipe sync']:.2f} s -> dali_pipe is "
              f"{best['aws s3 sync'] / best['dali_pipe sync']:.2f}x as fast")
    server.stop()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
