"""A loop shared with worker interpreters gives what this process alone gives, a failing worker included."""
from __future__ import annotations

import os

import numpy as np

from dali_pipe.fanout import fan_out
from dali_pipe.manifest import _lstat_all
from dali_pipe.scan import _keys


def _here(names):
    return b"".join(len(n).to_bytes(4, "little") for n in names)


ECHO = r"""
import sys
sys.stdout.buffer.write(b"".join(len(n.decode("utf-8", "surrogateescape")).to_bytes(4, "little")
                                 for n in sys.stdin.buffer.read().split(b"\0")))
"""


def test_workers_answer_as_this_process_and_a_failing_one_leaves_its_share_here():
    names = [f"n{i}" * (i % 7) for i in range(1000)] + ["caf\u00e9", "\udcff-not-utf8"]
    assert fan_out(names, ECHO, [], 4, _here, parallel_from=0, shares=3) == _here(names)
    assert fan_out(names, "import sys; sys.exit(3)", [], 4, _here, parallel_from=0, shares=3) == _here(names)
    assert fan_out(names, "print('short')", [], 4, _here, parallel_from=0, shares=3) == _here(names)
    assert fan_out(names[:2], ECHO, [], 4, _here, parallel_from=0, shares=3) == _here(names[:2])  # shares of 0 and 1 names
    assert fan_out([], ECHO, [], 4, _here, parallel_from=0, shares=3) == b""


def test_lstats_and_path_digests_in_workers_are_the_serial_ones(tmp_path):
    names = []
    for i in range(300):
        name = f"f{i}.jpg" if i % 50 else os.fsdecode(b"\xff-%d.jpg" % i)  # some not UTF-8
        if i % 9:
            (tmp_path / name).write_bytes(b"x" * i)
        names.append(name)
    (tmp_path / "d").mkdir()
    names.append("d")
    rel = np.array(names, dtype=object)
    for a, b in zip(_lstat_all(tmp_path, rel, parallel_from=0), _lstat_all(tmp_path, rel, parallel_from=10**9)):
        assert a.tolist() == b.tolist()
    modes = _lstat_all(tmp_path, rel, parallel_from=0)[0]
    assert (modes[[i for i in range(300) if i % 9 == 0]] == 0).all() and modes[-1] != 0
    paths = [str(tmp_path / n) for n in names]
    assert _keys(paths, parallel_from=0).tolist() == _keys(paths, parallel_from=10**9).tolist()
