"""Measure where the time goes: a background sampler (GPU via NVML, CPU and RSS via psutil),
per-step timings, a time budget, and a diagnosis in plain words. The same Lightning callback
(`MonitorCallback`, public as `dali_pipe.MonitorCallback`) serves `--monitor` during training, any
user's Trainer, and the benchmark's timed runs (which skip warm-up steps and synchronise the GPU at
the two ends of the timed window only).

The time budget splits the wall time of a run into start-up, data wait, model step, checkpoint
saves, validation and logging and other callbacks (the rest), adding up to 100%. Each is measured
from host timestamps of the actions Lightning already profiles (`trainer.profiler`, which the
callback wraps and forwards to), so no step waits for the GPU. Every share of 10% or more gets a
verdict, its fix and the gain computed from the measured numbers.

Diagnosis rules (also in docs/benchmark.md):
- input-bound: data-wait >= 10% of the time. Says whether the CPU is saturated (>= 80%: decoding
  cannot keep up) or not (I/O or too few workers/threads).
- compute-bound: data-wait < 10% and, on a GPU, utilization >= 90% (on the CPU: the step dominates).
- host-bound: data-wait < 10% but the GPU is under 90% busy (launch overhead, syncs, small batch).
- swings: GPU utilization p5 < 50% while the mean is >= 70%.
- stalls: steps over 3x the median (checkpoint saves and validation are counted apart, in the budget).
- busy cores: other processes used the pinned cores (their share is the cores' load minus this
  process tree's CPU time); the figures are then low.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pytorch_lightning as pl

from .decoder import DecoderLog
from .prescribe import budget_line, budget_verdicts, diagnose, time_budget
from .sampler import Sampler, StepLog, nvml_handle
from .workdir import remove_dead_temps, write_atomic

# -- measuring the budget inside any Trainer -------------------------------------------------------
FETCH_SUFFIX = "].train_dataloader_next"  # the training loop's batch fetch, as "[ITS LOOP CLASS].train_dataloader_next"
STEP_ACTION = "run_training_batch"
SAVE_ACTION = "save_checkpoint"
TRANSPARENT = ("run_training_epoch",)  # spans a whole epoch, validation included: its parts are counted


class _ProfilerTap:
    """Stands in for the Trainer's profiler: forwards every call to it, and reports the start and stop of
    each action Lightning profiles (hooks, the batch fetch, the training batch, checkpoint saves) to a
    _Clock. Host timestamps only: nothing here waits for the GPU."""

    def __init__(self, inner, clock: "_Clock"):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_clock", clock)

    def start(self, action_name: str) -> None:
        self._clock.begin(action_name)
        self._inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self._inner.stop(action_name)
        self._clock.end(action_name)

    @contextlib.contextmanager
    def profile(self, action_name: str):
        self.start(action_name)
        try:
            yield action_name
        finally:
            self.stop(action_name)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


def _owner(action: str) -> str:
    """'[Callback]ModelCheckpoint{...}.on_train_batch_end' -> 'ModelCheckpoint'."""
    body = action.split("]", 1)[-1]
    return body.split("{", 1)[0].rsplit(".", 1)[0] or body


def _no_step() -> None:
    """The global step before a Trainer is attached (a module function, so that a _Clock pickles)."""
    return None


class _Clock:
    """Adds up host seconds per share from the profiled actions, once `on` (after start-up): the batch
    fetch (and its move to the device) is data wait, the training batch is the model step, checkpoint
    saves are saves wherever they happen, and every other top-level action is a callback's or a hook's,
    by owner. Nested actions count once, in the outermost attributed one."""

    def __init__(self):
        self.stack: list[list] = []  # [action, start, seconds of counted actions nested in it]
        self.on = self.in_val = False
        self.fetch = self.step = 0.0
        self.hooks: dict[str, float] = {}
        self.saves: list[list] = []  # merged [start, end, global_step, phase] per save
        self.saves_total = self.saves_in_val = 0.0
        self.global_step = _no_step  # the Trainer's, once a fit is tapped


    def _kind(self, action: str) -> str:
        if action == SAVE_ACTION:
            return "save"
        if action.endswith(FETCH_SUFFIX) or (not self.in_val and action.startswith("[Strategy]")
                                             and action.endswith(".batch_to_device")):
            return "fetch"
        if action == STEP_ACTION:
            return "step"
        return "transparent" if action in TRANSPARENT else "hook"

    def begin(self, action: str) -> None:
        self.stack.append([action, time.perf_counter(), 0.0])

    def end(self, action: str) -> None:
        t1 = time.perf_counter()
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == action:
                _, t0, nested = self.stack.pop(i)
                break
        else:
            return
        if not self.on:
            return
        kind = self._kind(action)
        d = t1 - t0
        enclosing = [self._kind(f[0]) for f in self.stack]
        parent = self.stack[-1] if self.stack else None
        if kind == "save":
            if "save" in enclosing:
                return
            phase = next((f[0].rsplit(".", 1)[-1] for f in reversed(self.stack) if f[0].startswith("[Callback]")), "")
            added = self.add_save(t0, t1, phase)
            if parent is not None:
                parent[2] += added
            return
        if kind == "transparent" or {"fetch", "step", "save"} & set(enclosing):
            return
        net = max(0.0, d - nested)
        if kind == "fetch":
            self.fetch += net
        elif kind == "step":
            self.step += net
        elif not self.in_val:
            key = _owner(action)
            self.hooks[key] = self.hooks.get(key, 0.0) + net
        else:
            return
        if parent is not None:
            parent[2] += d

    def add_save(self, t0: float, t1: float, phase: str = "", step: int | None = None) -> float:
        """Count a save (merged with those it overlaps); returns the seconds it adds to the total."""
        step = self.global_step() if step is None else step
        before = self.saves_total
        for s in self.saves:
            if t0 <= s[1] and s[0] <= t1:  # overlaps: one save (the outer one reported by its callback)
                self.saves_total -= s[1] - s[0]
                s[0], s[1] = min(s[0], t0), max(s[1], t1)
                s[3] = s[3] or phase
                self.saves_total += s[1] - s[0]
                break
        else:
            self.saves.append([t0, t1, step, phase])
            self.saves_total += t1 - t0
        added = self.saves_total - before
        if self.in_val:
            self.saves_in_val += added
        return added

    def save_details(self) -> dict:
        batch = sorted(s[2] for s in self.saves if s[3] == "on_train_batch_end" and s[2])
        gaps = np.diff([0] + batch)
        return {"count": len(self.saves), "periodic": len(batch),
                "every_steps": int(np.median(gaps)) if len(batch) else None,
                "steps": [s[2] for s in self.saves]}


class MonitorCallback(pl.Callback):
    """Where the time goes, in any Trainer: `Trainer(callbacks=[dali_pipe.MonitorCallback()])`.

    At the end of `fit` it prints (rank 0) the diagnosis as `MONITOR ...` lines, the same as
    `train.py --monitor`: input-bound (with why), compute-bound, host-bound, GPU swings, stalls, busy
    cores; then `MONITOR time: ...`, the run's wall time split into start-up (sync, scan, pipeline
    build, first batch), data wait, model step (forward, backward, optimizer), checkpoint saves,
    validation and logging and other callbacks, adding up to 100%; and for every share of at least
    10% a verdict with its fix and the expected gain (e.g. "checkpoint saves take 21% of the run (5
    saves, 1.40 s each); ModelCheckpoint(every_n_train_steps=25) would cut that to about 4%").

    The logger gets `monitor/*` scalars every epoch and at the end (data wait, step time, CPU and GPU
    utilization, `monitor/time_<share>`), and the verdicts as text where it takes text (TensorBoard).
    `output`: a folder that also gets `monitor.json`. `origin`: when the run started (a
    `time.perf_counter()` value; default: this callback's creation, or the DataModule's
    `prepare_data` when that came first). `spans`: more named start-up parts, `{name: (start, end)}` in
    `time.perf_counter()` values, beside the DataModule's own (the CLI's `imports`).

    How it measures: host timestamps of what Lightning profiles (the batch fetch, the training batch,
    `save_checkpoint`, every hook), read through the Trainer's profiler, which keeps working as
    before; utilization from a 20 Hz NVML/psutil sampler. Nothing waits for the GPU inside the run;
    the GPU is synchronised at the ends of the window only (`sync_window`), so on a GPU the host time
    spent waiting for queued work lands where the host waits. Data-wait per step is the fetch; the
    benchmark's runs skip `skip_steps` warm-up steps before the timed window.
    """

    def __init__(self, output=None, hz: float = 20.0, *, skip_steps: int = 0, sync_window: bool = True,
                 name: str = "training", verbose: bool = True, origin: float | None = None, cli: dict | None = None,
                 spans: dict | None = None):
        self.output, self.hz = output, hz
        self.spans = dict(spans or {})
        self.skip_steps, self.sync_window, self.name, self.verbose = skip_steps, sync_window, name, verbose
        self.origin, self.cli = origin if origin is not None else time.perf_counter(), cli
        self._given_origin = origin is not None
        self.report: dict | None = None
        self._tap = None
        self._decoder_log = None  # nvImageCodec's refusals, counted on a CUDA device (dali_pipe/decoder.py)
        self._last_stage_end = None  # perf_counter at the end of this callback's previous Trainer stage
        self._reset()

    def __getstate__(self) -> dict:
        """What pickles (Trainer(strategy="ddp_spawn") sends its callbacks to each process): the settings and
        any finished report, not the live taps (the Trainer's profiler, the sampler's thread)."""
        state = dict(self.__dict__)
        state.update(_tap=None, sampler=None, clock=_Clock(), _decoder_log=None)
        return state

    def _reset(self) -> None:
        """A fresh measurement (each fit with this callback is measured on its own)."""
        self.steps = StepLog()
        self.timeline = None
        self.t0 = self.t1 = None
        self.clock = _Clock()
        self.sampler = None
        self._seen = 0
        self._batch = None  # images per batch, from the first batch
        self._started = None  # perf_counter of the first training batch: the end of start-up
        self._prev = None  # (time, fetch, saves, validation) at the previous batch end
        self._val_start = None
        self._val = {"runs": 0, "images": 0, "batches": 0, "seconds": 0.0}
        self._reported: dict[int, int] = {}  # callbacks that record their own saves: entries already counted
        self._train_end = None
        self._epochs: set[int] = set()  # the epochs that trained in the window (the validation fix counts them)

    # -- the window ---------------------------------------------------------------------------
    def _sync(self, pl_module) -> float:
        """Synchronise the GPU (window ends only); returns the seconds it took."""
        start = time.perf_counter()
        if self.sync_window and pl_module.device.type == "cuda":
            import torch

            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter() - start

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        self._untap(trainer)
        if self.report is not None or self._started is not None:  # a second fit: measure it from its start
            self._reset()
            self.report = None
            if not self._given_origin:
                self.origin = time.perf_counter()
        self._tap = _ProfilerTap(trainer.profiler, self.clock)
        trainer.profiler = self._tap
        if self._on_cuda(trainer) and self._decoder_log is None:
            self._decoder_log = DecoderLog().__enter__()  # before the loaders' first decode (no first batch is
            # prepared before iteration: loader.py)
        self.clock.global_step = lambda: trainer.global_step
        spans = getattr(trainer.datamodule, "spans", None) or {}
        since = self._last_stage_end if self._last_stage_end is not None else float("-inf")
        if "prepare_data" in spans and spans["prepare_data"][0] >= since:  # this fit's, not an earlier stage's
            self.origin = min(self.origin, spans["prepare_data"][0])

    @staticmethod
    def _on_cuda(trainer) -> bool:
        """Whether this fit runs on a CUDA device (where DALI's loaders decode with nvImageCodec)."""
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        return getattr(device, "type", None) == "cuda"

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._untap(trainer)
        self._last_stage_end = time.perf_counter()

    def _untap(self, trainer) -> None:
        """Give the Trainer its own profiler back, and the process its own stderr."""
        if self._tap is not None and trainer.profiler is self._tap:
            trainer.profiler = self._tap._inner
        self._tap = None
        self._close_decoder_log()

    def _close_decoder_log(self):
        """The refusals counted so far (None when not counting), the process's stderr given back."""
        log, self._decoder_log = self._decoder_log, None
        if log is None:
            return None
        log.__exit__(None, None, None)
        return log.refusals

    def on_train_start(self, trainer, pl_module):
        gpu = (pl_module.device.index or 0) if pl_module.device.type == "cuda" else None
        self.sampler = Sampler(self.hz, gpu).start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._started is None:
            self._started = time.perf_counter()
            self.clock.on = True
            self._prev = (self._started, 0.0, 0.0, 0.0)
            self._batch = _batch_len(batch)
            if not self.skip_steps:
                self.t0 = self._started

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._count_reported_saves(trainer)
        self._seen += 1
        self._epochs.add(trainer.current_epoch)
        if self._seen == self.skip_steps:  # the timed window starts here, with the GPU caught up
            self.clock.step += self._sync(pl_module)
        now = time.perf_counter()
        t, fetch, saves, val = self._prev
        cycle = now - t - (self.clock.saves_total - saves) - (self._val["seconds"] - val)
        self._prev = (now, self.clock.fetch, self.clock.saves_total, self._val["seconds"])
        if self._seen == self.skip_steps:
            self.t0 = now
        elif self._seen > self.skip_steps:
            self.steps.step_s.append(max(0.0, cycle))
            self.steps.wait_s.append(self.clock.fetch - fetch)

    def _count_reported_saves(self, trainer) -> None:
        """Saves a callback times itself (SpotSafeCheckpoint: the fsync and the rename too) join the profiled ones."""
        for cb in trainer.callbacks:
            records = getattr(cb, "saves", None)
            if not isinstance(records, list):
                continue
            done = self._reported.get(id(cb), 0)
            for step, start, seconds in records[done:]:
                if self._started is not None and start >= self._started:
                    added = self.clock.add_save(start, start + seconds, step=step)
                    key = type(cb).__name__
                    self.clock.hooks[key] = self.clock.hooks.get(key, 0.0) - added  # it was counted as its hook
            self._reported[id(cb)] = len(records)

    def on_validation_start(self, trainer, pl_module):
        if self.clock.on and not trainer.sanity_checking:
            self._val_start = time.perf_counter()
            self.clock.in_val = True

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self._val_start is not None:
            self._val["images"] += _batch_len(batch)
            self._val["batches"] += 1

    def on_validation_end(self, trainer, pl_module):
        if self._val_start is not None:
            self._val["seconds"] += time.perf_counter() - self._val_start
            self._val["runs"] += 1
            self._val_start = None
            self.clock.in_val = False

    # -- results ------------------------------------------------------------------------------
    def budget(self, trainer, end: float | None = None) -> dict:
        """The time budget from `origin` to `end` (default: now)."""
        end = time.perf_counter() if end is None else end
        started = self._started if self._started is not None else end
        c = self.clock
        runs = self._val["runs"]
        spans = {**self.spans, **(getattr(trainer.datamodule, "spans", None) or {})}
        parts = {k: e - s for k, (s, e) in spans.items() if s >= self.origin - 1e-6}
        return time_budget(
            end - self.origin, startup=started - self.origin, data_wait=c.fetch, model_step=c.step,
            checkpoint_saves=c.saves_total, validation=self._val["seconds"] - c.saves_in_val,
            startup_parts=parts, saves_info=c.save_details(),
            validation_info={"runs": runs, "images": self._val["images"] // max(1, runs),
                             "batches": self._val["batches"] // max(1, runs), "epochs": len(self._epochs)},
            callbacks_by_name={k: v for k, v in c.hooks.items() if v > 0},
            steps=self._seen)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.logger is None or not self.steps.step_s:
            return
        w = self.sampler.window(self.t0 or self._started, time.perf_counter())
        s = self.steps.summary(1)
        metrics = {"monitor/data_wait_fraction": s["data_wait_fraction"], "monitor/step_ms_p50": s["step_ms_p50"],
                   "monitor/cpu_util_mean": w["cpu_util_mean"], "monitor/gpu_util_mean": w["gpu_util_mean"]}
        metrics.update({f"monitor/time_{k}": v for k, v in self.budget(trainer)["shares"].items()})
        trainer.logger.log_metrics({k: v for k, v in metrics.items() if v is not None}, step=trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        self._count_reported_saves(trainer)
        waited = self._sync(pl_module)  # work still queued on the GPU belongs to the window
        self.clock.step += waited
        if self.steps.step_s:
            self.steps.step_s[-1] += waited
        self._train_end = time.perf_counter()

    def on_fit_end(self, trainer, pl_module):
        """After every callback's on_train_end (ModelCheckpoint's last save included): the report."""
        if self._train_end is None:
            return
        self._count_reported_saves(trainer)
        ends = [s[1] for s in self.clock.saves] + [self._train_end]
        end = max(ends)
        self.clock.on = False
        self.t1 = end
        self.sampler.stop()
        m = {**self.steps.summary(self._batch or 1), **self.sampler.window(self.t0 or self._started or end, end),
             "stalls": self.steps.stalls()}
        self.timeline = m.pop("gpu_timeline", None)
        b = self.budget(trainer, end)
        m["time_budget"] = b
        m["diagnosis"] = diagnose(self.name, m, cores=len(self.sampler.cores))
        refusals = self._close_decoder_log()
        if refusals is not None:
            m["decoder"] = refusals.to_json()
            images = self._seen * (self._batch or 0) + self._val["images"]
            m["diagnosis"] += [f"{self.name}: {line}" for line in refusals.lines(images)]
        m["time_line"] = budget_line(b)
        m["budget_verdicts"] = budget_verdicts(self.name, b, cli=self.cli)
        self.report = m
        if trainer.is_global_zero:
            self._publish(trainer, m)

    def on_exception(self, trainer, pl_module, exception):
        if self.sampler is not None:
            self.sampler.stop()
        self._untap(trainer)  # Lightning calls no teardown hook after an exception

    def _publish(self, trainer, m: dict) -> None:
        lines = m["diagnosis"] + [m["time_line"]] + m["budget_verdicts"]
        if self.verbose:
            for line in lines:
                print(f"MONITOR {line}", flush=True)
        if trainer.logger is not None:
            scalars = {f"monitor/time_{k}": v for k, v in m["time_budget"]["shares"].items()}
            scalars["monitor/images_per_sec"] = m["images_per_sec"]
            trainer.logger.log_metrics({k: v for k, v in scalars.items() if v is not None}, step=trainer.global_step)
            experiment = getattr(trainer.logger, "experiment", None)
            if hasattr(experiment, "add_text"):
                experiment.add_text("monitor/diagnosis", "\n\n".join(lines), trainer.global_step)
        if self.output is not None:
            out = Path(self.output)
            try:  # the run's own results come first: a full disk here costs the report, never the run
                out.mkdir(parents=True, exist_ok=True)
                remove_dead_temps(out, ".monitor.json.tmp-*")  # left by a run killed while writing
                write_atomic(out / "monitor.json", json.dumps({**m, "timeline": self.timeline}, indent=1))
            except OSError as e:
                print(f"MONITOR could not write {out / 'monitor.json'} ({e.strerror or e}); the lines above are the "
                      "report", flush=True)


def _batch_len(batch) -> int:
    """Images in a batch: the length of its labels (or of its first element)."""
    try:
        if isinstance(batch, dict):  # {"image": ..., "label": ...}: any entry has the batch's length
            return len(next(iter(batch.values())))
        part = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else batch[0]
        return len(part)
    except Exception:
        return 1


def gpu_memory_outside_torch(device_index: int) -> float | None:
    """MB of GPU memory this process holds beyond torch's caching allocator: DALI's memory pool and
    nvJPEG's buffers (and the CUDA context). None where NVML cannot see this process (PID namespaces)."""
    import pynvml
    import torch

    try:
        pynvml.nvmlInit()
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_handle(device_index))
    except Exception:
        return None
    mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory]
    if not mine:
        return None
    return (mine[0] - torch.cuda.memory_reserved(device_index)) / 2**20


class DaliMemoryLog(pl.Callback):
    """On a GPU, after the first training epoch: how much GPU memory DALI holds beside torch."""

    def on_train_epoch_end(self, trainer, pl_module):
        if pl_module.device.type != "cuda" or getattr(self, "_done", False):
            return
        self._done = True
        mb = gpu_memory_outside_torch(pl_module.device.index or 0)
        if mb is None:
            return
        if trainer.logger is not None:
            trainer.logger.log_metrics({"memory/gpu_outside_torch_mb": mb}, step=trainer.global_step)
        if trainer.is_global_zero:
            print(f"dali: after epoch 1 this process holds {mb:.0f} MB of GPU memory beyond torch's (DALI's pool, "
                  "nvJPEG's buffers and the CUDA context)", flush=True)
