#!/usr/bin/env python3
"""How long each command takes to stop after SIGTERM (or Ctrl-C), sent at a series of moments of its run, and
what it leaves: the exit status, the time from the signal to the exit, and any temporary file left behind.

    python tools/stop_latency.py --work /tmp/stoplat                       # all commands, SIGTERM
    python tools/stop_latency.py --work /tmp/stoplat --commands pack,sync --signal INT --json out.json

Each command runs on N real photographs hard-linked into class folders (tools/scale.py's dataset), in a fresh
process per moment. Where a command has not exited `--trace-after` seconds after the signal, it is sent SIGUSR1,
on which faulthandler (registered through a sitecustomize on PYTHONPATH) prints where its main thread is: the
place that does not look at the stop's flag (dali_pipe/stop.py). A command that has not exited 20 s after the
signal is killed and counted as such.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from scale import make_dataset, photos  # noqa: E402  (the same dataset as the scale benchmark)

SITE = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=False)\n"
TEMP_MARKS = (".tmp-", ".part-", ".sync-running-")


def leftovers(*folders: Path) -> list[str]:
    """Temporary files of ours under `folders` (a stop must remove them), and any lock left in a `locks/` folder
    under them (a cache dir's: a stop must release and remove its locks)."""
    out = []
    for folder in folders:
        if folder.exists():
            out += [str(p) for p in folder.rglob("*") if any(m in p.name for m in TEMP_MARKS)
                    or (p.parent.name == "locks" and p.is_file())]
    return out


S3_LEFT = []  # callables: what a stopped command left in the bucket (open multipart uploads, temporary keys)


def attempt(argv: list[str], at: float, sig: int, env: dict, trace_after: float, clean) -> dict:
    """Run `argv`, send `sig` `at` seconds after its start; the exit status, the time to exit, its stack if slow."""
    folders = clean()
    t0 = time.monotonic()
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        p.wait(at)
        return {"at": at, "ended_before": round(time.monotonic() - t0, 2), "status": p.returncode,
                "last_line": p.stderr.read().strip().splitlines()[-2:]}
    except subprocess.TimeoutExpired:
        pass
    p.send_signal(sig)
    sent = time.monotonic()
    traced = False
    try:
        p.wait(trace_after)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)
        traced = True
        try:
            p.wait(20 - trace_after)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    latency = time.monotonic() - sent
    err = p.stderr.read()
    row = {"at": at, "latency": round(latency, 2), "status": p.returncode, "last_line": err.strip().splitlines()[-1:],
           "left": leftovers(*folders) + [x for f in S3_LEFT for x in f()]}
    if traced:
        row["stack"] = [line for line in err.splitlines() if line.startswith(("  File", "Current thread", "Thread"))]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "stoplat")
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--commands", default="train,manifest,pack,evaluate,predict,sync",
                    help="also: pack_s3, sync_pack, train_stream, predict_tar, predict_parquet, benchmark")
    ap.add_argument("--s3-delay", type=float, default=0.02, help="seconds the S3 server holds each request")
    ap.add_argument("--s3-files", type=int, default=3000, help="photos in the S3, shard and Parquet datasets")
    ap.add_argument("--at", default="0.5,1.5,3,5,8,12", help="seconds after the start to send the signal")
    ap.add_argument("--signal", choices=["TERM", "INT"], default="TERM")
    ap.add_argument("--trace-after", type=float, default=1.5)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    site = a.work / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    fresh_cache = a.work / "cache-fresh"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "TQDM_DISABLE": "1",
           "DALI_PIPE_CACHE": str(fresh_cache)}  # sync takes no --cache-dir: its locks go here too
    data = make_dataset(a.work / f"data-{a.files}", a.files, photos(a.work))
    model, cache = a.work / "model", a.work / "cache"
    py = sys.executable
    if not (model / "config.json").is_file() and {"evaluate", "predict"} & set(a.commands.split(",")):
        subprocess.run([py, "train.py", "--data", str(photos(a.work)), "--model", "tiny", "--device", "cpu",
                        "--epochs", "1", "--output", str(model), "--cache-dir", str(cache)], cwd=ROOT, check=True,
                       env=env, stdout=subprocess.DEVNULL)
    out = a.work / "out"
    wanted = set(a.commands.split(","))
    small = make_dataset(a.work / f"data-{a.s3_files}", a.s3_files, photos(a.work)) if wanted & {
        "pack_s3", "sync_pack", "train_stream", "predict_tar", "predict_parquet"} else None
    bucket_clean = []

    def clean():
        for d in (out, fresh_cache):
            shutil.rmtree(d, ignore_errors=True)
        (data / "dataset.tsv.bak").exists() and (data / "dataset.tsv.bak").unlink()
        for f in bucket_clean:
            f()
        return [out, data, fresh_cache] + ([small] if small else [])

    server = None
    commands = {
        "train": [py, "train.py", "--data", str(data), "--model", "tiny", "--device", "cpu", "--epochs", "1",
                  "--output", str(out), "--cache-dir", str(fresh_cache)],
        "manifest": [py, "-m", "dali_pipe", "manifest", "--force", str(data)],
        "pack": [py, "-m", "dali_pipe", "pack", str(data), str(out), "--cache-dir", str(fresh_cache)],
        "evaluate": [py, "-m", "dali_pipe", "evaluate", "--data", str(data), "--model", str(model), "--device",
                     "cpu", "--output", str(out), "--cache-dir", str(fresh_cache)],
        "predict": [py, "-m", "dali_pipe", "predict", "--data", str(data), "--model", str(model), "--device", "cpu",
                    "--output", str(out), "--cache-dir", str(fresh_cache)],
    }
    if "predict_tar" in wanted:  # one .tar shard of the small dataset, as webdataset's ShardWriter writes it
        tar = a.work / f"shard-{a.s3_files}" / "shard-000000.tar"
        if not tar.is_file():
            import webdataset as wds

            tar.parent.mkdir(parents=True, exist_ok=True)
            with wds.ShardWriter(str(tar.parent / "shard-%06d.tar"), maxcount=10 ** 9, verbose=0) as w:
                for i, line in enumerate((small / "dataset.tsv").read_text().splitlines()[1:]):
                    w.write({"__key__": f"k{i:07d}", "jpg": (small / line.split("\t")[0]).read_bytes()})
        commands["predict_tar"] = [py, "-m", "dali_pipe", "predict", "--data", str(tar), "--model", str(model),
                                   "--device", "cpu", "--output", str(out), "--cache-dir", str(fresh_cache)]
    if "predict_parquet" in wanted:  # one Parquet file of the small dataset, as datasets' to_parquet writes it
        pq = a.work / f"parquet-{a.s3_files}" / "data" / "train-00000-of-00001.parquet"
        if not pq.is_file():
            import datasets

            rels = [line.split("\t")[0] for line in (small / "dataset.tsv").read_text().splitlines()[1:]]
            names = sorted({r.split("/")[0] for r in rels})
            features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
            ds = datasets.Dataset.from_dict({"image": [str(small / r) for r in rels],
                                             "label": [names.index(r.split("/")[0]) for r in rels]}, features=features)
            ds.to_parquet(str(pq))
        commands["predict_parquet"] = [py, "-m", "dali_pipe", "predict", "--data", str(pq.parents[1]), "--model", str(model),
                                       "--device", "cpu", "--output", str(out), "--cache-dir", str(fresh_cache)]
    commands["benchmark"] = [py, "train.py", "--benchmark", "--data", str(data), "--model", "none", "--device", "cpu",
                             "--output", str(out), "--cache-dir", str(fresh_cache)]
    if wanted & {"sync", "pack_s3", "sync_pack", "train_stream"}:
        import boto3
        from s3server import delayed_server  # a moto server, 20 ms a request, with the photos uploaded

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
        server = delayed_server(0.0)
        url = "http://%s:%d" % server.get_host_and_port()
        keys = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        os.environ.update(keys)
        s3 = boto3.client("s3", endpoint_url=url)
        s3.create_bucket(Bucket="stopdata")
        if "sync" in wanted:
            lines = (data / "dataset.tsv").read_text().splitlines()[:3001]
            for rel in lines[1:]:
                rel = rel.split("\t")[0]
                s3.upload_file(str(data / rel), "stopdata", f"d/{rel}")
            s3.put_object(Bucket="stopdata", Key="d/dataset.tsv", Body="\n".join(lines) + "\n")
        if wanted & {"sync_pack", "train_stream"}:  # a pack of the small dataset, uploaded as files
            pack = a.work / f"pack-{a.s3_files}"
            if not (pack / "packed.json").is_file():
                subprocess.run([py, "-m", "dali_pipe", "pack", str(small), str(pack), "--cache-dir",
                                str(a.work / "cache-pack"), "--shard-size", "1MB"], cwd=ROOT, env=env, check=True,
                               stdout=subprocess.DEVNULL)
            for f in sorted(pack.rglob("*")):
                if f.is_file():
                    s3.upload_file(str(f), "stopdata", f"pk/{f.relative_to(pack)}")

        def s3_left(prefix="packup/"):
            left = [f"open upload {u['Key']}" for u in s3.list_multipart_uploads(Bucket="stopdata",
                                                                                 Prefix=prefix).get("Uploads", [])]
            keys = [o["Key"] for o in s3.list_objects_v2(Bucket="stopdata", Prefix=prefix).get("Contents", [])]
            return left + [f"s3 {k}" for k in keys if any(m in k for m in TEMP_MARKS)]

        def s3_clean(prefix="packup/"):
            for o in s3.list_objects_v2(Bucket="stopdata", Prefix=prefix).get("Contents", []):
                s3.delete_object(Bucket="stopdata", Key=o["Key"])

        if "pack_s3" in wanted:
            S3_LEFT.append(s3_left)
            bucket_clean.append(s3_clean)
        server.delay = a.s3_delay
        env.update(keys, AWS_ENDPOINT_URL=url)
        commands["sync"] = [py, "-m", "dali_pipe", "sync", "s3://stopdata/d", str(out)]
        commands["pack_s3"] = [py, "-m", "dali_pipe", "pack", str(small), "s3://stopdata/packup", "--cache-dir",
                               str(fresh_cache), "--shard-size", "1MB"]
        commands["sync_pack"] = [py, "-m", "dali_pipe", "sync", "s3://stopdata/pk", str(out)]
        commands["train_stream"] = [py, "train.py", "--data", "s3://stopdata/pk", "--packed-s3", "stream", "--model",
                                    "tiny", "--device", "cpu", "--epochs", "1", "--output", str(out), "--cache-dir",
                                    str(fresh_cache)]
    sig = signal.SIGTERM if a.signal == "TERM" else signal.SIGINT
    results = {}
    for name in a.commands.split(","):
        rows = results[name] = []
        for at in map(float, a.at.split(",")):
            row = attempt(commands[name], at, sig, env, a.trace_after, clean)
            rows.append(row)
            print(name, json.dumps(row), flush=True)
            if "ended_before" in row:
                break
    if server is not None:
        server.stop()
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
