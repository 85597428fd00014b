"""The monitor in a Trainer: the time budget measured from the profiled actions, the packing prescription printed,
the callback across processes, the GPU decoder's refusals counted."""
from __future__ import annotations

import json
import os
import re
import time

import train


def test_start_up_names_its_parts_from_the_process_start():
    """A command's start-up begins at the process's start: the imports are a named part beside the data
    preparation and the pipeline build, and what is left is the model load, the Trainer and the first batch."""
    from dali_pipe.cli import process_start
    from dali_pipe.prescribe import budget_verdicts, time_budget

    assert 0 <= time.perf_counter() - process_start() < 3600  # this process started earlier, and today
    b = time_budget(40.0, startup=20.0, data_wait=1.0, model_step=18.0,
                    startup_parts={"imports": 11.0, "prepare_data": 4.0, "setup": 1.5})
    line = [v for v in budget_verdicts("training", b) if "start-up takes" in v][0]
    assert ("start-up takes 50% of the run (20.0 s: interpreter start and imports 11.0 s, data preparation (sync, "
            "scan) 4.0 s, pipeline build 1.5 s, the rest (model load, Trainer set-up, the first batches) 3.5 s)") in line


def test_time_budget_names_the_checkpoint_saves(photo_root, tmp_path, cache_dir, monkeypatch, capsys):
    """Planted: a checkpoint every 2 steps whose writing takes 0.8 s (6 steps). --monitor names the saves with
    their share and a larger --checkpoint-every-steps, beside one `MONITOR time:` line, and TensorBoard gets it."""
    import time

    import torch

    real = torch.save

    def slow_save(obj, f, *a, **k):
        time.sleep(0.8)  # a large checkpoint on a slow disk
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", slow_save)
    out = tmp_path / "o"
    train.main(["--data", str(photo_root), "--model", "tiny", "--epochs", "1", "--batch-size", "8",
                "--device", "cpu", "--output", str(out), "--num-threads", "1",
                "--checkpoint-every-steps", "2", "--monitor", "--val-fraction", "0"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("MONITOR ")]
    time_lines = [ln for ln in lines if ln.startswith("MONITOR time: ")]
    assert len(time_lines) == 1, lines
    shares = [int(x.split()[-1].rstrip("%")) for x in time_lines[0].split(": ", 1)[1].split(" (of ")[0].split(", ")]
    assert len(shares) == 6 and 97 <= sum(shares) <= 103  # rounded shares of a whole
    saves = [ln for ln in lines if "checkpoint saves take" in ln]
    # steps 2 and 4, then the final save (none at step 6, the epoch's last: a resume from there skips validation)
    each = re.search(r"\(3 save\(s\), (\d+\.\d+) s each\)", saves[0]) if saves else None
    assert each and float(each.group(1)) >= 0.8 and "--checkpoint-every-steps " in saves[0], lines  # 0.8 s or more
    suggested = int(saves[0].split("--checkpoint-every-steps ")[1].split()[0])
    assert suggested > 2
    report = json.loads((out / "monitor.json").read_text())
    assert abs(sum(report["time_budget"]["shares"].values()) - 1) < 1e-9
    assert report["time_budget"]["saves_info"]["every_steps"] == 2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(out / "tensorboard")).Reload().Tags()
    assert "monitor/time_checkpoint_saves" in tags["scalars"] and "monitor/diagnosis" in str(tags)


def test_monitor_prescribes_packing_for_large_photos(tmp_path, cache_dir, capsys):
    """An input-bound --monitor verdict on ~2.5 Mpx photos measures a pack of them (the timing itself is
    planted in test_benchmark; here the verdict is given)."""
    from dali_pipe.cli import fit, parse_train
    from dali_pipe.config import resolve
    from dali_pipe.dataset import read
    from dali_pipe.demo import make_photo_dataset
    from dali_pipe.spec import ImageSpec

    big = make_photo_dataset(tmp_path / "big", classes=2, per_class=6, side=(1600, 1800))
    s = resolve(parse_train(["--data", str(big), "--device", "cpu", "--model", "tiny", "--batch-size", "4"]))
    report = {"diagnosis": ["training: input-bound, 60% of each step waits for data while the CPU is 99% busy"]}
    fit.advise_packing(s, report, read(s.data), ImageSpec(64, 64, (0.5,) * 3, (0.5,) * 3))
    line = capsys.readouterr().out.strip()
    assert line.startswith("MONITOR input-bound on large photos (median 2.") and "--max-side 384" in line, line
    assert line.endswith(f": python -m dali_pipe pack {big} {big}-packed --max-side 384, then --data {big}-packed."), line
    fit.advise_packing(s, {"diagnosis": ["training: compute-bound (CPU)"]}, read(s.data), None)
    assert capsys.readouterr().out == ""


def test_the_callback_pickles_for_spawned_processes():
    """MonitorCallback survives pickling (Trainer(strategy="ddp_spawn") pickles its callbacks), before and after
    a fit's setup has tapped a Trainer."""
    import pickle
    from types import SimpleNamespace

    from pytorch_lightning.profilers import PassThroughProfiler

    from dali_pipe.monitor import MonitorCallback

    cb = MonitorCallback(verbose=False)
    assert isinstance(pickle.loads(pickle.dumps(cb)), MonitorCallback)
    trainer = SimpleNamespace(profiler=PassThroughProfiler(), datamodule=None, global_step=3)
    cb.setup(trainer, None, "fit")
    copy = pickle.loads(pickle.dumps(cb))
    assert copy._tap is None and copy.clock.global_step() is None and cb.clock.global_step() == 3


def test_a_second_fit_is_measured_from_its_own_start(photo_root, tmp_path, cache_dir):
    """trainer.fit twice with one DataModule and one MonitorCallback: the second fit's start-up is its own
    (the DataModule's prepare_data of the first fit, long past, is not counted again)."""
    import time

    import pytorch_lightning as pl
    import torch

    import dali_pipe

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(3, 4)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.head(batch[0].mean((2, 3))), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = dali_pipe.DaliDataModule(data=photo_root, model="tiny", batch_size=8, device="cpu", num_threads=1,
                                  val_fraction=0)
    dm.prepare_data()
    monitor = dali_pipe.MonitorCallback(verbose=False)
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[monitor])
    module = Module()
    trainer.fit(module, datamodule=dm)
    time.sleep(1.0)  # the user's own work between the two fits
    between = time.perf_counter()
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, datamodule=dm)
    budget = monitor.report["time_budget"]
    assert trainer.global_step == 4 and budget["seconds"]["startup"] < time.perf_counter() - between, budget


def test_on_a_gpu_the_report_counts_the_images_the_gpu_decoder_refused(photo_root, tmp_path, monkeypatch, capfd):
    """A fit on a CUDA device (stood in for here) folds nvImageCodec's per-image warnings on stderr into one
    MONITOR line, "the GPU decoder refused N of M images; they were decoded on the CPU: reason", and the
    report's `decoder` counts; the process's stderr is its own again afterwards."""
    import pytorch_lightning as pl
    import torch

    import dali_pipe
    from dali_pipe.monitor import MonitorCallback

    reason = "ROI decode with fancy upsampling may produce wrong results on image edge (1 pixel wide)"

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(3, 4)

        def training_step(self, batch, batch_idx):
            for _ in range(len(batch[1])):  # what nvImageCodec prints for each image it hands to the CPU
                os.write(2, f"\x1b[33m[WARNING] \x1b[0m[nvjpeg_cuda_decoder] {reason}\n".encode())
            return torch.nn.functional.cross_entropy(self.head(batch[0].mean((2, 3))), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monkeypatch.setattr(MonitorCallback, "_on_cuda", staticmethod(lambda trainer: True))
    dm = dali_pipe.DaliDataModule(data=photo_root, model="tiny", batch_size=8, device="cpu", num_threads=1,
                                  val_fraction=0)
    monitor = dali_pipe.MonitorCallback()
    trainer = pl.Trainer(max_epochs=1, limit_train_batches=3, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                         callbacks=[monitor])
    trainer.fit(Module(), datamodule=dm)
    os.write(2, b"after the fit\n")
    out, err = capfd.readouterr()
    assert monitor.report["decoder"]["to_cpu"] == 24
    line = f"MONITOR training: the GPU decoder refused 24 of 24 images; they were decoded on the CPU: {reason}"
    assert line in out.splitlines(), out
    assert err.count(reason) == 1 and err.endswith("after the fit\n"), err
