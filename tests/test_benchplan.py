"""The benchmark's plan: defaults from the machine where none was given, --cpus cut to the cores, the estimate's
refusal on the CPU."""
from __future__ import annotations

import pytest

from dali_pipe.benchplan import check_duration, estimate, plan
from dali_pipe.cli import parse_train, prepared
from dali_pipe.config import UsageError


def _settings(*flags):
    return prepared(parse_train(["--benchmark", "--data", "DATA", "--device", "cpu", "--output", "OUT", *flags]))


def test_defaults_come_from_the_machine_and_say_so(monkeypatch, tmp_path):
    """On the CPU with a model: a batch for the memory and fewer steps, in one line naming the flags; what was given
    is kept; a GPU gets the GPU's defaults; --cpus beyond the cores is cut to them, with a line."""
    monkeypatch.setattr("dali_pipe.cli.data_check", lambda data: None)
    s, lines = plan(_settings("--model", "vit-b16-random", "--cpus", "4"), gpu=False, available_cores=2, memory=24.0)
    assert (s.data.batch_size, s.bench.warmup, s.bench.steps, s.bench.repeat, s.bench.cpus) == (8, 2, 6, 2, 2)
    assert lines[0] == "--cpus 4 is more than the 2 core(s) this process may use; using 2"
    assert "chose batch 8, 6 timed step(s), 2 warm-up step(s), 2 round(s)" in lines[1] and "no GPU" in lines[1]
    assert "set --batch-size, --steps, --warmup, --repeat to choose" in lines[1]
    s, lines = plan(_settings("--model", "vit-b16-random", "--steps", "3", "--batch-size", "16"), gpu=False,
                    available_cores=2, memory=6.0)
    assert (s.data.batch_size, s.bench.steps, s.bench.repeat) == (16, 3, 2) and "chose 2 warm-up" in lines[0]
    s, _ = plan(_settings("--model", "vit-b16-random"), gpu=True, available_cores=4, memory=16.0)
    assert (s.data.batch_size, s.bench.steps, s.bench.warmup, s.bench.repeat) == (32, 50, 10, 3)
    s, lines = plan(_settings("--model", "none", "--batch-size", "4", "--steps", "2", "--warmup", "1", "--repeat", "1"),
                    gpu=False, available_cores=2, memory=24.0)
    assert lines == [] and (s.data.batch_size, s.bench.steps) == (4, 2)


def test_a_long_cpu_run_is_refused_with_its_estimate():
    """Over 10 minutes on the CPU: refused, naming the estimate and --allow-long; with it, or on a GPU, it runs."""
    probe = {"step_ms_p50": 5000.0, "rss_peak_mb": 3200.0, "time_budget": {"wall_s": 20.0, "shares": {"startup": 0.5}}}
    seconds = estimate(probe, legs=6, warmup=2, steps=30, model=True)
    assert seconds == pytest.approx(6 * (10 + 32 * 5.5))
    with pytest.raises(UsageError, match=r"about 19 minutes on the CPU, .*estimated 18.6 min .*--allow-long"):
        check_duration(seconds, probe, legs=6, batch=8, allow_long=False, gpu=False)
    assert check_duration(seconds, probe, legs=6, batch=8, allow_long=True, gpu=False).startswith("estimated 18.6 min")
    check_duration(seconds, probe, legs=6, batch=8, allow_long=False, gpu=True)
