#!/usr/bin/env python3
"""The parts of the GPU check (tools/gpu_check.sh) that are measurements of our own code rather than a test
or a benchmark run: the stack report, and the probe. Each part that fails is reported and the next one runs.

    python tools/gpu_probe.py versions                # the stack, checked; exit 0 ok, 1 a check failed,
                                                      # 3 no CUDA GPU visible (the GPU steps cannot run)
    python tools/gpu_probe.py data DATA PACK          # the check's photos (672, 400-600 px) and their pack
    python tools/gpu_probe.py probe DATA OUT.json     # decode costs, next() against the step, clipping's cost
        [--pack PACK] [--device gpu|cpu] [--steps 30] [--warmup 8] [--batch 128] [--model vit-b16-random]
        [--rounds 2]
    python tools/gpu_probe.py summary OUT STEPS.tsv SECONDS   # summary.md from what the steps left in OUT

`versions` says which Python, torch (and its CUDA build), DALI variant, Lightning and transformers run and how
they differ from the image's (the lock and the Dockerfile's torch build): a different stack is reported, not
failed, since the results then speak for that stack. It fails on what would break the image's stack too: two
DALI variants in one environment, torch without CUDA, or DALI's GPU decode, handed to torch in the same process,
giving other pixels than DALI's CPU decode (within decoder.GPU_DECODE_LEVELS, the GPU test's bound, chroma
upsampled as the pipeline does).

`probe`, on DATA (a folder with dataset.tsv), with the project's own pipeline, loader, module and Trainer:

- decode: the training decode (random-crop ROI decode, resize, augment, normalise; loaders alone, batch 128)
  with libjpeg-turbo's chroma upsampling on (the pipeline's setting) and off (DALI's default), with the GPU's
  hardware JPEG decoder and without it (a T4 has none), and without it with --hybrid-huffman-threshold 0;
  then the validation decode on and off, and (--pack) the training decode fed by our shard reader from the
  photos' pack. Rounds alternate the order; images/s and CPU % per run (a decode that falls back to the CPU
  shows as CPU time).
- steps: ViT-B/16 training steps fed by the DALI loader and by synthetic data, under bf16-mixed (where the
  GPU has it) and 16-mixed, with and without --clip-grad-norm 1.0. CUDA events around each step give the
  step's GPU time and the GPU's idle gap before the next step starts, beside the host's time in `next()`
  (Lightning's batch fetch): DALIGenericIterator's `next()` blocks the host until the batch's GPU work ends,
  which costs the GPU nothing while the host still runs ahead, and shows as a gap if it does not.

With `--device cpu` the same code runs on the CPU (tiny model, host timers): how the check is tried without
a GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dali_pipe.config import VIT_B16_RANDOM, DataSettings, ModelSettings, PipelineSettings  # noqa: E402

IMAGE_DALI = "nvidia-dali-cuda120"  # the lock's and the image's variant
ROI, WHOLE = "ROI decode", "whole decode + GPU crop"  # the two training decodes (dali_pipe/decoder.py)
STACK = ("torch", "pytorch-lightning", "transformers", "torchmetrics", "numpy", "pillow")
RUNTIME_MODULES = {"boto3": "s3:// data", "tensorboard": "training's TensorBoard logs (train.py, the GPU tests)",
                   "skimage": "the demo photos (or DALI_PIPE_PHOTOS)", "pynvml": "GPU utilization in the benchmark",
                   "psutil": "CPU utilization in the benchmark", "matplotlib": "benchmark.png"}


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    return pins


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def dali_variants() -> dict[str, str]:
    """{distribution name: version} of every DALI wheel this Python sees (one is right; two share a folder)."""
    found = {}
    for d in metadata.distributions():
        name = re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "").lower())
        if name.startswith("nvidia-dali-"):
            found[name] = d.version
    return found


def versions() -> int:
    """Print the stack and check it; 0: fine, 1: a check failed, 3: no CUDA GPU visible."""
    problems, notes = [], []
    lock = _lock()
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
            print((r.stdout + r.stderr).rstrip() or f"nvidia-smi: exit {r.returncode}, no output")
        except subprocess.TimeoutExpired:
            print("nvidia-smi: no answer within 30 s (the driver may be stuck)")
    else:
        print("nvidia-smi: not installed")
    print("python", platform.python_version(), "(the image's: 3.11)")
    try:
        import torch
    except Exception as e:
        print(f"torch cannot be imported: {type(e).__name__}: {e}")
        print("checks: FAILED: torch cannot be imported (so no GPU step can run)")
        return 3
    build = re.search(r'"torch==[0-9.]+\+cu(\d+)(\d)"', (ROOT / "Dockerfile").read_text())
    image_cuda = f"{build.group(1)}.{build.group(2)}" if build else "?"
    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda} (the image's: {lock.get('torch')} "
          f"CUDA {image_cuda})")
    for name in STACK[1:]:
        print(f"{name} {_installed(name) or 'not installed'} (lock {lock.get(name, '-')})")
    variants = dali_variants()
    print("dali:", ", ".join(f"{n} {v}" for n, v in variants.items()) or "no DALI distribution found",
          f"(the image's: {IMAGE_DALI} {lock.get(IMAGE_DALI)})")
    if len(variants) > 1:
        problems.append(f"{len(variants)} DALI variants in one environment ({', '.join(variants)}): they install "
                        "into the same nvidia/dali/ folder; keep one")
    off = [f"{n} {_installed(n)} (lock {lock[n]})" for n in STACK if n in lock and _installed(n)
           and _installed(n).split("+")[0] != lock[n]]
    if torch.version.cuda != image_cuda:
        off.append(f"torch's CUDA {torch.version.cuda} build (the image's {image_cuda})")
    off += [f"{n} {v} (the image's {IMAGE_DALI} {lock.get(IMAGE_DALI)})" for n, v in variants.items()
            if n != IMAGE_DALI or v != lock.get(IMAGE_DALI)]
    if platform.python_version_tuple()[:2] != ("3", "11"):
        off.append(f"python {platform.python_version()} (the image's 3.11)")
    notes.append("stack: the image's" if not off else "stack differs from the image's (results speak for this "
                 "stack): " + "; ".join(off))
    photos = os.environ.get("DALI_PIPE_PHOTOS")
    missing = [f"{m} ({why})" for m, why in RUNTIME_MODULES.items() if importlib.util.find_spec(m) is None
               and not (m == "skimage" and photos and Path(photos).is_dir())]
    if missing:
        notes.append("not installed here: " + "; ".join(missing))
    try:
        import nvidia.dali as dali

        print("dali imports as", dali.__version__, "from", Path(dali.__file__).parent)
        from dali_pipe.decoder import nvjpeg

        found = nvjpeg()
        print(f"nvjpeg: {found}; the training decode on the GPU: "
              f"{ROI if found.roi_with_fancy_upsampling else WHOLE} (dali_pipe/decoder.py)")
    except Exception as e:
        problems.append(f"DALI cannot be imported ({type(e).__name__}: {str(e)[:200]})")
    if torch.version.cuda is None:
        problems.append("this torch has no CUDA (a CPU build)")
    if not torch.cuda.is_available():
        print("\n".join(notes))
        print("gpu: no CUDA GPU visible (torch.cuda.is_available() is False)")
        print("checks: FAILED: " + "; ".join(problems + ["no CUDA GPU visible"]))
        return 3
    print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
          "| torch kernels:", " ".join(torch.cuda.get_arch_list()))
    if "sm_75" not in torch.cuda.get_arch_list():
        (problems if torch.version.cuda == image_cuda else notes).append("torch has no sm_75 kernels: it would not "
                                                                         "run on a T4")
    if not problems:
        try:
            problems += one_process_check()
        except Exception as e:
            problems.append(f"DALI + torch in one process: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    print("\n".join(notes))
    print("checks: " + ("all passed" if not problems else "FAILED: " + "; ".join(problems)))
    return 1 if problems else 0


def one_process_check() -> list[str]:
    """torch holds GPU memory while DALI decodes on the GPU (as the pipeline decodes) and torch reads the
    result; checked against DALI's CPU decode of the same JPEG, within DALI's own bound (1 level)."""
    import numpy as np
    import torch
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import feed_ndarray

    from dali_pipe.decoder import GPU_DECODE_LEVELS
    from dali_pipe.demo import make_photo_dataset
    from dali_pipe.pipeline import Augment, PipelineOptions, decoder_args, resources_for_rank

    root = make_photo_dataset(Path(tempfile.mkdtemp()), classes=2, per_class=2)
    jpegs = [str(p) for p in sorted(root.rglob("*.jpg"))]
    held = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB that torch keeps
    settings = PipelineSettings(device="gpu", num_threads=1)
    opts = PipelineOptions(batch_size=len(jpegs), device="gpu", resources=resources_for_rank(settings),
                           augment=Augment.from_settings(settings), device_id=0)

    @pipeline_def(batch_size=len(jpegs), num_threads=1, device_id=0)
    def decode(device):
        data, _ = fn.readers.file(files=jpegs)
        dev, hints = decoder_args(opts) if device == "gpu" else ("cpu", {})
        return fn.decoders.image(data, device=dev, output_type=types.RGB, **hints)

    gpu_pipe, cpu_pipe = decode("gpu"), decode("cpu")
    gpu_pipe.build()
    cpu_pipe.build()
    (gpu_out,) = gpu_pipe.run()
    (cpu_out,) = cpu_pipe.run()
    worst = 0.0
    for i in range(len(jpegs)):
        t = gpu_out[i]
        img = torch.empty(t.shape(), dtype=torch.uint8, device="cuda")
        feed_ndarray(t, img, cuda_stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        ref = torch.from_numpy(np.array(cpu_out[i]))
        if img.shape != ref.shape:
            return [f"DALI's GPU decode of {jpegs[i]} has shape {tuple(img.shape)}, its CPU decode {tuple(ref.shape)}"]
        worst = max(worst, (img.cpu().int() - ref.int()).abs().max().item())
    bound = GPU_DECODE_LEVELS["max"]
    ok = held.sum().item() == held.numel() and worst <= bound
    print(f"dali+torch in one process: {len(jpegs)} GPU decodes read by torch; max |GPU - CPU decode| {worst:.0f} "
          f"level(s) (the bound, as the GPU test's: {bound}): {'ok' if ok else 'FAILED'}")
    return [] if ok else [f"DALI's GPU decode, read by torch, differs from its CPU decode by {worst:.0f} levels"]


# -- the probe ---------------------------------------------------------------------------------------
def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def decode_configs(pack: bool, old_nvjpeg: bool = False) -> dict[str, dict]:
    """The decode runs: name -> (training, fancy upsampling, ROI decode (None: as the pipeline builds it),
    hw_decoder_load, hybrid_huffman_threshold, from the pack). Under an nvJPEG older than 13.2 (`old_nvjpeg`,
    the probe's second process) only the two training decodes the rule chooses between, without the hardware
    decoder (a T4's case)."""
    c = {}
    for hw_name, hw in (("hw decoder", None), ("no hw decoder", 0.0)):
        c[f"train, {ROI} + fancy upsampling, {hw_name}"] = dict(training=True, fancy=True, roi=True, hw=hw)
        c[f"train, {WHOLE}, fancy upsampling, {hw_name}"] = dict(training=True, fancy=True, roi=False, hw=hw)
        if not old_nvjpeg:
            c[f"train, {ROI}, no fancy upsampling, {hw_name}"] = dict(training=True, fancy=False, roi=True, hw=hw)
    if old_nvjpeg:
        return {k: v for k, v in c.items() if k.endswith("no hw decoder")}
    c["train, as built, no hw decoder, huffman threshold 0"] = dict(training=True, fancy=True, roi=None, hw=0.0,
                                                                    huffman=0)
    c["val, fancy upsampling, hw decoder"] = dict(training=False, fancy=True)
    c["val, no fancy upsampling, hw decoder"] = dict(training=False, fancy=False)
    if pack:  # the training decode as built, fed by the shard reader (external_source) from the photos' pack
        c["train, as built, hw decoder, from the pack"] = dict(training=True, fancy=True, roi=None, pack=True)
    return c


def decode_pairs(configs: dict, found) -> dict[str, tuple[str, str]]:
    """Ratios of images/s, each labelled by what it measures on this nvJPEG: the fancy upsampling's cost where
    the ROI decode with it runs on the GPU, else the CPU fallback's."""
    fancy_cost = ("chroma upsampling's cost" if found.roi_with_fancy_upsampling else
                  f"the CPU fallback's cost (nvImageCodec refuses the ROI decode with fancy upsampling; {found.name})")
    pairs = {}
    for hw in ("hw decoder", "no hw decoder"):
        roi, whole = f"train, {ROI} + fancy upsampling, {hw}", f"train, {WHOLE}, fancy upsampling, {hw}"
        off = f"train, {ROI}, no fancy upsampling, {hw}"
        if whole in configs and roi in configs:
            pairs[f"{WHOLE} / {ROI} (fancy upsampling), {hw}"] = (whole, roi)
        if off in configs:
            pairs[f"{ROI}, fancy on / off, {hw}: {fancy_cost}"] = (roi, off)
    if "val, no fancy upsampling, hw decoder" in configs:
        pairs["val, fancy on / off, hw decoder: chroma upsampling's cost"] = ("val, fancy upsampling, hw decoder",
                                                                             "val, no fancy upsampling, hw decoder")
    def built(hw: str) -> str:  # the configuration the pipeline builds on this nvJPEG
        return (f"train, {ROI} + fancy upsampling, {hw}" if found.roi_with_fancy_upsampling else
                f"train, {WHOLE}, fancy upsampling, {hw}")

    if "train, as built, no hw decoder, huffman threshold 0" in configs:
        pairs["huffman threshold 0 / default, no hw decoder"] = ("train, as built, no hw decoder, huffman threshold 0",
                                                                 built("no hw decoder"))
    if "train, as built, hw decoder, from the pack" in configs:
        pairs["from the pack / from files, train, hw decoder"] = ("train, as built, hw decoder, from the pack",
                                                                  built("hw decoder"))
    return pairs


def decode_part(data: str, a, cores: int, old_nvjpeg: bool = False) -> dict:
    """Loaders alone over DATA's training files, each configuration `a.rounds` times, alternating; per run the
    images/s, CPU % and the images nvImageCodec's GPU decoders refused (decoded on the CPU instead)."""
    import torch

    from dali_pipe.benchrun import measure
    from dali_pipe.datamodule import DaliDataModule
    from dali_pipe.decoder import nvjpeg
    from dali_pipe.loader import DaliLoader
    from dali_pipe.pipeline import build_pipeline
    from dali_pipe.samples import Files
    from dali_pipe.spec import ImageSpec

    gpu = a.device == "gpu"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    spec = ImageSpec(224, 224, (0.5,) * 3, (0.5,) * 3)
    found = nvjpeg()
    print(f"decode: {found}; the pipeline's training decode: "
          f"{ROI if found.roi_with_fancy_upsampling else WHOLE}", flush=True)
    configs = decode_configs(bool(a.pack), old_nvjpeg)
    base = DaliDataModule(DataSettings(data=data, batch_size=a.batch, cache_dir=a.cache_dir, scan="off",
                                       val_fraction=0.0),
                          PipelineSettings(device=a.device, num_threads=cores), spec, Path(tempfile.mkdtemp()))
    base.prepare_data()
    train = base.manifest.train
    files = Files([s.path for s in train], [s.label for s in train])
    shards = None
    if a.pack:
        packed = DaliDataModule(dataclasses.replace(base.data, data=a.pack), base.pipeline, spec,
                                Path(tempfile.mkdtemp()))
        packed.prepare_data()
        shards = packed.manifest.train
    results = {name: [] for name in configs}
    for r in range(a.rounds):
        for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
            c = configs[name]
            settings = PipelineSettings(device=a.device, num_threads=cores,
                                        **({} if c.get("hw") is None else {"hw_decoder_load": c["hw"]}),
                                        **({} if c.get("huffman") is None else {"hybrid_huffman_threshold": c["huffman"]}))
            dm = DaliDataModule(base.data, settings, spec)
            opts = dataclasses.replace(dm.options(training=c["training"]), fancy_upsampling=c["fancy"],
                                       roi_decode=c.get("roi"))
            source = shards if c.get("pack") else files

            def build(opts=opts, training=c["training"], source=source):
                return DaliLoader(lambda ckpt: build_pipeline(source, spec, opts, training=training, checkpoint=ckpt),
                                  training=training)

            m = measure(name, build, device=device, batch_size=a.batch, warmup=a.warmup, steps=a.steps,
                        cores=cores, classes=base.manifest.classes, label=f"round {r + 1} decode {name}")["metrics"]
            results[name].append({"images_per_sec": m["images_per_sec"], "cpu_util_mean": m["cpu_util_mean"],
                                  "gpu_util_mean": m.get("gpu_util_mean"),
                                  "to_cpu": (m.get("decoder") or {}).get("to_cpu"),
                                  "images": (a.warmup + a.steps) * a.batch,
                                  "refusals": m.get("decoder")})
    out = {}
    for name, runs in results.items():
        out[name] = {"images_per_sec": _spread([x["images_per_sec"] for x in runs]),
                     "cpu_util_mean": _spread([x["cpu_util_mean"] or 0.0 for x in runs]),
                     "gpu_util_mean": [x["gpu_util_mean"] for x in runs],
                     "to_cpu": [x["to_cpu"] for x in runs], "images": runs[0]["images"],
                     "refusals": runs[-1]["refusals"]}
    ratios = {k: _spread([x["images_per_sec"] / y["images_per_sec"] for x, y in zip(results[n], results[d])])
              for k, (n, d) in decode_pairs(configs, found).items()}
    return {"nvjpeg": str(found), "training_decode": ROI if found.roi_with_fancy_upsampling else WHOLE,
            "batch": a.batch, "steps": a.steps, "threads": cores, "images": len(files), "configs": out,
            "ratios": ratios}


def old_nvjpeg_part(data: str, a, cores: int) -> dict:
    """decode_part's two training decodes in a second process whose nvImageCodec loads the nvJPEG in
    `a.old_nvjpeg` (a folder with an older libnvjpeg, put first on LD_LIBRARY_PATH as the extension's dlopen
    reads it): the CUDA 12 stack's case on this GPU."""
    out = Path(tempfile.mkdtemp()) / "old.json"
    env = {**os.environ, "LD_LIBRARY_PATH": f"{a.old_nvjpeg}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    cmd = [sys.executable, __file__, "decode-only", data, str(out), "--device", a.device, "--batch", str(a.batch),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--rounds", str(a.rounds), "--cache-dir", a.cache_dir]
    r = subprocess.run(cmd, env=env)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"the old-nvJPEG decode process exited {r.returncode}")
    return json.loads(out.read_text())


class StepEvents:
    """A Lightning callback: per training step, the host's time in the batch fetch (`next()` on the loader and
    the move to the device) and, on CUDA, events at the step's start and end on the training stream, read
    after the run (no sync inside it). Without CUDA, host times stand in for the events."""

    def __init__(self, cuda: bool):
        import pytorch_lightning as pl

        self.cuda, self.events, self.fetch_s = cuda, [], []
        self._end = None
        outer = self

        class _Hooks(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                now = time.perf_counter()  # the fetch: from the previous step's end to this one's start
                outer.fetch_s.append(None if outer._end is None else now - outer._end)
                outer.events.append([outer._mark(), None])

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                outer.events[-1][1] = outer._mark()
                outer._end = time.perf_counter()

        self.callback = _Hooks()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def summary(self, skip: int) -> dict:
        """Medians over the steps after `skip`: GPU step time, the GPU's idle gap before the next step, and the
        host's fetch time; and the gaps' share of the timed GPU span."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            ms = lambda a, b: a.elapsed_time(b)  # noqa: E731
        else:
            ms = lambda a, b: (b - a) * 1e3  # noqa: E731
        ev = self.events[skip:]
        steps = [ms(s, e) for s, e in ev if e is not None]
        gaps = [ms(ev[i][1], ev[i + 1][0]) for i in range(len(ev) - 1) if ev[i][1] is not None]
        fetch = [f * 1e3 for f in self.fetch_s[skip:] if f is not None]
        span = ms(ev[0][0], ev[-1][1]) if ev and ev[-1][1] is not None else 0.0
        return {"steps": len(steps), "gpu_step_ms": _spread(steps) if steps else None,
                "gap_ms": _spread(gaps) if gaps else None, "fetch_ms": _spread(fetch) if fetch else None,
                "gap_share": (sum(gaps) / span) if span > 0 else None}


def steps_part(data: str, a, cores: int) -> dict:
    """The model's steps from DALI and from synthetic data, per precision, with and without clipping."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning.loggers.logger import DummyLogger

    from dali_pipe.benchrun import Synthetic, measure, quiet_lightning
    from dali_pipe.datamodule import DaliDataModule
    from dali_pipe.spec import ImageSpec
    from model.loading import load_processor
    from model.module import ImageClassifier

    gpu = a.device == "gpu"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    spec = ImageSpec.from_processor(load_processor(a.model if a.model != "tiny" else VIT_B16_RANDOM))
    if a.model == "tiny":
        spec = ImageSpec(64, 64, (0.5,) * 3, (0.5,) * 3)
    dm = DaliDataModule(DataSettings(data=data, batch_size=a.batch, cache_dir=a.cache_dir, scan="off",
                                     val_fraction=0.0),
                        PipelineSettings(device=a.device, num_threads=cores), spec, Path(tempfile.mkdtemp()))
    dm.prepare_data()
    dm.setup_manifest(1)
    train, classes = dm.manifest.train, dm.manifest.classes
    precisions = ["bf16-mixed", "16-mixed"] if gpu else ["bf16-mixed"]
    if gpu and not torch.cuda.is_bf16_supported():
        precisions = ["16-mixed"]
    out = {}
    for precision in precisions:
        for clip in (None, 1.0):
            for loader in ("synthetic", "dali"):
                name = f"{precision}, clip {clip or 'off'}, {loader}"
                events = StepEvents(gpu)

                def make_trainer(callbacks, max_steps, precision=precision, clip=clip, events=events):
                    return pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=1, precision=precision,
                                      max_steps=max_steps, max_epochs=-1, gradient_clip_val=clip,
                                      gradient_clip_algorithm="norm", logger=DummyLogger(), enable_checkpointing=False,
                                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                                      num_sanity_val_steps=0, callbacks=callbacks + [events.callback])

                def make_module(precision=precision, clip=clip):
                    module = ImageClassifier(ModelSettings(model=a.model, lr=1e-3, precision=precision,
                                                           clip_grad_norm=clip), seed=0, classes=classes)
                    module.metric_lines = False
                    return module

                def build(loader=loader):
                    return (Synthetic(a.batch, spec, len(classes), device) if loader == "synthetic"
                            else dm.loader(train, training=True))

                with quiet_lightning():
                    m = measure(name, build, device=device, batch_size=a.batch, warmup=a.warmup, steps=a.steps,
                                cores=cores, classes=classes, make_module=make_module, make_trainer=make_trainer,
                                label=f"steps {name}")["metrics"]
                out[name] = {"images_per_sec": m["images_per_sec"], "data_wait_fraction": m["data_wait_fraction"],
                             "gpu_util_mean": m.get("gpu_util_mean"), **events.summary(a.warmup)}
    return {"model": a.model, "batch": a.batch, "steps": a.steps, "runs": out}


def probe(a) -> int:
    from dali_pipe.benchrun import pin_cpus

    cores = len(pin_cpus(None))
    report = {"device": a.device, "cores": cores, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    failed = []
    wanted = set(a.parts.split(","))
    parts = [(name, fn) for name, fn, key in (("decode", decode_part, "decode"),
                                               ("decode, old nvJPEG", old_nvjpeg_part, "old"),
                                               ("steps", steps_part, "steps"))
             if key in wanted and (key != "old" or a.old_nvjpeg)]
    for part, fn in parts:
        t0 = time.perf_counter()
        print(f"== probe: {part}", flush=True)
        try:
            report[part] = fn(a.data, a, cores)
        except Exception as e:  # reported, and the next part still runs
            traceback.print_exc()
            report[part] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}"}
            failed.append(part)
        report.setdefault("seconds", {})[part] = round(time.perf_counter() - t0, 1)
        tmp = Path(f"{a.out}.tmp-{os.getpid()}")  # whole or not at all, after each part
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, a.out)
    print(f"probe: wrote {a.out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def data(root: str, pack: str) -> int:
    """The check's data: 672 real photos at 400-600 px (ImageNet-size), and their pack (about 10 shards)."""
    from dali_pipe.cli.commands import main as commands
    from dali_pipe.demo import make_photo_dataset

    t0 = time.perf_counter()
    make_photo_dataset(root, classes=7, per_class=96, side=(400, 600))
    print(f"data: {root} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return commands(["pack", root, pack, "--workers", "4", "--val-fraction", "0", "--shard-size", "4MB"]) or 0


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _m(spread: dict | None, fmt: str = "{:.0f}") -> str:
    """median (min-max) of a spread, or '-'."""
    if not spread:
        return "-"
    med, lo, hi = (fmt.format(spread[k]) for k in ("median", "min", "max"))
    return med if lo == hi else f"{med} ({lo}-{hi})"


def _refused(v: dict) -> str:
    """'N of M' per run, or '-' where not counted (the CPU device)."""
    counts = [c for c in v.get("to_cpu") or [] if c is not None]
    return "-" if not counts else ", ".join(f"{c} of {v.get('images')}" for c in counts)


def summary(out: str, steps_tsv: str, seconds: str) -> int:
    """The check's summary (markdown) from what its steps left in OUT."""
    out_dir = Path(out)
    lines = [f"# GPU check, {time.strftime('%Y-%m-%d')}: {seconds} s in all", ""]
    versions_txt = (out_dir / "versions.txt").read_text() if (out_dir / "versions.txt").exists() else ""
    for prefix in ("gpu", "torch", "dali:", "nvjpeg:", "stack", "not installed", "dali+torch", "checks:"):
        lines += [f"- {ln}" for ln in versions_txt.splitlines() if ln.startswith(prefix)]
    lines += ["", "| step | result | seconds |", "|---|---|---|"]
    rows = [ln.split("\t") for ln in Path(steps_tsv).read_text().splitlines()] if Path(steps_tsv).exists() else []
    lines += [f"| {r[0]} | {r[1]} | {r[2]} |" for r in rows if len(r) == 3]
    tests = (out_dir / "gpu-tests.txt").read_text() if (out_dir / "gpu-tests.txt").exists() else ""
    measured = [ln for ln in tests.splitlines() if re.match(r"(GPU decode|CPU decode|GPU vs CPU|ViT-B/16 batch)", ln)]
    result = [ln for ln in tests.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    if tests:
        lines += ["", "GPU tests: " + (result[-1].strip("= ") if result else "no result line")]
        lines += [f"- {ln}" for ln in measured]
        lines += [f"- {ln}" for ln in tests.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    for name, label in (("benchmark.json", "benchmark"), ("benchmark-recipe.json", "recipe benchmark")):
        r = _load(out_dir / name)
        if not r:
            continue
        env, cfg = r.get("env", {}), r.get("config", {})
        lines += ["", f"{label}: {cfg.get('model')} batch {cfg.get('batch_size')}, {cfg.get('precision')}, "
                      f"{env.get('gpu')}, {env.get('cpus')} cores",
                  "| loader | images/s median (min-max) | data-wait | GPU % mean | GPU % p5 | CPU % |",
                  "|---|---|---|---|---|---|"]
        for loader, m in r.get("loaders", {}).items():
            lines.append(f"| {loader} | {_m(m.get('images_per_sec_rounds'))} | {m.get('data_wait_fraction') or 0:.1%} "
                         f"| {m.get('gpu_util_mean') or 0:.0f} | {m.get('gpu_util_p5') or 0:.0f} | "
                         f"{m.get('cpu_util_mean') or 0:.0f} |")
        lines += [f"- {k}: {_m(v, '{:.2f}')}x" for k, v in r.get("ratios", {}).items()]
    p = _load(out_dir / "probe.json") or {}
    for part in ("decode", "decode, old nvJPEG"):
        dec = p.get(part) or {}
        if dec.get("error"):
            lines += ["", f"probe, {part}: FAILED: {dec['error']}"]
        elif dec:
            lines += ["", f"{part}, loaders alone, {dec.get('nvjpeg')}, the pipeline's training decode: "
                          f"{dec.get('training_decode')} (batch {dec['batch']}, {dec['threads']} DALI threads, "
                          f"{dec['images']} training photos), runs alternating:",
                      "| configuration | images/s | CPU % | decoded on the CPU (nvImageCodec's refusals) |",
                      "|---|---|---|---|"]
            lines += [f"| {k} | {_m(v['images_per_sec'])} | {_m(v['cpu_util_mean'])} | "
                      f"{_refused(v)} |" for k, v in dec["configs"].items()]
            lines += [f"- {k}: {_m(v, '{:.2f}')}x" for k, v in dec["ratios"].items()]
            reasons = {r for v in dec["configs"].values() for r in ((v.get("refusals") or {}).get("reasons") or {})}
            lines += [f"- refused because: {r}" for r in sorted(reasons)]
    st = p.get("steps") or {}
    if st.get("error"):
        lines += ["", f"probe, steps: FAILED: {st['error']}"]
    elif st:
        lines += ["", f"steps: {st['model']} batch {st['batch']}, {st['steps']} timed steps each; GPU times from CUDA "
                      "events (median, min-max over the steps):",
                  "| run | images/s | GPU step ms | GPU idle before the next step, ms | idle share | host next() ms |",
                  "|---|---|---|---|---|---|"]
        runs = st["runs"]
        for k, v in runs.items():
            share = v.get("gap_share")
            lines.append(f"| {k} | {v['images_per_sec'] or 0:.0f} | {_m(v.get('gpu_step_ms'), '{:.1f}')} | "
                         f"{_m(v.get('gap_ms'), '{:.2f}')} | {'-' if share is None else f'{share:.1%}'} | "
                         f"{_m(v.get('fetch_ms'), '{:.1f}')} |")
        for precision in sorted({k.split(",")[0] for k in runs}):
            off, on = runs.get(f"{precision}, clip off, synthetic"), runs.get(f"{precision}, clip 1.0, synthetic")
            if off and on and off.get("gpu_step_ms") and on.get("gpu_step_ms"):
                lines.append(f"- {precision}: clipping costs {on['gpu_step_ms']['median'] / off['gpu_step_ms']['median']:.3f}x "
                             "the GPU step time (synthetic data)")
            d, syn = runs.get(f"{precision}, clip off, dali"), runs.get(f"{precision}, clip off, synthetic")
            if d and syn and d.get("gap_share") is not None and syn.get("gap_share") is not None:
                lines.append(f"- {precision}: the GPU idles {d['gap_share']:.1%} of the time between steps fed by DALI "
                             f"against {syn['gap_share']:.1%} with synthetic data (next() blocking the host shows here)")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("versions")
    d = sub.add_parser("data")
    d.add_argument("root")
    d.add_argument("pack")
    sm = sub.add_parser("summary")
    sm.add_argument("out")
    sm.add_argument("steps_tsv")
    sm.add_argument("seconds")
    p = sub.add_parser("probe")
    old = sub.add_parser("decode-only", help="(the probe's second process) the training decodes under "
                                             "LD_LIBRARY_PATH's nvJPEG, as JSON to OUT")
    for q in (p, old):
        q.add_argument("data")
        q.add_argument("out")
        q.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
        q.add_argument("--batch", type=int, default=128)
        q.add_argument("--steps", type=int, default=30)
        q.add_argument("--warmup", type=int, default=8)
        q.add_argument("--rounds", type=int, default=2)
        q.add_argument("--cache-dir", default=os.environ.get("DALI_PIPE_CACHE", "/tmp/dali_pipe_cache"))
    p.add_argument("--model", default=VIT_B16_RANDOM)
    p.add_argument("--pack", help="DATA's pack: also time the training decode fed by the shard reader")
    p.add_argument("--parts", default="decode,old,steps",
                   help="which parts run, of decode,old,steps (old: only with --old-nvjpeg); default all")
    p.add_argument("--old-nvjpeg", metavar="DIR",
                   help="a folder holding an nvJPEG older than 13.2 (libnvjpeg.so.N): also time the training decodes "
                        "with it, in a second process (the CUDA 12 stack's case)")
    a = ap.parse_args(argv)
    if a.cmd == "versions":
        return versions()
    if a.cmd == "data":
        return data(a.root, a.pack)
    if a.cmd == "summary":
        return summary(a.out, a.steps_tsv, a.seconds)
    if a.cmd == "decode-only":
        from dali_pipe.benchrun import pin_cpus

        a.pack = None
        Path(a.out).write_text(json.dumps(decode_part(a.data, a, len(pin_cpus(None)), old_nvjpeg=True), indent=1))
        return 0
    return probe(a)


if __name__ == "__main__":
    sys.exit(main())
