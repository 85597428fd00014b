"""The training command: pre-flight, then DataModule + classifier + Trainer, then the model in
save_pretrained form.

Pre-flight, in the main process of each node (Lightning's DDP launcher re-runs this script for
the other local ranks, which skip what only one process may do):
- on node rank 0 only, hold OUT exclusively (a second run on the same OUT stops at once, naming the
  PID); the other nodes never touch OUT, which may be one folder shared by all;
- with several nodes, join the hosts' meeting first (hosts.py), and meet after the sync and scan;
- check that OUT and the checkpoint dir are writable directories with room for two checkpoints
  and the model;
- sync s3:// data, scan, write the report (once; Lightning's own `prepare_data` is then a no-op);
- fingerprint the run and decide what to resume (`--resume`), before any training.

Finished means exported: a rerun of a finished run says "nothing to do" only after checking that
OUT holds this run's complete model (model/export.py); otherwise it exports it again from the
final checkpoint (or the best model with --select best) and says so.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from model import export as exporter
from model.checkpoint import SpotSafeCheckpoint, plan_resume, read_meta
from model.export import remove_dead
from model.loading import load_processor, parameter_count
from model.module import ImageClassifier
from model.progress import PlainProgressBar
from model.selection import BestModel, recover

from ..config import Settings
from ..datamodule import DaliDataModule, drop_note
from ..errors import UserError
from ..manifest import Manifest
from ..monitor import DaliMemoryLog, MonitorCallback
from ..prescribe import prescription
from ..redact import redact
from ..spec import ImageSpec
from ..workdir import OutputError, check_writable, lock, unlock
from .hosts import fail_together, join, plan_text
from .noise import quiet_known_noise


def world_size(s: Settings) -> int:
    if s.run.devices != "auto":
        return s.run.devices * s.run.num_nodes
    import torch

    return max(1, torch.cuda.device_count()) * s.run.num_nodes


def is_main_process() -> bool:
    """The process the user started (Lightning sets LOCAL_RANK for the ranks it launches)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def is_first_node() -> bool:
    """Node rank 0, the one node that writes OUT (NODE_RANK, as Lightning reads it; absent on one node)."""
    return os.environ.get("NODE_RANK", "0") == "0"


def make_trainer(s: Settings, callbacks: list, *, logger=True, **overrides):
    """The one Trainer configuration training and the benchmark share."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger

    if logger is True:
        logger = TensorBoardLogger(s.run.log_dir, name="", version="")
    world = world_size(s)
    strategy = "auto"
    if world > 1:  # collectives (and Lightning's own rendezvous) give up after --dist-timeout, naming no hang

        from pytorch_lightning.strategies import DDPStrategy

        strategy = DDPStrategy(timeout=timedelta(seconds=s.run.dist_timeout))
    kw = dict(accelerator=s.pipeline.device, devices=s.run.devices, num_nodes=s.run.num_nodes,
              strategy=strategy, precision=s.model.precision,
              max_epochs=s.model.epochs, max_steps=s.model.max_steps, use_distributed_sampler=False,
              accumulate_grad_batches=s.model.grad_accum, gradient_clip_val=s.model.clip_grad_norm,
              gradient_clip_algorithm="norm", logger=logger, enable_checkpointing=False, callbacks=callbacks,
              log_every_n_steps=LOG_EVERY, enable_progress_bar=True, enable_model_summary=False)
    kw.update(overrides)
    return pl.Trainer(**kw)


def model_bytes(params: int) -> int:
    """The exported model (fp32 weights, written beside the model it replaces until the swap), plus 10%."""
    return int(4 * params * 1.1)


def same_disk(a: Path, b: Path) -> bool:
    """Both folders (which exist by now) are on one file system, so one room check covers both."""
    return os.stat(a).st_dev == os.stat(b).st_dev


LOG_EVERY = 50  # optimizer steps between loss points in TensorBoard (each one reads the loss: a GPU sync)


def bytes_needed(params: int) -> int:
    """Two checkpoints (fp32 weights + AdamW's two moments: the last one and the one being written), the
    best model and the exported one, each beside its temporary copy while it is written (fp32), plus 10%."""
    return int((2 * 12 + 4 * 4) * params * 1.1)


def run(s: Settings, started: float | None = None) -> dict:
    """Fit the model and write it to OUTPUT in save_pretrained form. Returns the last epoch's metrics.
    `started`: when the command began (a `time.perf_counter()` value; default now), the origin of --monitor's
    time budget, whose start-up share then holds the imports before this function ran too."""
    started = time.perf_counter() if started is None else started
    imports = (started, time.perf_counter())  # the interpreter's start and the imports before this function ran
    quiet_known_noise()
    out, ckpt_dir = Path(s.run.output), Path(s.run.checkpoint_dir)
    main = is_main_process()
    writes_out = main and is_first_node()  # the other nodes never touch OUT (it may be one shared folder)
    meeting = None
    if main and s.run.num_nodes > 1:
        meeting = join(s.run.num_nodes, s.run.dist_timeout)
    try:
        if writes_out:
            check_writable(out, "--output")
            lock(out, "training run", "wait for it to finish, or pass another --output")
        if main and s.run.report_dir and Path(s.run.report_dir) != out:
            check_writable(s.run.report_dir, "--report-dir")
        return _fit(s, out, ckpt_dir, main, meeting, started, imports)
    except BaseException as e:
        if meeting is not None:
            fail_together(meeting, e)  # tells the others; raises another host's failure when it caused this one
        raise
    finally:
        if writes_out:
            unlock(out)


@dataclass
class Prepared:
    """What the pre-flight found: the model's processor and spec, the data, and what to resume."""
    processor: object
    spec: object
    dm: object
    manifest: object
    params: int
    fingerprint: dict
    targets: dict
    plan: object


def preflight(s: Settings, out: Path, ckpt_dir: Path, main: bool) -> Prepared:
    """Outputs writable, data synced and scanned (main process), the run fingerprinted, the resume decided."""
    import pytorch_lightning as pl

    if main and is_first_node():  # the node that writes OUT and the checkpoints (folders other nodes may share)
        remove_dead(out)  # what a killed export left
        recover(ckpt_dir)  # a best model a kill left between two renames
    if main:
        check_writable(ckpt_dir, "--checkpoint-dir")
    pl.seed_everything(s.data.seed, workers=True, verbose=False)
    processor = load_processor(s.model.model)
    spec = ImageSpec.from_processor(processor)
    dm = DaliDataModule(s.data, s.pipeline, spec, Path(s.run.report_dir or out))  # reports: OUT, or output/data
    if main:
        dm.prepare_data()
    manifest = dm.setup_manifest(world_size(s))
    params = parameter_count(s.model.model, manifest.classes)
    if main:
        check_writable(ckpt_dir, "--checkpoint-dir", bytes_needed(params))
        if is_first_node() and not same_disk(out, ckpt_dir):  # else the check above counted the model too
            check_writable(out, "--output", model_bytes(params), "the model")
    fingerprint = {**dm.fingerprint(world_size(s)), "model": redact(s.model.model), "grad_accum": s.model.grad_accum}
    targets = {"epochs": s.model.epochs, "max_steps": s.model.max_steps}
    plan = plan_resume(s.run.resume, ckpt_dir, fingerprint, targets, may_modify=main)
    return Prepared(processor, spec, dm, manifest, params, fingerprint, targets, plan)


def _fit(s: Settings, out: Path, ckpt_dir: Path, main: bool, meeting=None,
         started: float | None = None, imports: tuple[float, float] | None = None) -> dict:
    from pytorch_lightning.callbacks import LearningRateMonitor
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    p = preflight(s, out, ckpt_dir, main)
    if meeting is not None:  # every host synced and scanned: meet (bounded), then Lightning's rendezvous is quick

        meeting.arrive(plan_text(p.plan), p.fingerprint)
    if p.plan.done_step is not None:
        return finished(s, p, out, ckpt_dir)
    if main:
        print(summary(s, p.manifest, p.dm.scan_result, p.params))
        note = resume_line(s, p) or p.plan.note
        if note:
            print(note)

    module = ImageClassifier(s.model, seed=s.data.seed)
    ckpt = SpotSafeCheckpoint(ckpt_dir, every_steps=s.run.checkpoint_every_steps, fingerprint=p.fingerprint,
                              targets=p.targets, run_id=p.plan.run_id)
    best = BestModel(ckpt_dir, run_id=ckpt.run_id)
    monitor = MonitorCallback(Path(s.run.report_dir or out), origin=started,  # monitor.json beside the reports
                              cli={"checkpoint_every_steps": s.run.checkpoint_every_steps,
                                   "val_fraction": s.data.val_fraction},
                              spans={"imports": imports} if imports else None) if s.run.monitor else None
    callbacks = [ckpt, best, LearningRateMonitor(logging_interval="step"), DaliMemoryLog()]
    callbacks += [PlainProgressBar()] if not sys.stderr.isatty() else []  # lines in logs; tqdm on a terminal
    callbacks += [monitor] if monitor else []
    trainer = make_trainer(s, callbacks, log_every_n_steps=max(1, min(LOG_EVERY, steps_per_epoch(s, p.manifest))))
    try:
        trainer.fit(module, datamodule=p.dm, ckpt_path=p.plan.ckpt_path)
    except SIGTERMException:
        pass  # SpotSafeCheckpoint saved; report below and exit 0
    if ckpt.interrupted:
        print(f"stopped by SIGTERM; checkpoint saved to {ckpt_dir}. Rerun the same command to resume.")
        return {"interrupted": True, "global_step": trainer.global_step}
    if monitor and monitor.report and trainer.is_global_zero:
        advise_packing(s, monitor.report, p.manifest, p.spec)
    if trainer.is_global_zero:
        export(s, module, p, best, ckpt, trainer.global_step, out)
    elif ckpt.final_error:
        raise OutputError(f"training finished, but {ckpt.final_error}")
    last = module.epoch_metrics[-1] if module.epoch_metrics else {}
    return {**last, "global_step": trainer.global_step}


def export(s: Settings, module, p: Prepared, best, ckpt, global_step: int, out: Path) -> None:
    """The selected model into OUT, even when the final checkpoint failed; then fail with what went wrong."""
    problems = [str(ckpt.final_error)] if ckpt.final_error else []
    select = selection(s, p.manifest)
    try:
        model, selected = exporter.selected_model(best, select, module.model)
        exporter.write(model, p.processor, out, {"selected": selected, "epochs": module.epoch_metrics,
                                                 "global_step": global_step}, run=ckpt.run_id, select=select)
        print(f"model ({exporter.describe(selected)}), image processor, label map and metrics.json written to {out}")
    except exporter.ExportError as e:
        problems.append(f"{e}; the checkpoint in {ckpt.dir} holds the trained weights: {exporter.RERUN}")
    except UserError as e:  # the best model is missing or damaged: the message says which and the ways out
        problems.append(str(e))
    print(f"TensorBoard logs in {s.run.log_dir}")
    print(f"TRAINED global_step={global_step}")
    if problems:
        raise OutputError("training finished, but " + "; and ".join(problems))


def selection(s: Settings, manifest) -> str:
    """What --select means for this data: best, last, or none (no validation data)."""
    return s.run.select if manifest.val else "none"


def finished(s: Settings, p: Prepared, out: Path, ckpt_dir: Path) -> dict:
    """The run already trained to its end: "nothing to do" once OUT is checked to hold its model;
    else the model exported again from the final checkpoint (or the best one, --select best)."""
    step = p.plan.done_step
    if not (is_main_process() and is_first_node()):  # the export is global rank 0's
        return {"nothing_to_do": True, "global_step": step}
    select = selection(s, p.manifest)
    problem = exporter.problem(out, run=p.plan.run_id, global_step=step, select=select)
    if problem is None:
        print(f"nothing to do: already trained to {step} steps with these settings, and {out} holds the model "
              "(checked); pass --resume never to train again from scratch")
        return {"nothing_to_do": True, "global_step": step}
    print(f"already trained to {step} steps, but {out} {problem}: exporting the model again from "
          f"{p.plan.checkpoint}")
    selected = exporter.from_checkpoint(p.plan.checkpoint, ckpt_dir, s.model.model, p.manifest.classes, p.processor,
                                        out, run=p.plan.run_id, global_step=step, select=select)
    print(f"model ({exporter.describe(selected)}), image processor, label map and metrics.json written to {out}")
    return {"exported_again": True, "global_step": step}


def advise_packing(s: Settings, report: dict, manifest, spec) -> None:
    """--monitor found the loader input-bound: if the photos are large, measure what packing would give."""
    if isinstance(manifest, Manifest) and report["diagnosis"][0].startswith("training: input-bound"):
        advice = prescription(manifest, spec, s.pipeline, batch_size=s.data.batch_size,
                              cores=len(os.sched_getaffinity(0)))
        if advice:
            print(f"MONITOR {advice}", flush=True)


def resume_line(s: Settings, p: Prepared) -> str | None:
    """"resuming epoch 2, step 3 of 5 (global step 8) from PATH": where in the data the run continues
    (the steps of finished epochs are whole epochs: every epoch has the same steps). None when not resuming
    a checkpoint that says its step."""
    if not p.plan.ckpt_path:
        return None
    meta = read_meta(Path(p.plan.ckpt_path)) or {}
    step, per_epoch = meta.get("global_step"), steps_per_epoch(s, p.manifest)
    if not isinstance(step, int) or per_epoch < 1:
        return None
    epoch, within = divmod(step, per_epoch)
    where = (f"epoch {epoch + 1}, step {within} of {per_epoch}" if within else
             f"at the start of epoch {epoch + 1} ({per_epoch} steps each)")
    return f"resuming {where} (global step {step}) from {p.plan.ckpt_path}"


def steps_per_epoch(s: Settings, manifest) -> int:
    """Optimizer steps per epoch: each rank's full batches, over the accumulation, rounded up (Lightning
    steps at an epoch's last batch even when it ends a partial accumulation)."""
    return -(-(len(manifest.train) // world_size(s) // s.data.batch_size) // s.model.grad_accum)


def summary(s: Settings, manifest, scan_result, params: int) -> str:
    """The start-up summary: data, scan, device, model, batch and steps."""
    world = world_size(s)
    steps = steps_per_epoch(s, manifest)
    total = steps * s.model.epochs if s.model.max_steps < 0 else min(steps * s.model.epochs, s.model.max_steps)
    names = ", ".join(manifest.classes[:6]) + (", ..." if len(manifest.classes) > 6 else "")
    scan = (f"scan {s.data.scan}: {len(scan_result.bad)} of {scan_result.total} excluded" if scan_result
            else f"scan {s.data.scan}")
    effective = s.data.batch_size * world * s.model.grad_accum

    drop = drop_note(len(manifest.train), s.data.batch_size, world)
    return "\n".join([
        f"data: {len(manifest.classes)} classes ({names}); {len(manifest.train)} train + {len(manifest.val)} val "
        f"images; {scan}" + (f"; {manifest.note}" if getattr(manifest, "note", "") else ""),
        f"device: {s.pipeline.device}, precision {s.model.precision}, {world} process(es)",
        f"model: {s.model.model}, {params / 1e6:.2f} M parameters",
        f"batch: {s.data.batch_size} per process x {world} process(es) x {s.model.grad_accum} accumulation = "
        f"{effective} per optimizer step; {steps} steps per epoch, {total} in all"] + ([drop] if drop else []))
