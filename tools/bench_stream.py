#!/usr/bin/env python3
"""Measure the two routes for a pack on S3, side by side in one benchmark run: DALI streaming the
shards from S3 (`--packed-s3 stream`) against DALI reading the same pack from local disk.

Starts moto's S3 server in its own process on 127.0.0.1 (optionally delaying each request, to stand
in for S3's latency), uploads a pack of real photos, and runs
`train.py --benchmark --data s3://bench/packed --packed-s3 stream --packed LOCAL --loaders dali,packed`.

    python tools/bench_stream.py PACK_DIR [--latency-ms 20] [--repeat 3] [--output OUT] [-- more benchmark flags]
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = """
import sys, time
sys.path.insert(0, {tools!r})
from s3server import delayed_server
s = delayed_server({delay})
print(s.get_host_and_port()[1], flush=True)
time.sleep(10**6)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pack", help="a pack (python -m dali_pipe pack)")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--output", default="runs/bench-stream")
    args, extra = p.parse_known_args()
    server = subprocess.Popen([sys.executable, "-c", SERVER.format(tools=str(ROOT / "tools"),
                                                                     delay=args.latency_ms / 1000)],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
               "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
        code = ("import sys; from pathlib import Path; sys.path.insert(0, %r)\n"
                "from dali_pipe.sync import make_client\nc = make_client(8); c.create_bucket(Bucket='bench')\n"
                "for f in Path(%r).iterdir():\n"
                "    if f.is_file() and not f.name.startswith('.'):\n"
                "        c.upload_file(str(f), 'bench', 'packed/' + f.name)\n"
                % (str(ROOT), args.pack))
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
        t = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "train.py"), "--benchmark", "--data", "s3://bench/packed",
                        "--packed-s3", "stream", "--packed", args.pack, "--loaders", "dali,packed", "--model", "none",
                        "--repeat", str(args.repeat), "--output", args.output, "--cache-dir",
                        str(Path(args.output) / "cache"), *[x for x in extra if x != "--"]], check=True, env=env)
        print(f"bench_stream: {time.perf_counter() - t:.1f} s; 'dali' streamed from S3 at {args.latency_ms:g} ms per "
              "request, 'packed' read the same pack from local disk")
    finally:
        server.terminate()


if __name__ == "__main__":
    socket.setdefaulttimeout(60)
    main()
