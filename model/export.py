"""The trained model in OUT, written so that a kill at any moment never leaves a model that looks
finished but is not, and the check that OUT holds the model of this run.

OUT gets the model in save_pretrained form (config.json with id2label, the weights,
preprocessor_config.json), label_map.json and metrics.json. Everything is written into
OUT/.model-tmp-PID first; then the old metrics.json is removed, the other files are moved into OUT
one by one, and the new metrics.json lands last. metrics.json is the commit record: besides every
epoch's metrics, which weights the model is (`selected`: epoch, step and why) and how the validation
split was made (`split`, which evaluate defaults to), its `export` entry names the run (the id its
checkpoints carry), the step, the selection (--select), the run's fingerprint (the data and every
setting that changes the weights) and the size and sha256 of every other file. A run whose fingerprint
differs from the one OUT records stops before training (`check_identity`), as it does for a checkpoint.

So after a kill (SIGTERM, kill -9, a full disk) between two moves, over an older OUT or not, OUT has
either no metrics.json or one that names another run, step or selection, or files that do not match
it: `problem()` says which, and the training command exports again from the checkpoint instead of
saying "nothing to do". A temporary folder left by a killed writer is removed on the next run.

What the previous export wrote and this one does not is removed (an older model's
pytorch_model.bin, say), and only that: a name its metrics.json records is removed when it is a plain
file name in OUT (no separator, not `..`, not a symlink) whose size and sha256 are still those
recorded, i.e. a file that export wrote. Any other name (a folder reused as --output, a crafted or
foreign metrics.json naming `../victim` or `/etc/passwd`) is left alone, with a line saying so.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dali_pipe.errors import UserError
from dali_pipe.redact import redact
from dali_pipe.workdir import move, plain_name, remove, write_failure

from . import checkpoint, resume
from .exported import TEMP
from .files import RECORD, damaged_files, file_record, read_record
from .loading import load_checked
from .selection import BestModel

RERUN = "fix that (free space there, or make it writable) and rerun the same command: it exports the model from there"


class ExportError(UserError):
    """The model could not be written to OUT; what was there before is kept or named."""


def write(model, processor, out: Path, metrics: dict, *, run: str | None, select: str,
          fingerprint: dict | None = None) -> None:
    """The model, its processor, label_map.json and metrics.json (with the export record) into OUT,
    atomically as the module docstring says. Raises ExportError (the temporary folder removed)."""
    out = Path(out)
    tmp = out / f"{TEMP}{os.getpid()}"
    if not out.is_dir():
        print(f"export: {out} is gone (removed while the run trained); creating it again for the model",
              file=sys.stderr)
    try:
        remove(tmp, out, quiet=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / "label_map.json").write_text(json.dumps(model.config.id2label, indent=1, sort_keys=True))
        files = file_record(tmp)
        record = {"run": run, "global_step": metrics.get("global_step"), "select": select,
                  "fingerprint": fingerprint, "files": files}
        (tmp / RECORD).write_text(json.dumps({**metrics, "export": record}, indent=1))
        previous = read_record(out)
        (out / RECORD).unlink(missing_ok=True)  # from here until the last move, OUT reads as unfinished
        for name in files:
            move(tmp / name, out / name, out)
        move(tmp / RECORD, out / RECORD, out)
        for name in stale(out, previous, files):  # what the previous export wrote and this one did not
            remove(out / name, out)
    except Exception as e:  # OSError, safetensors' SafetensorError: a full disk, a read-only OUT
        raise ExportError(f"the model could not be written to {out} ({write_failure(e, out)})") from None
    finally:
        remove(tmp, out, quiet=True)


def stale(out: Path, previous: dict | None, files: dict) -> list[str]:
    """The names the previous export record lists, this export does not write, and that export wrote: plain
    file names of regular files in OUT with the size and sha256 recorded. Every other name it lists is
    left alone, each with one line saying why."""
    listed = (previous or {}).get("files", {})
    out_names = []
    for name, want in (listed.items() if isinstance(listed, dict) else ()):
        if name in files or name == RECORD:
            continue
        why = None
        if not plain_name(name):
            why = "not a file name in that folder"
        elif (out / name).is_symlink() or ((out / name).exists() and not (out / name).is_file()):
            why = "not a file the export wrote (a link or a folder)"
        elif not (out / name).exists():
            continue
        elif damaged_files(out, {"files": {name: want}}):
            why = "its size or sha256 differ from what that export wrote"
        if why:
            print(f"export: left {redact(repr(name))} alone, which the previous {RECORD} in {out} lists: {why}",
                  file=sys.stderr)
        else:
            out_names.append(name)
    return out_names


def selected_model(best, select: str, last, where: dict):
    """(the weights --select chooses: the best model's folder, checked whole, or `last`, whose epoch and
    step `where` gives; the record for metrics.json). Raises BestModelError when the best model is missing
    or damaged."""
    folder, selected = best.choice(select, where)
    return (load_checked(str(folder), f"the best model in {folder}") if folder else last), selected


def from_checkpoint(path: Path, checkpoint_dir: Path, name: str, classes: list[str], processor, out: Path, *,
                    run: str | None, global_step: int, select: str, epoch: int, fingerprint: dict | None = None,
                    split: dict | None = None) -> dict:
    """Export a finished run again from its final checkpoint (the last weights, in `epoch` at `global_step`;
    its epochs' metrics, its best record) or its best model; returns the record of what was selected."""
    state = resume.load(path)
    best = BestModel(checkpoint_dir, run_id=run)
    best.load_state_dict(state.get("callbacks", {}).get(best.state_key, {}))
    model, selected = selected_model(best, select, None, {"epoch": epoch, "global_step": global_step})
    if model is None:
        model = checkpoint.model_from(state, name, classes)
    rows = state.get("epoch_metrics_so_far", {}).get("rows", [])
    metrics = {"selected": selected, "epochs": rows, "global_step": global_step, "split": split}
    try:
        write(model, processor, out, metrics, run=run, select=select, fingerprint=fingerprint)
    except ExportError as e:
        raise ExportError(f"{e}; {path} holds the trained weights: {RERUN}") from None
    return selected
