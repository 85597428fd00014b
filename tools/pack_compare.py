#!/usr/bin/env python3
"""`python -m dali_pipe pack` against the hand-written pack (tools/pack_baseline.py), side by side: the two run in
turn, ROUNDS times, each into a fresh folder (ours with a fresh cache dir: its scan is part of its cost), timed
wall to wall as a user runs them; prints each round and the ratio (baseline time / ours: above 1 is ours faster)
with its range.

    python tools/pack_compare.py DATA [--rounds 2] [--work /tmp/pack-compare] [--json OUT.json]   (DATA holds dataset.tsv)

--json also writes each round's times and ratio, with the command line, the cores and the load before and after.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return took, (done.stdout + done.stderr).strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("data", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/pack-compare"))
    ap.add_argument("--json", type=Path, help="also write the rounds here")
    a = ap.parse_args()
    load_before = os.getloadavg()
    ratios, rounds = [], []
    for r in range(1, a.rounds + 1):
        shutil.rmtree(a.work, ignore_errors=True)
        base, said = timed([sys.executable, "tools/pack_baseline.py", str(a.data), str(a.work / "baseline")])
        images = json.loads(said)["images"]
        ours, _ = timed([sys.executable, "-m", "dali_pipe", "pack", str(a.data), str(a.work / "ours"),
                         "--cache-dir", str(a.work / "cache")])
        ratios.append(base / ours)
        rounds.append({"baseline_s": base, "pack_s": ours, "images": images, "pack_vs_baseline": base / ours})
        print(f"round {r}: baseline {base:.1f} s ({images / base:.0f} img/s), pack {ours:.1f} s "
              f"({images / ours:.0f} img/s): {base / ours:.2f}x", flush=True)
    shutil.rmtree(a.work, ignore_errors=True)
    print(f"pack / baseline images/s: {min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} rounds")
    if a.json:
        a.json.write_text(json.dumps({
            "command": sys.argv, "data": str(a.data), "cores": len(os.sched_getaffinity(0)),
            "load_before": load_before, "load_after": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rounds": rounds,
            "pack_vs_baseline": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
