"""What the measurements mean, in plain words, and what to change: the verdicts on one loader's measurements
(`diagnose`: input-, compute- or host-bound, swings, stalls, a busy machine), the time budget of a run and the
verdict, fix and expected gain for each share of it large enough (`time_budget`, `budget_verdicts`); and a
diagnosis that prescribes: when the loader is input-bound on large photos, measure what packing would give on
the user's own files (`pack_gain`).

Large photos cap a small machine however fast its GPU is: their JPEG decode (on a T4 the Huffman
stage runs on the CPU) dominates. When the median image is above LARGE_PIXELS, `pack_gain` packs a
sample of SAMPLE of them with --max-side 384 into a temporary folder and times the DALI training
pipeline over the raw sample and over the packed one, on the same cores: the two ceilings are
measured, not guessed.
"""
from __future__ import annotations

import dataclasses
import shlex
import statistics
import tempfile
import time
from pathlib import Path

from .loader import DaliLoader
from .manifest import Manifest
from .pack import pack_manifest
from .pipeline import Augment, PipelineOptions, build_pipeline, resources_for_rank
from .sampler import STALL_FACTOR
from .samples import Files
from .shards.packs import open_packed

LARGE_PIXELS = 1_000_000
SAMPLE = 64
MAX_SIDE = 384


def median_pixels(paths: list[str], n: int = SAMPLE) -> float:
    """Median width x height over (up to) n images, read from their headers."""
    from PIL import Image

    sizes = []
    for p in paths[:n]:
        try:
            with Image.open(p) as im:
                sizes.append(im.size[0] * im.size[1])
        except Exception:
            continue
    return float(statistics.median(sizes)) if sizes else 0.0


def _images_per_sec(source, spec, opts, passes: int = 2) -> float:
    loader = DaliLoader(lambda ck: build_pipeline(source, spec, opts, training=True, checkpoint=ck), training=True)
    list(loader)  # warm-up: allocations, first decode
    start, n = time.perf_counter(), 0
    for _ in range(passes):
        n += sum(len(y) for _, y in loader)
    return n / (time.perf_counter() - start)


def pack_gain(manifest, spec, pipeline_settings, *, batch_size: int, cores: int) -> tuple[float, float, int]:
    """(raw images/s, packed images/s, sample size): DALI's training pipeline on SAMPLE of the
    manifest's training images, raw and packed at MAX_SIDE, on the same cores."""
    train = manifest.train[:SAMPLE]
    sample = Manifest(manifest.root, manifest.classes, train, [])
    batch = max(1, min(batch_size, len(train) // 2))
    opts = PipelineOptions(batch_size=batch, device=pipeline_settings.device,
                           resources=resources_for_rank(pipeline_settings, training=True, available_cores=cores + 1),
                           augment=Augment.from_settings(pipeline_settings),
                           device_id=0 if pipeline_settings.device == "gpu" else None)
    raw = _images_per_sec(Files([s.path for s in train], [s.label for s in train]), spec, opts)
    with tempfile.TemporaryDirectory(prefix="dali_pipe-pack-sample-") as tmp:
        pack_manifest(sample, Path(tmp), max_side=MAX_SIDE, quality=90, shard_size=1 << 40, workers=cores, seed=0,
                      bad={}, progress=False)
        packed = _images_per_sec(dataclasses.replace(open_packed(tmp, tmp).train), spec, opts)
    return raw, packed, len(train)


def pack_command(data: str | None) -> tuple[str, str]:
    """(the command that packs --data, the --data to train on then): DATA-packed beside DATA, local or
    s3://, so that it can be run as printed; DATA and PACKED as words when --data is not known."""
    if not data:
        return f"python -m dali_pipe pack DATA PACKED --max-side {MAX_SIDE}", "PACKED"
    packed = data.rstrip("/") + "-packed"
    return f"python -m dali_pipe pack {shlex.quote(data)} {shlex.quote(packed)} --max-side {MAX_SIDE}", packed


def prescription(manifest, spec, pipeline_settings, *, batch_size: int, cores: int, data: str | None = None
                 ) -> str | None:
    """The advice line, or None when the photos are not large (packing would not pay). `data`: the --data
    the run read, which the command it prescribes packs."""
    paths = [s.path for s in manifest.train]
    pixels = median_pixels(paths)
    if pixels <= LARGE_PIXELS:
        return None
    raw, packed_rate, n = pack_gain(manifest, spec, pipeline_settings, batch_size=batch_size, cores=cores)
    command, packed = pack_command(data)
    return (f"input-bound on large photos (median {pixels / 1e6:.1f} Mpx); packing with --max-side {MAX_SIDE} raises "
            f"the loader ceiling from {raw:.0f} to about {packed_rate:.0f} images/s on these {cores} core(s) (measured on "
            f"{n} of your images): {command}, then --data {shlex.quote(packed)}.")


INPUT_BOUND_WAIT = 0.10


GPU_BUSY = 90.0


CPU_SATURATED = 80.0


OTHER_LOAD_WARN = 0.25  # cores' worth of load from other processes that makes a measurement suspect


def diagnose(name: str, m: dict, *, cores: int, model: bool = True) -> list[str]:
    """Plain-words verdicts with the numbers behind them, for one loader's measurements."""
    out = []
    wait = m.get("data_wait_fraction") or 0.0
    cpu = m.get("cpu_util_mean") or 0.0
    gpu, p5 = m.get("gpu_util_mean"), m.get("gpu_util_p5")
    if not model:
        out.append(f"{name}: loader ceiling (no model) is {m.get('images_per_sec', 0):.0f} images/s on {cores} "
                   f"core(s), with the CPU {cpu:.0f}% busy.")
    elif wait >= INPUT_BOUND_WAIT:
        why = (f"decoding on {cores} core(s) cannot keep up with the model" if cpu >= CPU_SATURATED else
               "the CPU is not saturated, so the loader is starved by I/O or too few workers/threads")
        gpu_part = f", the GPU only {gpu:.0f}% busy" if gpu is not None else ""
        out.append(f"{name}: input-bound, {wait:.0%} of each step waits for data while the CPU is {cpu:.0f}% "
                   f"busy{gpu_part}; {why}.")
    elif gpu is None:
        out.append(f"{name}: compute-bound (CPU), the training steps wait on the model, not on the data (data-wait "
                   f"is {wait:.1%} of their time).")
    elif gpu >= GPU_BUSY:
        out.append(f"{name}: compute-bound, the GPU is {gpu:.0f}% busy and data-wait is {wait:.1%}.")
    else:
        out.append(f"{name}: host-bound, the GPU is only {gpu:.0f}% busy although data-wait is {wait:.1%}; "
                   "kernel-launch overhead, syncs or a small batch leave it idle.")
    if gpu is not None and p5 is not None and p5 < 50 and gpu >= 70:
        out.append(f"{name}: GPU utilization swings: p5 {p5:.0f}% against a mean of {gpu:.0f}%.")
    st = m.get("stalls") or {}
    if st.get("count") and model:
        out.append(f"{name}: stalls, {st['count']} step(s) took over {STALL_FACTOR:.0f}x the median "
                   f"({st['median_ms']:.0f} ms, worst {st['max_ms']:.0f} ms), checkpoint saves and validation "
                   "not included (the time budget counts those).")
    busy = busy_cores(name, m, cores)
    if busy:
        out.append(busy)
    return out


def busy_cores(name: str, m: dict, cores: int) -> str | None:
    """The warning that other processes loaded the pinned cores while `name` was measured (its figures are
    then low), or None."""
    other = m.get("other_load_cores")
    if other is None or other < OTHER_LOAD_WARN:
        return None
    return (f"{name}: other processes kept {other:.1f} of the {cores} pinned core(s) busy during the "
            "measurement; these figures are low, rerun on idle cores.")


SHARES = ("startup", "data_wait", "model_step", "checkpoint_saves", "validation", "callbacks")


SHARE_WORDS = {"startup": "start-up", "data_wait": "data wait", "model_step": "model step",
               "checkpoint_saves": "checkpoint saves", "validation": "validation",
               "callbacks": "logging and other callbacks"}


VERDICT_SHARE = 0.10  # a share this large gets a verdict, a fix and its expected gain


TARGET_SHARE = 0.05  # the share a suggested save or validation setting aims at


def time_budget(wall: float, *, startup: float, data_wait: float, model_step: float, checkpoint_saves: float = 0.0,
                validation: float = 0.0, **details) -> dict:
    """The wall time in six shares that add up to 100%: five measured ones, and the rest of the loop's
    time (logging, callbacks, Lightning's own work) as "callbacks". `details` go beside (counts, parts)."""
    parts = {"startup": startup, "data_wait": data_wait, "model_step": model_step,
             "checkpoint_saves": checkpoint_saves, "validation": validation}
    parts = {k: max(0.0, float(v)) for k, v in parts.items()}
    parts["callbacks"] = max(0.0, wall - sum(parts.values()))
    total = sum(parts.values())
    return {"wall_s": total, "seconds": {k: parts[k] for k in SHARES},
            "shares": {k: parts[k] / total if total > 0 else 0.0 for k in SHARES}, **details}


def budget_line(b: dict) -> str:
    """`time: start-up 4%, data wait 2%, ... (of 84.2 s)`: every share, in the fixed order."""
    return ("time: " + ", ".join(f"{SHARE_WORDS[k]} {b['shares'][k]:.0%}" for k in SHARES) +
            f" (of {b['wall_s']:.1f} s)")


def _without(b: dict, key: str, new_seconds: float) -> float:
    """The share `key` would have if it took `new_seconds`, everything else as measured."""
    old = b["seconds"][key]
    wall = b["wall_s"] - old + new_seconds
    return new_seconds / wall if wall > 0 else 0.0


def budget_verdicts(name: str, b: dict, *, cli: dict | None = None) -> list[str]:
    """A verdict for every share of at least 10%, with its fix and the gain computed from the measured
    numbers. `cli` holds the CLI's current --checkpoint-every-steps and --val-fraction (fixes are then
    flags); without it the fixes are the Trainer's and ModelCheckpoint's arguments."""
    out = []
    sh, sec, wall = b["shares"], b["seconds"], b["wall_s"]
    if sh["startup"] >= VERDICT_SHARE:
        parts = b.get("startup_parts") or {}
        words = {"imports": "interpreter start and imports", "prepare_data": "data preparation (sync, scan)",
                 "setup": "pipeline build"}
        named = [f"{words[k]} {v:.1f} s" for k, v in parts.items() if k in words and v >= 0.05]
        rest = max(0.0, sec["startup"] - sum(parts.values()))
        detail = (f": {', '.join(named)}, the rest (model load, Trainer set-up, the first batches) {rest:.1f} s"
                  if named else "")
        longer = sec["startup"] / (sec["startup"] + 10 * (wall - sec["startup"])) if wall > sec["startup"] else 1.0
        out.append(f"{name}: start-up takes {sh['startup']:.0%} of the run ({sec['startup']:.1f} s{detail}); it is "
                   f"paid once per run: a run 10x as long would spend about {longer:.0%} on it, and a rerun reuses the "
                   "synced files and the scan's verdicts.")
    if sh["data_wait"] >= VERDICT_SHARE:
        out.append(f"{name}: data wait takes {sh['data_wait']:.0%} of the run; a loader that kept up would make it "
                   f"about {1 / max(1e-9, 1 - sh['data_wait']):.1f}x faster (the input-bound verdict says why).")
    if sh["model_step"] >= VERDICT_SHARE:
        rest = 1 - sh["model_step"]
        out.append(f"{name}: the model step (forward, backward, optimizer) takes {sh['model_step']:.0%} of the run, "
                   f"the work itself; everything else is {rest:.0%}, so no fix outside the model can make the run more "
                   f"than {1 / max(1e-9, sh['model_step']):.1f}x faster.")
    if sh["checkpoint_saves"] >= VERDICT_SHARE:
        out.append(_saves_verdict(name, b, cli))
    if sh["validation"] >= VERDICT_SHARE:
        out.append(_validation_verdict(name, b, cli))
    if sh["callbacks"] >= VERDICT_SHARE:
        named = sorted((b.get("callbacks_by_name") or {}).items(), key=lambda kv: -kv[1])
        top = [(k, v) for k, v in named if v / wall >= 0.02][:2] if wall > 0 else []
        if top:
            worst = "; ".join(f"{k} {v:.1f} s ({v / wall:.0%})" for k, v in top)
            gain = _without(b, "callbacks", sec["callbacks"] - top[0][1])
            out.append(f"{name}: logging and other callbacks take {sh['callbacks']:.0%} of the run, most in {worst}; "
                       f"without {top[0][0]} they would take about {gain:.0%}.")
        else:
            out.append(f"{name}: logging and other callbacks take {sh['callbacks']:.0%} of the run, spread over "
                       "Lightning's loop and the loggers; logging less often (Trainer(log_every_n_steps=...)) is the "
                       "usual fix.")
    return out


def _saves_verdict(name: str, b: dict, cli: dict | None) -> str:
    s, wall = b["seconds"]["checkpoint_saves"], b["wall_s"]
    info = b.get("saves_info") or {}
    n = max(1, info.get("count", 1))
    mean = s / n
    head = (f"{name}: checkpoint saves take {b['shares']['checkpoint_saves']:.0%} of the run ({n} save(s), "
            f"{mean:.2f} s each)")
    every, periodic = info.get("every_steps"), info.get("periodic", 0)
    if every and periodic:
        # the least frequent saving that reaches TARGET_SHARE, but always keeping a periodic save (spot safety)
        span = periodic * every
        choices = [every * m for m in (2, 5, 10, 20, 50, 100, 200, 500, 1000) if every * m <= span] or [span]
        for k in choices:
            share = _without(b, "checkpoint_saves", s - periodic * mean + (span // k) * mean)
            if share <= TARGET_SHARE * 1.1:
                break
        how = f"--checkpoint-every-steps {k}" if cli is not None else f"ModelCheckpoint(every_n_train_steps={k})"
        return f"{head}; {how} would cut that to about {share:.0%}."
    half = _without(b, "checkpoint_saves", s / 2)
    if cli is not None:
        return (f"{head}, at the end of training only: a longer run amortises it (twice as many steps would bring "
                f"it to about {s / (2 * wall - s):.0%}).")
    return (f"{head}; saving half as often (ModelCheckpoint's every_n_epochs or every_n_train_steps) would cut that "
            f"to about {half:.0%}.")


def _validation_verdict(name: str, b: dict, cli: dict | None) -> str:
    v, info = b["seconds"]["validation"], b.get("validation_info") or {}
    runs, images = max(1, info.get("runs", 1)), info.get("images", 0)
    head = (f"{name}: validation takes {b['shares']['validation']:.0%} of the run ({runs} run(s) of {v / runs:.2f} s"
            + (f" on {images} image(s)" if images else "") + ")")
    rest = b["wall_s"] - v
    ratio = min(1.0, TARGET_SHARE * rest / ((1 - TARGET_SHARE) * v)) if v > 0 else 1.0  # val time that gives 5%
    fraction = (cli or {}).get("val_fraction")
    if cli is not None and fraction:
        new = max(0.01, float(f"{fraction * ratio:.1g}"))
        share = _without(b, "validation", v * new / fraction)
        return (f"{head}; --val-fraction {new:g} would cut that to about {share:.0%} (with a split column: fewer val "
                "rows).")
    if cli is not None:
        share = _without(b, "validation", v * ratio)
        return f"{head}; fewer val rows in the split column ({ratio:.0%} of them) would cut that to about {share:.0%}."
    # check_val_every_n_epoch=k validates in epochs k, 2k, ...: floor(epochs / k) of them, never none
    epochs = max(1, info.get("epochs") or runs)
    every = None
    for k in (k for k in (2, 3, 5, 10, 20, 50, 100) if k <= epochs):
        every = k, _without(b, "validation", v * (epochs // k) / epochs)
        if every[1] <= TARGET_SHARE * 1.1:
            break
    if every and every[1] < VERDICT_SHARE:
        return f"{head}; Trainer(check_val_every_n_epoch={every[0]}) would cut that to about {every[1]:.0%}."
    batches = info.get("batches") or 0  # per run; a fraction of them below one batch is refused by Lightning
    if batches:
        n = max(1, round(ratio * batches))
        if n >= batches:
            return (f"{head}, {batches} batch(es) each: validate less often or on a smaller set (fewer runs, "
                    "Trainer(check_val_every_n_epoch=...), over more epochs).")
        return (f"{head}; Trainer(limit_val_batches={n}) ({n} of its {batches} batches) would cut that to about "
                f"{_without(b, 'validation', v * n / batches):.0%}.")
    limit = max(0.01, float(f"{ratio:.1g}"))
    return (f"{head}; Trainer(limit_val_batches={limit:g}) would cut that to about "
            f"{_without(b, 'validation', v * limit):.0%}.")
