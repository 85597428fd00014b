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

ROOT = Path(__file__).resolve().parents[1]


def _argv(photo_root, out, *more):
    return ["--data", str(photo_root), "--model", "tiny", "--device", "cpu", "--epochs", "4", "--batch-size", "8",
            "--num-threads", "1", "--val-fraction", "0.25", "--lr", "2e-3", "--output", str(out), *more]


def _copy(trained: Path, dest: Path) -> Path:
    shutil.copytree(trained, dest, ignore=shutil.ignore_patterns(".dali_pipe.lock"))
    return dest


def test_a_finished_runs_rerun_is_told_before_torch_lightning_and_transformers_load(trained, photo_root, tmp_path):
    """The rerun of the session's finished run, as a user runs it: "nothing to do" and exit 0, with none of
    the heavy modules loaded (they made it take 5 to 10 s)."""
    out = _copy(trained, tmp_path / "out")
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


# case -> (how the folder or the flags change, what the early decision says: "nothing to do", None for "left
# to the full pre-flight", or the start of the error both raise)
CASES = {
    "the same settings": (None, "nothing to do"),
    "another --lr": ("--lr 3e-3", "belongs to another run:\n  --lr: 0.002 in the checkpoint, 0.003 now"),
    "another --seed": ("--seed 1", "belongs to another run:\n  the data (files, labels or split)"),
    "one photo fewer": ("data", "belongs to another run:\n  the data (files, labels or split)"),
    "the weights in OUT damaged": (_flip_weights, None),
    "a checkpoint of a version without image_source": (_older_sidecar, None),
    "the processor changed since": (_other_processor, None),
    "more --epochs": ("--epochs 5", None),
    "another run holds OUT": ("lock", "is in use by another training run (PID"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_early_decision_is_the_full_preflights(case, trained, photo_root, tmp_path, cache_dir, capsys):
    """For each change to a finished run (the flags, the data, OUT, the checkpoint's record), the early decision
    either says what the full pre-flight says (the same result, or the same error), or leaves it to the full
    pre-flight; the full pre-flight then does what the case needs (exports again, resumes, says "nothing to do")."""
    from dali_pipe.cli import described, parse_train, prepared
    from dali_pipe.cli.finished import nothing_to_do
    from dali_pipe.cli.fit import run
    from dali_pipe.errors import UserError

    change, early = CASES[case]
    holder = None
    outcomes = {}
    for path in ("early", "full"):
        out = _copy(trained, tmp_path / path)
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
        elif change:
            flags = change.split()
        if early not in (None, "nothing to do"):  # a refusal leaves no empty folder of ours (TensorBoard's)
            shutil.rmtree(out / "tensorboard")
        s = prepared(parse_train(_argv(data, out, *flags)))
        try:
            if path == "early":
                outcomes[path] = nothing_to_do(s, described(s.data))
            elif early is not None or change != "--epochs 5":  # more epochs: the full path trains one more
                outcomes[path] = run(s, described(s.data))
        except UserError as e:
            outcomes[path] = re.sub(r"PID \d+", "PID N", str(e).replace(str(out), "OUT"))
        finally:
            if holder is not None:
                holder.kill()
                holder.wait()
                holder = None
    capsys.readouterr()
    if early is None:
        assert outcomes["early"] is None
        if change is _flip_weights:
            assert outcomes["full"] == {"exported_again": True, "global_step": 16}
        elif change in (_older_sidecar, _other_processor):
            assert outcomes["full"] == {"nothing_to_do": True, "global_step": 16}
    elif early == "nothing to do":
        assert outcomes["early"] == outcomes["full"] == {"nothing_to_do": True, "global_step": 16}
    else:
        assert isinstance(outcomes["early"], str) and early in outcomes["early"], outcomes
        assert not (tmp_path / "early" / "tensorboard").exists() and not (tmp_path / "full" / "tensorboard").exists()
        assert outcomes["early"] == outcomes["full"].replace(str(tmp_path / "full"), str(tmp_path / "early"))


def test_the_early_decision_lets_go_of_out(trained, photo_root, tmp_path, cache_dir):
    """It holds OUT while it reads, as a run does, and lets go after, whatever it decided: another process
    then gets OUT."""
    from dali_pipe.cli import described, parse_train, prepared
    from dali_pipe.cli.finished import nothing_to_do

    out = _copy(trained, tmp_path / "out")
    for flags in ([], ["--epochs", "5"]):  # told here, and left to the full pre-flight
        s = prepared(parse_train(_argv(photo_root, out, *flags)))
        nothing_to_do(s, described(s.data))
        r = subprocess.run([sys.executable, "-c", f"from dali_pipe.workdir import lock\nlock({str(out)!r}, 'run', 'x')"],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert r.returncode == 0, r.stderr
