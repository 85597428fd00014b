"""Small builders the tests share: CPU pipeline options, a DataModule and model settings."""
from __future__ import annotations

from pathlib import Path

from dali_pipe.config import DataSettings, ModelSettings, PipelineSettings
from dali_pipe.pipeline import Augment, PipelineOptions, resources_for_rank


def cpu_options(batch_size: int, *, threads: int = 1, training: bool = True, augment: dict | None = None,
                **kw) -> PipelineOptions:
    """PipelineOptions for a CPU pipeline with `threads` DALI threads (and PipelineSettings `augment`)."""
    settings = PipelineSettings(device="cpu", num_threads=threads, **(augment or {}))
    res = resources_for_rank(settings, training=training)
    return PipelineOptions(batch_size=batch_size, device="cpu", resources=res, augment=Augment.from_settings(settings),
                           **kw)


def datamodule(data, output, *, batch_size: int, cache_dir, spec, device: str = "cpu", threads: int = 1, **data_kw):
    from dali_pipe.datamodule import DaliDataModule

    return DaliDataModule(DataSettings(data=str(data), batch_size=batch_size, cache_dir=str(cache_dir), **data_kw),
                          PipelineSettings(device=device, num_threads=threads), spec, Path(output))


def tiny_settings(**kw) -> ModelSettings:
    return ModelSettings(**{"model": "tiny", "lr": 1e-3, "precision": "32-true", **kw})


class Batches:
    """A fixed list of batches as one iterable loader (Lightning reads a plain list as several loaders)."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.batch_size = len(self.batches[0][1])

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def hold_lock(directory, what: str):
    """Another process that holds `directory`'s lock (as a running job would); returns it, holding."""
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    holder = subprocess.Popen([sys.executable, "-c", f"import sys, time; sys.path.insert(0, {root!r})\n"
                               "from dali_pipe.workdir import lock\n"
                               f"lock({str(directory)!r}, {what!r}, 'x'); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder
