"""Benchmark mode: DALI, the classic DataLoader and synthetic data side by side, in one run.

Same files (the training split), batch size, model and precision for every loader. With a model,
each loader feeds the real training step: the LightningModule run by the same Trainer setup as
training (same AdamW, precision plugin and loss), timed by `MonitorCallback` after `--warmup`
untimed steps; `--model none` times the loaders alone. `--repeat N` runs N rounds, alternating the
loaders' order, and reports the median and min-max of each loader and of each ratio (ratios are
taken within a round). Writes OUT/benchmark.json, OUT/benchmark.png and prints a table.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import statistics
from pathlib import Path

from ..benchmark import Synthetic, endless, environment, pin_cpus, plot, ratios, spread, table, time_loader
from ..config import VIT_B16_RANDOM, Settings, UsageError
from ..monitor import MonitorCallback, Sampler, diagnose
from ..pipeline import Shards


def _release_gpu_memory(gpu: bool) -> None:
    """Return the memory of the loader just measured, so the next one starts with the same pool:
    DALI's memory pool outlives its pipelines, torch's caching allocator its tensors."""
    gc.collect()
    if gpu:
        import torch
        from nvidia.dali.backend import ReleaseUnusedMemory

        ReleaseUnusedMemory()
        torch.cuda.empty_cache()


class Bench:
    """One benchmark run's fixed parts: pinned cores, the data (and its pack), the image spec, and how
    to build and time each loader."""

    def __init__(self, s: Settings):
        import torch

        from model.loading import load_processor

        from ..datamodule import DaliDataModule
        from ..spec import ImageSpec

        self.s, self.out = s, Path(s.run.output)
        self.out.mkdir(parents=True, exist_ok=True)
        self.cores = pin_cpus(s.bench.cpus)
        self.threads = s.pipeline.num_threads or len(self.cores)  # as many DALI threads as the baseline's workers
        torch.set_num_threads(len(self.cores))
        self.gpu = s.pipeline.device == "gpu"
        self.device = torch.device("cuda", 0) if self.gpu else torch.device("cpu")
        self.model = None if s.model.model == "none" else s.model.model
        self.spec = ImageSpec.from_processor(load_processor(self.model or VIT_B16_RANDOM))
        self.pipeline = dataclasses.replace(s.pipeline, num_threads=self.threads)
        self.names = s.bench.loaders.split(",")
        self.dm = DaliDataModule(s.data, self.pipeline, self.spec, self.out)
        self.dm.prepare_data()  # sync s3:// data, scan, report
        self.dm.setup_manifest()  # refuses a batch larger than the training split
        self.train = self.dm.manifest.train
        if isinstance(self.train, Shards) and "baseline" in self.names:
            raise UsageError("invalid arguments:\n  --loaders: the classic baseline reads image files, and --data is "
                             "a pack; pass the raw dataset as --data and the pack as --packed")
        self.packed = None
        if "packed" in self.names:
            self.packed = DaliDataModule(dataclasses.replace(s.data, data=s.bench.packed), self.pipeline, self.spec,
                                         self.out / "packed")
            self.packed.prepare_data()
            self.packed.setup_manifest()

    def loader(self, name: str):
        if name == "dali":
            return self.dm.loader(self.train, training=True)
        if name == "packed":
            return self.packed.loader(self.packed.manifest.train, training=True)
        if name == "baseline":
            from ..baseline import classic_loader

            return classic_loader([x.path for x in self.train], [x.label for x in self.train], self.spec,
                                  batch_size=self.s.data.batch_size, workers=len(self.cores), pin_memory=self.gpu,
                                  seed=self.s.data.seed)
        return Synthetic(self.s.data.batch_size, self.spec, len(self.dm.manifest.classes), self.device)

    def measure(self, name: str) -> dict:
        """One timed run of one loader: its metrics and timelines."""
        data = self.loader(name)
        batch, warmup, steps = self.s.data.batch_size, self.s.bench.warmup, self.s.bench.steps
        if self.model is None:
            sampler = Sampler(20.0, 0 if self.gpu else None).start()
            try:
                log, t0, t1 = time_loader(endless(data), self.device, warmup=warmup, steps=steps)
            finally:
                sampler.stop()
            m = {**log.summary(batch), **sampler.window(t0, t1), "stalls": log.stalls(), "gpu_note": sampler.gpu_note}
            timeline, wait = m.pop("gpu_timeline"), log.wait_s
            m["diagnosis"] = diagnose(name, m, cores=len(self.cores), model=False)
        else:
            m, timeline, wait = self._train_steps(name, data)
        del data
        _release_gpu_memory(self.gpu)
        return {"metrics": m, "timeline": {"gpu": timeline, "wait_ms": [w * 1e3 for w in wait]}}

    def _train_steps(self, name: str, data):
        """The LightningModule's own training step, run by the training Trainer setup, timed."""
        import pytorch_lightning as pl

        from model.module import ImageClassifier

        from .fit import make_trainer

        s = self.s
        pl.seed_everything(s.data.seed, verbose=False)
        timer = MonitorCallback(skip_steps=s.bench.warmup, sync_window=True, name=name, verbose=False)
        trainer = make_trainer(s, [timer], logger=False, devices=1, num_nodes=1, strategy="auto",
                               max_steps=s.bench.warmup + s.bench.steps, max_epochs=-1, limit_val_batches=0,
                               num_sanity_val_steps=0, enable_progress_bar=False)
        trainer.fit(ImageClassifier(s.model, seed=s.data.seed, classes=self.dm.manifest.classes),
                    train_dataloaders=data)
        m = {**timer.report, "gpu_note": timer.sampler.gpu_note}
        if name == "synthetic" and m["data_wait_fraction"] < 0.10:
            m["diagnosis"][0] = m["diagnosis"][0].replace(f"{name}: ", f"{name}: the model's own ceiling; ", 1)
        return m, timer.timeline, timer.steps.wait_s


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


def verdicts(b: Bench, results: dict, ratio: dict) -> list[str]:
    """Each loader's diagnosis, the ratios in words, and the packing prescription when it applies."""
    cores = len(b.cores)
    lines = [line for name in b.names for line in results[name]["diagnosis"]]
    if "dali_vs_baseline" in ratio:
        lines.append(f"dali delivers {ratio['dali_vs_baseline']['median']:.2f}x the images/s of the classic "
                     f"DataLoader on {cores} core(s).")
    if "dali_vs_synthetic" in ratio and b.model is not None:
        lines.append(f"dali reaches {ratio['dali_vs_synthetic']['median']:.0%} of the synthetic-data ceiling.")
    if "packed_vs_dali" in ratio:
        lines.append(f"the packed loader delivers {ratio['packed_vs_dali']['median']:.2f}x the images/s of the "
                     f"dali loader ({b.s.bench.packed} against {b.s.data.data}).")
    bound = any(results[n]["diagnosis"][0].startswith(f"{n}: input-bound") for n in ("dali", "baseline")
                if n in results)
    if bound and not isinstance(b.train, Shards):
        from ..prescribe import prescription

        advice = prescription(b.dm.manifest, b.spec, b.pipeline, batch_size=b.s.data.batch_size, cores=cores)
        if advice:
            lines.append(advice)
    return lines


def run(s: Settings) -> dict:
    from .fit import quiet_known_noise

    quiet_known_noise()
    b = Bench(s)
    rounds: dict[str, list[dict]] = {n: [] for n in b.names}
    for r in range(s.bench.repeat):
        for name in b.names if r % 2 == 0 else b.names[::-1]:
            print(f"benchmark: round {r + 1}/{s.bench.repeat}, {name} ({s.bench.warmup} warm-up + {s.bench.steps} "
                  f"timed steps, batch {s.data.batch_size}, {len(b.cores)} core(s))", flush=True)
            rounds[name].append(b.measure(name))
    results, timelines, ips = summarise(rounds)
    ratio = ratios(ips)
    report = {
        "env": environment(b.cores, b.gpu, b.threads),
        "config": {"model": s.model.model, "batch_size": s.data.batch_size, "steps": s.bench.steps,
                   "warmup": s.bench.warmup, "repeat": s.bench.repeat, "precision": s.model.precision,
                   "device": s.pipeline.device, "images": len(b.train), "image": [b.spec.height, b.spec.width],
                   "data": str(s.data.data)},
        "loaders": results,
        "ratios": ratio,
        "diagnosis": verdicts(b, results, ratio),
        "timelines": timelines,
    }
    (b.out / "benchmark.json").write_text(json.dumps(report, indent=1))
    plot(report, b.out / "benchmark.png")
    print(table(report))
    print(f"benchmark: wrote {b.out / 'benchmark.json'} and {b.out / 'benchmark.png'}")
    return report
