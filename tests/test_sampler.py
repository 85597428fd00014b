"""The sampler's window (our load told apart from other processes') and the step timer's spread and stalls."""
from __future__ import annotations

from dali_pipe.sampler import Sampler, StepLog


def test_window_separates_other_processes_from_ours():
    """Pinned cores 90% busy on average, this process tree used 0.5 core-seconds per second: 2 cores -> 1.3 other."""
    s = Sampler(hz=1000)
    s.cores = [0, 1]
    s.samples = [(0.0, None, None, 90.0, 100.0, 10.0), (1.0, None, None, 90.0, 120.0, 10.25),
                 (2.0, None, None, 90.0, 110.0, 11.0)]
    w = s.window(0.0, 2.0)
    assert abs(w["other_load_cores"] - 1.3) < 1e-9 and w["rss_peak_mb"] == 120.0 and w["cpu_util_mean"] == 90.0


def test_steplog_summary_and_stalls():
    log = StepLog(step_s=[0.1] * 9 + [1.0], wait_s=[0.05] * 10)
    s = log.summary(8)
    assert abs(s["images_per_sec"] - 80 / 1.9) < 1e-9 and abs(s["data_wait_fraction"] - 0.5 / 1.9) < 1e-9
    assert log.stalls()["count"] == 1
