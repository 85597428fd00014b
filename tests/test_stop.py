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
    """A future that never completes, a thread that never ends, a long sleep: each wait
    ends by the stop, a few POLLs after the signal; the future is cancelled (its work dropped)."""
    release = threading.Event()
    never = threading.Thread(target=release.wait, daemon=True)
    never.start()
    future = Future()
    waits = {"result": lambda: stop.result(future),
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


def _slow_shards(tmp_path, monkeypatch, module, name, n=12, each=0.3):
    """n local shard files with their xxh3, and `module.name` (the per-shard check) slowed to `each` seconds."""
    from dali_pipe.shards.format import file_xxh3

    paths = []
    for i in range(n):
        p = tmp_path / f"train-{i:06d}.tar"
        p.write_bytes(os.urandom(1024) * (i + 1))
        paths.append(p)
    real = getattr(module, name)

    def slow(*a, **kw):
        time.sleep(each)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, slow)
    return paths, [file_xxh3(p) for p in paths]


def test_the_check_of_local_shards_before_training_looks_at_the_flag(handlers, tmp_path, monkeypatch):
    """verify_local hashes every local shard of a pack before training (minutes for a large pack on a cold disk);
    a SIGTERM meanwhile is acted on after the shards being hashed, not after all of them."""
    from types import SimpleNamespace

    from dali_pipe.shards import verdicts

    paths, sums = _slow_shards(tmp_path, monkeypatch, verdicts, "check_file")
    shards = SimpleNamespace(paths=[str(p) for p in paths], sizes=[p.stat().st_size for p in paths],
                             sha256=None, xxh3=sums)
    _kill_soon(signal.SIGTERM)
    t = time.monotonic()
    with pytest.raises(stop.Terminated):
        verdicts.verify_local(shards, tmp_path / "cache", progress=False)
    assert time.monotonic() - t < 0.2 + 2 * 0.3 + 0.5  # the 4 being hashed finish; not the 12 (0.9 s at 4 a time)


def test_a_pack_sync_looks_at_the_flag_while_it_checks_the_shards_already_there(handlers, tmp_path, monkeypatch):
    """sync_shards checks each shard already in LOCAL (hashed where no verdict is cached) before fetching the
    rest: a SIGTERM there is acted on at the next shard."""
    from dali_pipe.shards import packsync
    from dali_pipe.shards.verdicts import Remote

    local = tmp_path / "local"
    local.mkdir()
    paths, sums = _slow_shards(local, monkeypatch, packsync, "check_remote")
    remotes = [Remote(f"s3://bkt/p/{p.name}", p.stat().st_size, None, xxh3=x) for p, x in zip(paths, sums)]
    _kill_soon(signal.SIGTERM)
    t = time.monotonic()
    with pytest.raises(stop.Terminated):
        packsync.sync_shards(remotes, local, cache_dir=tmp_path / "cache", progress=False, listed_already=True)
    assert time.monotonic() - t < 0.2 + 0.3 + 0.5  # 12 shards one at a time: 3.6 s


def test_a_stop_while_manifest_lists_the_folders_writes_nothing(handlers, tmp_path):
    """`python -m dali_pipe manifest` walks the class folders (minutes for a million files on a network disk):
    a stop asked for meanwhile ends it there, 143, with no dataset.tsv written, as it did before the flag."""
    from dali_pipe.imagefolder import write_manifest

    for c in ("cat", "dog"):
        (tmp_path / c).mkdir()
        (tmp_path / c / "1.jpg").write_bytes(b"\xff\xd8")
    stop.ask(signal.SIGTERM)
    with pytest.raises(stop.Terminated):
        write_manifest(tmp_path, force=False)
    assert not (tmp_path / "dataset.tsv").exists()
