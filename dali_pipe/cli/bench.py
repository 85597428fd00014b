"""Benchmark mode (`train.py --benchmark`): DALI, the classic DataLoader and synthetic data side by
side, in one run, for the built-in classifier and the settings of a training run.

Same files (the training split), batch size, model and precision for every loader. With a model,
each loader feeds the real training step: the LightningModule run by the same Trainer setup as
training (same AdamW, precision plugin and loss), timed by `MonitorCallback` after `--warmup`
untimed steps; `--model none` times the loaders alone (and leaves synthetic out, with a note).
`--repeat N` runs N rounds, alternating the loaders' order, and reports the median and min-max of
each loader and of each ratio (ratios are taken within a round). The measuring, reporting and
plotting live in dali_pipe/benchrun.py, which `dali_pipe.benchmark()` shares.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

from model.loading import load_processor
from model.module import ImageClassifier

from ..baseline import classic_loader
from ..benchplan import check_duration, estimate, memory_gib, plan
from ..benchreport import flags, ratio_lines
from ..benchrun import (
    NO_MODEL_NOTE,
    SHARDS_NOTE,
    Synthetic,
    environment,
    finish,
    measure,
    pin_cpus,
    quiet_lightning,
    ratios,
    run_rounds,
    summarise,
)
from ..config import VIT_B16_RANDOM, Settings, UsageError, cores
from ..datamodule import DaliDataModule
from ..manifest import Manifest
from ..prescribe import prescription
from ..samples import Shards
from ..spec import ImageSpec
from .fit import make_trainer
from .noise import quiet_known_noise


class Bench:
    """One benchmark run's fixed parts: pinned cores, the data (and its pack), the image spec, and how
    to build and time each loader."""

    def __init__(self, s: Settings, manifest: Manifest | None = None):
        import torch

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
        self.notes = []
        if self.model is None and "synthetic" in self.names:
            self.names.remove("synthetic")
            self.notes.append(NO_MODEL_NOTE)
            if not self.names:
                raise UsageError("invalid arguments:\n  --loaders: 'synthetic' alone needs a model (--model NAME); "
                                 "with --model none there is nothing for it to be the ceiling of")
        self.dm = DaliDataModule(s.data, self.pipeline, self.spec, self.out, manifest=manifest)
        self.dm.prepare_data()  # sync s3:// data, scan, report
        self.dm.setup_manifest()  # refuses a batch larger than the training split
        self.train = self.dm.manifest.train
        if isinstance(self.train, Shards) and "baseline" in self.names:
            self.names.remove("baseline")
            self.notes.append(SHARDS_NOTE)
            if not self.names:
                raise UsageError("invalid arguments:\n  --loaders: the classic baseline reads image files, and --data "
                                 "holds shards; pass the image files as --data and their pack as --packed")
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
            return classic_loader([x.path for x in self.train], [x.label for x in self.train], self.spec,
                                  batch_size=self.s.data.batch_size, workers=len(self.cores), pin_memory=self.gpu,
                                  seed=self.s.data.seed)
        return Synthetic(self.s.data.batch_size, self.spec, len(self.dm.manifest.classes), self.device)

    def module(self):
        module = ImageClassifier(self.s.model, seed=self.s.data.seed, classes=self.dm.manifest.classes)
        module.metric_lines = False  # a report, not a training log
        return module

    def trainer(self, callbacks: list, max_steps: int):
        """Training's Trainer setup, on one device, without checkpoints, validation or progress bar; its
        logger takes the step's logging (as in training) and writes nothing."""
        from pytorch_lightning.loggers.logger import DummyLogger

        return make_trainer(self.s, callbacks, logger=DummyLogger(), devices=1, num_nodes=1, strategy="auto",
                            max_steps=max_steps, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0,
                            enable_progress_bar=False)

    def measure(self, name: str, label: str, *, warmup: int | None = None, steps: int | None = None) -> dict:
        """One timed run of one loader: its metrics and timelines."""
        s = self.s
        return measure(name, lambda: self.loader(name), device=self.device, batch_size=s.data.batch_size,
                       warmup=s.bench.warmup if warmup is None else warmup,
                       steps=s.bench.steps if steps is None else steps, cores=len(self.cores),
                       classes=self.dm.manifest.classes, make_module=self.module if self.model else None,
                       make_trainer=self.trainer if self.model else None, label=label)

    def probe(self) -> dict:
        """One warm-up and one timed step, of the model on synthetic data (a real loader's step is the model's and
        little more on the CPU) or, without a model, of the first loader: the estimate's measurements."""
        name = "synthetic" if self.model else self.names[0]
        return self.measure(name, f"probe ({name}, 1 warm-up + 1 timed step)", warmup=1, steps=1)["metrics"]


def verdicts(b: Bench, results: dict, ratio: dict, flagged: list[str]) -> list[str]:
    """Each loader's diagnosis, the ratios in words (a headline only where every round agrees and nothing was
    flagged), and the packing prescription when it applies."""
    cores = len(b.cores)
    lines = [line for name in b.names for line in results[name]["diagnosis"]]
    lines += ratio_lines(ratio, cores=cores, model=b.model is not None, packed=b.s.bench.packed, data=b.s.data.data,
                         disturbed=bool(flagged))
    bound = any(results[n]["diagnosis"][0].startswith(f"{n}: input-bound") for n in ("dali", "baseline")
                if n in results)
    if bound and not isinstance(b.train, Shards):
        advice = prescription(b.dm.manifest, b.spec, b.pipeline, batch_size=b.s.data.batch_size, cores=cores,
                              data=b.s.data.data)
        if advice:
            lines.append(advice)
    return lines + b.notes


def run(s: Settings, manifest: Manifest | None = None) -> dict:
    """The benchmark; `manifest`: the local dataset's, read already (cli.described)."""
    quiet_known_noise()
    began = time.perf_counter()
    s, planned = plan(s, gpu=s.pipeline.device == "gpu", available_cores=cores(), memory=memory_gib())
    for line in planned:
        print(f"benchmark: {line}", flush=True)
    b = Bench(s, manifest)
    print(f"benchmark: {', '.join(b.names)}; {s.bench.warmup} warm-up + {s.bench.steps} timed steps each, batch "
          f"{s.data.batch_size}, {len(b.cores)} core(s), {s.bench.repeat} round(s)" +
          "".join(f"\nbenchmark: {n}" for n in b.notes), flush=True)
    legs = len(b.names) * s.bench.repeat
    guess = None
    with quiet_lightning():
        if not b.gpu:  # on the CPU a long run is refused before it starts
            probe = b.probe()
            guess = estimate(probe, legs=legs, warmup=s.bench.warmup, steps=s.bench.steps, model=b.model is not None)
            print("benchmark: " + check_duration(guess, probe, legs=legs, batch=s.data.batch_size,
                                                 allow_long=s.bench.allow_long, gpu=b.gpu), flush=True)
        timed = time.perf_counter()
        rounds = run_rounds(b.names, b.measure, s.bench.repeat)
    results, timelines, ips = summarise(rounds)
    ratio = ratios(ips)
    flagged = flags(results, ratio, cores=len(b.cores), model=b.model is not None)
    report = {
        "env": environment(b.cores, b.gpu, b.threads),
        "config": {"model": s.model.model, "batch_size": s.data.batch_size, "steps": s.bench.steps,
                   "warmup": s.bench.warmup, "repeat": s.bench.repeat, "precision": s.model.precision,
                   "device": s.pipeline.device, "images": len(b.train), "image": [b.spec.height, b.spec.width],
                   "data": str(s.data.data), "chosen": planned, "estimate_s": guess,
                   "rounds_s": time.perf_counter() - timed, "took_s": time.perf_counter() - began},
        "loaders": results,
        "ratios": ratio,
        "diagnosis": verdicts(b, results, ratio, flagged),
        "flags": flagged,
        "notes": b.notes,
        "timelines": timelines,
    }
    if guess is not None:
        print(f"benchmark: the rounds took {report['config']['rounds_s'] / 60:.1f} min (estimated {guess / 60:.1f} min)")
    sys.stdout.flush()
    return finish(report, b.out)
