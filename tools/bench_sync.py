#!/usr/bin/env python3
"""Measure S3 -> disk sync side by side on one local S3 server, in one run, alternating rounds.

    --compare cli     `python -m dali_pipe sync` of the raw files vs `aws s3 sync` of the same prefix
    --compare packed  `python -m dali_pipe sync` of the raw files vs of their pack (`pack --max-side 384`)

Starts moto's S3 server on 127.0.0.1, uploads a dataset of real photos (generated from
scikit-image's photographs; and its pack for --compare packed), then syncs into fresh folders.
`--latency-ms` delays every request in the server, to stand in for S3's per-request latency
(loopback answers in microseconds; S3 takes tens of milliseconds to the first byte). Prints each
round, the median and min-max per tool, and the ratio of medians.

    python tools/bench_sync.py [--compare cli|packed] [--files 420] [--side 600 900] [--rounds 3]
                               [--latency-ms 0 20] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]


def upload(client, folder: Path, prefix: str) -> tuple[int, int]:
    files = [q for q in folder.rglob("*") if q.is_file() and not q.name.startswith(".")]
    for q in files:
        client.put_object(Bucket="bench", Key=f"{prefix}/{q.relative_to(folder)}", Body=q.read_bytes())
    return len(files), sum(q.stat().st_size for q in files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", choices=("cli", "packed"), default="cli")
    p.add_argument("--files", type=int, default=420, help="number of JPEGs (7 classes)")
    p.add_argument("--side", type=int, nargs=2, default=(600, 900), help="longer side range in px")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=32, help="dali_pipe sync threads")
    p.add_argument("--latency-ms", type=float, nargs="+", default=[0.0, 20.0],
                   help="per-request server delays to measure at, one pass each")
    p.add_argument("--json", help="also write the measurements here")
    args = p.parse_args()
    import logging

    from s3server import delayed_server

    from dali_pipe.demo import make_photo_dataset
    from dali_pipe.sync import make_client

    work = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    src = make_photo_dataset(work / "src", classes=7, per_class=args.files // 7, side=tuple(args.side))
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = delayed_server()
    url = "http://%s:%d" % server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    client = make_client(16)
    client.create_bucket(Bucket="bench")
    n, size = upload(client, src, "raw")
    print(f"raw: {n} objects, {size / 1e6:.1f} MB on {url}")
    sync = [sys.executable, "-m", "dali_pipe", "sync", "--no-progress", "--workers", str(args.workers)]
    tools = {"dali_pipe sync (raw)": sync + ["s3://bench/raw"]}
    if args.compare == "cli":
        aws = shutil.which("aws") or str(Path(sys.executable).parent / "aws")
        tools = {"aws s3 sync (raw)": [aws, "s3", "sync", "--only-show-errors", "s3://bench/raw", "--endpoint-url",
                                       url, "--dest"], **tools}
    else:
        subprocess.run([sys.executable, "-m", "dali_pipe", "pack", str(src), str(work / "packed"), "--max-side",
                        "384", "--val-fraction", "0", "--cache-dir", str(work / "cache")], check=True, cwd=ROOT,
                       stderr=subprocess.DEVNULL)
        n, size = upload(client, work / "packed", "packed")
        print(f"packed: {n} objects, {size / 1e6:.1f} MB")
        tools["dali_pipe sync (packed)"] = sync + ["s3://bench/packed"]

    def command(name, dest):
        cmd = tools[name]
        if cmd[-1] == "--dest":  # aws s3 sync SRC DEST
            return cmd[:-1][:5] + [str(dest)] + cmd[5:-1]
        return cmd + [str(dest)]

    report = {"compare": args.compare, "files": args.files, "side": args.side, "rounds": args.rounds, "results": {}}
    for latency in args.latency_ms:
        server.delay = latency / 1000
        times = {name: [] for name in tools}
        for r in range(args.rounds):
            for name in (list(tools) if r % 2 == 0 else list(reversed(tools))):
                dest = work / f"{len(times[name])}_{name.split()[0]}_{'p' if 'packed' in name else 'r'}_{latency}"
                t = time.perf_counter()
                subprocess.run(command(name, dest), check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
                times[name].append(time.perf_counter() - t)
                print(f"latency {latency:g} ms, round {r}: {name:24s} {times[name][-1]:6.2f} s")
        med = {k: statistics.median(v) for k, v in times.items()}
        a, b = list(tools)
        print(f"latency {latency:g} ms, median of {args.rounds}: " + ", ".join(
            f"{k} {med[k]:.2f} s ({min(times[k]):.2f}-{max(times[k]):.2f})" for k in tools)
              + f" -> {b} is {med[a] / med[b]:.2f}x as fast as {a}")
        report["results"][f"{latency:g}ms"] = {"seconds": times, "median_ratio": med[a] / med[b]}
    server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
