"""The command layer: it composes the library (dali_pipe's stages, model/) into commands.

    train.py [flags]           -> fit.run (training) or bench.run (--benchmark)
    train.py train [flags]     -> sagemaker.run_sagemaker (the SageMaker container contract; also with no
                                  arguments inside a job; `serve` is refused in one line)
    python -m dali_pipe CMD    -> commands.main (sync, ...)

Nothing outside this package imports it (tests/test_layers.py checks). Importing it is cheap:
only the settings are loaded until a command runs, so `--help` and a bad flag answer at once.
"""
from __future__ import annotations

import signal
import sys
import time
import warnings
from pathlib import Path

from ..config import TRAIN_GROUPS, Settings, UsageError, build_parser, parse, resolve, settings_from, validate
from ..demo import demo_dataset
from ..errors import UserError, dali_missing
from ..redact import RedactingStream, redact
from ..workdir import is_disk_full

TRAIN_DOC = """Train an image classifier from a dataset.tsv of JPEGs (local or S3) with a DALI pipeline.

    python train.py                                   # demo: tiny ViT on generated photos, CPU ok
    python train.py --data DIR --model tiny --epochs 2 --device cpu --output OUT
    python train.py --data s3://bucket/prefix --model google/vit-base-patch16-224
    python train.py --benchmark --data DIR --model none --output OUT
    python train.py train                             # SageMaker: reads SAGEMAKER_BASE_DIR (default /opt/ml)
"""

__all__ = ["main", "cli", "parse_train", "UsageError"]


def train_parser():
    return build_parser("python train.py", TRAIN_DOC.split("\n\n")[0], TRAIN_GROUPS,
                        epilog="A first argument 'train' runs the SageMaker container contract: flags come "
                               "from /opt/ml/input/config/hyperparameters.json ($SAGEMAKER_BASE_DIR instead of "
                               "/opt/ml to run it without Docker); with no arguments inside a job it runs too.")


def parse_train(argv: list[str]) -> Settings:
    """train.py's flags -> checked Settings (every problem listed in one UsageError)."""
    ns, problems = parse(argv, train_parser())
    s = settings_from(ns)
    validate(s, TRAIN_GROUPS, problems)
    return s


def prepared(s: Settings) -> Settings:
    """Resolve the computed defaults; without --data, generate the demo set of real photos."""
    demo = s.data.data is None
    s = resolve(s)
    if demo:
        s.data.data = str(demo_dataset(s.data.cache_dir, seed=s.data.seed))
        print(f"demo: no --data given; training on generated photos in {s.data.data}")
    return s


def process_start() -> float:
    """This process's start as a `time.perf_counter()` value (the interpreter's start, before any import)."""
    import psutil

    return time.perf_counter() - max(0.0, time.time() - psutil.Process().create_time())


def main(argv: list[str] | None = None) -> dict:
    """train.py as a library: `main([...flags])` trains or benchmarks and returns the result dict."""
    # the origin of --monitor's time budget: the process's start when this process is the command (so a
    # restart's start-up share holds the interpreter and its imports), else this call's start
    started = process_start() if argv is None else time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["train"], ["serve"]) or not argv:  # a first argument only: a flag's value never lands here
        from . import sagemaker  # lazy: a command's module loads Lightning (~10 s); --help must answer at once

        if argv[:1] == ["serve"]:
            raise UsageError(sagemaker.SERVE_MESSAGE)
        if argv or sagemaker.in_job():  # no arguments inside a job: SDK 3's ModelTrainer starts the image so
            if not argv:
                print("sagemaker: started with no command inside a training job: running the training contract")
            return sagemaker.run_sagemaker(argv[1:], main)
    s = prepared(parse_train(argv))
    if s.bench.benchmark:
        from .bench import run  # lazy: as above, the benchmark command loads Lightning

        return run(s)
    from .fit import run  # lazy: as above, the training command loads Lightning

    return run(s, started)


class Terminated(SystemExit):
    """SIGTERM outside training (sync, scan, export): unwind, removing temporary files, and exit 143."""

    def __init__(self):
        super().__init__(143)


def _terminate(signum, frame):
    raise Terminated()


_OURS = (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2] / "model"))
_python_format = warnings.formatwarning


def plain_warning(message, category, filename, lineno, line=None) -> str:
    """Our own warnings (a UserWarning raised in dali_pipe or model) as one 'warning:' line, the way errors
    print; others as Python prints them (their file and line help whoever reports them)."""
    if issubclass(category, UserWarning) and str(Path(filename).resolve()).startswith(_OURS):
        return f"warning: {message}\n"
    return _python_format(message, category, filename, lineno, line)


def cli(entry=main) -> int:
    """Entry point: secrets never printed, SIGTERM handled from the first line, and user errors (and a
    full disk) as one clear message with exit status 2 instead of a traceback."""
    if not isinstance(sys.stdout, RedactingStream):
        sys.stdout, sys.stderr = RedactingStream(sys.stdout), RedactingStream(sys.stderr)
    warnings.formatwarning = plain_warning
    signal.signal(signal.SIGTERM, _terminate)  # training replaces it with its own (save, then exit 0)
    try:
        entry()
    except UserError as e:
        print(f"error: {redact(e)}", file=sys.stderr)
        return 2
    except Terminated:
        print("stopped by SIGTERM", file=sys.stderr)
        return 143
    except KeyboardInterrupt:  # Ctrl-C: unwound like SIGTERM (temporary files removed), the shell's status
        print("stopped by Ctrl-C", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # installed without a DALI extra: say which to install
        missing = dali_missing(e)
        if missing is None:
            raise
        print(f"error: {missing}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk wherever it strikes (an output file, a log): one line, not a traceback

        if not is_disk_full(e):
            raise
        print(f"error: no space left on device writing {redact(e.filename or 'a file')}; free space there (or "
              "write elsewhere) and rerun", file=sys.stderr)
        return 2
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0
