"""The decision to resume: what a run does with the checkpoint it finds, decided without loading torch or
Lightning (the sidecar `last.json` beside `last.ckpt` holds the fingerprint and progress), so the training
command can tell a finished run's rerun before they load (cli/finished.py).

Resuming (`--resume auto|never|PATH`): `plan_resume` compares the fingerprint of this run (the data,
classes, image size and world size, and every setting that changes what the weights become: config.py's
identity=RECIPE, from the model and batch size to the optimizer, schedule, loss, augmentations and
precision) with the checkpoint's, and either resumes, starts fresh, finds the run finished (the command
then checks the model in OUT), or stops with what differs; or, when the checkpoint is already past the
steps this run asks for (fewer --epochs or --max-steps), stops saying what it was trained to and the
ways out. A checkpoint written before the recipe counted is resumed with a note that it could not be
checked. A checkpoint is checked whole before it is used (every member's CRC: a
truncated or altered file is named, with the ways out, never a traceback). Each run has an id,
kept across its resumes, that its checkpoints and its export carry: an OUT written by another run
is never taken for this run's model.
"""
from __future__ import annotations

import json
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dali_pipe.config import flag_of, recipe_names
from dali_pipe.dataset import differences as fields_differ
from dali_pipe.errors import RunMismatchError, UserError
from dali_pipe.workdir import move, remove, remove_dead_temps

LAST = "last.ckpt"
SIDECAR = "last.json"


class CheckpointDamagedError(UserError):
    """A checkpoint is truncated or altered; the message names it and the ways out."""


class PastTheEndError(UserError):
    """The checkpoint trained further than this run asks for (fewer --epochs or --max-steps)."""


def damaged(path: Path, why: str) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"{path} is damaged ({why}); it cannot be resumed or exported from. Pass --resume never to start over "
        f"(the damaged file is moved aside, not deleted), or --resume PATH with an older checkpoint "
        f"({path.with_name('last-*.ckpt')}).")


def verify(path: Path) -> None:
    """The checkpoint is a whole zip archive (torch's format) whose every member matches its CRC."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise damaged(path, f"not a whole checkpoint archive: {e}") from None
    if bad is not None:
        raise damaged(path, f"its member {bad} does not match its checksum")


def load(path: Path) -> dict:
    """The checkpoint's contents (on the CPU), checked whole first."""
    import torch

    verify(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # an archive with the right CRCs that torch still cannot read
        raise damaged(Path(path), f"{type(e).__name__}: {str(e)[:160]}") from None


@dataclass
class ResumePlan:
    ckpt_path: str | None  # what Trainer.fit resumes from
    done_step: int | None = None  # set when the run already finished with these settings
    note: str | None = None  # one line for the user
    run_id: str | None = None  # the id of the run being resumed (None: a new run, or an older checkpoint)
    checkpoint: Path | None = None  # the finished run's checkpoint (done_step set): what to export from
    caveat: str | None = None  # one line for the user: what could not be checked (an older checkpoint's recipe)


def read_meta(checkpoint: Path) -> dict | None:
    """The fingerprint and progress saved with a checkpoint: from the sidecar when it describes this
    file, else from the checkpoint itself (older checkpoints have neither: None)."""
    meta = read_sidecar(checkpoint)
    return meta if meta is not None else load(checkpoint).get("dali_pipe")


def read_sidecar(checkpoint: Path) -> dict | None:
    """The sidecar's copy of the checkpoint's fingerprint and progress, when `checkpoint` is a last.ckpt the
    sidecar describes (its size); else None (read the checkpoint itself)."""
    sidecar = checkpoint.with_name(SIDECAR)
    if checkpoint.name == LAST and sidecar.is_file():
        try:
            meta = json.loads(sidecar.read_text())
            if isinstance(meta, dict) and meta.get("size") == checkpoint.stat().st_size:
                return meta
        except (OSError, ValueError):
            pass
    return None


RECIPE = recipe_names()  # the settings whose values are part of a run's identity (config.py: identity=RECIPE)
FINGERPRINT = {"samples": "the data (files, labels or split)", "classes": "the classes",
               "image_size": "the model's input size", "world_size": "the number of processes (--devices x "
               "--num-nodes)", **{n: flag_of(n) for n in RECIPE}}  # what each field of a fingerprint is, in words
EARLIER = {"samples", "classes", "image_size", "world_size", "model", "batch_size", "seed"}  # fingerprinted always
OPTIONAL = set(FINGERPRINT) - EARLIER  # compared only where both sides hold it (checkpoints written before they were)


def differences(saved: dict, current: dict, sides: tuple[str, str] = ("in the checkpoint", "now")) -> list[str]:
    """One line per fingerprint field that differs, in the CLI's words: 'LABEL: A SIDE0, B SIDE1'."""
    return fields_differ(saved, current, FINGERPRINT, sides, OPTIONAL)


def unchecked(saved: dict, current: dict) -> list[str]:
    """The flags of the recipe settings that `current` holds and `saved` lacks (written by an older version,
    before they counted): they could not be compared."""
    return [flag_of(n) for n in RECIPE if n in current and n not in saved]


NEVER_MOVES = "the old checkpoint is moved aside, not deleted"


def mismatch(path: Path, diff: list[str], what: str = "belongs to another run",
             never: str = NEVER_MOVES) -> RunMismatchError:
    """The error for a checkpoint or a model folder of another run: each difference, then the two ways out
    (`never`: what --resume never does to it)."""
    return RunMismatchError(
        f"{path} {what}:\n  " + "\n  ".join(diff) + "\n  Use a new --output for this run, or --resume never to "
        f"start over here ({never}).")


def trained_to(targets: dict) -> str:
    """'--epochs 2' or '--epochs 5 --max-steps 7': what a run was asked to train to, as flags."""
    epochs, steps = targets.get("epochs"), targets.get("max_steps")
    return f"--epochs {epochs}" + (f" --max-steps {steps}" if isinstance(steps, int) and steps > 0 else "")


def plan_resume(resume: str, checkpoint_dir: Path, fingerprint: dict, targets: dict, *,
                may_modify: bool = True, steps: int | None = None) -> ResumePlan:
    """What to resume from. `resume` is auto, never or a checkpoint path; `targets` holds the
    epochs/max_steps this run trains to, `steps` the optimizer steps they make (None: not known). Only the
    main process moves files (`may_modify`)."""
    checkpoint_dir = Path(checkpoint_dir)
    last = checkpoint_dir / LAST
    if may_modify:
        for pattern in (f".{LAST}.tmp-*", f".{SIDECAR}.tmp-*"):
            remove_dead_temps(checkpoint_dir, pattern, include_own=True)
    if resume == "never":
        if last.is_file() and may_modify:
            aside = checkpoint_dir / f"last-{time.strftime('%Y%m%d-%H%M%S')}.ckpt"
            move(last, aside, checkpoint_dir)
            remove(checkpoint_dir / SIDECAR, checkpoint_dir)
            return ResumePlan(None, note=f"--resume never: starting over; the previous checkpoint is kept as {aside}")
        return ResumePlan(None)
    path = last if resume == "auto" else Path(resume)
    if not path.is_file():
        return ResumePlan(None)
    meta = read_meta(path)
    if meta is None:
        return ResumePlan(str(path), note=f"resuming from {path}, written by an older version without a run "
                                          "fingerprint or loader position: the data order restarts")
    saved = meta.get("fingerprint")
    saved = saved if isinstance(saved, dict) else {}  # a damaged record: every field then reads as another run's
    diff = differences(saved, fingerprint)
    if diff:
        raise mismatch(path, diff)
    missing = unchecked(saved, fingerprint)
    caveat = (f"note: {path} was written by an older version, before the recipe counted toward a run's identity: "
              f"{', '.join(missing)} could not be checked against it") if missing else None
    run, step = meta.get("run"), meta.get("global_step")
    if meta.get("finished") and (meta.get("targets") == targets or step == steps):
        return ResumePlan(None, done_step=step, run_id=run, checkpoint=path, caveat=caveat)
    if steps is not None and isinstance(step, int) and step > steps:
        was = meta.get("targets") if isinstance(meta.get("targets"), dict) else {}
        raise PastTheEndError(
            f"{path} is already past the end of this run: it was trained to step {step}"
            + (f" ({trained_to(was)})" if was else "") + f", and this run asks for {steps} steps "
            f"({trained_to(targets)}); the model in --output is left as it is. Pass "
            + (f"{trained_to(was)}{' (no --max-steps)' if was.get('max_steps', -1) < 0 < targets['max_steps'] else ''}"
               " to keep that run, a larger --epochs or --max-steps to train it further, "
               if was else "a larger --epochs or --max-steps to train it further, ")
            + "--resume never to train again from scratch to this end (the checkpoint is moved aside, not deleted), "
            "or another --output.")
    if may_modify:
        verify(path)  # a damaged checkpoint is named here, not by a traceback from inside Lightning
    return ResumePlan(str(path), note=f"resuming from {path} (step {step})", run_id=run, caveat=caveat)


