"""The command layer: it composes the library (dali_pipe's stages, model/) into commands.

    train.py [flags]           -> fit.run (training) or bench.run (--benchmark)
    train.py train [flags]     -> sagemaker.run_sagemaker (the SageMaker container contract; also with no
                                  arguments inside a job; `serve` is refused in one line)
    python -m dali_pipe CMD    -> commands.main (sync, ...)

Nothing outside this package imports it (tests/test_layers.py checks). Importing it is cheap:
only the settings are loaded until a command runs, so `--help` and a bad flag answer at once.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

from ..config import TRAIN_GROUPS, DataSettings, Settings, UsageError, default_cache_dir, resolve, validate
from ..demo import demo_dataset
from ..errors import RunFailed, UserError, dali_missing
from ..limits import own_process
from ..redact import RedactingStream, redact
from ..stop import Terminated, ask, check, clear
from ..workdir import fix_for, is_disk_full, output_failure
from .parser import build_parser, parse, settings_from

TRAIN_DOC = """Train an image classifier from a dataset.tsv of JPEGs (local or S3) with a DALI pipeline.

    python train.py                                   # demo: tiny ViT on generated photos, CPU ok
    python train.py --data DIR --model tiny --epochs 2 --device cpu --output OUT
    python train.py --data s3://bucket/prefix --model google/vit-base-patch16-224
    python train.py --benchmark --data DIR --model none --output OUT
    python train.py train                             # SageMaker: reads SAGEMAKER_BASE_DIR (default /opt/ml)
"""

__all__ = ["main", "cli", "parse_train", "described", "UsageError"]


def train_parser():
    return build_parser("python train.py", TRAIN_DOC.split("\n\n")[0], TRAIN_GROUPS,
                        epilog="A first argument 'train' runs the SageMaker container contract: flags come "
                               "from /opt/ml/input/config/hyperparameters.json ($SAGEMAKER_BASE_DIR instead of "
                               "/opt/ml to run it without Docker); with no arguments inside a job it runs too.")


def parse_train(argv: list[str]) -> Settings:
    """train.py's flags -> checked Settings (every problem listed in one UsageError)."""
    ns, problems = parse(argv, train_parser())
    s = settings_from(ns)
    validate(s, TRAIN_GROUPS, problems, data_check=data_check)
    return s


def data_check(data: str) -> str | None:
    """What is wrong with --data (inputs.data_problem), asked once the flags have parsed."""
    with command_imports():
        from ..inputs import data_problem  # lazy: the registry loads numpy (0.3 s); --help answers at once
    return data_problem(data)


def prepared(s: Settings) -> Settings:
    """Resolve the computed defaults; without --data, generate the demo set of real photos."""
    demo = s.data.data is None
    s = resolve(s)
    if demo:
        s.data.data = str(demo_dataset(s.data.cache_dir, seed=s.data.seed))
        print(f"demo: no --data given; training on generated photos in {s.data.data}")
    return s


class NoDataError(UserError):
    """--data (or pack's SRC) names a path that does not exist."""


def described(data: DataSettings, what: str = "--data") -> "Manifest | None":  # noqa: F821
    """The local dataset's manifest (a dataset.tsv folder's, or an ImageFolder's listing), read and checked
    before a command loads torch and Lightning (~10 s), so that a data mistake (a misspelt header, a CSV file, a
    split without train rows, a listed file that is missing, a class folder without images) is told at once;
    the command's DataModule takes it and does not read it again. A path that does not exist is said so, as
    `what`. None where there is nothing local to read as files: s3:// (or https://) data (its manifest is
    checked as it is synced, before the first GET), shards and tables (checked as they are opened), the demo."""
    with command_imports():
        from ..inputs import detect, forms_text, object_hint  # lazy: the registry loads numpy; --help at once

    if data.data is None or data.data.startswith(("https://", "http://")):  # https:// data: read as it is fetched
        return None
    form = detect(data.data, data.cache_dir or str(default_cache_dir()))
    if data.data.startswith("s3://"):  # (a few small requests; its files are synced with the heavy modules loaded)
        if form is None:
            raise NoDataError(f"{what} {data.data!r} holds none of the input forms, or nothing at all (check the "
                              f"prefix's spelling){object_hint(data.data)}; {what} may be:" + forms_text("\n    "))
        return None
    root = Path(data.data)
    if form is None and not os.path.lexists(root):
        raise NoDataError(f"{what} {data.data!r} does not exist; {what} may be:" + forms_text("\n    "))
    if form is None or form.reader != "files":  # (shards and tables are checked as they are opened)
        return None
    return form.read(dataclasses.replace(data, cache_dir=data.cache_dir or str(default_cache_dir())))


_COMMAND = False  # set by as_a_command(): this process is one of our commands, not a library user's
NO_FULL_PASS = 1 << 30  # the collector's third threshold while a command's heavy modules load: no full pass


def as_a_command() -> None:
    """For a process started as a command (train.py, python -m dali_pipe): its exit skips the interpreter's
    shutdown collection over the ~440k objects torch, Lightning and transformers hold, 3 s of every exit
    on 2 cores (a SIGTERM's exit included, inside a spot reclaim's two minutes). At exit, after the other
    atexit handlers, the garbage there is then is collected (its finalizers run) and what is alive is
    frozen (gc.freeze), so the final collection has nothing to walk; module teardown, stream flushes and
    finalizers of objects freed by reference count run as usual. Not for library use: a process that goes
    on would keep the frozen objects.

    What the command's imports made (modules, classes, functions: alive until exit) is frozen here already,
    as gc.freeze's documentation suggests for long-lived objects: no collection walks it again, neither those
    of the run nor the one at exit (12 ms -> 1 ms of a `python -m dali_pipe sync` on 2 cores). The garbage
    the imports left, if any, is never collected: no finalizer of ours is in it. The entry points (train.py,
    dali_pipe/__main__.py) turn the collector off before their first import, so that none of its passes runs
    while the imports build what is frozen here; it is turned back on here. The heavy modules a command
    loads later go through command_imports() the same way."""
    global _COMMAND
    _COMMAND = True
    own_process()  # the transfer engines may tune this process's malloc and open-file limit (never a user's)
    gc.freeze()
    gc.enable()
    atexit.register(_freeze_at_exit)  # registered first, so it runs last (atexit runs handlers in reverse)


@contextlib.contextmanager
def command_imports():
    """Around a command's lazy import of its heavy modules (torch, Lightning, transformers, numpy): no full
    collection runs while they load, and what they made is frozen once they have (gc.freeze), as as_a_command()
    does for the first imports. Loading torch, Lightning and transformers makes some 470k objects that live until
    exit, and the collector walks them over and over as they come (1069 young, 97 middle and 7 full passes):
    about a fifth of the import. Without the full passes, `from dali_pipe.cli.fit import run` takes 3.15 s
    instead of 4.03 (2 cores, medians of 6 alternating rounds). The young passes still run: with the collector
    off it took 2.96 s, but the garbage the import makes (12 000 objects, 8 MB, mostly copies of sys.modules
    that inspect's signature parsing keeps in cycles) was frozen with the rest for the process's life. In
    library use (main() called from the user's code, as_a_command() never called), or with the collector off
    already, it changes nothing."""
    if not _COMMAND or not gc.isenabled():
        yield
    else:
        thresholds = gc.get_threshold()
        try:
            gc.set_threshold(thresholds[0], thresholds[1], NO_FULL_PASS)
            yield
        finally:
            gc.freeze()
            gc.set_threshold(*thresholds)
    check()  # a stop asked for while they loaded (seconds, in which nothing looks at the flag)


def _freeze_at_exit() -> None:
    gc.collect()
    gc.freeze()


def process_start() -> float:
    """This process's start as a `time.perf_counter()` value (the interpreter's start, before any import)."""
    import psutil

    return time.perf_counter() - max(0.0, time.time() - psutil.Process().create_time())


def stream_refusal(s: Settings):
    """A pack streamed from S3: a --stream-cache (or a disk) too small for its readers, found before torch and
    Lightning load, from packed.json (one GET; shards/preflight.py), as the refusal to raise (or None); before, it
    came 15-17 s later, once the index files were local. One node with a number of devices ('auto' is known only
    once torch has looked; the DataModule's check still applies to every run)."""
    if not (s.data.data or "").startswith("s3://") or s.run.num_nodes != 1 or not isinstance(s.run.devices, int):
        return None
    with command_imports():
        from ..shards.preflight import stream_preflight  # lazy: the transfer engine and numpy; --help answers at once

    try:
        stream_preflight(s.data.data, s.data.cache_dir or default_cache_dir(), mode=s.data.packed_s3,
                         stream_cache=s.data.stream_cache, batch=s.data.batch_size, seed=s.data.seed,
                         world=s.run.devices, local_ranks=s.run.devices)
    except UserError as e:
        return e
    return None


def main(argv: list[str] | None = None, style: str = "flag") -> dict:
    """train.py as a library: `main([...flags])` trains or benchmarks and returns the result dict. `style`:
    how the user named the settings (config.named; "hyperparameter" under SageMaker), for the advice printed."""
    # the origin of --monitor's time budget: the process's start when this process is the command (so a
    # restart's start-up share holds the interpreter and its imports), else this call's start
    started = process_start() if argv is None else time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["train"], ["serve"]) or not argv:  # a first argument only: a flag's value never lands here
        with command_imports():
            from . import sagemaker  # lazy: a command's module loads Lightning (~10 s); --help must answer at once

        if argv[:1] == ["serve"]:
            raise UsageError(sagemaker.SERVE_MESSAGE)
        if argv or sagemaker.in_job():  # no arguments inside a job: SDK 3's ModelTrainer starts the image so
            if not argv:
                print("sagemaker: started with no command inside a training job: running the training contract")
            return sagemaker.run_sagemaker(argv[1:], main)
    s = parse_train(argv)
    # before torch and Lightning load, a data mistake is told at once; with several nodes the DataModule reads
    # it after this host has joined the others, so that a mistake stops them all at once (cli/hosts.py)
    manifest = described(s.data) if s.run.num_nodes == 1 else None
    refusal = None
    if not s.bench.benchmark:
        with command_imports():
            from .finished import fits, holds_a_run, nothing_to_do  # lazy: it loads numpy (0.3 s); --help at once

        refusal = stream_refusal(s)
        if refusal is not None and not holds_a_run(s.run.output):
            raise refusal  # (a finished run's folder is asked first whether there is anything to do: below)
        fits(s, manifest)  # --batch-size and --grad-accum against a local training split
    s = prepared(s)  # (it may load torch, to ask for a GPU)
    if s.bench.benchmark:
        with command_imports():
            from .bench import run  # lazy: as above, the benchmark command loads Lightning

        return run(s, manifest)
    done = nothing_to_do(s, manifest)  # a finished run's rerun, told before torch and Lightning load
    if done is not None:
        return done
    if refusal is not None:
        raise refusal
    with command_imports():
        from .fit import run  # lazy: as above, the training command loads Lightning

    return run(s, manifest, style, started=started)


def exit_status(result) -> int:
    """0, or 130 for a run that Ctrl-C stopped after saving its checkpoint."""
    return 130 if isinstance(result, dict) and result.get("stopped_by") == "SIGINT" else 0


_OURS = (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2] / "model"))
_python_format = warnings.formatwarning


def plain_warning(message, category, filename, lineno, line=None) -> str:
    """Our own warnings (a UserWarning raised in dali_pipe or model) as one 'warning:' line, the way errors
    print; others as Python prints them (their file and line help whoever reports them)."""
    if issubclass(category, UserWarning) and str(Path(filename).resolve()).startswith(_OURS):
        return f"warning: {message}\n"
    return _python_format(message, category, filename, lineno, line)


def cli(entry=main) -> int:
    """Entry point: secrets never printed, SIGTERM and Ctrl-C handled from the first line, and user errors
    (and a full disk) as one clear message with exit status 2 instead of a traceback; a failed run (training
    diverged) as one clear message with exit status 1. A command that cancelled object-store requests still
    running (a stop, a refusal while the LIST ran ahead) ends here (end_command)."""
    status = _cli(entry)
    transfer = sys.modules.get("dali_pipe.transfer")  # loaded only where requests were made
    if _COMMAND and transfer is not None and transfer.abandoned():
        end_command(status)
    return status


def end_command(status: int):
    """End this command's process with `status` as a normal exit would (streams flushed, non-daemon threads joined,
    atexit handlers run),
    but without the interpreter's finalization: obstore's own threads may still be finishing a cancelled request,
    and one that hands its result to a finalized interpreter crashes the process (SIGSEGV after "stopped by
    SIGTERM", 3 of 118 stopped syncs). Only in a command's own process (as_a_command), never in a user's."""
    sys.stdout.flush()
    sys.stderr.flush()
    threading._shutdown()  # what the interpreter's exit does first: the threads that are not daemons joined
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _cli(entry) -> int:
    if not isinstance(sys.stdout, RedactingStream):
        sys.stdout, sys.stderr = RedactingStream(sys.stdout), RedactingStream(sys.stderr)
    warnings.formatwarning = plain_warning
    sigterm = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, ask)  # a flag the commands look at (stop.py); training's own: save, then exit 0
    sigint = signal.getsignal(signal.SIGINT)
    if sigint is signal.default_int_handler:  # not where the shell ignores it (a job started with &)
        signal.signal(signal.SIGINT, ask)  # the same flag; training's own: save, then exit 130
    try:
        return exit_status(entry())
    except UserError as e:
        print(f"error: {redact(e)}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"error: {redact(e)}", file=sys.stderr)
        return 1
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
    except OSError as e:  # a full or read-only disk wherever it strikes (an output file, a log): one line
        failure = output_failure(e)
        if failure is None and not is_disk_full(e):
            raise
        if failure is None or "No space" in failure[1]:
            print(f"error: no space left on device writing {redact(e.filename or 'a file')}; free space there (or "
                  "write elsewhere) and rerun", file=sys.stderr)
        else:
            print(f"error: cannot write {redact(str(failure[0] or 'a file'))} ({failure[1]}); "
                  f"{redact(fix_for(failure[1], failure[0]))} (or write elsewhere) and rerun", file=sys.stderr)
        return 2
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if threading.current_thread() is threading.main_thread():  # as they were (the tests call cli() in their
            # own process); so a SIGTERM while the interpreter exits, the result told, ends it as SIGTERM does,
            # not with a traceback from an atexit handler
            signal.signal(signal.SIGTERM, sigterm if sigterm is not None else signal.SIG_DFL)
            if sigint is not None:
                signal.signal(signal.SIGINT, sigint)
        clear()
