"""What the measurements mean and what to change: the diagnosis rules with their numbers, the time budget and
the verdict, fix and gain of each large share, and the packing advice as a command that runs."""
from __future__ import annotations

from dali_pipe.prescribe import diagnose


def test_diagnosis_rules_with_numbers():
    from dali_pipe.prescribe import diagnose

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


def test_time_budget_adds_up_and_each_large_share_gets_its_fix():
    """The issue's planted numbers: 5 saves of 1.4 s every 5 steps in a 33 s run are 21%; 5x fewer saves
    bring them to about 5%, in the CLI's flag or in ModelCheckpoint's argument."""
    from dali_pipe.prescribe import SHARES, budget_line, budget_verdicts, time_budget

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


def test_the_validation_fix_for_a_trainer_is_one_that_trainer_can_take():
    """Your own Trainer's validation fix keeps at least one validation: check_val_every_n_epoch at most the
    epochs trained (it validates floor(epochs / k) times), else limit_val_batches as a whole number of the
    batches each run has (Lightning refuses a fraction below one batch); dict batches count their images."""
    from dali_pipe.monitor import _batch_len
    from dali_pipe.prescribe import budget_verdicts, time_budget

    ten = time_budget(100.0, startup=5.0, data_wait=5.0, model_step=60.0, validation=25.0,
                      validation_info={"runs": 10, "images": 64, "batches": 8, "epochs": 10})
    fix = [x for x in budget_verdicts("training", ten) if "validation takes" in x][0]
    assert fix.endswith("Trainer(check_val_every_n_epoch=10) would cut that to about 3%."), fix  # 1 run of 10
    two = time_budget(10.0, startup=0.5, data_wait=0.5, model_step=4.0, validation=4.0,
                      validation_info={"runs": 4, "images": 64, "batches": 8, "epochs": 2})
    fix = [x for x in budget_verdicts("training", two) if "validation takes" in x][0]
    assert "check_val_every_n_epoch" not in fix and "Trainer(limit_val_batches=1) (1 of its 8 batches)" in fix, fix
    assert _batch_len({"image": [0] * 8, "label": [1] * 8}) == 8 and _batch_len(([0] * 3, [1] * 3)) == 3


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
