"""A finished run's rerun, told before torch, Lightning and transformers load (cli/finished.py): what it
decides is what the full pre-flight decides, on the same folder."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import copy_trained

ROOT = Path(__file__).resolve().parents[1]


def _argv(photo_root, out, *more):
    return ["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "4", "--batch-size", "8",
            "--num-threads", "1", "--val-fraction", "0.25", "--lr", "2e-3", "--output", str(out), *more]


def test_a_finished_runs_rerun_is_told_before_torch_lightning_and_transformers_load(trained, photo_root, tmp_path):
    """The rerun of the session's finished run, as a user runs it: "nothing to do" and exit 0, with none of
    the heavy modules loaded (they made it take 5 to 10 s)."""
    out = copy_trained(trained, tmp_path / "out")
    code = ("import json, sys\nimport train\n"
            f"result = train.main({_argv(photo_root, out)!r})\n"
            "print(json.dumps([result, [m for m in ('torch', 'pytorch_lightning', 'transformers', 'pandas', "
            "'nvidia.dali') if m in sys.modules]]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**__import__("os").environ, "DALI_PIPE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    said, last = r.stdout.strip().splitlines()[:-1], r.stdout.strip().splitlines()[-1]
    result, loaded = json.loads(last)
    assert result == {"nothing_to_do": True, "global_step": 16} and loaded == []
    assert said == [f"nothing to do: already trained to 16 steps with these settings, and {out} holds the model "
                    "(checked); pass --resume never to train again from scratch"]


def _older_sidecar(out: Path) -> None:
    """The sidecar as a version before image_source wrote it."""
    side = out / "checkpoints" / "last.json"
    meta = json.loads(side.read_text())
    del meta["image_source"]
    side.write_text(json.dumps(meta))


def _other_processor(out: Path) -> None:
    """The sidecar as if the model's processor files were other ones when the run trained."""
    side = out / "checkpoints" / "last.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), "image_source": "0" * 64}))


def _flip_weights(out: Path) -> None:
    weights = out / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(data)


def _one_photo_fewer(photo_root: Path, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(photo_root, data)
    lines = (data / "dataset.tsv").read_text().splitlines()
    (data / "dataset.tsv").write_text("\n".join(lines[:-1]) + "\n")
    return data


def _edited_sidecar_size(out: Path) -> None:
    """The sidecar's fingerprint edited (its image size), the checkpoint and OUT's record left as they were."""
    side = out / "checkpoints" / "last.json"
    meta = json.loads(side.read_text())
    side.write_text(json.dumps({**meta, "fingerprint": {**meta["fingerprint"], "image_size": [32, 32]}}))


def _no_tensorboard(out: Path) -> None:
    shutil.rmtree(out / "tensorboard")


NOTHING, AGAIN = {"nothing_to_do": True, "global_step": 16}, {"exported_again": True, "global_step": 16}
# case -> (how the folder, the flags or the environment change; what the early decision says: the full
# pre-flight's result, None for "left to the full pre-flight", or the start of the error both raise; what the
# full pre-flight then says, where the early decision leaves it; None: not run, it trains)
CASES = {
    "the same settings": (None, NOTHING, NOTHING),
    "another --lr": ("--lr 3e-3", "belongs to another run:\n  --lr: 0.002 in the checkpoint, 0.003 now", None),
    "one photo fewer": ("data", "belongs to another run:\n  the data (files, labels or split)", None),
    "another run holds OUT": ("lock", "is in use by another training run (PID", None),
    "a disk too full to train on": ("full disk", NOTHING, NOTHING),  # a finished run needs no room
    "the weights in OUT damaged": (_flip_weights, None, AGAIN),
    "a checkpoint of a version without image_source": (_older_sidecar, None, NOTHING),
    "the processor changed since": (_other_processor, None, NOTHING),
    "the sidecar's image size edited": (_edited_sidecar_size, None, "[32, 32] in the checkpoint, [64, 64] now"),
    "TensorBoard's folder gone": (_no_tensorboard, None, NOTHING),
    "another node's main process": ("NODE_RANK=1", None, NOTHING),
    "more --epochs": ("--epochs 5", None, None),
}


@pytest.mark.parametrize("case", CASES)
def test_the_early_decision_is_the_full_preflights(case, trained, photo_root, tmp_path, cache_dir, capsys,
                                                   monkeypatch):
    """For each change to a finished run (the flags, the data, OUT, the checkpoint's records, the disk, the
    node), the early decision either says what the full pre-flight says (the same result, or the same error),
    or leaves it to the full pre-flight, which then does what the case needs (exports again, refuses, says
    "nothing to do")."""
    import shutil as shutil_module

    from dali_pipe.cli import described, parse_train, prepared
    from dali_pipe.cli.finished import nothing_to_do
    from dali_pipe.cli.fit import run
    from dali_pipe.errors import UserError

    change, early, full = CASES[case]
    if change == "full disk":  # 1 MiB free: the checkpoints and the model need more
        usage = shutil_module.disk_usage(tmp_path)
        monkeypatch.setattr(shutil_module, "disk_usage", lambda p: usage._replace(free=1 << 20))
    elif change == "NODE_RANK=1":
        monkeypatch.setenv("NODE_RANK", "1")
    holder = None
    outcomes = {}
    for path in ("early", "full"):
        out = copy_trained(trained, tmp_path / path)
        data, flags = photo_root, []
        if change == "data":
            data = _one_photo_fewer(photo_root, tmp_path / path)
        elif change == "lock":
            holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom dali_pipe.workdir import lock\n"
                                       f"lock({str(out)!r}, 'training run', 'wait')\nprint('held', flush=True)\n"
                                       "time.sleep(60)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            assert holder.stdout.readline().strip() == "held"
        elif callable(change):
            change(out)
        elif change and change.startswith("--"):
            flags = change.split()
        s = prepared(parse_train(_argv(data, out, *flags)))
        try:
            if path == "early":
                outcomes[path] = nothing_to_do(s, described(s.data))
            elif early is not None or full is not None:
                outcomes[path] = run(s, described(s.data))
        except UserError as e:
            outcomes[path] = re.sub(r"PID \d+", "PID N", str(e).replace(str(out), "OUT"))
        finally:
            if holder is not None:
                holder.kill()
                holder.wait()
                holder = None
    said = capsys.readouterr().out
    if early is None:
        assert outcomes["early"] is None, outcomes
        if isinstance(full, str):
            assert full in outcomes["full"], outcomes
        elif full is not None:
            assert outcomes["full"] == full, outcomes
    elif isinstance(early, dict):
        assert outcomes["early"] == outcomes["full"] == early, outcomes
    else:
        assert isinstance(outcomes["early"], str) and early in outcomes["early"], outcomes
        assert outcomes["early"] == outcomes["full"], outcomes
    if change == "NODE_RANK=1":
        assert "nothing to do" not in said  # only node 0 looks at OUT and says so


def test_the_early_decision_lets_go_of_out(trained, photo_root, tmp_path, cache_dir):
    """It holds OUT while it reads, as a run does, and lets go after, whatever it decided: another process
    then gets OUT."""
    from dali_pipe.cli import described, parse_train, prepared
    from dali_pipe.cli.finished import nothing_to_do

    out = copy_trained(trained, tmp_path / "out")
    for flags in ([], ["--epochs", "5"]):  # told here, and left to the full pre-flight
        s = prepared(parse_train(_argv(photo_root, out, *flags)))
        nothing_to_do(s, described(s.data))
        r = subprocess.run([sys.executable, "-c", f"from dali_pipe.workdir import lock\nlock({str(out)!r}, 'run', 'x')"],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 0, r.stderr
