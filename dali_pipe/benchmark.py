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
import gc
import importlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import pytorch_lightning as pl

from .baseline import classic_loader
from .config import LOADERS, UsageError, resolve_precision
from .decoder import DecoderLog
from .monitor import MonitorCallback
from .prescribe import SHARE_WORDS, SHARES, budget_line, busy_cores, diagnose, time_budget
from .sampler import Sampler, StepLog
from .samples import Shards
from .workdir import OutputError, atomic, remove_dead_temps, write_atomic

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
    iterable without one a batch ahead (to see its end), and the fetch it times would be the next batch's."""

    def __init__(self, loader, length: int):
        self.loader, self.length = loader, length
        self.batch_size = getattr(loader, "batch_size", None)

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return endless(self.loader)


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


class Progress:
    """One line per loader: rewritten in place on a terminal, printed once when done in a log."""

    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total, self.stream = label, total, stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if self.tty and (now - self._last > 0.25 or done == self.total):
            self._last = now
            self.stream.write(f"\r{self.label}: step {done}/{self.total}")
            self.stream.flush()

    def done(self, result: str) -> None:
        line = f"{self.label}: {result}"
        self.stream.write(f"\r{line}\033[K\n" if self.tty else f"{line}\n")
        self.stream.flush()


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
    """Return the memory of the loader just measured, so the next one starts with the same pool:
    DALI's memory pool outlives its pipelines, torch's caching allocator its tensors."""
    gc.collect()
    if gpu:
        import torch
        from nvidia.dali.backend import ReleaseUnusedMemory

        ReleaseUnusedMemory()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def quiet_lightning():
    """Lightning's per-Trainer banners ("GPU available", "`Trainer.fit` stopped") are a training log's
    lines; the benchmark prints a report. Restored afterwards."""
    names = ("pytorch_lightning", "pytorch_lightning.utilities.rank_zero", "lightning_fabric",
             "pytorch_lightning.accelerators.cuda")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
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
    """One timed run of one loader (`build()` makes it): its metrics, time budget and timelines. With
    `make_module` and `make_trainer(callbacks, max_steps)` each step is the module's training step run by
    that Trainer; without, the loader alone."""
    progress = Progress(label or name, warmup + steps)
    origin = time.perf_counter()
    data = build()
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
        trainer.fit(make_module(), datamodule=_Feed(Cycle(data, warmup + steps), classes))
        m = {**timer.report, "gpu_note": timer.sampler.gpu_note}
        m["diagnosis"] = m["diagnosis"] + m.pop("budget_verdicts")
        if name == "synthetic" and m["data_wait_fraction"] < 0.10:
            m["diagnosis"][0] = m["diagnosis"][0].replace(f"{name}: ", f"{name}: the model's own ceiling; ", 1)
        timeline, wait = timer.timeline, timer.steps.wait_s
    m.pop("time_line", None)
    progress.done(f"{m['images_per_sec']:.1f} images/s, step p50 {m['step_ms_p50']:.1f} ms, data wait "
                  f"{m['data_wait_fraction']:.0%} ({m['time_budget']['wall_s']:.1f} s)")
    del data
    release_memory(device.type == "cuda")
    return {"metrics": m, "timeline": {"gpu": timeline, "wait_ms": [w * 1e3 for w in wait]}}


def run_rounds(names: list[str], measure_one, repeat: int) -> dict[str, list[dict]]:
    """`repeat` rounds, the loaders' order alternating; a table after each round."""
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(repeat):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            rounds[name].append(measure_one(name, f"round {r + 1}/{repeat} {name:>9}"))
        print(round_table(r + 1, repeat, {n: rounds[n][-1]["metrics"] for n in names}), flush=True)
    return rounds


def summarise(rounds: dict[str, list[dict]]) -> tuple[dict, dict, dict]:
    """(per-loader results from the round nearest each median, their timelines, images/s per round)."""
    results, timelines, ips = {}, {}, {}
    for name, runs in rounds.items():
        ips[name] = [x["metrics"]["images_per_sec"] for x in runs]
        med = statistics.median(ips[name])
        typical = min(runs, key=lambda x: abs(x["metrics"]["images_per_sec"] - med))
        results[name] = {**typical["metrics"], "images_per_sec": med, "images_per_sec_rounds": spread(ips[name])}
        timelines[name] = typical["timeline"]
    return results, timelines, ips


def ratio_lines(ratio: dict, *, cores: int, model: bool, packed: str | None = None,
                data: str | None = None) -> list[str]:
    lines = []
    if "dali_vs_baseline" in ratio:
        lines.append(f"dali delivers {ratio['dali_vs_baseline']['median']:.2f}x the images/s of the classic "
                     f"DataLoader on {cores} core(s).")
    if "dali_vs_synthetic" in ratio and model:
        r = ratio["dali_vs_synthetic"]
        if r["median"] > 1.1:  # a real loader cannot beat data that is already there: the ceiling run was disturbed
            lines.append(f"dali measured {r['median']:.2f}x faster than the synthetic-data ceiling, which a real "
                         "loader cannot be: the synthetic run was disturbed (other processes on the cores, or too "
                         "few --warmup steps for the model to settle); rerun on idle cores, or with more --warmup "
                         "and --steps.")
        else:
            lines.append(f"dali reaches {r['median']:.0%} ({r['min'] * 100:.0f}-{r['max']:.0%}) of the synthetic-data "
                         "ceiling.")
    if "packed_vs_dali" in ratio:
        r = ratio["packed_vs_dali"]
        lines.append(f"the packed loader delivers {r['median']:.2f}x the images/s of the dali loader ({packed} against "
                     f"{data}); the other way round, --data reaches {1 / r['median']:.2f}x "
                     f"({1 / r['max']:.2f}-{1 / r['min']:.2f}) of the pack.")
    return lines


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
def benchmark(module, datamodule, *, loaders: str = "dali,baseline,synthetic", steps: int = 50, warmup: int = 10,
              repeat: int = 1, precision: str = "auto", cpus: int | None = None, output=None, **trainer_kwargs) -> dict:
    """Why is MY GPU idle? Your LightningModule fed by DALI, the classic DataLoader and synthetic data,
    side by side, as `train.py --benchmark` does for the built-in classifier.

        report = dali_pipe.benchmark(MyModule(num_classes=len(dm.classes)), dm, steps=50, repeat=3)

    `module`: a LightningModule (each loader trains a fresh copy of it, from the same weights) or a
    function returning one. `datamodule`: a dali_pipe.DaliDataModule (its training split, batch size,
    image spec and device; its trainer-less device "auto" means the GPU when CUDA is there). `loaders`:
    a comma-separated subset of dali, baseline, synthetic. Each loader runs `warmup` untimed and `steps`
    timed steps of your `training_step` in a Trainer (one device, `precision` as the CLI resolves it,
    `trainer_kwargs` passed on); `repeat` rounds alternate their order. `cpus` pins this process to that
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
        raise UsageError("loaders: the classic baseline reads image files, and the DataModule reads a pack; leave "
                         "baseline out")
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cores = pin_cpus(cpus)
    try:
        torch.set_num_threads(len(cores))
        device_name = dm.device
        gpu = device_name == "gpu"
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        precision = resolve_precision(precision, device_name)
        batch = dm.data.batch_size

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
        report = {
            "env": environment(cores, gpu, dm.pipeline.num_threads or len(cores)),
            "config": {"model": model, "batch_size": batch, "steps": steps, "warmup": warmup, "repeat": repeat,
                       "precision": precision, "device": device_name, "images": len(train),
                       "image": [dm.spec.height, dm.spec.width], "data": str(dm.data.data)},
            "loaders": results, "ratios": ratio,
            "diagnosis": [d for n in names for d in results[n]["diagnosis"]] +
                         ratio_lines(ratio, cores=len(cores), model=True),
            "timelines": timelines,
        }
        return finish(report, Path(output) if output is not None else dm.output)
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


# -- printing and plotting ------------------------------------------------------------------------
def _fmt(k, v):
    if v is None:
        return "-"
    if k in ("data_wait_fraction",) or k.startswith("time_"):
        return f"{v:.0%}" if k.startswith("time_") else f"{v:.1%}"
    return f"{v:.1f}" if v < 100 else f"{v:.0f}"


def _grid(rows: list[list[str]]) -> list[str]:
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, width)) for r in rows]


SHORT = {"startup": "start-up", "data_wait": "data", "model_step": "model", "checkpoint_saves": "saves",
         "validation": "val", "callbacks": "other"}


def round_table(r: int, repeat: int, metrics: dict[str, dict]) -> str:
    """The loaders of one round: images/s, step times, data wait, utilization and their time budget."""
    head = ["loader", "img/s", "p50 ms", "p95 ms", "wait", "cpu %", "gpu %"] + [SHORT[k] for k in SHARES]
    rows = [head]
    for n, m in metrics.items():
        shares = (m.get("time_budget") or {}).get("shares", {})
        rows.append([n] + [_fmt(k, m.get(k)) for k in ("images_per_sec", "step_ms_p50", "step_ms_p95",
                                                        "data_wait_fraction", "cpu_util_mean", "gpu_util_mean")]
                    + [_fmt("time_" + k, shares.get(k)) for k in SHARES])
    words = ", ".join(f"{SHORT[k]} = {SHARE_WORDS[k]}" for k in SHARES if SHORT[k] != SHARE_WORDS[k])
    return "\n".join([f"round {r}/{repeat} (then each loader's time budget: {words}):"] + _grid(rows)) + "\n"


def table(report: dict) -> str:
    cols = ["images_per_sec", "step_ms_p50", "step_ms_p95", "data_wait_fraction", "cpu_util_mean",
            "gpu_util_mean", "gpu_util_p5", "gpu_mem_peak_mb", "rss_peak_mb"]
    head = ["loader", "img/s", "min-max", "p50 ms", "p95 ms", "wait", "cpu %", "gpu %", "gpu p5", "gpu MB", "rss MB"]
    rows = [head]
    for n, m in report["loaders"].items():
        r = m["images_per_sec_rounds"]
        rows.append([n, _fmt("", r["median"]), f"{r['min']:.0f}-{r['max']:.0f}"]
                    + [_fmt(k, m.get(k)) for k in cols[1:]])
    n = report["config"]["repeat"]
    lines = [f"summary over {n} round(s):"] + _grid(rows)
    lines += [f"ratio {k}: {v['median']:.2f}x (min {v['min']:.2f}, max {v['max']:.2f} over {n} round(s))"
              for k, v in report["ratios"].items()]
    lines += [f"{name} {budget_line(m['time_budget'])}" for name, m in report["loaders"].items()
              if m.get("time_budget")]
    lines += [f"- {d}" for d in report["diagnosis"]]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """benchmark.png: the figure of the report, written whole or not at all."""
    import matplotlib.pyplot as plt

    fig = figure(report)
    try:
        with atomic(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)


def figure(report: dict):
    """The report drawn: the timeline (GPU utilization, or the time per step), the throughput with its ratios,
    each loader's time budget, and any warning that makes its figures suspect (busy cores)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(report["loaders"])
    gpu = report["env"]["gpu"] is not None
    alone = report["config"]["model"] == "none"  # no model: every millisecond of a step is the loader's
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.5), gridspec_kw={"width_ratios": [2, 1, 1.2]})
    for n in names:
        tl = report["timelines"][n]
        if gpu and tl["gpu"]:
            t, u = zip(*tl["gpu"])
            ax1.plot(t, u, label=f"{n} (mean {report['loaders'][n]['gpu_util_mean']:.0f}%)", lw=1.4)
        else:
            wait = "" if alone else f" (wait {report['loaders'][n]['data_wait_fraction']:.0%})"
            ax1.plot(range(1, len(tl["wait_ms"]) + 1), tl["wait_ms"], label=n + wait, lw=1.4)
    if gpu:
        ax1.set(xlabel="seconds into the timed window", ylabel="GPU utilization %", ylim=(0, 105),
                title="GPU utilization over time (NVML, 20 Hz)")
    elif alone:
        ax1.set(xlabel="timed step", ylabel="ms per batch", title="Time per batch, loaders alone (no model, no GPU)")
    else:
        ax1.set(xlabel="timed step", ylabel="ms blocked waiting for the batch", title="Data-wait per step (no GPU)")
    if not gpu:
        ax1.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 2.5 or 7.5 on the axis
    ax1.legend(loc="best", fontsize=9)
    ax1.grid(alpha=0.3)
    rounds = [report["loaders"][n]["images_per_sec_rounds"] for n in names]
    med = [r["median"] for r in rounds]
    err = [[r["median"] - r["min"] for r in rounds], [r["max"] - r["median"] for r in rounds]]
    colors = [{"dali": "#76b900", "packed": "#3d6b00", "baseline": "#888888"}.get(n, "#4a90d9") for n in names]
    bars = ax2.bar(names, med, yerr=err, capsize=4, color=colors)
    ax2.set_ylim(0, 1.15 * max(r["max"] for r in rounds))  # room for the labels under the title
    for b, v in zip(bars, med):
        ax2.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                     xytext=(12, 2), textcoords="offset points")
    shown = [(k, v) for k, v in report["ratios"].items() if k in ("packed_vs_dali", "dali_vs_baseline")]
    ax2.set(ylabel="images / s (median, min-max bars)",
            title="Throughput" + "".join(f"\n{k.replace('_vs_', ' / ')} = {v['median']:.2f}x" for k, v in shown))
    ax2.grid(axis="y", alpha=0.3)
    budget_panel(ax3, {n: report["loaders"][n].get("time_budget") for n in names})
    cfg = report["config"]
    fig.suptitle(f"model {cfg['model']}, batch {cfg['batch_size']}, {report['env']['cpus']} CPU core(s), "
                 f"{report['env']['gpu'] or 'no GPU'}, {cfg['repeat']} round(s)", fontsize=11)
    warnings = [w for n in names for w in [busy_cores(n, report["loaders"][n], report["env"]["cpus"])] if w]
    fig.tight_layout(rect=(0, 0.06 * len(warnings), 1, 1))
    for i, w in enumerate(warnings):  # a figure seen without its log says that its figures are low, and why
        fig.text(0.01, 0.06 * (len(warnings) - i) - 0.045, "warning: " + w, color="#c9302c", fontsize=10)
    return fig


BUDGET_COLORS = {"startup": "#b0b0b0", "data_wait": "#d9534f", "model_step": "#76b900", "checkpoint_saves": "#f0ad4e",
                 "validation": "#4a90d9", "callbacks": "#9b59b6"}


def budget_panel(ax, budgets: dict[str, dict | None]) -> None:
    """One stacked bar per loader: where its run's wall time went, in the budget's six shares."""
    names = [n for n, b in budgets.items() if b]
    left = [0.0] * len(names)
    for k in SHARES:
        widths = [100 * budgets[n]["shares"][k] for n in names]
        ax.barh(names, widths, left=left, color=BUDGET_COLORS[k], label=SHARE_WORDS[k])
        for i, w in enumerate(widths):
            if w >= 8:
                ax.text(left[i] + w / 2, i, f"{w:.0f}%", ha="center", va="center", fontsize=8)
        left = [a + w for a, w in zip(left, widths)]
    ax.set(xlim=(0, 100), xlabel="% of the loader's run (wall time)", title="Where the time goes")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8, frameon=False)
