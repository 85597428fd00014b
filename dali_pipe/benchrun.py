"""The benchmark: loaders side by side in one run, each feeding the same training step, timed and
diagnosed; and `benchmark()`, the same comparison for your own LightningModule.

Loaders: `dali` (this project's pipeline), `packed` (the same over a pack), `baseline` (the classic
PIL + DataLoader recipe at its best for the cores given) and `synthetic` (random tensors already on
the device: the model's own ceiling; left out without a model, where it would time nothing).

With a model each timed step is the LightningModule's own training step run by a Trainer (the CLI
uses training's Trainer setup: same optimizer, precision and loss), timed by
`monitor.MonitorCallback` after `warmup` untimed steps; without one (`--model none`) the loaders
alone are timed. `repeat` rounds alternate the loaders' order; the report gives each loader's
median and min-max and each ratio's (ratios are taken within a round), a time budget per loader,
the verdicts, and writes benchmark.json and benchmark.png. It prints a report, not a training log:
one progress line per loader, a table per round, then the summary.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import importlib
import json
import logging
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import pytorch_lightning as pl

from .baseline import classic_loader
from .benchplan import machine_defaults, memory_gib
from .benchreport import flags, plot, ratio_lines, round_table, table
from .config import LOADERS, UsageError, resolve_precision
from .decoder import DecoderLog
from .limits import on_glibc
from .monitor import MonitorCallback
from .prescribe import diagnose, time_budget
from .sampler import Sampler, StepLog, TreeMemory
from .samples import Shards
from .stop import check
from .workdir import OutputError, remove_dead_temps, write_atomic

SHARDS_NOTE = ("baseline left out: the classic loader reads image files, and --data holds shards (a pack, WebDataset "
               "shards or a Hugging Face table); to time it, pass the image files as --data and their pack as --packed")
NO_MODEL_NOTE = ("synthetic left out: without a model it would only time a tensor that is already there; it is the "
                 "model's ceiling when there is one")


def pin_cpus(n: int | None) -> list[int]:
    """Pin this process (and the workers/threads it starts later) to its first n allowed cores."""
    cores = sorted(os.sched_getaffinity(0))
    if n:
        cores = cores[:n]
        os.sched_setaffinity(0, cores)
    return cores


def endless(loader):
    while True:
        yield from loader


class Cycle:
    """A loader repeated as one epoch of `length` batches (the run's steps), so no epoch-end work (metric lines,
    schedulers) lands inside the timed window. It has a length, as training's loader has: Lightning fetches an
    iterable without one a batch ahead (to see its end), and the fetch it times would be the next batch's.

    The loader's first iterator is made here, so a DataLoader forks its workers now, before the model exists:
    forked later, each worker's memory maps the model's and the optimizer's pages as well (a sum of RSS counted
    them once per worker)."""

    def __init__(self, loader, length: int):
        self.loader, self.length = loader, length
        self.batch_size = getattr(loader, "batch_size", None)
        self._first = iter(loader)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        first, self._first = self._first, None
        if first is not None:
            yield from first
        yield from endless(self.loader)


class Synthetic:
    """The same random batch, already on the device, forever: the model's own ceiling."""

    def __init__(self, batch: int, spec, classes: int, device):
        import torch

        g = torch.Generator(device="cpu").manual_seed(0)
        self.x = torch.randn(batch, 3, spec.height, spec.width, generator=g).to(device)
        self.y = torch.randint(0, classes, (batch,), generator=g).to(device)
        self.batch_size = batch

    def __iter__(self):
        while True:
            yield self.x, self.y


PROGRESS_EVERY = 8.0  # seconds between progress lines in a log (a terminal's line is rewritten every second)


class Progress:
    """Where one loader's run is: its stage (building the loader, starting, warm-up, timed steps), the step, and
    the images/s of the timed steps so far, with the seconds since it began. On a terminal one line rewritten in
    place every second; in a log a line every `every` seconds, from a thread (a ViT-B/16 step on 2 CPU cores
    takes seconds, and building a loader may too); then the result line."""

    def __init__(self, label: str, total: int, *, warmup: int = 0, batch_size: int | None = None, stream=None,
                 every: float = PROGRESS_EVERY):
        self.label, self.total, self.warmup, self.batch_size = label, total, warmup, batch_size
        self.stream, self.every = stream or sys.stdout, every
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.stage, self.steps = "building the loader", 0
        self.began = self._printed = time.perf_counter()
        self._timed_from: float | None = None
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True, name="benchmark-progress")
        self._thread.start()

    def started(self) -> None:
        """The loader is built: the Trainer, the model and the first batch come next."""
        self.stage = "starting (the model and the first batch)"
        if not self.warmup:
            self._timed_from = time.perf_counter()

    def update(self, done: int) -> None:
        """`done` steps (warm-up included) have finished."""
        self.steps = done
        if done == self.warmup:
            self._timed_from = time.perf_counter()
        self.stage = "warm-up" if done < self.warmup else "timed"
        if self.tty:
            self._write(f"\r{self.status()}\033[K")

    def status(self) -> str:
        now = time.perf_counter()
        took = f"{now - self.began:.0f} s"
        if self.stage == "warm-up":
            return f"{self.label}: warm-up, {self.steps}/{self.warmup} step(s) done, {took}"
        if self.stage == "timed":
            timed = self.steps - self.warmup
            rate = ""
            if timed and self.batch_size and self._timed_from is not None and now > self._timed_from:
                rate = f", {timed * self.batch_size / (now - self._timed_from):.3g} images/s so far"
            return f"{self.label}: timed, {timed}/{self.total - self.warmup} step(s) done{rate}, {took}"
        return f"{self.label}: {self.stage}, {took}"

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(1.0 if self.tty else 0.5):
            now = time.perf_counter()
            if self.tty:
                self._write(f"\r{self.status()}\033[K")
            elif now - self._printed >= self.every:
                self._printed = now
                self._write(self.status() + "\n")

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def done(self, result: str) -> None:
        self.stop()
        line = f"{self.label}: {result}"
        self._write(f"\r{line}\033[K\n" if self.tty else f"{line}\n")


def time_loader(batches, device, *, warmup: int, steps: int, progress: Progress | None = None,
                origin: float | None = None) -> tuple[StepLog, float, float, dict]:
    """Loaders alone (--model none): move each batch to the device, nothing else. Returns the log of the
    timed steps, the timed window (t0, t1), synchronised with the GPU at both ends only, and the time
    budget from `origin` (before the loader was built): start-up up to the first batch, then the time
    blocked waiting for batches, and the rest (the copies and the loop)."""
    import torch

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    origin = time.perf_counter() if origin is None else origin
    it = iter(batches)
    log = StepLog()
    waits = []
    t0 = prev = time.perf_counter()
    for i in range(warmup + steps):
        check()  # SIGTERM, Ctrl-C (stop.py): a flag's look, nothing against a step's time
        if i == warmup:
            sync()
            t0 = prev = time.perf_counter()
        x, y = next(it)
        got = time.perf_counter()
        waits.append(got - prev)
        x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        end = time.perf_counter()
        if i >= warmup:
            log.wait_s.append(got - prev)
            log.step_s.append(end - prev)
        prev = end
        if i == 0:
            first = got
        if progress:
            progress.update(i + 1)
    sync()
    t1 = time.perf_counter()
    log.step_s[-1] += t1 - prev
    budget = time_budget(t1 - origin, startup=first - origin, data_wait=sum(waits[1:]), model_step=0.0)
    return log, t0, t1, budget


def spread(values: list[float]) -> dict:
    """Median and min-max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


RATIO_PAIRS = (("dali", "baseline"), ("dali", "synthetic"), ("baseline", "synthetic"), ("packed", "dali"),
               ("packed", "baseline"), ("packed", "synthetic"))


def ratios(rounds: dict[str, list[float]]) -> dict[str, dict]:
    """Per-round ratios of images/s (both loaders measured in the same round), then their spread."""
    return {f"{a}_vs_{b}": spread([x / y for x, y in zip(rounds[a], rounds[b])])
            for a, b in RATIO_PAIRS if a in rounds and b in rounds}


def environment(cores, gpu: bool, threads: int) -> dict:
    import torch

    def version(mod):
        try:
            return importlib.import_module(mod).__version__
        except Exception:
            return None

    return {"cpus": len(cores), "cores": cores, "dali_threads": threads, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if gpu else None, "torch": torch.__version__,
            "dali": version("nvidia.dali"), "lightning": version("pytorch_lightning"),
            "transformers": version("transformers"), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


# -- measuring one loader -------------------------------------------------------------------------
def release_memory(gpu: bool) -> None:
    """Return the memory of the loader just measured (its module, Trainer and loader must be unreachable by now),
    so the next one starts with the same pool: the cycles between a Trainer and its module collected; the heap
    glibc's malloc keeps after freeing them (1.2-1.9 GB after a ViT-B/16 leg on the CPU) given back to the kernel;
    DALI's memory pool, which outlives its pipelines, and torch's caching allocator, which outlives its tensors."""
    gc.collect()
    if on_glibc():
        ctypes.CDLL(None).malloc_trim(0)
    if gpu:
        import torch
        from nvidia.dali.backend import ReleaseUnusedMemory

        ReleaseUnusedMemory()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def quiet_lightning():
    """Lightning's per-Trainer banners ("GPU available", "`Trainer.fit` stopped") are a training log's
    lines, and its warning that a run of a few steps is shorter than the logging interval is true of every
    benchmark run; the benchmark prints a report. Restored afterwards."""
    names = ("pytorch_lightning", "pytorch_lightning.utilities.rank_zero", "lightning_fabric",
             "pytorch_lightning.accelerators.cuda")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*smaller than the logging interval.*")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _Feed(pl.LightningDataModule):
    """What a benchmark Trainer fits on: one loader, and the classes a module may size its head from
    (`trainer.datamodule.classes`)."""

    def __init__(self, loader, classes):
        super().__init__()
        self.loader, self.classes = loader, list(classes)

    def train_dataloader(self):
        return self.loader

    def val_dataloader(self):
        return []  # no validation in a benchmark (and no warning that a module's validation_step goes unused)


class _StepProgress(pl.Callback):
    def __init__(self, progress: Progress):
        self.progress, self.batches = progress, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches += 1
        self.progress.update(self.batches)


def measure(name: str, build, *, device, batch_size: int, warmup: int, steps: int, cores: int, classes: list[str],
            make_module=None, make_trainer=None, label: str = "") -> dict:
    """One timed run of one loader (`build()` makes it): its metrics, time budget, peak memory and timelines.
    With `make_module` and `make_trainer(callbacks, max_steps)` each step is the module's training step run by
    that Trainer; without, the loader alone. Its loader, module and Trainer are gone (and their memory given
    back) when it returns, so the next loader's run starts from the same process."""
    progress = Progress(label or name, warmup + steps, warmup=warmup, batch_size=batch_size)
    memory = TreeMemory().start()
    try:
        m, timeline, wait = _leg(name, build, progress, device=device, batch_size=batch_size, warmup=warmup,
                                 steps=steps, cores=cores, classes=classes, make_module=make_module,
                                 make_trainer=make_trainer)  # what it made is unreachable once it returns
        m.update(memory.stop())
    finally:
        memory.stop()
        progress.stop()
    release_memory(device.type == "cuda")
    progress.done(f"{m['images_per_sec']:.3g} images/s, step p50 {m['step_ms_p50']:.0f} ms, data wait "
                  f"{m['data_wait_fraction']:.0%}, peak memory {m['rss_peak_mb']:.0f} MB "
                  f"({m['time_budget']['wall_s']:.1f} s)")
    return {"metrics": m, "timeline": {"gpu": timeline, "wait_ms": [w * 1e3 for w in wait]}}


def _leg(name: str, build, progress: Progress, *, device, batch_size: int, warmup: int, steps: int, cores: int,
         classes: list[str], make_module, make_trainer) -> tuple[dict, list, list]:
    """measure()'s run: (metrics, GPU timeline, data waits)."""
    origin = time.perf_counter()
    data = build()
    progress.started()
    if make_module is None:
        sampler = Sampler(20.0, 0 if device.type == "cuda" else None).start()
        decoder_log = DecoderLog() if device.type == "cuda" else contextlib.nullcontext()
        try:
            with decoder_log:  # nvImageCodec's refusals, counted (the MonitorCallback does it for the model's runs)
                log, t0, t1, budget = time_loader(endless(data), device, warmup=warmup, steps=steps,
                                                  progress=progress, origin=origin)
        finally:
            sampler.stop()
        m = {**log.summary(batch_size), **sampler.window(t0, t1), "stalls": log.stalls(), "gpu_note": sampler.gpu_note,
             "time_budget": budget}
        timeline, wait = m.pop("gpu_timeline"), log.wait_s
        m["diagnosis"] = diagnose(name, m, cores=cores, model=False)
        if isinstance(decoder_log, DecoderLog):
            m["decoder"] = decoder_log.refusals.to_json()
            m["diagnosis"] += [f"{name}: {line}" for line in decoder_log.refusals.lines((warmup + steps) * batch_size)]
    else:
        pl.seed_everything(0, verbose=False)
        timer = MonitorCallback(skip_steps=warmup, sync_window=True, name=name, verbose=False, origin=origin)
        trainer = make_trainer([timer, _StepProgress(progress)], warmup + steps)
        feed = _Feed(Cycle(data, warmup + steps), classes)  # a DataLoader's workers fork here, before the model
        trainer.fit(make_module(), datamodule=feed)
        m = {**timer.report, "gpu_note": timer.sampler.gpu_note}
        m["diagnosis"] = m["diagnosis"] + m.pop("budget_verdicts")
        if name == "synthetic" and m["data_wait_fraction"] < 0.10:
            m["diagnosis"][0] = m["diagnosis"][0].replace(f"{name}: ", f"{name}: the model's own ceiling; ", 1)
        timeline, wait = timer.timeline, timer.steps.wait_s
    m.pop("time_line", None)
    m.pop("rss_peak_mb", None)  # the timed window's sum of RSS; measure() puts the whole run's peak memory
    return m, timeline, wait


def run_rounds(names: list[str], measure_one, repeat: int) -> dict[str, list[dict]]:
    """`repeat` rounds, the loaders' order alternating; a table after each round."""
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(repeat):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            check()
            rounds[name].append(measure_one(name, f"round {r + 1}/{repeat} {name:>9}"))
        print(round_table(r + 1, repeat, {n: rounds[n][-1]["metrics"] for n in names}), flush=True)
    return rounds


def summarise(rounds: dict[str, list[dict]]) -> tuple[dict, dict, dict]:
    """(per-loader results from the round nearest each median, with the peak memory and the other processes' load
    of every round; their timelines; images/s per round)."""
    results, timelines, ips = {}, {}, {}
    for name, runs in rounds.items():
        ips[name] = [x["metrics"]["images_per_sec"] for x in runs]
        med = statistics.median(ips[name])
        typical = min(runs, key=lambda x: abs(x["metrics"]["images_per_sec"] - med))
        results[name] = {**typical["metrics"], "images_per_sec": med, "images_per_sec_rounds": spread(ips[name]),
                         "rss_peak_mb": max(x["metrics"]["rss_peak_mb"] for x in runs),
                         "rss_peak_mb_rounds": [x["metrics"]["rss_peak_mb"] for x in runs],
                         "other_load_cores_rounds": [x["metrics"].get("other_load_cores") for x in runs]}
        timelines[name] = typical["timeline"]
    return results, timelines, ips


def finish(report: dict, out: Path) -> dict:
    """Print the summary, then write benchmark.json and benchmark.png into `out` (each whole or not at all)."""
    print(table(report))
    try:
        out.mkdir(parents=True, exist_ok=True)
        for left in (".benchmark.json.tmp-*", ".benchmark.png.tmp-*"):  # left by a run killed while writing
            remove_dead_temps(out, left)
        write_atomic(out / "benchmark.json", json.dumps(report, indent=1))
        plot(report, out / "benchmark.png")
    except OSError as e:
        raise OutputError(f"the benchmark ran, but its results could not be written to {out} ({e.strerror or e}); "
                          "free space there or pass another --output") from None
    print(f"benchmark: wrote {out / 'benchmark.json'} and {out / 'benchmark.png'}")
    return report


# -- your own module --------------------------------------------------------------------------------
def benchmark(module, datamodule, *, loaders: str = "dali,baseline,synthetic", steps: int | None = None,
              warmup: int | None = None, repeat: int | None = None, precision: str = "auto", cpus: int | None = None,
              output=None, **trainer_kwargs) -> dict:
    """Why is MY GPU idle? Your LightningModule fed by DALI, the classic DataLoader and synthetic data,
    side by side, as `train.py --benchmark` does for the built-in classifier.

        report = dali_pipe.benchmark(MyModule(num_classes=len(dm.classes)), dm, steps=50, repeat=3)

    `module`: a LightningModule (each loader trains a fresh copy of it, from the same weights) or a
    function returning one. `datamodule`: a dali_pipe.DaliDataModule (its training split, batch size,
    image spec and device; its trainer-less device "auto" means the GPU when CUDA is there). `loaders`:
    a comma-separated subset of dali, baseline, synthetic. Each loader runs `warmup` untimed and `steps`
    timed steps of your `training_step` in a Trainer (one device, `precision` as the CLI resolves it,
    `trainer_kwargs` passed on); `repeat` rounds alternate their order. Those not given are chosen for the
    machine as `train.py --benchmark` chooses them for a model (benchplan.machine_defaults: 10 + 50 steps and
    3 rounds on a GPU, 2 + 6 steps and 2 rounds on the CPU), said in one line. `cpus` pins this process to that
    many cores for the run (restored after). `output` (default: the DataModule's output) gets
    benchmark.json and benchmark.png. Prints one line per loader, a table per round and the summary
    (images/s, step times, data wait, CPU/GPU utilization, the ratios, each loader's time budget and
    verdicts); returns the report as a dict.
    """
    import torch

    names = [n for n in loaders.split(",") if n]
    bad = [n for n in names if n not in LOADERS or n == "packed"]
    if bad or not names:
        raise UsageError(f"loaders: {loaders!r}: choose from dali, baseline, synthetic")
    factory = (lambda: copy.deepcopy(module)) if isinstance(module, pl.LightningModule) else module
    dm = datamodule
    dm.prepare_data()
    dm.setup_manifest(1)
    train = dm.manifest.train
    if isinstance(train, Shards) and "baseline" in names:
        raise UsageError("loaders: the classic baseline reads image files, and the DataModule reads shards (a pack, "
                         "WebDataset shards or a Hugging Face table); leave baseline out")
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cores = pin_cpus(cpus)
    try:
        torch.set_num_threads(len(cores))
        device_name = dm.device
        gpu = device_name == "gpu"
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        precision = resolve_precision(precision, device_name)
        batch = dm.data.batch_size
        defaults = machine_defaults(gpu=gpu, model=True, memory=memory_gib())  # (the batch is the DataModule's)
        chosen = {k: defaults[k] for k, v in (("steps", steps), ("warmup", warmup), ("repeat", repeat)) if v is None}
        steps, warmup, repeat = (chosen.get("steps", steps), chosen.get("warmup", warmup),
                                 chosen.get("repeat", repeat))
        if chosen:
            print(f"benchmark: chose {', '.join(f'{k}={v}' for k, v in chosen.items())} for this machine "
                  f"({'a GPU' if gpu else 'no GPU'}, {len(cores)} core(s)); pass them to choose", flush=True)

        def build(name):
            if name == "dali":
                return dm.loader(train, training=True)
            if name == "baseline":
                return classic_loader([x.path for x in train], [x.label for x in train], dm.spec, batch_size=batch,
                                      workers=len(cores), pin_memory=gpu, seed=dm.data.seed)
            return Synthetic(batch, dm.spec, len(dm.classes), device)

        def make_trainer(callbacks, max_steps):
            from pytorch_lightning.loggers.logger import DummyLogger

            kw = dict(accelerator="gpu" if gpu else "cpu", devices=1, precision=precision, max_steps=max_steps,
                      max_epochs=-1, logger=DummyLogger(), enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks)
            return pl.Trainer(**{**kw, **trainer_kwargs})

        def one(name, label):
            return measure(name, lambda: build(name), device=device, batch_size=batch, warmup=warmup, steps=steps,
                           cores=len(cores), classes=dm.classes, make_module=factory, make_trainer=make_trainer,
                           label=label)

        with quiet_lightning():
            rounds = run_rounds(names, one, repeat)
        results, timelines, ips = summarise(rounds)
        ratio = ratios(ips)
        model = (type(module).__name__ if isinstance(module, pl.LightningModule)
                 else getattr(module, "__name__", "model"))
        flagged = flags(results, ratio, cores=len(cores), model=True)
        report = {
            "env": environment(cores, gpu, dm.pipeline.num_threads or len(cores)),
            "config": {"model": model, "batch_size": batch, "steps": steps, "warmup": warmup, "repeat": repeat,
                       "precision": precision, "device": device_name, "images": len(train),
                       "image": [dm.spec.height, dm.spec.width], "data": str(dm.data.data)},
            "loaders": results, "ratios": ratio,
            "diagnosis": [d for n in names for d in results[n]["diagnosis"]] +
                         ratio_lines(ratio, cores=len(cores), model=True, disturbed=bool(flagged)),
            "flags": flagged,
            "timelines": timelines,
        }
        return finish(report, Path(output) if output is not None else dm.output)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)
