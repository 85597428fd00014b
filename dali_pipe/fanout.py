"""One loop over a million names, shared with a worker interpreter per further core.

Looking at each of a million files (an lstat) or hashing each of a million paths costs about 1 µs of Python's
own work per name around a call that takes about as long, so threads, which take turns on the GIL, gain nothing
(measured: 3.0 s with one thread, 3.8 s with two). Each worker is `python -c SCRIPT` (no fork of a training
process's threads, no re-run of the user's script, as multiprocessing's spawn would do): it reads its share of
the names, NUL-separated, on stdin and writes a fixed-size binary record per name on stdout. This process
works through the first share meanwhile. A worker that cannot start or fails leaves its share to this process:
only slower, never another answer.
"""
from __future__ import annotations

import subprocess
import sys

from .config import cores
from .stop import check


def fan_out(names: list[str], script: str, args: list[str], record: int, here, *, parallel_from: int,
            shares: int | None = None) -> bytes:
    """The records of `names`, in order: `here(names)` (bytes, `record` bytes a name) on this process's share,
    `python -c script *args` on each other share, from `parallel_from` names on (below, all here). `shares`:
    how many (default: one a core, at most 8)."""
    parts = (shares or max(1, min(cores(), 8))) if len(names) >= parallel_from else 1
    bounds = [len(names) * k // parts for k in range(parts + 1)]
    workers = []
    for a, b in zip(bounds[1:-1], bounds[2:]):
        try:
            w = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL)
            w.stdin.write("\0".join(names[a:b]).encode("utf-8", "surrogateescape"))
            w.stdin.close()
        except OSError:
            w = None
        workers.append((w, a, b))
    try:
        out = [here(names[:bounds[1]])]
        for w, a, b in workers:
            check()  # SIGTERM, Ctrl-C: after this process's share (about a second a million names), not after all
            got = w.stdout.read() if w is not None else b""
            if w is None or w.wait() != 0 or len(got) != (b - a) * record:
                got = here(names[a:b])
            out.append(got)
    except BaseException:
        for w, _, _ in workers:
            if w is not None:
                w.kill()
        raise
    return b"".join(out)
