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


def run(s: Settings) -> dict:
    import pytorch_lightning as pl
    import torch

    from model.loading import load_processor

    from ..baseline import classic_loader
    from ..datamodule import DaliDataModule
    from ..spec import ImageSpec
    from .fit import make_trainer, quiet_known_noise

    quiet_known_noise()
    out = Path(s.run.output)
    out.mkdir(parents=True, exist_ok=True)
    cores = pin_cpus(s.bench.cpus)
    threads = s.pipeline.num_threads or len(cores)  # as many DALI threads as the baseline has workers
    torch.set_num_threads(len(cores))
    gpu = s.pipeline.device == "gpu"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    model_name = None if s.model.model == "none" else s.model.model
    spec = ImageSpec.from_processor(load_processor(model_name or VIT_B16_RANDOM))
    pipeline = dataclasses.replace(s.pipeline, num_threads=threads)
    dm = DaliDataModule(s.data, pipeline, spec, out)
    dm.prepare_data()  # sync s3:// data, scan, report
    dm.setup_manifest()  # refuses a batch larger than the training split
    train, classes = dm.manifest.train, dm.manifest.classes
    names = s.bench.loaders.split(",")
    if isinstance(train, Shards) and "baseline" in names:
        raise UsageError("invalid arguments:\n  --loaders: the classic baseline reads image files, and --data is a "
                         "pack; pass the raw dataset as --data and the pack as --packed")
    files = [x.path for x in train] if not isinstance(train, Shards) else []
    labels = [x.label for x in train] if not isinstance(train, Shards) else []
    batch, warmup, steps = s.data.batch_size, s.bench.warmup, s.bench.steps
    packed_dm = None
    if "packed" in names:
        packed_dm = DaliDataModule(dataclasses.replace(s.data, data=s.bench.packed), pipeline, spec, out / "packed")
        packed_dm.prepare_data()
        packed_dm.setup_manifest()

    def loader(name: str):
        if name == "dali":
            return dm.loader(train, training=True)
        if name == "packed":
            return packed_dm.loader(packed_dm.manifest.train, training=True)
        if name == "baseline":
            return classic_loader(files, labels, spec, batch_size=batch, workers=len(cores), pin_memory=gpu,
                                  seed=s.data.seed)
        return Synthetic(batch, spec, len(classes), device)

    def measure(name: str) -> dict:
        data = loader(name)
        if model_name is None:
            sampler = Sampler(20.0, 0 if gpu else None).start()
            try:
                log, t0, t1 = time_loader(endless(data), device, warmup=warmup, steps=steps)
            finally:
                sampler.stop()
            m = {**log.summary(batch), **sampler.window(t0, t1), "stalls": log.stalls(), "gpu_note": sampler.gpu_note}
            timeline, wait = m.pop("gpu_timeline"), log.wait_s
            m["diagnosis"] = diagnose(name, m, cores=len(cores), model=False)
        else:
            from model.module import ImageClassifier

            pl.seed_everything(s.data.seed, verbose=False)
            timer = MonitorCallback(skip_steps=warmup, sync_window=True, name=name, verbose=False)
            trainer = make_trainer(s, [timer], logger=False, devices=1, num_nodes=1, strategy="auto",
                                   max_steps=warmup + steps, max_epochs=-1, limit_val_batches=0,
                                   num_sanity_val_steps=0, enable_progress_bar=False)
            trainer.fit(ImageClassifier(s.model, seed=s.data.seed, classes=classes), train_dataloaders=data)
            m = {**timer.report, "gpu_note": timer.sampler.gpu_note}
            timeline, wait = timer.timeline, timer.steps.wait_s
            if name == "synthetic" and m["data_wait_fraction"] < 0.10:
                m["diagnosis"][0] = m["diagnosis"][0].replace(f"{name}: ", f"{name}: the model's own ceiling; ", 1)
            del trainer
        del data
        _release_gpu_memory(gpu)
        return {"metrics": m, "timeline": {"gpu": timeline, "wait_ms": [w * 1e3 for w in wait]}}

    rounds: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(s.bench.repeat):
        for name in names if r % 2 == 0 else names[::-1]:
            print(f"benchmark: round {r + 1}/{s.bench.repeat}, {name} ({warmup} warm-up + {steps} timed steps, "
                  f"batch {batch}, {len(cores)} core(s))", flush=True)
            rounds[name].append(measure(name))

    results, timelines, ips = {}, {}, {}
    for name, runs in rounds.items():
        ips[name] = [x["metrics"]["images_per_sec"] for x in runs]
        med = statistics.median(ips[name])
        typical = min(runs, key=lambda x: abs(x["metrics"]["images_per_sec"] - med))  # the round nearest the median
        results[name] = {**typical["metrics"], "images_per_sec": med, "images_per_sec_rounds": spread(ips[name])}
        timelines[name] = typical["timeline"]
    ratio = ratios(ips)
    diagnosis = [line for name in names for line in results[name]["diagnosis"]]
    if "dali_vs_baseline" in ratio:
        diagnosis.append(f"dali delivers {ratio['dali_vs_baseline']['median']:.2f}x the images/s of the classic "
                         f"DataLoader on {len(cores)} core(s).")
    if "dali_vs_synthetic" in ratio and model_name is not None:
        diagnosis.append(f"dali reaches {ratio['dali_vs_synthetic']['median']:.0%} of the synthetic-data ceiling.")
    if "packed_vs_dali" in ratio:
        diagnosis.append(f"the packed loader delivers {ratio['packed_vs_dali']['median']:.2f}x the images/s of the "
                         f"dali loader ({s.bench.packed} against {s.data.data}).")
    bound = any(results[n]["diagnosis"][0].startswith(f"{n}: input-bound") for n in ("dali", "baseline")
                if n in results)
    if bound and files:
        from ..prescribe import prescription

        advice = prescription(dm.manifest, spec, pipeline, batch_size=batch, cores=len(cores))
        if advice:
            diagnosis.append(advice)

    report = {
        "env": environment(cores, gpu, threads),
        "config": {"model": s.model.model, "batch_size": batch, "steps": steps, "warmup": warmup,
                   "repeat": s.bench.repeat, "precision": s.model.precision, "device": s.pipeline.device,
                   "images": len(files), "image": [spec.height, spec.width], "data": str(s.data.data)},
        "loaders": results,
        "ratios": ratio,
        "diagnosis": diagnosis,
        "timelines": timelines,
    }
    (out / "benchmark.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "benchmark.png")
    print(table(report))
    print(f"benchmark: wrote {out / 'benchmark.json'} and {out / 'benchmark.png'}")
    return report
