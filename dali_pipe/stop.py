"""A stop asked for by SIGTERM or Ctrl-C while a command runs outside training: a flag that the signal handler
sets (ask) and the command's own code acts on where it looks at it (check), never an exception raised from
whatever code the signal happens to land in.

Raised from arbitrary code, a stop was lost once inside a __del__ (Python prints and drops what a finaliser
raises: the run went on to its end, exit 0), and it could cut the rename that lands a file, the removal of a
temporary one or a lock's release. Raised by check(), at the points the commands chose, it unwinds as any other
error does: temporary files removed, locks released, then "stopped by SIGTERM" (143) or "stopped by Ctrl-C" (130).

Where the commands look: once per file, shard, batch or page in their loops, and every POLL seconds in their
waits (result(), sleep(), join(), completed()), so a stop is acted on within about POLL seconds of a wait, or after the one
step that cannot look at a flag: an import, a DALI pipeline's build, one object-store request (bounded by its
own timeouts). Imports are not cut short either: tried (2026-12-06), a stop raised while the modules loaded ended
most commands 0.03-0.37 s after the signal instead of 2.7-7.3 s, but one of 21 landed inside scipy's import of a
pybind11 extension, whose retry failed ("type 'ObjSense' is already registered") and left the process hanging.
A second Ctrl-C stops the process at once (the first gives SIGINT its default action back).

Training has its own handlers (model/checkpoint.py, SpotSafeCheckpoint: save after the current step, every rank
at the same step); they take over a stop asked for before they were installed (asked()).

Why not a library: the standard library's signal module is the mechanism; what is ours is where the commands
look, which no library can know.
"""
from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

POLL = 0.1  # seconds between two looks at the flag while a command waits

_asked: list[int | None] = [None]  # the first stop's signal number, until clear()


class Terminated(SystemExit):
    """SIGTERM outside training (sync, scan, pack, predict, evaluate, export): unwind, removing temporary files,
    and exit 143."""

    def __init__(self):
        super().__init__(143)


def ask(signum: int, frame=None) -> None:
    """The commands' signal handler for SIGTERM and SIGINT: note the stop and return. Ctrl-C gives SIGINT its
    default action back, so that a second one stops the process at once, even inside a long call."""
    if signum == signal.SIGINT and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    if _asked[0] is None:
        _asked[0] = signum


def asked() -> int | None:
    """The signal that asked for a stop (signal.SIGTERM or signal.SIGINT), or None."""
    return _asked[0]


def clear() -> None:
    """Forget a stop (the CLI, once it has told it; the tests, which call the CLI in their own process)."""
    _asked[0] = None


def check() -> None:
    """In the main thread, raise the stop asked for, if any: Terminated for SIGTERM, KeyboardInterrupt for Ctrl-C.
    Other threads go on: the main thread acts on the stop, and its unwinding cancels their work (a fetcher of a
    training run's stream cache, say, must not fail a step that SpotSafeCheckpoint is about to save after)."""
    signum = _asked[0]
    if signum is None or threading.current_thread() is not threading.main_thread():
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated()


def sleep(seconds: float) -> None:
    """time.sleep(seconds), looking at the flag every POLL seconds."""
    end = time.monotonic() + seconds
    while True:
        check()
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(POLL, left))


def join(thread: threading.Thread) -> None:
    """thread.join(), looking at the flag every POLL seconds."""
    while thread.is_alive():
        check()
        thread.join(POLL)


def completed(futures):
    """concurrent.futures.as_completed(futures), looking at the flag every POLL seconds."""
    pending = set(futures)
    while pending:
        check()
        done, pending = wait(pending, timeout=POLL, return_when=FIRST_COMPLETED)
        yield from done


def result(future: Future, timeout: float | None = None):
    """future.result(timeout), looking at the flag every POLL seconds; the future is cancelled when the wait
    ends without its result (a stop, the timeout), so that nothing keeps running for a caller that is gone."""
    end = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            check()
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no result within {timeout} s")
            try:
                return future.result(POLL if left is None else min(POLL, left))
            except TimeoutError:
                if future.done():  # the future's own TimeoutError (a request's), not this wait's
                    raise
    except BaseException:
        future.cancel()
        raise


def each(items, every: int = 256):
    """The items of `items`, the flag looked at every `every` of them: a loop over a million files or keys."""
    for i, item in enumerate(items):
        if not i % every:
            check()
        yield item
