"""What OUT holds, checked without loading torch, Lightning or transformers: whether it is the model that a
run exported at a step (`problem`), whether it belongs to another run (`check_identity`), which weights
its metrics.json says it is (`describe`). model/export.py writes it; the training command asks here before
it loads anything heavy, so a finished run's rerun says "nothing to do" at once (cli/finished.py).

"This run's model" means: metrics.json (the commit record, written last) names this run, step and
selection, lists the files an export writes, and every file it lists has its recorded size and sha256,
i.e. the bytes save_pretrained wrote when the export committed.
"""
from __future__ import annotations

import json
from pathlib import Path

from dali_pipe.workdir import remove_dead_temps

from . import resume
from .files import RECORD, damaged_files, read_record

TEMP = ".model-tmp-"
EXPORTED = ("config.json", "preprocessor_config.json", "label_map.json")  # besides the weights, an export's files


def unlisted(files: dict) -> list[str]:
    """What an export writes that the record's `files` lacks: its three JSON files and the weights
    (model.safetensors, or the index of the shards save_pretrained splits a large model into)."""
    weights = {"model.safetensors", "model.safetensors.index.json"}
    return [n for n in EXPORTED if n not in files] + ([] if weights & set(files) else ["model.safetensors"])


def problem(out: Path, *, run: str | None, global_step: int, select: str) -> str | None:
    """Why OUT does not hold the model that run `run` exports at `global_step` with `select`, or None
    when it does: the record names this run, step and selection and lists the files an export writes,
    and every file it lists has its recorded size and sha256."""
    out = Path(out)
    if not (out / RECORD).is_file():
        return f"has no {RECORD} (an export was interrupted, or none was written)"
    record = read_record(out)
    if record is None:
        return f"has a {RECORD} without an export record (written by an older version, or damaged)"
    if record.get("run") != run or record.get("global_step") != global_step:
        return f"holds the model of another run or step (step {record.get('global_step')}; this run: {global_step})"
    if record.get("select") != select:
        return f"holds the model selected by --select {record.get('select')}, not {select}"
    damaged = damaged_files(out)
    if damaged:
        return "has files that differ from its record: " + "; ".join(damaged)
    files = record.get("files")
    missing = unlisted(files if isinstance(files, dict) else {})
    if missing:
        return f"has a {RECORD} whose record lists no {', '.join(missing)} (written by an older version, or damaged)"
    return None


def check_identity(out: Path, fingerprint: dict) -> None:
    """Stop (RunMismatchError, each difference and the two ways out) when OUT holds the model of a run
    whose fingerprint differs from this one's: other data, or another value of a setting that changes the
    weights. An OUT without a model, or written before its export recorded a fingerprint, passes."""
    saved = (read_record(Path(out)) or {}).get("fingerprint")
    if isinstance(saved, dict) and saved:
        diff = resume.differences(saved, fingerprint, ("in its model", "now"))
        if diff:
            raise resume.mismatch(Path(out), diff, "holds the model of another run (its metrics.json says so)",
                                  "its model is replaced when this run exports; an old checkpoint is moved "
                                  "aside, not deleted")


def training_metrics(folder: str) -> dict | None:
    """The metrics.json a training run wrote into `folder` (a model folder of ours), or None (a hub id, a
    folder without one, or one another tool wrote)."""
    try:
        metrics = json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return metrics if isinstance(metrics, dict) and "export" in metrics else None


def describe(selected: dict) -> str:
    """Which weights metrics.json says the model is, in words: 'epoch 3 (step 12), the best validation ...'."""
    if "epoch" not in selected:
        return selected["rule"]
    step = f" (step {selected['global_step']})" if selected.get("global_step") is not None else ""
    return f"epoch {selected['epoch']}{step}, {selected['rule']}"


def remove_dead(out: Path) -> None:
    """The temporary folders of writers that died (kill -9) or of another container (the same PID)."""
    remove_dead_temps(out, f"{TEMP}*", include_own=True)
    remove_dead_temps(out, ".write-test-*", include_own=True)
