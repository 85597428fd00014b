"""Small builders the tests share: CPU pipeline options, a DataModule and model settings."""
from __future__ import annotations

from contextlib import contextmanager
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


def datamodule(data, output, *, batch_size: int, cache_dir, spec, device: str = "cpu", threads: int = 1, manifest=None,
               **data_kw):
    from dali_pipe.datamodule import DaliDataModule

    return DaliDataModule(DataSettings(data=str(data), batch_size=batch_size, cache_dir=str(cache_dir), **data_kw),
                          PipelineSettings(device=device, num_threads=threads), spec, Path(output), manifest=manifest)


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


@contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` ("2m") mounted at `path` for the block (a full disk for real); the test is
    skipped, saying why, where this process may not mount one."""
    import subprocess

    import pytest

    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to fill a disk ({(r.stderr or r.stdout).strip()[:120]})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill the file system of `directory` up to `leave` bytes free; returns the filler file."""
    import shutil

    filler = directory / "filler"
    with open(filler, "ab") as f:
        while True:
            room = shutil.disk_usage(directory).free - leave
            if room <= 0:
                break
            try:
                f.write(b"\0" * min(room, 1 << 20))
                f.flush()
            except OSError:
                break
    return filler


def under_a_terminal(argv: list[str], env: dict, columns: int = 80, timeout: float = 600) -> tuple[int, str]:
    """(exit status, output) of a program run under a pseudo-terminal of `columns` columns (as `docker run -t`
    and SageMaker's local mode give it): its stdin, stdout and stderr, as a log scraper reads them."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdin, stdout and stderr are the terminal
        os.environ.update(env)
        os.execv(argv[0], argv)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        try:
            chunk = os.read(fd, 1 << 16) if ready else b""
        except OSError:  # the child closed the terminal
            break
        if ready and not chunk:
            break
        out += chunk
    else:
        os.kill(pid, 9)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")



def run_train(argv: list[str]) -> int:
    """train.py's entry in this process: its signal handlers, its one-line errors and exit status (the
    SIGTERM handler and the redacting streams it installs are put back afterwards)."""
    import signal
    import sys

    import train
    from dali_pipe.cli import cli

    old, streams = signal.getsignal(signal.SIGTERM), (sys.stdout, sys.stderr)
    try:
        return cli(lambda: train.main(argv))
    finally:
        signal.signal(signal.SIGTERM, old)
        sys.stdout, sys.stderr = streams


def copy_trained(trained: Path, dest: Path, *, model_only: bool = False) -> Path:
    """A copy of the session's trained OUT (`trained`: its model, checkpoints and TensorBoard folder), or with
    `model_only` of its model folder alone; never its lock file."""
    import shutil

    extra = ("checkpoints", "tensorboard") if model_only else ()
    shutil.copytree(trained, dest, ignore=shutil.ignore_patterns(".dali_pipe.lock", *extra))
    return Path(dest)


def s3_listing(client, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    """{key relative to `prefix`: (size, ETag)}, as boto3 (the peer) lists the bucket."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"][len(prefix):]] = (obj["Size"], obj["ETag"].strip('"'))
    return out


def told_before_torch(argv: list[str]) -> str:
    """What train.main(argv) raises, as 'ErrorName message', in a fresh process, checking that neither torch nor
    Lightning had loaded when it was raised (a mistake told at once, not after ~10 s of imports)."""
    import subprocess
    import sys

    code = ("import sys, train\n"
            f"try:\n    train.main({argv!r})\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n"
            "print(sorted(m for m in ('torch', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    lines = out.stdout.strip().splitlines()
    assert lines and lines[-1] == "[]", out.stdout + out.stderr[-2000:]
    return "\n".join(lines[:-1])
