"""The DataModule: settings -> sync/scan/report -> per-rank loaders."""
from __future__ import annotations

import pytest
from helpers import datamodule

from dali_pipe.spec import ImageSpec

SPEC = ImageSpec(16, 16, (0.5,) * 3, (0.5,) * 3)


def test_datamodule_batches_and_labels(photo_root, tmp_path, cache_dir):
    """setup() builds CPU loaders; labels are int64 class indices; val covers the whole val split."""
    dm = datamodule(photo_root, tmp_path / "out", batch_size=8, cache_dir=cache_dir, spec=SPEC, val_fraction=0.25)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.classes == ["astronaut", "chelsea", "coffee", "rocket"]
    assert len(dm.manifest.train) == 38 and len(dm.manifest.val) == 10
    for _ in range(3):
        train = list(dm.train_dataloader())
        assert len(train) == len(dm.train_dataloader()) == 38 // 8
        x, y = train[0]
        assert x.shape == (8, 3, 16, 16) and y.dtype.is_floating_point is False and str(y.dtype) == "torch.int64"
        assert sum(len(y) for _, y in dm.val_dataloader()) == 10
    assert (tmp_path / "out" / "bad_images.tsv").read_text().strip() == "image_path\treason"


def test_batch_larger_than_a_ranks_share_is_refused(photo_root, tmp_path, cache_dir):
    from dali_pipe.datamodule import BatchTooLargeError

    dm = datamodule(photo_root, tmp_path / "out", batch_size=64, cache_dir=cache_dir, spec=SPEC)
    dm.prepare_data()
    with pytest.raises(BatchTooLargeError, match="--batch-size 64 is larger than the 43 training images"):
        dm.setup("fit")
