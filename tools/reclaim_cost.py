#!/usr/bin/env python3
"""What a spot reclaim costs, measured on the bundled demo data with the real training command.

A reclaim is a SIGTERM (SageMaker and EC2 give two minutes), the process's exit, a new instance, and the
same command run again. This tool times each part, repeated, in one run:

  sigterm   a fresh run is sent SIGTERM mid-epoch: seconds from the signal to its "checkpoint saved" line (the
            current step finishes, every rank saves last.ckpt) and to the process's exit (exit 0, the
            DataModule's and the interpreter's teardown); the step saved is read from last.json.
  local     the same command again with the data already on disk: seconds from the process's start to
            its first training step (`--monitor`'s start-up share, which starts at the process's start:
            imports, data check, checkpoint restore, pipeline build, first batch), and the steps replayed
            (the resumed step against the step the SIGTERM saved).
  kill9     a run with --checkpoint-every-steps K killed with SIGKILL mid-epoch: the step it resumes from
            (the last periodic save) and the steps the killed run had reached by its last progress line.
  sync      (--s3) the restart of a new instance whose disk is empty: the data synced again from a local S3
            server (moto, in its own process, `--latency-ms` per request) before the first step.
  stream    (--s3) the same from a pack streamed through the bounded shard cache (no sync first).

    python tools/reclaim_cost.py [--model tiny] [--repeat 3] [--every 10] [--s3] [--latency-ms 20]
                                 [--batch-size 32] [--output runs/reclaim] [--json FILE]

`--model vit-b16-random --batch-size 4` gives ViT-B/16's checkpoint (about 1 GB with AdamW's moments),
to see how the save and the restore scale with its size. Prints a table (median and min-max over the
rounds) and writes the measurements as JSON (default OUTPUT/reclaim-cost.json).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dali_pipe.demo import demo_dataset  # noqa: E402

SERVER = """
import logging, sys, time
logging.getLogger("werkzeug").setLevel(logging.ERROR)
sys.path.insert(0, {tools!r})
from s3server import delayed_server
s = delayed_server({delay})
print(s.get_host_and_port()[1], flush=True)
time.sleep(10**6)
"""


class Run:
    """train.py in a subprocess, its output read line by line (and kept) as it comes."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.log = log
        self._progress = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with open(self.log, "w") as f:
            for line in self.proc.stdout:
                self.lines.append((time.perf_counter(), line.rstrip("\n")))
                f.write(line)
                if line.startswith("progress: "):
                    self._progress.set()

    def wait_training(self, min_step: int = 0, timeout: float = 900.0) -> None:
        """Until a progress line at global step `min_step` or later (training has taken steps), or fail with
        the log."""
        while True:
            if self._progress.wait(0.2):
                per_epoch = steps_per_epoch(self.text())
                if (progress_step(self.text(), per_epoch) or 0) >= min_step:
                    return
            if self.proc.poll() is not None or time.perf_counter() - self.started > timeout:
                self.finish()
                raise SystemExit(f"the run ended or hung before training (see {self.log}):\n" + self.text()[-2000:])

    def when(self, prefix: str) -> float | None:
        """The time the first line starting with `prefix` came."""
        return next((t for t, line in self.lines if line.startswith(prefix)), None)

    def finish(self, timeout: float = 900.0) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def last_step(ckpt_dir: Path) -> int | None:
    try:
        return json.loads((ckpt_dir / "last.json").read_text())["global_step"]
    except (OSError, ValueError, KeyError):
        return None


def resumed_step(text: str) -> int | None:
    m = re.search(r"resuming .*\(global step (\d+)\)", text)
    return int(m.group(1)) if m else None


def progress_step(text: str, steps_per_epoch: int) -> int | None:
    """The global step of the last progress line ("progress: epoch 2/5 step 7/11 ...")."""
    found = re.findall(r"progress: epoch (\d+)/\d+ step (\d+)/\d+", text)
    if not found:
        return None
    epoch, step = map(int, found[-1])
    return (epoch - 1) * steps_per_epoch + step


def steps_per_epoch(text: str) -> int:
    m = re.search(r"(\d+) steps per epoch", text)
    return int(m.group(1)) if m else 0


def monitor_startup(out: Path) -> tuple[float, dict]:
    report = json.loads((out / "monitor.json").read_text())
    budget = report["time_budget"]
    return budget["seconds"]["startup"], budget.get("startup_parts", {})


def summarize(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def start_server(latency_ms: float, env: dict) -> tuple[subprocess.Popen, str]:
    code = SERVER.format(tools=str(ROOT / "tools"), delay=latency_ms / 1000)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    port = int(proc.stdout.readline())
    return proc, f"http://127.0.0.1:{port}"


def upload(folder: Path, prefix: str, env: dict) -> None:
    code = ("import sys; from pathlib import Path; sys.path.insert(0, %r)\n"
            "from dali_pipe.s3 import make_client\n"
            "c = make_client(8)\n"
            "names = [b['Name'] for b in c.list_buckets().get('Buckets', [])]\n"
            "'bench' in names or c.create_bucket(Bucket='bench')\n"
            "root = Path(%r)\n"
            "for f in root.rglob('*'):\n"
            "    if f.is_file() and not f.name.startswith('.'):\n"
            "        c.upload_file(str(f), 'bench', %r + '/' + f.relative_to(root).as_posix())\n"
            % (str(ROOT), str(folder), prefix))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, vit-b16-random, or a local model folder")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=20)  # enough that the SIGTERM lands mid-run on a fast machine (2: ended before it)
    p.add_argument("--every", type=int, default=10, help="--checkpoint-every-steps of the kill -9 scenario")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--s3", action="store_true", help="also time a new instance's restart through sync and stream")
    p.add_argument("--latency-ms", type=float, default=20.0, help="per-request delay of the local S3 server")
    p.add_argument("--output", default="runs/reclaim")
    p.add_argument("--json", help="where the measurements go (default OUTPUT/reclaim-cost.json)")
    p.add_argument("--seed", type=int, default=0, help="draws the moments of the signals")
    args = p.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.output).resolve()
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="reclaim_", dir=work))
    cache = tmp / "cache"
    env = {**os.environ, "DALI_PIPE_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    data = demo_dataset(cache)  # the bundled demo photos (what `python train.py` trains on)
    common = ["--model", args.model, "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
              "--device", "cpu", "--seed", "0"]
    results: dict[str, list] = {k: [] for k in ("sigterm_saved_s", "sigterm_exit_s", "restart_local_s", "replayed_after_sigterm",
                                                "kill9_resumed_step", "kill9_reached_step", "restart_sync_s",
                                                "restart_stream_s", "sync_s", "checkpoint_mb")}
    parts_seen: list[dict] = []
    server = None
    if args.s3:
        env.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        env.pop("AWS_PROFILE", None)
        server, url = start_server(args.latency_ms, env)
        env["AWS_ENDPOINT_URL"] = url
        upload(data, "raw", env)
        pack = tmp / "pack"
        subprocess.run([sys.executable, "-m", "dali_pipe", "pack", str(data), str(pack)], cwd=ROOT, env=env,
                       check=True, capture_output=True)
        upload(pack, "packed", env)
    try:
        for r in range(args.repeat):
            # -- SIGTERM mid-epoch, then the same command with the data on disk ------------------
            out = tmp / f"sigterm-{r}"
            flags = ["--data", str(data), "--output", str(out), *common]
            run = Run(flags, env, tmp / f"sigterm-{r}.log")
            run.wait_training()
            time.sleep(rng.uniform(0.0, 1.5))
            signalled = time.perf_counter()
            run.proc.send_signal(signal.SIGTERM)
            rc = run.finish()
            if rc != 0 or "stopped by SIGTERM" not in run.text():
                raise SystemExit(f"SIGTERM run: exit {rc} (see {run.log})")
            results["sigterm_exit_s"].append(time.perf_counter() - signalled)
            saved_at = run.when("stopped by SIGTERM")
            results["sigterm_saved_s"].append(saved_at - signalled if saved_at else None)
            saved = last_step(out / "checkpoints")
            results["checkpoint_mb"].append((out / "checkpoints" / "last.ckpt").stat().st_size / 1e6)
            again = Run(flags + ["--monitor"], env, tmp / f"local-{r}.log")
            if again.finish() != 0:
                raise SystemExit(f"the resumed run failed (see {again.log})")
            startup, parts = monitor_startup(out)
            results["restart_local_s"].append(startup)
            parts_seen.append({"local": parts})
            resumed = resumed_step(again.text())
            results["replayed_after_sigterm"].append(None if resumed is None or saved is None else saved - resumed)
            # -- kill -9 between periodic saves ----------------------------------------------------
            out9 = tmp / f"kill9-{r}"
            longer = list(common)
            longer[longer.index("--epochs") + 1] = str(args.epochs + 3)
            flags9 = ["--data", str(data), "--output", str(out9), "--checkpoint-every-steps", str(args.every),
                      *longer]  # epochs enough that the kill lands mid-training on a fast machine too
            run = Run(flags9, env, tmp / f"kill9-{r}.log")
            run.wait_training(min_step=args.every + 1 + rng.randrange(max(1, args.every - 1)))  # between saves
            run.proc.send_signal(signal.SIGKILL)
            run.finish()
            per_epoch = steps_per_epoch(run.text())
            results["kill9_reached_step"].append(progress_step(run.text(), per_epoch))
            again = Run(flags9, env, tmp / f"kill9-resume-{r}.log")
            if again.finish() != 0:
                raise SystemExit(f"the run resumed after kill -9 failed (see {again.log})")
            results["kill9_resumed_step"].append(resumed_step(again.text()) or 0)
            if not args.s3:
                continue
            # -- a new instance: empty disk, the checkpoint dir restored (as SageMaker does) ------------
            for kind, uri in (("sync", "s3://bench/raw"), ("stream", "s3://bench/packed")):
                outs = tmp / f"{kind}-{r}"
                fresh = tmp / f"{kind}-cache-{r}"
                flags_s = ["--data", uri, "--output", str(outs), "--cache-dir", str(fresh), *common]
                if kind == "stream":
                    flags_s += ["--packed-s3", "stream"]
                run = Run(flags_s, env, tmp / f"{kind}-{r}.log")
                run.wait_training()
                run.proc.send_signal(signal.SIGTERM)
                if run.finish() != 0:
                    raise SystemExit(f"{kind}: the first run failed (see {run.log})")
                shutil.rmtree(fresh)  # the new instance's empty NVMe
                again = Run(flags_s + ["--monitor"], env, tmp / f"{kind}-resume-{r}.log")
                if again.finish() != 0:
                    raise SystemExit(f"{kind}: the resumed run failed (see {again.log})")
                startup, parts = monitor_startup(outs)
                results[f"restart_{kind}_s"].append(startup)
                parts_seen.append({kind: parts})
                if kind == "sync":
                    results["sync_s"].append(parts.get("prepare_data"))
            print(f"round {r + 1}/{args.repeat}: " + ", ".join(
                f"{k} {v[-1]:.2f}" for k, v in results.items() if v and isinstance(v[-1], (int, float))), flush=True)
    finally:
        if server is not None:
            server.kill()
    report = {"model": args.model, "batch_size": args.batch_size, "every": args.every, "repeat": args.repeat,
              "latency_ms": args.latency_ms if args.s3 else None, "cores": len(os.sched_getaffinity(0)),
              "data": {"images": sum(1 for _ in data.rglob("*.jpg")),
                       "mb": sum(f.stat().st_size for f in data.rglob("*.jpg")) / 1e6},
              "raw": results, "startup_parts": parts_seen,
              "summary": {k: summarize(v) for k, v in results.items() if v}}
    target = Path(args.json) if args.json else work / "reclaim-cost.json"
    target.write_text(json.dumps(report, indent=1))
    print(f"\n{args.model}, batch {args.batch_size}, {args.repeat} round(s), {report['cores']} cores; "
          f"checkpoint {statistics.median(results['checkpoint_mb']):.0f} MB")
    print(f"{'measure':<28} {'median':>9}  min-max")
    for k, s in report["summary"].items():
        print(f"{k:<28} {s['median']:>9.2f}  {s['min']:.2f}-{s['max']:.2f}")
    print(f"written to {target}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
