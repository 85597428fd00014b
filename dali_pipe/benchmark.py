"""Benchmark mode: DALI, the classic DataLoader and synthetic data side by side, in one run.

Same files, batch size, model and precision for every loader. Each loader gets `--warmup`
untimed steps, then `--steps` timed ones. A step is a real training step (forward, backward,
AdamW) unless `--model none`, which times the loaders alone (the loader ceiling). There is no
GPU sync inside the timed loop, so host and GPU overlap as in training; the clock stops after a
final `torch.cuda.synchronize()`. Writes OUT/benchmark.json, OUT/benchmark.png and prints a table.
"""
from __future__ import annotations

import gc
import json
import os
import platform
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from .monitor import Sampler, StepLog, diagnose


def pin_cpus(n: int | None) -> list[int]:
    """Pin this process (and the workers/threads it starts later) to its first n allowed cores."""
    cores = sorted(os.sched_getaffinity(0))
    if n:
        cores = cores[:n]
        os.sched_setaffinity(0, cores)
    return cores


def _endless(loader):
    while True:
        yield from loader


def _synthetic(batch: int, spec, classes: int, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, 3, spec.height, spec.width, generator=g).to(device)
    y = torch.randint(0, classes, (batch,), generator=g).to(device)
    while True:
        yield x, y


class _Step:
    """One training step of the model (or nothing, for --model none), on `device`."""

    def __init__(self, model_name: str | None, classes: list[str], device, precision: str, lr: float):
        import torch

        self.device = device
        self.model = None
        if model_name is None:
            return
        from model.vit import load_model

        torch.manual_seed(0)
        self.model = load_model(model_name, classes).to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=device.type == "cuda" or None)
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        self.autocast = torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

    def __call__(self, x, y):
        import torch.nn.functional as F

        if x.device != self.device:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        if self.model is None:
            return
        with self.autocast:
            loss = F.cross_entropy(self.model(pixel_values=x).logits.float(), y)
        if self.scaler:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def time_loader(batches, step: _Step, *, warmup: int, steps: int, sync) -> tuple[StepLog, float, float]:
    """Warm up, then time `steps` steps; returns the log and the timed window (t0, t1)."""
    it = iter(batches)
    for _ in range(warmup):
        step(*next(it))
    sync()
    log = StepLog()
    t0 = time.perf_counter()
    prev = t0
    for _ in range(steps):
        x, y = next(it)
        got = time.perf_counter()
        step(x, y)
        end = time.perf_counter()
        log.wait_s.append(got - prev)
        log.step_s.append(end - prev)
        prev = end
    sync()
    t1 = time.perf_counter()
    log.step_s[-1] += t1 - prev  # work still queued on the GPU belongs to the window
    return log, t0, t1


def run_benchmark(args) -> dict:
    import torch

    from model.vit import load_processor

    from .datamodule import prepare
    from .spec import ImageSpec

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    cores = pin_cpus(args.cpus)
    args.num_threads = threads = args.num_threads or len(cores)  # as many as the baseline's workers
    torch.set_num_threads(len(cores))
    loaders = args.loaders.split(",")
    gpu = args.device == "gpu"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    model_name = None if args.model == "none" else args.model

    from train import data_config  # one place maps flags to the data settings

    cfg = data_config(args)
    manifest = prepare(cfg)
    samples = manifest.train + manifest.val
    files, labels = [s.path for s in samples], [s.label for s in samples]
    spec = ImageSpec.from_processor(load_processor(model_name or "vit-b16-random"))
    step = _Step(model_name, manifest.classes, device, args.precision, args.lr)
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    results = {}
    timelines = {}
    for name in loaders:
        print(f"benchmark: {name} ({args.warmup} warm-up + {args.steps} timed steps, batch {args.batch_size}, "
              f"{len(cores)} core(s))", flush=True)
        batches = _make_loader(name, files, labels, spec, args, threads, len(cores), device)
        sampler = Sampler(20.0, 0 if gpu else None).start()
        try:
            log, t0, t1 = time_loader(batches, step, warmup=args.warmup, steps=args.steps, sync=sync)
        finally:
            sampler.stop()
        m = {**log.summary(args.batch_size), **sampler.window(t0, t1), "stalls": log.stalls()}  # steps sum to t1 - t0
        timelines[name] = {"gpu": m.pop("gpu_timeline"), "wait_ms": [w * 1e3 for w in log.wait_s]}
        m["diagnosis"] = diagnose(name, m, cores=len(cores), model=model_name is not None)
        if name == "synthetic" and model_name is not None and m["data_wait_fraction"] < 0.10:
            m["diagnosis"][0] = m["diagnosis"][0].replace(f"{name}: ", f"{name}: the model's own ceiling; ", 1)
        m["gpu_note"] = sampler.gpu_note
        results[name] = m
        del batches
        gc.collect()

    ratios = {f"{a}_vs_{b}": results[a]["images_per_sec"] / results[b]["images_per_sec"]
              for a, b in (("dali", "baseline"), ("dali", "synthetic"), ("baseline", "synthetic"))
              if a in results and b in results}
    diagnosis = [line for name in loaders for line in results[name]["diagnosis"]]
    if "dali_vs_baseline" in ratios:
        diagnosis.append(f"dali delivers {ratios['dali_vs_baseline']:.2f}x the images/s of the classic DataLoader "
                         f"on {len(cores)} core(s).")
    if "dali_vs_synthetic" in ratios and model_name is not None:
        diagnosis.append(f"dali reaches {ratios['dali_vs_synthetic']:.0%} of the synthetic-data ceiling.")

    report = {
        "env": _env(cores, gpu, threads),
        "config": {"model": args.model, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                   "precision": args.precision, "device": args.device, "images": len(files),
                   "image": [spec.height, spec.width], "data": str(args.data)},
        "loaders": results,
        "ratios": ratios,
        "diagnosis": diagnosis,
        "timelines": timelines,
    }
    (out / "benchmark.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "benchmark.png")
    print(table(report))
    print(f"benchmark: wrote {out / 'benchmark.json'} and {out / 'benchmark.png'}")
    return report


def _make_loader(name, files, labels, spec, args, threads: int, cores: int, device):
    if name == "dali":
        from .loader import DaliLoader
        from .pipeline import PipelineOptions, build_pipeline

        opts = PipelineOptions(batch_size=args.batch_size, device=args.device,
                               device_id=0 if args.device == "gpu" else None, num_threads=threads, seed=args.seed)
        return _endless(DaliLoader(build_pipeline(files, labels, spec, opts, training=True), training=True))
    if name == "baseline":
        from .baseline import classic_loader

        return _endless(classic_loader(files, labels, spec, batch_size=args.batch_size, workers=cores,
                                       pin_memory=device.type == "cuda", seed=args.seed))
    return _synthetic(args.batch_size, spec, max(labels) + 1, device)


def _env(cores, gpu: bool, threads: int) -> dict:
    import importlib

    import torch

    def version(mod):
        try:
            return importlib.import_module(mod).__version__
        except Exception:
            return None

    return {"cpus": len(cores), "cores": cores, "dali_threads": threads, "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name(0) if gpu else None, "torch": torch.__version__,
            "dali": version("nvidia.dali"),
            "lightning": version("pytorch_lightning"), "transformers": version("transformers"),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def table(report: dict) -> str:
    cols = ["images_per_sec", "step_ms_p50", "step_ms_p95", "data_wait_fraction", "cpu_util_mean",
            "gpu_util_mean", "gpu_util_p5", "gpu_mem_peak_mb", "rss_peak_mb"]
    head = ["loader", "img/s", "p50 ms", "p95 ms", "wait", "cpu %", "gpu %", "gpu p5", "gpu MB", "rss MB"]

    def fmt(k, v):
        if v is None:
            return "-"
        if k == "data_wait_fraction":
            return f"{v:.1%}"
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"

    rows = [head] + [[n] + [fmt(k, m.get(k)) for k in cols] for n, m in report["loaders"].items()]
    width = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, width)) for r in rows]
    lines += [f"ratio {k}: {v:.2f}x" for k, v in report["ratios"].items()]
    lines += [f"- {d}" for d in report["diagnosis"]]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["loaders"])
    gpu = report["env"]["gpu"] is not None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for n in names:
        tl = report["timelines"][n]
        if gpu and tl["gpu"]:
            t, u = zip(*tl["gpu"])
            ax1.plot(t, u, label=f"{n} (mean {report['loaders'][n]['gpu_util_mean']:.0f}%)", lw=1.4)
        else:
            ax1.plot(range(1, len(tl["wait_ms"]) + 1), tl["wait_ms"],
                     label=f"{n} (wait {report['loaders'][n]['data_wait_fraction']:.0%})", lw=1.4)
    if gpu:
        ax1.set(xlabel="seconds into the timed window", ylabel="GPU utilization %", ylim=(0, 105),
                title="GPU utilization over time (NVML, 20 Hz)")
    else:
        ax1.set(xlabel="timed step", ylabel="ms blocked waiting for the batch", title="Data-wait per step (no GPU)")
    ax1.legend(loc="best", fontsize=9)
    ax1.grid(alpha=0.3)
    ips = [report["loaders"][n]["images_per_sec"] for n in names]
    bars = ax2.bar(names, ips, color=["#76b900" if n == "dali" else "#888888" if n == "baseline" else "#4a90d9"
                                      for n in names])
    for b, v in zip(bars, ips):
        ax2.annotate(f"{v:.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    r = report["ratios"].get("dali_vs_baseline")
    ax2.set(ylabel="images / s", title="Throughput" + (f" (dali = {r:.2f}x baseline)" if r else ""))
    ax2.grid(axis="y", alpha=0.3)
    cfg = report["config"]
    fig.suptitle(f"model {cfg['model']}, batch {cfg['batch_size']}, {report['env']['cpus']} CPU core(s), "
                 f"{report['env']['gpu'] or 'no GPU'}", fontsize=11)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
