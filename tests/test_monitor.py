"""The monitor: diagnosis rules with their numbers, the sampler's window, and the step timer."""
from __future__ import annotations

import json
import os
import re
import time

import train
from dali_pipe.monitor import Sampler, StepLog, diagnose


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


def test_busy_cores_are_named():
    m = {"data_wait_fraction": 0.0, "cpu_util_mean": 95.0, "other_load_cores": 0.9}
    d = diagnose("dali", m, cores=2)
    assert d[-1] == ("dali: other processes kept 0.9 of the 2 pinned core(s) busy during the measurement; these "
                     "figures are low, rerun on idle cores.")
    assert not any("other processes" in x for x in diagnose("dali", {**m, "other_load_cores": 0.1}, cores=2))


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


def test_time_budget_adds_up_and_each_large_share_gets_its_fix():
    """The issue's planted numbers: 5 saves of 1.4 s every 5 steps in a 33 s run are 21%; 5x fewer saves
    bring them to about 5%, in the CLI's flag or in ModelCheckpoint's argument."""
    from dali_pipe.monitor import SHARES, budget_line, budget_verdicts, time_budget

    b = time_budget(33.3, startup=1.0, data_wait=0.5, model_step=24.0, checkpoint_saves=7.0, validation=0.3,
                    saves_info={"count": 5, "periodic": 5, "every_steps": 5})
    assert list(b["shares"]) == list(SHARES) and abs(sum(b["shares"].values()) - 1) < 1e-9
    assert abs(b["seconds"]["callbacks"] - 0.5) < 1e-9
    assert budget_line(b) == ("time: start-up 3%, data wait 2%, model step 72%, checkpoint saves 21%, validation 1%, "
                              "logging and other callbacks 2% (of 33.3 s)")
    cli = [v for v in budget_verdicts("training", b, cli={}) if "checkpoint" in v]
    assert cli == ["training: checkpoint saves take 21% of the run (5 save(s), 1.40 s each); --checkpoint-every-steps "
                   "25 would cut that to about 5%."]
    lib = [v for v in budget_verdicts("training", b) if "checkpoint" in v][0]
    assert "ModelCheckpoint(every_n_train_steps=25) would cut that to about 5%" in lib
    assert any(v.startswith("training: the model step (forward, backward, optimizer) takes 72%") for v in
               budget_verdicts("training", b))
    v = time_budget(100.0, startup=5.0, data_wait=30.0, model_step=30.0, validation=25.0,
                    validation_info={"runs": 5, "images": 500})
    lines = budget_verdicts("training", v, cli={"val_fraction": 0.5})
    val = [x for x in lines if "validation takes" in x][0]
    assert val.startswith("training: validation takes 25% of the run (5 run(s) of 5.00 s on 500 image(s)); "
                          "--val-fraction 0.08 would cut that to about 5%"), val
    assert any("Trainer(check_val_every_n_epoch=5) would cut that to about 6%" in x for x in
               budget_verdicts("training", v))
    assert any(x.startswith("training: data wait takes 30% of the run; a loader that kept up would make it about 1.4x")
               for x in lines)
    assert not [x for x in lines if "start-up takes" in x]  # 5% gets no verdict


def test_start_up_names_its_parts_from_the_process_start():
    """A command's start-up begins at the process's start: the imports are a named part beside the data
    preparation and the pipeline build, and what is left is the model load, the Trainer and the first batch."""
    from dali_pipe.cli import process_start
    from dali_pipe.monitor import budget_verdicts, time_budget

    assert 0 <= time.perf_counter() - process_start() < 3600  # this process started earlier, and today
    b = time_budget(40.0, startup=20.0, data_wait=1.0, model_step=18.0,
                    startup_parts={"imports": 11.0, "prepare_data": 4.0, "setup": 1.5})
    line = [v for v in budget_verdicts("training", b) if "start-up takes" in v][0]
    assert ("start-up takes 50% of the run (20.0 s: interpreter start and imports 11.0 s, data preparation (sync, "
            "scan) 4.0 s, pipeline build 1.5 s, the rest (model load, Trainer set-up, the first batches) 3.5 s)") in line


def test_the_validation_fix_for_a_trainer_is_one_that_trainer_can_take():
    """Your own Trainer's validation fix keeps at least one validation: check_val_every_n_epoch at most the
    epochs trained (it validates floor(epochs / k) times), else limit_val_batches as a whole number of the
    batches each run has (Lightning refuses a fraction below one batch); dict batches count their images."""
    from dali_pipe.monitor import _batch_len, budget_verdicts, time_budget

    ten = time_budget(100.0, startup=5.0, data_wait=5.0, model_step=60.0, validation=25.0,
                      validation_info={"runs": 10, "images": 64, "batches": 8, "epochs": 10})
    fix = [x for x in budget_verdicts("training", ten) if "validation takes" in x][0]
    assert fix.endswith("Trainer(check_val_every_n_epoch=10) would cut that to about 3%."), fix  # 1 run of 10
    two = time_budget(10.0, startup=0.5, data_wait=0.5, model_step=4.0, validation=4.0,
                      validation_info={"runs": 4, "images": 64, "batches": 8, "epochs": 2})
    fix = [x for x in budget_verdicts("training", two) if "validation takes" in x][0]
    assert "check_val_every_n_epoch" not in fix and "Trainer(limit_val_batches=1) (1 of its 8 batches)" in fix, fix
    assert _batch_len({"image": [0] * 8, "label": [1] * 8}) == 8 and _batch_len(([0] * 3, [1] * 3)) == 3


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


def test_the_packing_advice_is_a_command_that_runs_as_printed(tmp_path):
    """The prescription's pack command names the run's own --data and a folder (or prefix) beside it, quoted
    for the shell, not the words DATA and PACKED: it parses as the pack command with exactly those paths."""
    import shlex

    from dali_pipe.cli.commands import parser
    from dali_pipe.cli.parser import settings_from
    from dali_pipe.prescribe import pack_command

    for data in (str(tmp_path / "my photos"), "s3://bucket/prefix/"):
        command, packed = pack_command(data)
        argv = shlex.split(command)
        assert argv[:3] == ["python", "-m", "dali_pipe"] and packed == data.rstrip("/") + "-packed"
        ns = parser().parse_args(argv[3:])
        del ns.command
        s = settings_from(ns)
        assert (s.pack.src, s.pack.dst, s.pack.max_side) == (data, packed, 384)


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
