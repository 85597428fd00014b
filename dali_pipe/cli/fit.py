"""The training command: pre-flight, then DataModule + classifier + Trainer, then the model in
save_pretrained form.

Pre-flight, in the main process of each node (Lightning's DDP launcher re-runs this script for
the other local ranks, which skip what only one process may do):
- on node rank 0 only, hold OUT exclusively (a second run on the same OUT stops at once, naming the
  PID); the other nodes never touch OUT, which may be one folder shared by all;
- with several nodes, join the hosts' meeting first (hosts.py), and meet after the sync and scan;
- check that OUT and the checkpoint dir are writable directories with room for two checkpoints
  and the model, and that the report and TensorBoard folders are writable;
- sync s3:// data, scan, write the report (once; Lightning's own `prepare_data` is then a no-op);
- fingerprint the run (the data and every setting that changes the weights) and decide what to resume
  (`--resume`), before any training: a checkpoint, or a model in OUT, of another run stops it naming
  each difference; so does a checkpoint already past the steps this run asks for.

Finished means exported: a rerun of a finished run says "nothing to do" only after checking that
OUT holds this run's complete model (model/export.py); otherwise it exports it again from the
final checkpoint (or the best model with --select best) and says so. A run whose loss stays
non-finite stops with exit status 1 (model/module.py), exporting nothing.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from model import export as exporter
from model import exported
from model.checkpoint import SpotSafeCheckpoint
from model.exported import remove_dead
from model.loading import image_source, load_processor, parameter_count
from model.module import ImageClassifier, TrainingDiverged
from model.progress import PlainProgressBar, TerminalProgressBar
from model.resume import LAST, plan_resume, read_meta
from model.selection import BestModel, recover

from ..config import Settings
from ..datamodule import DaliDataModule
from ..dataset import check_accumulation, data_line, drop_note, split_record
from ..errors import UserError
from ..manifest import Manifest
from ..monitor import DaliMemoryLog, MonitorCallback
from ..naming import named
from ..prescribe import prescription
from ..scan import is_empty_report
from ..spec import ImageSpec
from ..stop import check
from ..workdir import OutputError, check_writable, fix_for, no_empty_folders_on_failure, output_failure
from .finished import (
    check_reports,
    hold_out,
    is_first_node,
    is_main_process,
    release,
    run_fingerprint,
    say_nothing_to_do,
    selection,
    steps_per_epoch,
    targets,
    total_steps,
    world_size,
)
from .hosts import fail_together, join, plan_text
from .noise import quiet_known_noise


def make_trainer(s: Settings, callbacks: list, *, logger=True, purge_step: int | None = None, **overrides):
    """The one Trainer configuration training and the benchmark share. `purge_step`: TensorBoard drops the
    events of earlier runs in --log-dir from that step on (see tensorboard_purge_step)."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger

    if logger is True:
        # a resumed run logs no second placeholder hp_metric at step 0 (its first run's is kept)
        logger = TensorBoardLogger(s.run.log_dir, name="", version="", purge_step=purge_step,
                                   default_hp_metric=not purge_step)
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


def run(s: Settings, manifest: Manifest | None = None, style: str = "flag", started: float | None = None) -> dict:
    """Fit the model and write it to OUTPUT in save_pretrained form. Returns the last epoch's metrics.
    `manifest`: the local dataset's, read already (cli.described), so it is not read again; `style`: how the
    user names settings, for the summary's advice (config.named); `started`: when the command began (a
    `time.perf_counter()` value; default now), the origin of --monitor's time budget, whose start-up share
    then holds the imports before this function ran too."""
    started = time.perf_counter() if started is None else started
    imports = (started, time.perf_counter())  # the interpreter's start and the imports before this function ran
    quiet_known_noise()
    out, ckpt_dir = Path(s.run.output), Path(s.run.checkpoint_dir)
    main = is_main_process()
    writes_out = main and is_first_node()  # the other nodes never touch OUT (it may be one shared folder)
    meeting = None
    if main and s.run.num_nodes > 1:
        meeting = join(s.run.num_nodes, s.run.dist_timeout)
    ours = (out, ckpt_dir, s.run.report_dir, s.run.log_dir) if main else ()
    with no_empty_folders_on_failure(*ours, blank=is_empty_report):  # a failed run leaves no empty OUT/checkpoints/
        try:
            if writes_out:
                hold_out(out, ckpt_dir)
            if main:
                check_reports(s, out, logs=writes_out)  # TensorBoard's folder: written by global rank 0 only
            return _fit(s, out, ckpt_dir, main, meeting, started, manifest, style, imports)
        except BaseException as e:
            if meeting is not None:
                fail_together(meeting, e)  # tells the others; raises another host's failure when it caused this one
            raise
        finally:
            if writes_out:
                release(out, ckpt_dir)


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
    split: dict  # how the validation split was made (metrics.json records it; evaluate defaults to it)
    image_source: str | None  # what the image size was computed from (loading.image_source; the checkpoints say it)


def preflight(s: Settings, out: Path, ckpt_dir: Path, main: bool, manifest: Manifest | None = None) -> Prepared:
    """Outputs writable, data synced and scanned (main process), the run fingerprinted, the resume decided."""
    import pytorch_lightning as pl

    if main and is_first_node():  # the node that writes OUT and the checkpoints (folders other nodes may share)
        remove_dead(out)  # what a killed export left
        recover(ckpt_dir)  # a best model a kill left between two renames
    if main:
        check_writable(ckpt_dir, "--checkpoint-dir")
    pl.seed_everything(s.data.seed, workers=True, verbose=False)
    processor = load_processor(s.model.model)
    check()  # a stop asked for meanwhile (stop.py): at each stage of the pre-flight, before training's own handlers
    source = image_source(s.model.model)  # after the processor loaded (a hub model's files are cached by then)
    spec = ImageSpec.from_processor(processor)
    dm = DaliDataModule(s.data, s.pipeline, spec, Path(s.run.report_dir or out),  # reports: OUT, or output/data
                        manifest=manifest)
    if main:
        dm.prepare_data()
    check()
    manifest = dm.setup_manifest(world_size(s))
    check_accumulation(len(manifest.train), s.data.batch_size, world_size(s), s.model.grad_accum)
    params = parameter_count(s.model.model, manifest.classes)
    fingerprint = run_fingerprint(s, dm.fingerprint(world_size(s)))
    check()
    plan = plan_resume(s.run.resume, ckpt_dir, fingerprint, targets(s), may_modify=main,
                       steps=total_steps(s, manifest))
    if main and plan.done_step is None:  # room to train (a finished run needs none, or the model's: finished())
        check_writable(ckpt_dir, "--checkpoint-dir", bytes_needed(params))
        if is_first_node() and not same_disk(out, ckpt_dir):  # else the check above counted the model too
            check_writable(out, "--output", model_bytes(params), "the model")
    if main and is_first_node() and s.run.resume != "never":
        exported.check_identity(out, fingerprint)  # OUT holds the model of another run: stop, as for a checkpoint
    split = split_record(manifest, s.data, fingerprint["samples"])
    return Prepared(processor, spec, dm, manifest, params, fingerprint, targets(s), plan, split, source)


def _fit(s: Settings, out: Path, ckpt_dir: Path, main: bool, meeting=None,
         started: float | None = None, manifest: Manifest | None = None, style: str = "flag",
         imports: tuple[float, float] | None = None) -> dict:
    from pytorch_lightning.callbacks import LearningRateMonitor
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    p = preflight(s, out, ckpt_dir, main, manifest)
    if meeting is not None:  # every host synced and scanned: meet (bounded), then Lightning's rendezvous is quick

        meeting.arrive(plan_text(p.plan), p.fingerprint)
    if p.plan.done_step is not None:
        return finished(s, p, out, ckpt_dir)
    if main:
        print(named(summary(s, p.manifest, p.dm.scan_result, p.params), style))  # its advice in the user's words
        for note in (resume_line(s, p) or p.plan.note, p.plan.caveat):
            if note:
                print(note)

    module = ImageClassifier(s.model, seed=s.data.seed)
    ckpt = SpotSafeCheckpoint(ckpt_dir, every_steps=s.run.checkpoint_every_steps, fingerprint=p.fingerprint,
                              targets=p.targets, run_id=p.plan.run_id, image_source=p.image_source)
    best = BestModel(ckpt_dir, run_id=ckpt.run_id)
    monitor = MonitorCallback(Path(s.run.report_dir or out), origin=started,  # monitor.json beside the reports
                              cli={"checkpoint_every_steps": s.run.checkpoint_every_steps,
                                   "val_fraction": s.data.val_fraction},
                              spans={"imports": imports} if imports else None) if s.run.monitor else None
    callbacks = [ckpt, best, LearningRateMonitor(logging_interval="step"), DaliMemoryLog()]
    callbacks += [TerminalProgressBar() if sys.stderr.isatty() else PlainProgressBar()]  # a bar on a terminal
    callbacks += [monitor] if monitor else []
    trainer = make_trainer(s, callbacks, log_every_n_steps=max(1, min(LOG_EVERY, steps_per_epoch(s, p.manifest))),
                           purge_step=tensorboard_purge_step(p.plan))
    check()  # from here SpotSafeCheckpoint takes a stop over: saved after the next step
    try:
        trainer.fit(module, datamodule=p.dm, ckpt_path=p.plan.ckpt_path)
    except SIGTERMException:
        pass  # SpotSafeCheckpoint saved; report below and exit 0 (SIGTERM) or 130 (Ctrl-C)
    except TrainingDiverged as e:  # nothing is exported; say which checkpoint is the last good one
        meta = read_meta(ckpt_dir / LAST) if (ckpt_dir / LAST).is_file() else None
        good = (f"{ckpt_dir / LAST} (step {meta.get('global_step')}) is the last checkpoint, saved while the weights "
                "were finite" if meta else "no checkpoint was saved before it")
        raise TrainingDiverged(f"{e} Nothing was exported to {out}; {good}.") from None
    except SystemExit as e:  # Lightning's "Detected KeyboardInterrupt": a Ctrl-C before SpotSafeCheckpoint's own
        if isinstance(e.__context__, KeyboardInterrupt):  # handler was installed (while the loaders were built)
            raise KeyboardInterrupt from None  # the CLI: "stopped by Ctrl-C", exit 130
        raise
    except Exception as e:  # an output folder turned read-only, vanished or filled up: one line, not a traceback
        failure = None if isinstance(e, UserError) else output_failure(e, outputs(s))
        if failure is None:
            raise
        path, why = failure
        left, resumable = kept(ckpt_dir)
        fix = fix_for(why, path)
        then = "then rerun the same command" + (" to resume." if resumable else ".")
        raise OutputError(f"training stopped: cannot write {path or 'an output'} ({why}); {left}. {fix[0].upper()}"
                          f"{fix[1:]} (or write elsewhere), {then}") from None
    finally:  # Lightning tears the datamodule down only after a run that ends normally: a stopped or failed one
        p.dm.teardown()  # closes the stream cache here (its fetches ended, its lock under locks/ released)
    if ckpt.interrupted:
        what = "Ctrl-C" if ckpt.stopped_by == "SIGINT" else "SIGTERM"
        print(f"stopped by {what}; checkpoint saved to {ckpt_dir} (step {trainer.global_step}). Rerun the same "
              "command to resume.")
        return {"interrupted": True, "global_step": trainer.global_step, "stopped_by": ckpt.stopped_by}
    if monitor and monitor.report and trainer.is_global_zero:
        advise_packing(s, monitor.report, p.manifest, p.spec)
    if trainer.is_global_zero:
        export(s, module, p, best, ckpt, trainer.global_step, out)
    elif ckpt.final_error:
        raise OutputError(f"training finished, but {ckpt.final_error}")
    last = module.epoch_metrics[-1] if module.epoch_metrics else {}
    return {**last, "global_step": trainer.global_step}


def outputs(s: Settings) -> list[str]:
    """The folders a training run writes to: OUT, the checkpoints, TensorBoard, the reports, the cache."""
    return [s.run.output, s.run.checkpoint_dir, s.run.log_dir, s.run.report_dir, s.data.cache_dir]


def kept(ckpt_dir: Path) -> tuple[str, bool]:
    """Which checkpoint a failed run leaves to resume from, in words, and whether there is one."""
    last = ckpt_dir / LAST
    try:
        step = (read_meta(last) or {}).get("global_step") if last.is_file() else None
    except UserError:  # damaged: the rerun names it
        step = None
    if not last.is_file():
        return "no checkpoint was saved before it (--checkpoint-every-steps saves within epochs)", False
    return f"the last checkpoint, {last}" + (f" (step {step})" if step is not None else "") + ", is kept", True


def tensorboard_purge_step(plan) -> int | None:
    """Where this run's TensorBoard curves take over from the events already in --log-dir: at the step of the
    checkpoint it resumes (Lightning logs step N's points at index N - 1, so what the earlier run logged from
    index N on came after that checkpoint: trained again after a kill -9, it would appear twice),
    or from step 0 for a run that starts over (the curves of the run it replaces are dropped from view).
    None (nothing dropped) for a checkpoint of an older version, which does not say its step. The
    SummaryWriter writes a session start at this step, and TensorBoard drops the earlier files' events from
    there on (the files themselves stay)."""
    if not plan.ckpt_path:
        return 0
    step = (read_meta(Path(plan.ckpt_path)) or {}).get("global_step")
    return step if isinstance(step, int) else None


def export(s: Settings, module, p: Prepared, best, ckpt, global_step: int, out: Path) -> None:
    """The selected model into OUT, even when the final checkpoint failed; then fail with what went wrong."""
    problems = [str(ckpt.final_error)] if ckpt.final_error else []
    select = selection(s, p.manifest)
    where = {"epoch": epoch_of(s, p.manifest, global_step), "global_step": global_step}
    try:
        model, selected = exporter.selected_model(best, select, module.model, where)
        exporter.write(model, p.processor, out, {"selected": selected, "epochs": module.epoch_metrics,
                                                 "global_step": global_step, "split": p.split},
                       run=ckpt.run_id, select=select, fingerprint=p.fingerprint)
        print(f"model ({exported.describe(selected)}), image processor, label map and metrics.json written to {out}")
    except exporter.ExportError as e:
        problems.append(f"{e}; the checkpoint in {ckpt.dir} holds the trained weights: {exporter.RERUN}")
    except UserError as e:  # the best model is missing or damaged: the message says which and the ways out
        problems.append(str(e))
    print(f"TensorBoard logs in {s.run.log_dir}")
    print(f"TRAINED global_step={global_step}")
    if problems:
        raise OutputError("training finished, but " + "; and ".join(problems))


def epoch_of(s: Settings, manifest, global_step: int) -> int:
    """The 1-based epoch that optimizer step `global_step` falls in (its last, for an epoch's last step)."""
    return max(1, -(-global_step // max(1, steps_per_epoch(s, manifest))))


def finished(s: Settings, p: Prepared, out: Path, ckpt_dir: Path) -> dict:
    """The run already trained to its end: "nothing to do" once OUT is checked to hold its model;
    else the model exported again from the final checkpoint (or the best one, --select best)."""
    step = p.plan.done_step
    if not (is_main_process() and is_first_node()):  # the export is global rank 0's
        return {"nothing_to_do": True, "global_step": step}
    if p.plan.caveat:
        print(p.plan.caveat)
    select = selection(s, p.manifest)
    problem = exported.problem(out, run=p.plan.run_id, global_step=step, select=select)
    if problem is None:
        return say_nothing_to_do(step, out)
    print(f"already trained to {step} steps, but {out} {problem}: exporting the model again from "
          f"{p.plan.checkpoint}")
    check_writable(out, "--output", model_bytes(p.params), "the model")
    selected = exporter.from_checkpoint(p.plan.checkpoint, ckpt_dir, s.model.model, p.manifest.classes, p.processor,
                                        out, run=p.plan.run_id, global_step=step, select=select,
                                        epoch=epoch_of(s, p.manifest, step), fingerprint=p.fingerprint, split=p.split)
    print(f"model ({exported.describe(selected)}), image processor, label map and metrics.json written to {out}")
    return {"exported_again": True, "global_step": step}


def advise_packing(s: Settings, report: dict, manifest, spec) -> None:
    """--monitor found the loader input-bound: if the photos are large, measure what packing would give."""
    if isinstance(manifest, Manifest) and report["diagnosis"][0].startswith("training: input-bound"):
        advice = prescription(manifest, spec, s.pipeline, batch_size=s.data.batch_size,
                              cores=len(os.sched_getaffinity(0)), data=s.data.data)
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


def summary(s: Settings, manifest, scan_result, params: int) -> str:
    """The start-up summary: data, scan, device, model, batch and steps."""
    world = world_size(s)
    steps, total = steps_per_epoch(s, manifest), total_steps(s, manifest)
    effective = s.data.batch_size * world * s.model.grad_accum

    drop = drop_note(len(manifest.train), s.data.batch_size, world)
    return "\n".join([
        data_line(manifest, s.data.scan, scan_result),
        f"device: {s.pipeline.device}, precision {s.model.precision}, {world} process(es)",
        f"model: {s.model.model}, {params / 1e6:.2f} M parameters",
        f"batch: {s.data.batch_size} per process x {world} process(es) x {s.model.grad_accum} accumulation = "
        f"{effective} per optimizer step; {steps} steps per epoch, {total} in all"] + ([drop] if drop else []))
