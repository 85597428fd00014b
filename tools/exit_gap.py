#!/usr/bin/env python3
"""Seconds from a command's last output line to its exit: train.py (as_a_command: the imports' objects frozen, no
final collection walk over them) against the same CLI run without as_a_command, alternating, N rounds (default 3).
The run is a tiny model's one epoch on the demo set.

    python tools/exit_gap.py 4
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
ARGS = ["--model", "tiny", "--device", "cpu", "--epochs", "1", "--resume", "never", "--output", "/tmp/exit-gap-out",
        "--cache-dir", "/tmp/exit-gap-cache"]


def gap(argv: list[str]) -> float:
    """Seconds from the command's last line of output to its exit (status 0 checked)."""
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    last = time.perf_counter()
    for _ in iter(p.stdout.readline, b""):
        last = time.perf_counter()
    status = p.wait()
    assert status == 0, (argv, status)
    return time.perf_counter() - last


def main(rounds: int) -> None:
    commands = {"train.py": [sys.executable, "train.py", *ARGS],
                "without as_a_command": [sys.executable, "-c", "import sys; from dali_pipe.cli import cli; "
                                         f"sys.argv[1:] = {ARGS!r}; sys.exit(cli())"]}
    seconds = {name: [] for name in commands}
    for r in range(rounds):
        for name in (list(commands) if r % 2 == 0 else list(commands)[::-1]):
            seconds[name].append(gap(commands[name]))
            print(name, f"{seconds[name][-1]:.3f} s", flush=True)
    for name, v in seconds.items():
        print(f"{name}: median {statistics.median(v):.3f} s ({min(v):.3f}-{max(v):.3f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
