"""Benchmark mode and the training monitor on the CPU: outputs, and planted diagnoses."""
from __future__ import annotations

import json
import math

import pytest

import train


@pytest.fixture(scope="module")
def big_root(tmp_path_factory):
    """Few, large real photos: decoding them on one core is far slower than a tiny model step."""
    from dali_pipe.demo import make_photo_dataset

    return make_photo_dataset(tmp_path_factory.mktemp("big"), classes=2, per_class=6, side=(1600, 1800))


def _bench(data, out, *extra):
    return train.main(["--benchmark", "--data", str(data), "--output", str(out), "--device", "cpu",
                       "--batch-size", "4", "--steps", "6", "--warmup", "2", *extra])


def test_benchmark_writes_complete_json_and_png(photo_root, tmp_path, cache_dir):
    """Every documented key is present; numbers are finite and positive where they must be."""
    out = tmp_path / "b"
    _bench(photo_root, out, "--model", "tiny", "--cpus", "1")
    rep = json.loads((out / "benchmark.json").read_text())
    assert rep["env"]["cpus"] == 1 and rep["env"]["gpu"] is None
    for k in ("torch", "dali", "lightning"):
        assert rep["env"][k]
    assert set(rep["loaders"]) == {"dali", "baseline", "synthetic"}
    for name, m in rep["loaders"].items():
        for k in ("images_per_sec", "step_ms_p50", "step_ms_p95", "data_wait_fraction", "cpu_util_mean",
                  "rss_peak_mb"):
            assert isinstance(m[k], float) and math.isfinite(m[k]) and m[k] >= 0, (name, k, m[k])
        assert m["images_per_sec"] > 0 and m["rss_peak_mb"] > 0 and 0 <= m["data_wait_fraction"] <= 1
        for k in ("gpu_util_mean", "gpu_util_p5", "gpu_mem_peak_mb"):
            assert m[k] is None
        assert "GPU fields are null" in m["gpu_note"]
    assert set(rep["ratios"]) == {"dali_vs_baseline", "dali_vs_synthetic", "baseline_vs_synthetic"}
    assert all(v > 0 for v in rep["ratios"].values())
    assert rep["diagnosis"] and all(isinstance(d, str) for d in rep["diagnosis"])
    png = (out / "benchmark.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_planted_input_bound_and_compute_bound(big_root, tmp_path, cache_dir):
    """Large photos on 1 thread with a near-free model: the loaders are input-bound; synthetic is not."""
    rep = _bench(big_root, tmp_path / "b", "--model", "tiny", "--cpus", "1", "--num-threads", "1")
    diag = {n: m["diagnosis"][0] for n, m in rep["loaders"].items()}
    assert diag["dali"].startswith("dali: input-bound"), diag
    assert diag["baseline"].startswith("baseline: input-bound"), diag
    assert "compute-bound" in diag["synthetic"], diag
    assert rep["loaders"]["dali"]["data_wait_fraction"] > 0.2


def test_model_none_times_loaders_only(photo_root, tmp_path, cache_dir):
    rep = _bench(photo_root, tmp_path / "b", "--model", "none", "--loaders", "dali,baseline")
    assert set(rep["loaders"]) == {"dali", "baseline"} and list(rep["ratios"]) == ["dali_vs_baseline"]
    assert "loader ceiling" in rep["loaders"]["dali"]["diagnosis"][0]


def test_diagnosis_rules_with_numbers():
    from dali_pipe.monitor import diagnose

    m = {"data_wait_fraction": 0.46, "cpu_util_mean": 97.0, "gpu_util_mean": 41.0, "gpu_util_p5": 3.0}
    assert diagnose("baseline", m, cores=4)[0] == ("baseline: input-bound, 46% of each step waits for data while the "
                                                   "CPU is 97% busy, the GPU only 41% busy; decoding on 4 core(s) "
                                                   "cannot keep up with the model.")
    m = {"data_wait_fraction": 0.004, "cpu_util_mean": 30.0, "gpu_util_mean": 97.0, "gpu_util_p5": 93.0}
    assert diagnose("dali", m, cores=4) == ["dali: compute-bound, the GPU is 97% busy and data-wait is 0.4%."]
    m = {"data_wait_fraction": 0.02, "cpu_util_mean": 30.0, "gpu_util_mean": 80.0, "gpu_util_p5": 20.0}
    d = diagnose("x", m, cores=4)
    assert "host-bound" in d[0] and "swings" in d[1]


def test_monitor_callback_names_checkpoint_stalls(photo_root, tmp_path, cache_dir, monkeypatch, capsys):
    """A checkpoint every 3rd step with a slowed save: the training monitor blames checkpoint saves."""
    import time

    from model.checkpoint import SpotSafeCheckpoint

    real = SpotSafeCheckpoint.save

    def slow_save(self, trainer):
        time.sleep(0.5)
        real(self, trainer)

    monkeypatch.setattr(SpotSafeCheckpoint, "save", slow_save)
    train.main(["--data", str(photo_root), "--model", "tiny", "--epochs", "3", "--batch-size", "4",
                "--device", "cpu", "--output", str(tmp_path / "o"), "--num-threads", "1",
                "--checkpoint-every-steps", "3", "--monitor", "--val-fraction", "0"])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("MONITOR ")]
    assert lines and "training:" in lines[0]
    stall = [ln for ln in lines if "periodic stalls" in ln]
    assert stall and "line up with checkpoint saves" in stall[0], lines
