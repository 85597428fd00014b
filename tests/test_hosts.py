"""The hosts' meeting of a multi-node run (dali_pipe/cli/hosts.py): every host arrives or the wait ends,
bounded, naming the host that failed or is missing; SIGTERM while waiting ends the process at once.
The end-to-end runs with two SageMaker hosts are in tests/test_sagemaker.py."""
from __future__ import annotations

import socket
import threading

import pytest

from dali_pipe.cli.hosts import HostsError, open_meeting


def free_port() -> int:
    """A loopback port that is free, and the one after it too (MASTER_PORT and the meeting's port)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


_OPEN = []


@pytest.fixture(autouse=True)
def _close_meetings():
    """Each test's meetings stop their threads (a thread inside a store at interpreter exit aborts it)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def _pair(timeout: float = 10.0):
    port = free_port() + 1
    first = open_meeting("127.0.0.1", port, 0, ["algo-1", "algo-2"], timeout)
    second = open_meeting("127.0.0.1", port, 1, ["algo-1", "algo-2"], timeout)
    _OPEN.extend([second, first])
    return first, second


def test_hosts_that_agree_meet():
    """Both hosts arrive with the same plan: both pass."""
    first, second = _pair()
    t = threading.Thread(target=second.arrive, args=("a fresh start",))
    t.start()
    first.arrive("a fresh start")
    t.join(10)
    assert not t.is_alive()


def test_a_failed_host_is_named_by_the_others():
    """The second host fails before it arrives: the first stops waiting at once and says which host and why."""
    first, second = _pair()
    second.fail("--data: '/opt/ml/input/data/training' has no dataset.tsv")
    with pytest.raises(HostsError, match=r"host algo-2 failed: --data: '/opt/ml/input/data/training' has no "):
        first.arrive("a fresh start")


def test_a_missing_host_ends_the_wait_in_bounded_time():
    """Nobody else arrives: the wait ends after the timeout, naming the missing host and the setting."""
    port = free_port() + 1
    alone = open_meeting("127.0.0.1", port, 0, ["algo-1", "algo-2"], 0.6)
    with pytest.raises(HostsError, match=r"host\(s\) algo-2 did not arrive within 0.6 s \(--dist-timeout\)"):
        alone.arrive("a fresh start")


def test_hosts_that_disagree_on_the_resume_point_stop_before_training():
    """One host would resume, the other start fresh (different checkpoints): both stop, naming the plans."""
    first, second = _pair()
    errors = []

    def arrive():
        try:
            second.arrive("a fresh start")
        except HostsError as e:
            errors.append(e)

    t = threading.Thread(target=arrive)
    t.start()
    with pytest.raises(HostsError, match=r"disagree.*algo-1: resume from step 40; algo-2: a fresh start"):
        first.arrive("resume from step 40")
    t.join(10)
    assert errors and "checkpoint_s3_uri" in str(errors[0])


def test_no_first_host_ends_the_connection_attempts_in_bounded_time():
    """The first host never opens the meeting: the second gives up after the timeout, naming it."""
    port = free_port() + 1
    with pytest.raises(HostsError, match=r"host algo-2 could not reach host algo-1 \(the first host\).*within 0.3 s"):
        open_meeting("127.0.0.1", port, 1, ["algo-1", "algo-2"], 0.3)


def test_a_host_whose_heartbeat_stopped_is_named(monkeypatch):
    """After the hosts met, a host that died without a word (kill -9, a lost instance) is the one whose
    heartbeat stopped: a collective error elsewhere can name it."""
    import dali_pipe.cli.hosts as hosts

    monkeypatch.setattr(hosts, "BEAT", 0.05)
    first, second = _pair()
    first._beat()  # the second host never beats: it is gone
    assert first.silent_hosts() == ["algo-2"]


def test_hosts_whose_data_differs_stop_before_training():
    """Both hosts would start fresh but read different data (another manifest): both stop, naming the difference."""
    first, second = _pair()
    mine = {"samples": "aaaa", "classes": ["cat", "dog"], "batch_size": 8, "world_size": 2, "seed": 0}
    errors = []

    def arrive():
        try:
            second.arrive("a fresh start", {**mine, "samples": "bbbb"})
        except HostsError as e:
            errors.append(e)

    t = threading.Thread(target=arrive)
    t.start()
    with pytest.raises(HostsError, match=r"host algo-2 differs from host algo-1.*the data \(files, labels or "
                                         r"split\): 'bbbb' on algo-2, 'aaaa' on algo-1"):
        first.arrive("a fresh start", mine)
    t.join(10)
    assert errors and "the data" in str(errors[0])


def test_a_first_host_port_that_never_answers_ends_the_wait_in_bounded_time():
    """Another program holds MASTER_PORT + 1 (it accepts connections, never answers): the second host gives
    up after the timeout, saying so (before, TCPStore's client waited past any timeout, SIGTERM too)."""
    import time

    port = free_port() + 1
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", port))
        silent.listen()
        start = time.monotonic()
        with pytest.raises(HostsError, match=r"could not reach host algo-1 .*within 1 s.*never answered: another "
                                             r"program may hold that port"):
            open_meeting("127.0.0.1", port, 1, ["algo-1", "algo-2"], 1.0)
        assert time.monotonic() - start < 10


def test_a_host_waiting_alone_says_why_once_per_interval_with_nothing_from_torch(monkeypatch, capfd):
    """Nothing listens at the first host's port: the wait names that (before: "timed out", or "another program
    may hold that port"), prints at most one line per interval, and nothing of TCPStore's C++ logging reaches
    stderr (before: 374 of 420 lines in 15 s were its stack traces, past the redaction)."""
    import time

    import dali_pipe.cli.hosts as hosts

    monkeypatch.setattr(hosts, "INTERVAL", 0.25)
    port = free_port() + 1
    start = time.monotonic()
    with pytest.raises(HostsError, match=r"within 1 s \(--dist-timeout\): nothing is listening on that port yet "
                                         r"\(connection refused\)"):
        open_meeting("127.0.0.1", port, 1, ["algo-1", "algo-2"], 1.0)
    took = time.monotonic() - start
    out, err = capfd.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("hosts: algo-2 waiting")]
    assert 1 <= len(lines) <= took / 0.25 + 1 and all("nothing is listening" in ln for ln in lines), out
    assert "c10d" not in err and "frame #" not in err, err[:500]
    with socket.socket() as silent:  # a program that accepts and never answers: said, and still no C++ output
        silent.bind(("127.0.0.1", port))
        silent.listen()
        monkeypatch.setattr(hosts, "STORE_TRY", 0.3)
        with pytest.raises(HostsError, match="never answered"):
            open_meeting("127.0.0.1", port, 1, ["algo-1", "algo-2"], 1.0)
    assert "c10d" not in capfd.readouterr().err
