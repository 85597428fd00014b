"""Measure where the time goes: a background sampler (GPU via NVML, CPU and RSS via psutil),
per-step timings, and a diagnosis in plain words. The same Lightning callback serves `--monitor`
during training and the benchmark's timed runs (which skip warm-up steps and synchronise the GPU
at the two ends of the timed window only).

Diagnosis rules (also in the README):
- input-bound: data-wait >= 10% of the time. Says whether the CPU is saturated (>= 80%: decoding
  cannot keep up) or not (I/O or too few workers/threads).
- compute-bound: data-wait < 10% and, on a GPU, utilization >= 90% (on the CPU: the step dominates).
- host-bound: data-wait < 10% but the GPU is under 90% busy (launch overhead, syncs, small batch).
- swings: GPU utilization p5 < 50% while the mean is >= 70%.
- stalls: steps over 3x the median; named as checkpoint saves or validation when at least half
  of them coincide with those events.
- busy cores: other processes used the pinned cores (their share is the cores' load minus this
  process tree's CPU time); the figures are then low.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytorch_lightning as pl

INPUT_BOUND_WAIT = 0.10
GPU_BUSY = 90.0
CPU_SATURATED = 80.0
STALL_FACTOR = 3.0
OTHER_LOAD_WARN = 0.25  # cores' worth of load from other processes that makes a measurement suspect


def nvml_handle(device_index: int):
    """The NVML handle of CUDA device `device_index`, found by its UUID or PCI bus id: NVML counts
    devices physically, CUDA after CUDA_VISIBLE_DEVICES, so their indices can differ."""
    import pynvml
    import torch

    props = torch.cuda.get_device_properties(device_index)
    uuid = str(getattr(props, "uuid", "") or "")
    if uuid:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except pynvml.NVMLError:
            pass
    bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    return pynvml.nvmlDeviceGetHandleByPciBusId(bus)


class Sampler:
    """Samples GPU utilization/memory (NVML), CPU utilization of the pinned cores, this process
    tree's CPU time and RSS, at `hz` in a daemon thread. No GPU sync: NVML reads counters."""

    def __init__(self, hz: float = 20.0, gpu_index: int | None = None):
        import psutil

        self.period = 1.0 / hz
        self.proc = psutil.Process()
        self.cores = sorted(os.sched_getaffinity(0))
        # t, gpu %, gpu MB, cpu % of the pinned cores, rss MB, this process tree's CPU seconds
        self.samples: list[tuple[float, float | None, float | None, float, float, float]] = []
        self.gpu_note = None
        self._nvml = self._handle = None
        if gpu_index is not None:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handle = nvml_handle(gpu_index)
            except Exception as e:  # no driver, no NVML: GPU fields stay null with this note
                self.gpu_note = f"NVML unavailable ({type(e).__name__}); GPU fields are null"
        else:
            self.gpu_note = "no GPU in use; GPU fields are null (data-wait per step is plotted instead)"
        self._stop = threading.Event()
        self._thread = None

    def _tree(self) -> tuple[float, float]:
        """(RSS MB, CPU seconds) of this process and its children (DataLoader workers)."""
        procs = [self.proc]
        try:
            procs += self.proc.children(recursive=True)
        except Exception:
            pass
        rss = cpu = 0.0
        for p in procs:
            try:
                rss += p.memory_info().rss
                t = p.cpu_times()
                cpu += t.user + t.system
            except Exception:
                pass
        return rss / 2**20, cpu

    def _sample(self):
        import psutil

        per = psutil.cpu_percent(percpu=True)  # since the previous call
        cpu = float(np.mean([per[c] for c in self.cores if c < len(per)]))
        gpu = mem = None
        if self._handle is not None:
            try:
                gpu = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20
            except Exception:
                pass
        rss, cpu_s = self._tree()
        self.samples.append((time.perf_counter(), gpu, mem, cpu, rss, cpu_s))

    def _run(self):
        while not self._stop.wait(self.period):
            self._sample()

    def start(self):
        import psutil

        psutil.cpu_percent(percpu=True)  # prime the CPU counters
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True, name="monitor-sampler")
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join()
        self._sample()  # at least one sample after the window, however short the run

    def window(self, t0: float, t1: float) -> dict:
        """Summary of the samples taken between t0 and t1 (the timed part, after warm-up)."""
        s = [x for x in self.samples if t0 <= x[0] <= t1] or self.samples[-1:]
        gpu = [x[1] for x in s if x[1] is not None]
        mem = [x[2] for x in s if x[2] is not None]
        cpu_mean = float(np.mean([x[3] for x in s])) if s else None
        other = None
        if len(s) >= 2 and s[-1][0] > s[0][0] and cpu_mean is not None:
            own = (s[-1][5] - s[0][5]) / (s[-1][0] - s[0][0])  # cores' worth used by this process tree
            load = float(np.mean([x[3] for x in s[1:]])) / 100 * len(self.cores)
            other = max(0.0, load - own)
        return {
            "cpu_util_mean": cpu_mean,
            "other_load_cores": other,
            "rss_peak_mb": float(max(x[4] for x in s)) if s else None,
            "gpu_util_mean": float(np.mean(gpu)) if gpu else None,
            "gpu_util_p5": float(np.percentile(gpu, 5)) if gpu else None,
            "gpu_mem_peak_mb": float(max(mem)) if mem else None,
            "gpu_timeline": [[round(x[0] - t0, 3), x[1]] for x in s if x[1] is not None],
        }


@dataclass
class StepLog:
    """Per-step wall time and time blocked waiting for the batch, plus marked events."""
    step_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    events: dict[int, str] = field(default_factory=dict)  # step index -> "checkpoint" | "validation"

    def summary(self, batch_size: int) -> dict:
        st = np.array(self.step_s) if self.step_s else np.zeros(1)
        total = float(st.sum())
        return {
            "steps": len(self.step_s),
            "images_per_sec": batch_size * len(self.step_s) / total if total > 0 else None,
            "step_ms_p50": float(np.percentile(st, 50) * 1e3),
            "step_ms_p95": float(np.percentile(st, 95) * 1e3),
            "step_ms_max": float(st.max() * 1e3),
            "data_wait_fraction": float(sum(self.wait_s) / total) if total > 0 else None,
        }

    def stalls(self) -> dict:
        if len(self.step_s) < 4:
            return {"count": 0}
        st = np.array(self.step_s)
        med = float(np.median(st))
        idx = [i for i, s in enumerate(st) if s > STALL_FACTOR * med]
        kinds = [self.events.get(i) for i in idx]
        return {"count": len(idx), "median_ms": med * 1e3,
                "max_ms": float(st.max() * 1e3),
                "checkpoint": sum(k == "checkpoint" for k in kinds),
                "validation": sum(k == "validation" for k in kinds)}


def diagnose(name: str, m: dict, *, cores: int, model: bool = True) -> list[str]:
    """Plain-words verdicts with the numbers behind them, for one loader's measurements."""
    out = []
    wait = m.get("data_wait_fraction") or 0.0
    cpu = m.get("cpu_util_mean") or 0.0
    gpu, p5 = m.get("gpu_util_mean"), m.get("gpu_util_p5")
    if not model and name == "synthetic":
        return [f"{name}: tensors already on the device, no input work at all; a reference point only."]
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
        out.append(f"{name}: compute-bound (CPU), the model step dominates and data-wait is {wait:.1%}.")
    elif gpu >= GPU_BUSY:
        out.append(f"{name}: compute-bound, the GPU is {gpu:.0f}% busy and data-wait is {wait:.1%}.")
    else:
        out.append(f"{name}: host-bound, the GPU is only {gpu:.0f}% busy although data-wait is {wait:.1%}; "
                   "kernel-launch overhead, syncs or a small batch leave it idle.")
    if gpu is not None and p5 is not None and p5 < 50 and gpu >= 70:
        out.append(f"{name}: GPU utilization swings: p5 {p5:.0f}% against a mean of {gpu:.0f}%.")
    st = m.get("stalls") or {}
    if st.get("count") and model:
        cause = ""
        if st.get("checkpoint", 0) * 2 >= st["count"]:
            cause = f"; {st['checkpoint']} of them line up with checkpoint saves (save less often or asynchronously)"
        elif st.get("validation", 0) * 2 >= st["count"]:
            cause = f"; {st['validation']} of them line up with validation runs"
        out.append(f"{name}: periodic stalls, {st['count']} step(s) took over {STALL_FACTOR:.0f}x the median "
                   f"({st['median_ms']:.0f} ms, worst {st['max_ms']:.0f} ms){cause}.")
    other = m.get("other_load_cores")
    if other is not None and other >= OTHER_LOAD_WARN:
        out.append(f"{name}: other processes kept {other:.1f} of the {cores} pinned core(s) busy during the "
                   "measurement; these figures are low, rerun on idle cores.")
    return out


class MonitorCallback(pl.Callback):
    """Lightning callback: step time, data-wait and GPU utilization during training (`--monitor`),
    or over a benchmark's timed window (`skip_steps` warm-up steps first, `sync_window` on a GPU).

    Data-wait is the host time between the end of one training batch and the start of the next
    (the fetch); nothing here calls `.item()` or synchronises the GPU inside the window. Logs
    `monitor/*` to the logger each epoch and prints the diagnosis at the end; `self.report` keeps it.
    """

    def __init__(self, output=None, hz: float = 20.0, *, skip_steps: int = 0, sync_window: bool = False,
                 name: str = "training", verbose: bool = True):
        self.output, self.hz = output, hz
        self.skip_steps, self.sync_window, self.name, self.verbose = skip_steps, sync_window, name, verbose
        self.steps = StepLog()
        self.report: dict | None = None
        self.t0 = self.t1 = None
        self._t_end = self._t_start = None
        self._seen = 0

    def _sync(self, pl_module) -> None:
        if self.sync_window and pl_module.device.type == "cuda":
            import torch

            torch.cuda.synchronize(pl_module.device)

    def on_train_start(self, trainer, pl_module):
        gpu = (pl_module.device.index or 0) if pl_module.device.type == "cuda" else None
        self.sampler = Sampler(self.hz, gpu).start()
        if not self.skip_steps:
            self._sync(pl_module)
            self.t0 = time.perf_counter()
        self._t_end = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        self._t_start = now
        self._wait = (now - self._t_end) if self._t_end is not None else 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._seen += 1
        if self._seen <= self.skip_steps:
            if self._seen == self.skip_steps:  # the timed window starts here
                self._sync(pl_module)
                self.t0 = self._t_end = time.perf_counter()
            return
        self._t_end = time.perf_counter()
        if self._t_start is not None:
            self.steps.step_s.append(self._t_end - self._t_start + self._wait)
            self.steps.wait_s.append(self._wait)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        in_step = self._t_start is not None and (self._t_end is None or self._t_end < self._t_start)
        self.steps.events[len(self.steps.step_s) - (0 if in_step else 1)] = "checkpoint"

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking and self.steps.step_s:
            self._val_t = time.perf_counter()

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and self.steps.step_s and getattr(self, "_val_t", None):
            self.steps.step_s[-1] += time.perf_counter() - self._val_t
            self.steps.events.setdefault(len(self.steps.step_s) - 1, "validation")
            self._val_t = None
            self._t_end = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        if self.steps.step_s and trainer.logger is not None and self.t0 is not None:
            w = self.sampler.window(self.t0, time.perf_counter())
            s = self.steps.summary(1)
            metrics = {"monitor/data_wait_fraction": s["data_wait_fraction"], "monitor/step_ms_p50": s["step_ms_p50"],
                       "monitor/cpu_util_mean": w["cpu_util_mean"]}
            if w["gpu_util_mean"] is not None:
                metrics["monitor/gpu_util_mean"] = w["gpu_util_mean"]
            trainer.logger.log_metrics({k: v for k, v in metrics.items() if v is not None}, step=trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        self._sync(pl_module)
        self.t1 = time.perf_counter()
        if self.steps.step_s and self._t_end is not None:
            self.steps.step_s[-1] += self.t1 - self._t_end  # work still queued on the GPU belongs to the window
        self.sampler.stop()
        batch = getattr(trainer.train_dataloader, "batch_size", 1) or 1
        m = {**self.steps.summary(batch), **self.sampler.window(self.t0 or self.t1, self.t1),
             "stalls": self.steps.stalls()}
        self.timeline = m.pop("gpu_timeline", None)
        m["diagnosis"] = diagnose(self.name, m, cores=len(self.sampler.cores))
        self.report = m
        if self.verbose and trainer.is_global_zero:
            for line in m["diagnosis"]:
                print(f"MONITOR {line}", flush=True)


def gpu_memory_outside_torch(device_index: int) -> float | None:
    """MB of GPU memory this process holds beyond torch's caching allocator: DALI's memory pool and
    nvJPEG's buffers (and the CUDA context). None where NVML cannot see this process (PID namespaces)."""
    import pynvml
    import torch

    try:
        pynvml.nvmlInit()
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(nvml_handle(device_index))
    except Exception:
        return None
    mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid() and p.usedGpuMemory]
    if not mine:
        return None
    return (mine[0] - torch.cuda.memory_reserved(device_index)) / 2**20


class DaliMemoryLog(pl.Callback):
    """On a GPU, after the first training epoch: how much GPU memory DALI holds beside torch."""

    def on_train_epoch_end(self, trainer, pl_module):
        if pl_module.device.type != "cuda" or getattr(self, "_done", False):
            return
        self._done = True
        mb = gpu_memory_outside_torch(pl_module.device.index or 0)
        if mb is None:
            return
        if trainer.logger is not None:
            trainer.logger.log_metrics({"memory/gpu_outside_torch_mb": mb}, step=trainer.global_step)
        if trainer.is_global_zero:
            print(f"dali: after epoch 1 this process holds {mb:.0f} MB of GPU memory beyond torch's (DALI's pool, "
                  "nvJPEG's buffers and the CUDA context)", flush=True)
