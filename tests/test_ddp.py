"""2-rank DDP on the CPU (gloo) with the DALI CPU pipeline: exact sharding, equal batch counts,
validation metrics aggregated across ranks."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_two_ranks_shard_exactly_and_aggregate_validation(tmp_path, photo_root):
    # every image its own class; 41 train / 7 val through a split column
    rows = (photo_root / "dataset.tsv").read_text().splitlines()[1:]
    data = tmp_path / "data"
    data.mkdir()
    lines = ["image_path\tlabel\tsplit"]
    for i, rel in enumerate(rows):
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).symlink_to(photo_root / rel)
        lines.append(f"{rel}\ts{i:03d}\t{'val' if i % 7 == 3 else 'train'}")
    (data / "dataset.tsv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    epochs, batch = 3, 5
    r = subprocess.run([sys.executable, str(HERE / "ddp_worker.py"), str(data), str(out), str(epochs), str(batch)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(2)]
    classes = ranks[0]["classes"]
    train_ids = {i for i, _ in enumerate(rows) if i % 7 != 3}
    val_ids = {i for i, _ in enumerate(rows) if i % 7 == 3}
    name_to_row = {c: int(c[1:]) for c in classes}
    for e in range(epochs):
        per_rank = [[name_to_row[classes[i]] for i in rk["trace"][e]["seen"]] for rk in ranks]
        assert ranks[0]["trace"][e]["batches"] == ranks[1]["trace"][e]["batches"] > 0
        both = per_rank[0] + per_rank[1]
        assert max(Counter(both).values()) == 1, "a sample seen twice in one epoch"
        assert set(both) <= train_ids
        for seen in per_rank:  # at most one dropped partial batch per rank
            assert len(train_ids) // 2 - len(seen) < batch + 1
        val = [name_to_row[classes[i]] for rk in ranks for i in rk["trace"][e]["val_seen"]]
        assert sorted(val) == sorted(val_ids), "validation sees every val sample exactly once across ranks"
        m0, m1 = ranks[0]["trace"][e]["metrics"], ranks[1]["trace"][e]["metrics"]
        assert m0["val_samples"] == m1["val_samples"] == len(val_ids)  # reduced over both ranks
        assert m0["val_loss"] == pytest.approx(m1["val_loss"])
