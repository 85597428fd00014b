"""The benchmark's plan, before anything is timed: the defaults of --batch-size, --steps, --warmup, --repeat and
--cpus chosen from the machine (its cores, its memory, a GPU or not) where they were not given, said in one line;
and the run's duration estimated from a short probe (a warm-up step and a timed one), refused on the CPU above
LONG_RUN seconds unless --allow-long.

Why these defaults: on a GPU the training defaults (batch 32) and 10 + 50 steps over 3 rounds take a few minutes.
On the CPU a model's step is slow (ViT-B/16 at batch 8 on 2 cores: 4.5-5 s) and its activations are large
(about 130 MB per image for ViT-B/16 in fp32, beside 1.4 GB of weights, gradients and AdamW state), so the batch
follows the memory (CPU_BATCH) and 2 warm-up + 6 timed steps over 2 rounds keep the default ViT-B/16 run near 5
minutes; 2 rounds are the fewest that can agree (benchreport.disagreement). Loaders alone (--model none) are fast:
batch 32, 5 + 30 steps, 3 rounds.
"""
from __future__ import annotations

import dataclasses

from .config import Settings, UsageError

LONG_RUN = 600.0  # seconds: a CPU run estimated longer is refused unless --allow-long
CPU_BATCH = ((16.0, 8), (8.0, 4), (0.0, 2))  # (GiB of memory at least, the batch of a model's step on the CPU)
GPU_DEFAULTS = {"batch_size": 32, "steps": 50, "warmup": 10, "repeat": 3}
CPU_DEFAULTS = {"steps": 6, "warmup": 2, "repeat": 2}  # the batch from CPU_BATCH
ALONE_DEFAULTS = {"batch_size": 32, "steps": 30, "warmup": 5, "repeat": 3}  # --model none, on any device
LOADER_FACTOR = 1.1  # a real loader's step against the probe's synthetic one, on the same cores (measured once: 1.10 dali, 1.13 classic)
PLANNED = ("batch_size", "steps", "warmup", "repeat")


def memory_gib() -> float:
    """The machine's memory in GiB (psutil; what a run can hope to use)."""
    import psutil

    return psutil.virtual_memory().total / 2**30


def machine_defaults(*, gpu: bool, model: bool, memory: float) -> dict[str, int]:
    """The benchmark's defaults for this machine: a GPU's, the CPU's with a model, or the loaders' alone."""
    if not model:
        return dict(ALONE_DEFAULTS)
    if gpu:
        return dict(GPU_DEFAULTS)
    batch = next(b for gib, b in CPU_BATCH if memory >= gib)
    return {"batch_size": batch, **CPU_DEFAULTS}


def plan(s: Settings, *, gpu: bool, available_cores: int, memory: float) -> tuple[Settings, list[str]]:
    """`s` with the benchmark's settings that were not given chosen for this machine, --cpus clamped to the cores
    this process may use; and the lines that say so."""
    model = s.model.model != "none"
    chosen = {k: v for k, v in machine_defaults(gpu=gpu, model=model, memory=memory).items() if k not in s.given}
    data = dataclasses.replace(s.data, batch_size=chosen.get("batch_size", s.data.batch_size))
    bench = dataclasses.replace(s.bench, **{k: v for k, v in chosen.items() if k != "batch_size"})
    lines = []
    if bench.cpus is not None and bench.cpus > available_cores:
        lines.append(f"--cpus {bench.cpus} is more than the {available_cores} core(s) this process may use; "
                     f"using {available_cores}")
        bench.cpus = available_cores
    if chosen:
        what = ("a GPU" if gpu else "no GPU") + f", {available_cores} core(s), {memory:.0f} GiB of memory"
        why = ("loaders alone are fast" if not model else "a GPU step is fast" if gpu else
               "a model's step on the CPU is slow and its activations large, so a smaller batch and fewer steps")
        parts = {"batch_size": f"batch {data.batch_size}", "steps": f"{bench.steps} timed step(s)",
                 "warmup": f"{bench.warmup} warm-up step(s)", "repeat": f"{bench.repeat} round(s)"}
        flags = ", ".join("--" + k.replace("_", "-") for k in PLANNED if k in chosen)
        lines.append(f"chose {', '.join(parts[k] for k in PLANNED if k in chosen)} for this machine ({what}: {why}); "
                     f"set {flags} to choose")
    return dataclasses.replace(s, data=data, bench=bench), lines


def estimate(probe: dict, *, legs: int, warmup: int, steps: int, model: bool) -> float:
    """Seconds the run will take, from the probe's metrics (one warm-up and one timed step): each of `legs` loader
    runs pays the probe's start-up and `warmup + steps` steps of the probe's length (times LOADER_FACTOR for a
    real loader beside a model, which shares the cores with it)."""
    step = probe["step_ms_p50"] / 1e3 * (LOADER_FACTOR if model else 1.0)
    startup = probe["time_budget"]["wall_s"] * probe["time_budget"]["shares"]["startup"]
    return legs * (startup + (warmup + steps) * step)


def check_duration(seconds: float, probe: dict, *, legs: int, batch: int, allow_long: bool, gpu: bool) -> str:
    """The estimate in words; a UsageError where it is over LONG_RUN on the CPU and --allow-long was not given."""
    words = (f"estimated {seconds / 60:.1f} min for {legs} loader run(s): the probe's step took "
             f"{probe['step_ms_p50'] / 1e3:.2g} s at batch {batch}, its peak memory {probe['rss_peak_mb']:.0f} MB")
    if seconds > LONG_RUN and not gpu and not allow_long:
        raise UsageError(f"the benchmark would take about {seconds / 60:.0f} minutes on the CPU, over the "
                         f"{LONG_RUN / 60:.0f} minutes it runs without asking ({words}); pass --allow-long to run it, "
                         "or fewer --steps, --warmup, --repeat or --loaders, or a smaller --batch-size")
    return words
