"""A finished run's rerun, told before torch, Lightning and transformers load: "nothing to do" in about a
second, where the whole pre-flight took 5 to 10 s (most of it imports).

The decision is the training command's own, made by the functions its pre-flight calls (cli/fit.py), none
of which loads anything heavy: the outputs checked and OUT held as a run holds it, the data prepared as
training prepares it (dataset.prepare: the sync of s3:// data, the scan and its cache, the report), the
run's fingerprint (dataset.fingerprint and the model's recipe), the resume decision (model/resume.py, from
the checkpoint's sidecar), OUT's identity and checksums (model/exported.py). The one input that needs
transformers, the model's input size, is taken from the checkpoint when the digest of what it was computed
from is unchanged (model/loading.image_source: the processor's files, transformers' version, the spec
code). What this cannot tell (no finished checkpoint, one of an older version without that digest, another
model or targets, several nodes, a model to export again, a best model to put back after a kill) is left
to the full pre-flight, which decides it the same way and does the work.
"""
from __future__ import annotations

import os
from pathlib import Path

from model.exported import problem, remove_dead
from model.files import read_record
from model.loading import image_source
from model.resume import LAST, plan_resume, read_sidecar

from ..config import Settings, recipe
from ..dataset import check_accumulation, check_batch, fingerprint, no_training, prepare
from ..manifest import Manifest
from ..pipeline import resources_for_rank
from ..redact import redact_tree
from ..workdir import check_writable, lock, unlock


def fits(s: Settings, manifest) -> None:
    """--batch-size and --grad-accum against the training split of a local dataset read before torch loads (the
    CLI's `described`), so that either mistake is told at once rather than after torch and Lightning (about 4 s
    in). The scan can only remove images, so a refusal here is one the full pre-flight would make too. Nothing
    without that manifest (shards, tables, s3:// data: told once prepared) or with --devices auto (counting the
    GPUs takes torch)."""
    if manifest is None or s.run.devices == "auto":
        return
    world = world_size(s)
    check_batch(len(manifest.train), s.data.batch_size, world)
    check_accumulation(len(manifest.train), s.data.batch_size, world, s.model.grad_accum)


def holds_a_run(output: str | None) -> bool:
    """Whether OUT holds a run's export record (the rerun of a finished run is then decided by nothing_to_do)."""
    return bool(output) and read_record(Path(output)) is not None


def world_size(s: Settings) -> int:
    if s.run.devices != "auto":
        return s.run.devices * s.run.num_nodes
    import torch  # lazy: only --devices auto counts the GPUs, which takes torch (1.5 s)

    return max(1, torch.cuda.device_count()) * s.run.num_nodes


def is_main_process() -> bool:
    """The process the user started (Lightning sets LOCAL_RANK for the ranks it launches)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def is_first_node() -> bool:
    """Node rank 0, the one node that writes OUT (NODE_RANK, as Lightning reads it; absent on one node)."""
    return os.environ.get("NODE_RANK", "0") == "0"


def steps_per_epoch(s: Settings, manifest) -> int:
    """Optimizer steps per epoch: each rank's full batches, over the accumulation, rounded up (Lightning
    steps at an epoch's last batch even when it ends a partial accumulation)."""
    return -(-(len(manifest.train) // world_size(s) // s.data.batch_size) // s.model.grad_accum)


def total_steps(s: Settings, manifest) -> int:
    """The optimizer steps this run trains to: --epochs whole epochs, or --max-steps when that is fewer."""
    steps = steps_per_epoch(s, manifest) * s.model.epochs
    return steps if s.model.max_steps < 0 else min(steps, s.model.max_steps)


def selection(s: Settings, manifest) -> str:
    """What --select means for this data: best, last, or none (no validation data)."""
    return s.run.select if manifest.val else "none"


def targets(s: Settings) -> dict:
    """What the run trains to, as its checkpoints record it."""
    return {"epochs": s.model.epochs, "max_steps": s.model.max_steps}


def run_fingerprint(s: Settings, data_side: dict) -> dict:
    """The run's identity: the data side (dataset.fingerprint, as DaliDataModule.fingerprint returns it) and
    the model's recipe (no secret in a --model path)."""
    return {**data_side, **redact_tree(recipe(s.model))}


def _own_folder(ckpt_dir: Path, out: Path) -> bool:
    """--checkpoint-dir is not OUT itself: it is held on its own, also where it lies inside OUT (the default,
    OUT/checkpoints), so that another run whose --checkpoint-dir names this run's finds it held."""
    return ckpt_dir.resolve() != out.resolve()


def hold_out(out: Path, ckpt_dir: Path) -> None:
    """OUT a writable folder, held by this run, and --checkpoint-dir with it where it lies outside OUT: a second
    run on either stops at once, naming the PID (two runs sharing a --checkpoint-dir both exited 0, one's
    checkpoints written over by the other's)."""
    check_writable(out, "--output")
    lock(out, "training run", "wait for it to finish, or pass another --output")
    if _own_folder(ckpt_dir, out):
        try:
            check_writable(ckpt_dir, "--checkpoint-dir")
            lock(ckpt_dir, "training run (its --checkpoint-dir)", "wait for it to finish, or pass another "
                 "--checkpoint-dir")
        except BaseException:
            unlock(out)
            raise


def release(out: Path, ckpt_dir: Path) -> None:
    """Let go of what hold_out held."""
    if _own_folder(ckpt_dir, out):
        unlock(ckpt_dir)
    unlock(out)


def check_reports(s: Settings, out: Path, *, logs: bool) -> None:
    """--report-dir (where it is not OUT) writable, and with `logs` (global rank 0, TensorBoard's writer)
    --log-dir."""
    if s.run.report_dir and Path(s.run.report_dir) != out:
        check_writable(s.run.report_dir, "--report-dir")
    if logs and s.run.log_dir:
        check_writable(s.run.log_dir, "--log-dir")


def say_nothing_to_do(step: int, out: Path) -> dict:
    print(f"nothing to do: already trained to {step} steps with these settings, and {out} holds the model "
          "(checked); pass --resume never to train again from scratch")
    return {"nothing_to_do": True, "global_step": step}


def nothing_to_do(s: Settings, manifest: Manifest | None = None) -> dict | None:
    """Say "nothing to do" and return the training command's result for it, when the run already finished
    with these settings and OUT holds its model (checked); None when it has not, or when that cannot be told
    without the full pre-flight. Mistakes are raised as the full pre-flight raises them (a checkpoint of
    another run, a read-only OUT, a second run on OUT). `manifest`: the local dataset's, read already."""
    if s.run.num_nodes > 1 or s.run.resume == "never" or not (is_main_process() and is_first_node()):
        return None
    out, ckpt_dir = Path(s.run.output), Path(s.run.checkpoint_dir)
    meta = read_sidecar(ckpt_dir / LAST if s.run.resume == "auto" else Path(s.run.resume))
    saved = (meta or {}).get("fingerprint")
    if not (meta and meta.get("finished") and meta.get("targets") == targets(s) and isinstance(saved, dict)
            and saved.get("image_size") and meta.get("image_source")):
        return None
    if meta["image_source"] != image_source(s.model.model):  # another processor: its size takes transformers
        return None
    record = read_record(out)
    if (not record or record.get("run") != meta.get("run") or record.get("global_step") != meta.get("global_step")
            or record.get("fingerprint") != saved):  # OUT needs an export (or one of the two records was edited)
        return None
    folders = (out, ckpt_dir, Path(s.run.report_dir), Path(s.run.log_dir))  # resolved settings: all set
    if not all(f.is_dir() for f in folders) or any(ckpt_dir.glob(".best.*")):  # folders to make, a best model
        return None  # to put back after a kill: the full pre-flight does that
    hold_out(out, ckpt_dir)
    try:
        return _decide(s, manifest, out, ckpt_dir, record, saved["image_size"])
    finally:
        release(out, ckpt_dir)


def _decide(s: Settings, manifest: Manifest | None, out: Path, ckpt_dir: Path, record: dict,
            image_size) -> dict | None:
    """The pre-flight's checks, in its order, with OUT held."""
    check_reports(s, out, logs=True)
    remove_dead(out)
    check_writable(ckpt_dir, "--checkpoint-dir")
    # OUT's files first (the export the record describes; only --select needs the data, below): a model to
    # export again is left to the full pre-flight before the data is prepared here, so it is prepared once
    if problem(out, run=record["run"], global_step=record["global_step"], select=record.get("select")) is not None:
        return None
    data_set, _ = prepare(s.data, Path(s.run.report_dir or out), num_threads=resources_for_rank(s.pipeline).num_threads,
                          manifest=manifest)
    world = world_size(s)
    check_batch(len(data_set.train), s.data.batch_size, world, no_training(s.data.data, data_set))
    check_accumulation(len(data_set.train), s.data.batch_size, world, s.model.grad_accum)
    current = run_fingerprint(s, fingerprint(data_set.digest(), data_set.classes, image_size, world, s.data,
                                             s.pipeline))
    # OUT's record holds the checkpoint's fingerprint (checked first), so this comparison is also the full
    # pre-flight's check_identity of OUT
    plan = plan_resume(s.run.resume, ckpt_dir, current, targets(s), steps=total_steps(s, data_set))
    if plan.done_step is None:
        return None
    if selection(s, data_set) != record.get("select"):  # the rest of problem(), checked above
        return None
    if plan.caveat:
        print(plan.caveat)
    return say_nothing_to_do(plan.done_step, out)
