"""Run by test_ddp.py as a script (Lightning's DDP launcher re-runs it for rank 1): train.py's main
with 2 CPU processes (gloo), every trained and validated label traced (see resume_trace), and
optionally a SIGTERM on rank 0 after a given step.

    python ddp_worker.py TRACE SIGTERM_AT_STEP|none -- train.py flags...
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import resume_trace  # noqa: E402

from dali_pipe.cli import as_a_command, main  # noqa: E402

if __name__ == "__main__":
    as_a_command()  # as train.py exits
    trace, at = sys.argv[1], sys.argv[2]
    resume_trace.install(Path(trace), sigterm_at_step=None if at == "none" else int(at))
    print("RESULT", main(sys.argv[sys.argv.index("--") + 1:]), flush=True)
