"""A stop (SIGTERM, Ctrl-C) outside training is a flag: the handler only notes it, the command's own code acts on
it where it looks (check, and the waits that look every POLL seconds), in the main thread only."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest

from dali_pipe import stop


@pytest.fixture
def handlers():
    """stop.ask as SIGTERM's and SIGINT's handler for the test; both, and the flag, as they were afterwards."""
    old = signal.signal(signal.SIGTERM, stop.ask), signal.signal(signal.SIGINT, stop.ask)
    stop.clear()
    yield
    stop.clear()
    signal.signal(signal.SIGTERM, old[0])
    signal.signal(signal.SIGINT, old[1])


def _kill_soon(sig, after=0.2):
    threading.Timer(after, os.kill, (os.getpid(), sig)).start()


def test_the_handler_raises_nothing_and_check_raises_the_stop(handlers):
    """Code the signal lands in runs on (a finaliser, a rename, a lock's release); check() raises: Terminated
    (exit 143) for SIGTERM, KeyboardInterrupt for Ctrl-C, whose default action is back for a second one."""
    ran = []

    class Finaliser:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler runs here
            ran.append("__del__ ran to its end")

    Finaliser()
    assert ran == ["__del__ ran to its end"] and stop.asked() == signal.SIGTERM
    with pytest.raises(stop.Terminated) as e:
        stop.check()
    assert e.value.code == 143
    stop.clear()
    stop.check()  # nothing asked: nothing raised
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # a second Ctrl-C stops the process at once
    with pytest.raises(KeyboardInterrupt):
        stop.check()


def test_the_first_stop_asked_for_is_the_one_raised(handlers):
    stop.ask(signal.SIGTERM)
    stop.ask(signal.SIGINT)
    with pytest.raises(stop.Terminated):
        stop.check()


@pytest.mark.parametrize("sig, raised", [(signal.SIGTERM, stop.Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_each_wait_ends_within_a_poll_of_the_signal(handlers, sig, raised):
    """A future that never completes, an event never set, a thread that never ends, a long sleep: each wait
    ends by the stop, a few POLLs after the signal; the future is cancelled (its work dropped)."""
    release = threading.Event()
    never = threading.Thread(target=release.wait, daemon=True)
    never.start()
    future = Future()
    waits = {"result": lambda: stop.result(future), "wait": lambda: stop.wait(threading.Event()),
             "join": lambda: stop.join(never), "sleep": lambda: stop.sleep(60),
             "each": lambda: [time.sleep(0.001) for _ in stop.each(range(10 ** 6), every=10)]}
    try:
        for name, wait in waits.items():
            stop.clear()
            signal.signal(signal.SIGINT, stop.ask)
            _kill_soon(sig)
            start = time.monotonic()
            with pytest.raises(raised):
                wait()
            assert time.monotonic() - start < 0.2 + 5 * stop.POLL, name
        assert future.cancelled()
    finally:
        release.set()


def test_waits_return_what_they_waited_for(handlers):
    """No stop: the same results as the plain waits, and a future's own TimeoutError is its own."""
    done = Future()
    threading.Timer(0.15, done.set_result, ("value",)).start()
    assert stop.result(done) == "value"
    event = threading.Event()
    threading.Timer(0.15, event.set).start()
    assert stop.wait(event) is True and stop.wait(threading.Event(), timeout=0.15) is False
    with pytest.raises(TimeoutError, match="no result within"):
        stop.result(Future(), timeout=0.15)
    failed = Future()
    failed.set_exception(TimeoutError("the request's own"))
    with pytest.raises(TimeoutError, match="the request's own"):
        stop.result(failed)
    assert list(stop.each(range(1000), every=7)) == list(range(1000))


def test_other_threads_go_on(handlers):
    """A worker thread's check() does not raise: the main thread acts on the stop (a training run's stream-cache
    fetcher must not fail the step SpotSafeCheckpoint saves after)."""
    stop.ask(signal.SIGTERM)
    seen = []

    def worker():
        stop.check()
        seen.append(stop.sleep(0.15) is None)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [True]
    with pytest.raises(stop.Terminated):
        stop.check()
