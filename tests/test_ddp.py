"""2-rank DDP on the CPU (gloo) with the DALI CPU pipeline and the real Trainer, reading a pack: exact
sharding, equal batch counts, validation reduced across ranks, and a SIGTERM mid-epoch resumed exactly.
(Plain files go through the same DataModule and loader; their sharding is checked in test_loader.)"""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import resume_trace as rt

HERE = Path(__file__).resolve().parent
EPOCHS, BATCH = 2, 5


def _run(data, out, trace, sigterm_at, cache):
    argv = [sys.executable, str(HERE / "ddp_worker.py"), str(trace), str(sigterm_at), "--", "--data", str(data),
            "--model", "tiny", "--device", "cpu", "--devices", "2", "--epochs", str(EPOCHS), "--batch-size",
            str(BATCH), "--num-threads", "1", "--output", str(out)]
    env = {**os.environ, "DALI_PIPE_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_two_ranks_on_packed_data_resume_exactly_after_sigterm(photo_root, tmp_path):
    """2 ranks read a pack: each rank's share is disjoint and equal; a SIGTERM in epoch 2 saves every
    rank's position, and the rerun trains each sample once per epoch across both runs."""
    from dali_pipe.cli.commands import main

    data = rt.indexed_dataset(photo_root, tmp_path / "data")  # 41 train / 7 val, each image its own class
    packed, cache = tmp_path / "packed", tmp_path / "cache"
    os.environ.setdefault("DALI_PIPE_CACHE", str(cache))
    main(["pack", str(data), str(packed), "--max-side", "64", "--shard-size", "40kB", "--workers", "1"])
    out, trace = tmp_path / "out", tmp_path / "trace.jsonl"
    r = _run(packed, out, trace, 5, cache)  # epoch 2, after its first step on each rank
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "stopped by SIGTERM" in r.stdout
    r = _run(packed, out, trace, "none", cache)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "resuming epoch 2, step " in r.stdout and f"TRAINED global_step={EPOCHS * (20 // BATCH)}" in r.stdout

    records = rt.read(trace)
    rows = [x.split("\t") for x in (data / "dataset.tsv").read_text().splitlines()[1:]]
    train = {x[1] for x in rows if x[2] == "train"}
    val = {x[1] for x in rows if x[2] == "val"}
    rt.assert_each_sample_once_per_epoch(records, train=train, epochs=EPOCHS, batch=BATCH, world=2, val=val)
    for e in range(EPOCHS):
        per_rank = [[x for x in records if x["kind"] == "train" and x["epoch"] == e and x["rank"] == k]
                    for k in (0, 1)]
        assert len(per_rank[0]) == len(per_rank[1]) == 20 // BATCH, "equal batch counts on both ranks"
        assert not set(sum((x["labels"] for x in per_rank[0]), [])) & set(sum((x["labels"] for x in per_rank[1]), []))
    metric = [ln for ln in r.stdout.splitlines() if ln.startswith("METRIC epoch=2")]
    assert metric and "train_samples=40" in metric[0] and "val_samples=7" in metric[0], metric
    assert Counter(x["rank"] for x in records if x["kind"] == "val")[1] > 0, "rank 1 validated its shard"
