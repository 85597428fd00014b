#!/usr/bin/env python3
"""Time how long each data mistake of a first hour takes to be told, side by side with another checkout.

    python tools/time_errors.py [--against /path/to/other/checkout] [--rounds 5] [--json OUT.json]

Makes a dataset of real photos (dali_pipe.demo) and, from it, one mistake per case: a misspelt header
(`imagepath`), a CSV file given as dataset.tsv, a split column without train rows, a listed file that is
missing, `pack` of a path that does not exist, `evaluate` of a --data that does not exist, a --model
folder that does not exist; and "nothing to do", the rerun of a finished run (trained once first, tiny
model, one epoch), as trained and with `--device auto` (which loads torch to look for a GPU). Each case
runs as a user runs it (a fresh `python train.py ...` or `python -m dali_pipe ...`, wall time to its exit),
alternating between this checkout and `--against` (e.g. the main branch's) round by round, so both see
the same machine load. Prints each case's median and min-max per checkout, the ratio of medians, and each
case's first line of output; the exit status of every run is checked (2 for a mistake, 0 for nothing to
do). `train.py --help` is timed too, for scale: what starting the interpreter and reading the settings
costs on this machine now.
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
sys.path.insert(0, str(ROOT))


def mistakes(base: Path) -> dict[str, tuple[list[str], int]]:
    """case -> (argv after the interpreter, expected exit status), with the datasets made under `base`."""
    from dali_pipe.demo import make_photo_dataset

    photos = make_photo_dataset(base / "photos", classes=4, per_class=12)
    rows = (photos / "dataset.tsv").read_text().split()[1:]

    def dataset(name: str, tsv: str) -> str:
        root = base / name
        root.mkdir()
        for folder in sorted({r.split("/")[0] for r in rows}):
            (root / folder).symlink_to(photos / folder)
        (root / "dataset.tsv").write_text(tsv)
        return str(root)

    typo = dataset("typo", "imagepath\n" + "".join(f"{r}\n" for r in rows))
    csv = dataset("csv", "image_path,label\n" + "".join(f"{r},{r.split('/')[0]}\n" for r in rows))
    split = dataset("split", "image_path\tsplit\n" + "".join(f"{r}\tval\n" for r in rows))
    missing = dataset("missing", "image_path\n" + "".join(f"{r}\n" for r in rows + ["rocket/gone.jpg"]))
    out, nowhere = str(base / "out"), str(base / "nonexistent")
    train = ["train.py", "--model", "tiny", "--device", "cpu", "--output", out]
    finished = ["train.py", "--data", str(photos), "--model", "tiny", "--device", "cpu", "--epochs", "1",
                "--batch-size", "8", "--num-threads", "1", "--output", str(base / "done")]
    return {
        "train.py --help (for scale)": (["train.py", "--help"], 0),  # the interpreter and the settings alone
        "misspelt header": (train + ["--data", typo], 2),
        "CSV as dataset.tsv": (train + ["--data", csv], 2),
        "split without train rows": (train + ["--data", split], 2),
        "listed file missing": (train + ["--data", missing], 2),
        "pack /nonexistent": (["-m", "dali_pipe", "pack", nowhere, str(base / "packed")], 2),
        "evaluate --data /nonexistent": (["-m", "dali_pipe", "evaluate", "--model", "tiny", "--data", nowhere,
                                          "--output", str(base / "eval")], 2),
        "evaluate --model /nonexistent": (["-m", "dali_pipe", "evaluate", "--model", nowhere, "--data", str(photos),
                                           "--output", str(base / "eval")], 2),
        "nothing to do (finished run)": (finished, 0),
        "nothing to do (--device auto)": ([a if a != "cpu" else "auto" for a in finished], 0),  # torch looks for a GPU
    }


def run(checkout: Path, argv: list[str], env: dict) -> tuple[float, int, str]:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, *argv], cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - start
    text = (r.stderr + r.stdout).splitlines()
    said = next((i for i, ln in enumerate(text) if ln.startswith(("error:", "nothing to do", "usage:"))), None)
    if said is None:
        return took, r.returncode, text[-1] if text else ""
    line = text[said]  # "error: invalid arguments:" is followed by the problem, indented
    return took, r.returncode, line + (" " + text[said + 1].strip() if line.endswith(":") and said + 1 < len(text)
                                        else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, help="another checkout to time side by side (e.g. the main branch's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    checkouts = {"this": ROOT, **({"against": args.against.resolve()} if args.against else {})}
    base = Path(tempfile.mkdtemp(prefix="time-errors-"))
    try:
        env = {**os.environ, "DALI_PIPE_CACHE": str(base / "cache")}
        cases = mistakes(base)
        finished, _ = cases["nothing to do (finished run)"]
        subprocess.run([sys.executable, *finished], cwd=ROOT, env=env, check=True, capture_output=True, timeout=900)
        times = {c: {k: [] for k in checkouts} for c in cases}
        said = {c: {} for c in cases}
        for r in range(args.rounds):
            order = list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]
            for case, (argv, status) in cases.items():
                for name in order:
                    took, code, line = run(checkouts[name], argv, env)
                    if code != status:
                        print(f"warning: {case} ({name}) exited {code}, not {status}: {line}", file=sys.stderr)
                    times[case][name].append(took)
                    said[case][name] = line
        report = {}
        for case in cases:
            row = {n: {"median": statistics.median(t), "min": min(t), "max": max(t)} for n, t in times[case].items()}
            report[case] = {"seconds": row, "said": said[case]}
            cells = "  ".join(f"{n} {v['median']:5.2f} s ({v['min']:.2f}-{v['max']:.2f})" for n, v in row.items())
            ratio = (f"  ratio against/this {row['against']['median'] / row['this']['median']:.1f}x"
                     if "against" in row else "")
            print(f"{case:32s} {cells}{ratio}")
            for n, line in said[case].items():
                print(f"{'':32s}   {n}: {line[:150]}")
        if args.json:
            args.json.write_text(json.dumps({"rounds": args.rounds, "cases": report}, indent=1))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
