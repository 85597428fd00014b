"""What the monitor measures of the machine while a run goes on: CPU and GPU utilisation and memory sampled in a
thread (`Sampler`, the GPU through NVML), and the steps' times (`StepLog`: their spread and stalls).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

STALL_FACTOR = 3.0  # a step this many times the median is a stall


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
    """Per training step: its time (fetch, step and the loop's work; saves and validation are counted
    apart) and the part of it spent waiting for the batch."""
    step_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)

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
        return {"count": len(idx), "median_ms": med * 1e3, "max_ms": float(st.max() * 1e3)}


class TreeMemory:
    """The peak memory of this process and its children (DataLoader workers) over a stretch of a run, each page
    counted once: this process's peak RSS, exact where Linux keeps it (the high-water mark VmHWM, reset at
    start()), plus the most the children held of their own (USS: the pages a forked worker does not share with
    this process), read every `period` seconds in a thread. A sum of RSS counts the pages a forked worker shares
    with its parent once per worker: a ViT-B/16 benchmark on the CPU reported 10.8 GB so, of which the two
    workers' 3.1 GB each were almost all the parent's pages."""

    def __init__(self, period: float = 1.0):
        import psutil

        self.proc, self.period = psutil.Process(), period
        self.main_peak = self.workers_peak = 0.0
        self._exact = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _status_mb(self, key: str) -> float | None:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None

    def _sample(self) -> None:
        try:
            self.main_peak = max(self.main_peak, self.proc.memory_info().rss / 2**20)
            own = 0.0
            for child in self.proc.children(recursive=True):
                try:
                    own += child.memory_full_info().uss / 2**20
                except Exception:  # gone, or smaps unreadable: its RSS, an upper bound
                    try:
                        own += child.memory_info().rss / 2**20
                    except Exception:
                        pass
            self.workers_peak = max(self.workers_peak, own)
        except Exception:
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def start(self) -> "TreeMemory":
        try:
            with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS (Linux 4.0+)
            self._exact = True
        except OSError:
            pass
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tree-memory")
        self._thread.start()
        return self

    def stop(self) -> dict:
        """{rss_peak_mb: the tree's peak, main_rss_peak_mb, workers_mem_peak_mb}; stopping twice is harmless."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample()
            hwm = self._status_mb("VmHWM") if self._exact else None
            if hwm is not None:
                self.main_peak = max(self.main_peak, hwm)
        return {"rss_peak_mb": self.main_peak + self.workers_peak, "main_rss_peak_mb": self.main_peak,
                "workers_mem_peak_mb": self.workers_peak}
