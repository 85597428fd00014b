"""The TSVs we write (bad_images.tsv, predictions.tsv) read back through pandas as the rows written, whatever the
file names hold: a tab and a newline in a name once forged a row in both."""
from types import SimpleNamespace

import pandas as pd
import pytest

from dali_pipe.tsv import row

NAMES = ["plain.jpg", "tab\there.jpg", "new\nline.jpg", "cr\r.jpg", 'mid"quote.jpg', '"leading.jpg', "NA",
         "a\t\n\"b\".jpg", "dir/ünï cödé.jpg", ""]


def _read(path):
    return pd.read_csv(path, sep="\t", dtype=str, keep_default_na=False)


def test_a_row_reads_back_through_pandas_exactly_and_plain_cells_are_written_as_they_are(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text(row(["image_path", "reason"]) + "".join(row([n, f"why {i}"]) for i, n in enumerate(NAMES)))
    back = _read(path)
    assert back["image_path"].tolist() == NAMES and back["reason"].tolist() == [f"why {i}" for i in range(len(NAMES))]
    assert row(["plain.jpg", 'mid"quote.jpg', "x y"]) == 'plain.jpg\tmid"quote.jpg\tx y\n'  # as dataset.tsv wrote them


def test_bad_images_and_member_reports_and_predictions_read_back_row_for_row(tmp_path):
    torch = pytest.importorskip("torch")
    from dali_pipe.cli.predict import write_predictions
    from dali_pipe.scan import write_report

    root = tmp_path / "data"
    write_report({str(root / n): f"reason\t{i}\nmore" for i, n in enumerate(NAMES) if n}, root, tmp_path / "a")
    back = _read(tmp_path / "a" / "bad_images.tsv")
    assert sorted(back["image_path"]) == sorted(n for n in NAMES if n) and len(back) == len(NAMES) - 1
    assert all(r.startswith("reason\t") for r in back["reason"])

    model = SimpleNamespace(config=SimpleNamespace(id2label={0: "cat\tdog", 1: "b"}))
    write_predictions(tmp_path / "p", NAMES, torch.tensor([[2.0, 1.0]] * len(NAMES)), model, 2)
    back = _read(tmp_path / "p" / "predictions.tsv")
    assert back["image_path"].tolist() == NAMES and set(back["label"]) == {"cat\tdog"} and set(back["label_2"]) == {"b"}


def test_a_member_report_reads_back_row_for_row(tmp_path):
    from dali_pipe.shards.shardset import write_member_report

    shard = SimpleNamespace(image_paths=NAMES, name="s\t0.tar", keys=[f"k\n{i}" for i in range(len(NAMES))])
    shards = SimpleNamespace(bad=[(shard, e, f"bad {e}") for e in range(len(NAMES))])
    back = _read(write_member_report(shards, tmp_path))
    assert back["image_path"].tolist() == NAMES and back["key"].tolist() == shard.keys
    assert set(back["shard"]) == {"s\t0.tar"}
