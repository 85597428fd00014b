"""The benchmark's measuring and reporting parts: CPU pinning, the loader-only timing loop,
synthetic batches, the summary over repeated rounds, the printed table and the plot.

The runner that composes loaders, model and Trainer is `dali_pipe/cli/bench.py`; with a model,
each timed step is the LightningModule's own training step run by the Trainer (same optimizer,
precision and loss as training), timed by `monitor.MonitorCallback`.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

from .monitor import StepLog


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


def time_loader(batches, device, *, warmup: int, steps: int) -> tuple[StepLog, float, float]:
    """Loaders alone (--model none): move each batch to the device, nothing else. Returns the log
    and the timed window (t0, t1), synchronised with the GPU at both ends only."""
    import torch

    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    it = iter(batches)
    for _ in range(warmup):
        x, y = next(it)
        x.to(device, non_blocking=True)
    sync()
    log = StepLog()
    t0 = prev = time.perf_counter()
    for _ in range(steps):
        x, y = next(it)
        got = time.perf_counter()
        x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        end = time.perf_counter()
        log.wait_s.append(got - prev)
        log.step_s.append(end - prev)
        prev = end
    sync()
    t1 = time.perf_counter()
    log.step_s[-1] += t1 - prev
    return log, t0, t1


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
    import importlib

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


def table(report: dict) -> str:
    cols = ["images_per_sec", "step_ms_p50", "step_ms_p95", "data_wait_fraction", "cpu_util_mean",
            "gpu_util_mean", "gpu_util_p5", "gpu_mem_peak_mb", "rss_peak_mb"]
    head = ["loader", "img/s", "min-max", "p50 ms", "p95 ms", "wait", "cpu %", "gpu %", "gpu p5", "gpu MB", "rss MB"]

    def fmt(k, v):
        if v is None:
            return "-"
        if k == "data_wait_fraction":
            return f"{v:.1%}"
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"

    rows = [head]
    for n, m in report["loaders"].items():
        r = m["images_per_sec_rounds"]
        rows.append([n, fmt("", r["median"]), f"{r['min']:.0f}-{r['max']:.0f}"]
                    + [fmt(k, m.get(k)) for k in cols[1:]])
    width = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, width)) for r in rows]
    n = report["config"]["repeat"]
    lines += [f"ratio {k}: {v['median']:.2f}x (min {v['min']:.2f}, max {v['max']:.2f} over {n} round(s))"
              for k, v in report["ratios"].items()]
    lines += [f"- {d}" for d in report["diagnosis"]]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["loaders"])
    gpu = report["env"]["gpu"] is not None
    alone = report["config"]["model"] == "none"  # no model: every millisecond of a step is the loader's
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
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
    ax1.legend(loc="best", fontsize=9)
    ax1.grid(alpha=0.3)
    rounds = [report["loaders"][n]["images_per_sec_rounds"] for n in names]
    med = [r["median"] for r in rounds]
    err = [[r["median"] - r["min"] for r in rounds], [r["max"] - r["median"] for r in rounds]]
    colors = [{"dali": "#76b900", "packed": "#3d6b00", "baseline": "#888888"}.get(n, "#4a90d9") for n in names]
    bars = ax2.bar(names, med, yerr=err, capsize=4, color=colors)
    for b, v in zip(bars, med):
        ax2.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                     xytext=(12, 2), textcoords="offset points")
    shown = [(k, v) for k, v in report["ratios"].items() if k in ("packed_vs_dali", "dali_vs_baseline")]
    ax2.set(ylabel="images / s (median, min-max bars)",
            title="Throughput" + "".join(f"\n{k.replace('_vs_', ' / ')} = {v['median']:.2f}x" for k, v in shown))
    ax2.grid(axis="y", alpha=0.3)
    cfg = report["config"]
    fig.suptitle(f"model {cfg['model']}, batch {cfg['batch_size']}, {report['env']['cpus']} CPU core(s), "
                 f"{report['env']['gpu'] or 'no GPU'}, {cfg['repeat']} round(s)", fontsize=11)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
