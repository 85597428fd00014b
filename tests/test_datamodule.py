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


@pytest.mark.parametrize("devices,expected", [([2, 3], (2, 3)), ("2,3", (2, 3)), (-1, (0, 1)), ("auto", (0, 1)),
                                              ([1], (1, 1))])
def test_dali_runs_on_the_trainers_cuda_device(tmp_path, cache_dir, monkeypatch, devices, expected):
    """The device_id handed to the GPU pipeline is the Trainer's root device (Lightning's own parsing of each
    `devices=` form, on a machine made to show 4 GPUs), for local ranks 0 and 1: devices=[2, 3] decodes on
    cuda:2 and cuda:3, not on the local ranks' cuda:0 and cuda:1."""
    import pytorch_lightning as pl
    import torch
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", rank_zero_only.rank)  # a DDP Trainer sets it; put back after
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr("lightning_fabric.accelerators.cuda.num_cuda_devices", lambda: 4)
    for local_rank in (0, 1):
        for k, v in {"LOCAL_RANK": local_rank, "RANK": local_rank, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": 29999}.items():
            monkeypatch.setenv(k, str(v))
        trainer = pl.Trainer(accelerator="gpu", devices=devices, logger=False, enable_progress_bar=False)
        dm = datamodule(tmp_path, tmp_path / "out", batch_size=8, cache_dir=cache_dir, spec=SPEC, device="gpu")
        dm.trainer = trainer
        opts = dm.options(training=True)
        assert opts.device == "gpu" and opts.device_id == expected[local_rank] == trainer.strategy.root_device.index
    dm.trainer = None
    assert dm.options(training=False).device_id == 0  # no Trainer: device 0, as the benchmark's torch.device("cuda", 0)


def test_batch_larger_than_a_ranks_share_is_refused(photo_root, tmp_path, cache_dir):
    """The refusal names the largest batch that fits, and that batch size is accepted."""
    from dali_pipe.dataset import BatchTooLargeError, check_batch

    dm = datamodule(photo_root, tmp_path / "out", batch_size=64, cache_dir=cache_dir, spec=SPEC)
    dm.prepare_data()
    with pytest.raises(BatchTooLargeError, match="--batch-size 64 is larger than the 43 training images") as e:
        dm.setup("fit")
    advised = int(str(e.value).split("pass --batch-size ")[1].split()[0])
    check_batch(43, advised, 1)  # following the advice works
    with pytest.raises(BatchTooLargeError, match="pass --batch-size 21 or lower"):
        check_batch(43, 22, 2)
    check_batch(43, 21, 2)


def test_every_loader_asked_for_before_setup_says_which_call_is_missing(photo_root, tmp_path, cache_dir):
    """train/val/test/predict_dataloader before setup(): NotPreparedError naming the missing calls (before: None
    for train, [] for val, which trains nothing, and 'the validation split is empty' for predict)."""
    from dali_pipe.datamodule import NotPreparedError

    dm = datamodule(photo_root, tmp_path / "out", batch_size=8, cache_dir=cache_dir, spec=SPEC, val_fraction=0.25)
    calls = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader")
    for call in calls:
        with pytest.raises(NotPreparedError, match=rf"dm\.{call}\(\) was called before .* call dm\.prepare_data\(\), "
                                                   r"then dm\.setup\(\) first"):
            getattr(dm, call)()
    dm.prepare_data()
    with pytest.raises(NotPreparedError, match=r"call dm\.setup\(\) first"):
        dm.val_dataloader()
    dm.setup("fit")
    assert all(getattr(dm, call)() is not None for call in calls)


def test_trainer_test_and_predict_run_over_the_validation_split(photo_root, tmp_path, cache_dir):
    """trainer.test and trainer.predict take the validation split, unaugmented, every sample once, predict in
    the order of dm.manifest.val (so outputs map back to files); an empty split is refused, saying why."""
    import pytorch_lightning as pl
    import resume_trace as rt
    import torch

    import dali_pipe
    from dali_pipe.errors import UserError

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 1)

        def test_step(self, batch, batch_idx):
            self.log("seen", float(len(batch[1])), reduce_fx="sum")

        def predict_step(self, batch, batch_idx):
            return batch[1]

    data = rt.indexed_dataset(photo_root, tmp_path / "data")  # each image its own class: labels name the files
    dm = dali_pipe.DaliDataModule(data=data, model="tiny", batch_size=2, device="cpu", num_threads=1)
    dm.prepare_data()
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    assert trainer.test(Module(), datamodule=dm, verbose=False)[0]["seen"] == len(dm.manifest.val) == 7
    labels = torch.cat(trainer.predict(Module(), datamodule=dm)).tolist()
    assert labels == [s.label for s in dm.manifest.val]
    none = dali_pipe.DaliDataModule(data=rt.indexed_dataset(photo_root, tmp_path / "noval", val_every=None),
                                    model="tiny", batch_size=2, device="cpu", num_threads=1)
    with pytest.raises(UserError, match="the validation split is empty"):
        trainer.predict(Module(), datamodule=none)


def test_a_manifest_read_already_is_not_read_again(photo_root, tmp_path, cache_dir):
    """The manifest given to the DataModule (the CLI reads it before the heavy imports) is the one it scans and
    trains on, in the main process and in the other local ranks' (which read it without scanning)."""
    import os
    from unittest import mock

    from dali_pipe.manifest import read_manifest

    m = read_manifest(photo_root, val_fraction=0.25, seed=0, skip_missing=False)
    m.train = m.train[:20]  # differs from the folder's: a second read would undo it
    for local_rank in ("0", "1"):
        dm = datamodule(photo_root, tmp_path / "out", batch_size=8, cache_dir=cache_dir, spec=SPEC, val_fraction=0.25,
                        manifest=m)
        with mock.patch.dict(os.environ, {"LOCAL_RANK": local_rank}):
            dm.prepare_data()
        assert [s.path for s in dm.manifest.train] == [s.path for s in m.train], local_rank


def test_prediction_writers_get_each_batchs_positions_in_the_split(photo_root, tmp_path, cache_dir):
    """trainer.predict gives a BasePredictionWriter the real batch_indices (they were empty): positions in
    dm.manifest.val, per rank of a DDP run a contiguous share, so every output maps back to its file; checked
    through each rank's own DALI reader (ranks 0 and 1 of 2) and through a real Trainer."""
    from types import SimpleNamespace

    import pytorch_lightning as pl
    import resume_trace as rt
    import torch
    from pytorch_lightning.callbacks import BasePredictionWriter

    import dali_pipe

    data = rt.indexed_dataset(photo_root, tmp_path / "data")  # each image its own class: labels name the files
    seen = []
    for rank in (0, 1):
        dm = dali_pipe.DaliDataModule(data=data, model="tiny", batch_size=2, device="cpu", num_threads=1)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2, local_rank=0, num_nodes=1, accelerator=None,
                                     default_root_dir=str(tmp_path))
        dm.prepare_data()
        dm.setup("predict")
        loader = dm.predict_dataloader()
        for (images, labels), positions in zip(loader, loader.positions, strict=True):
            assert labels.tolist() == [dm.manifest.val[i].label for i in positions], (rank, positions)
            seen += positions
    assert sorted(seen) == list(range(len(dm.manifest.val))) == list(range(7))

    class Writer(BasePredictionWriter):
        def __init__(self):
            super().__init__(write_interval="batch_and_epoch")
            self.batches, self.epoch = [], None

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dl_idx=0):
            self.batches.append((list(batch_indices), prediction.tolist()))

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            self.epoch = batch_indices

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 1)

        def predict_step(self, batch, batch_idx):
            return batch[1]

    dm = dali_pipe.DaliDataModule(data=data, model="tiny", batch_size=2, device="cpu", num_threads=1)
    writer = Writer()
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[writer],
                         default_root_dir=tmp_path)
    trainer.predict(Module(), datamodule=dm, return_predictions=False)
    assert [i for indices, _ in writer.batches for i in indices] == list(range(7))
    for indices, labels in writer.batches:
        assert labels == [dm.manifest.val[i].label for i in indices]
    assert writer.epoch == [[indices for indices, _ in writer.batches]]
