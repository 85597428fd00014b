"""Multi-node runs: the hosts meet before training, the wait is bounded, and a host that fails is named.

torch's own rendezvous (Lightning's `init_process_group`, a TCPStore on MASTER_PORT) blocks inside
C++ until its timeout: a SIGTERM waits for it, and a host that died is never named. So the main
process of each host first joins a small meeting of its own, a TCPStore on MASTER_PORT + 1 of the
first host (node rank 0 holds it):

- `join()` as early as possible (the SageMaker contract joins before it reads the hyperparameters), so
  that a host failing at any point can publish why; until it arrives, a watcher thread stops this host
  (as Ctrl-C would) as soon as another host has failed, instead of letting it sync and scan for nothing;
- `Meeting.arrive(plan)` after the host's own sync and scan: it says "here, and this is what I will
  resume", then polls a few times a second until every host has arrived, one has published a
  failure, --dist-timeout has passed, or a SIGTERM came (Python runs its handler between polls);
- `Meeting.fail(reason)` from any error path: the others stop at their next poll, or, when they are
  already inside a collective that fails, name this host's reason instead of a bare socket error.

Lightning's rendezvous then finds every host there at once, and the collectives time out after
--dist-timeout too (DDPStrategy's timeout, set in fit.make_trainer). Why hand-written: torchrun's
elastic agent does rendezvous and failure detection, but it is a launcher (it would replace
Lightning's, and SageMaker starts one process per host itself); torch's TCPStore does the talking.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from model.resume import differences, read_meta

from ..errors import UserError
from ..redact import redact
from ..stop import ask, check, sleep

POLL = 0.2  # seconds between looks at the meeting
WATCH = 1.0  # seconds between looks for a failed host while this one syncs and scans
CONNECT_TRY = 0.5  # seconds one connection attempt may block (a SIGTERM waits at most this long)
STORE_TRY = 5.0  # seconds a store attempt on a port that accepts may take before it counts as never answering
BEAT = 2.0  # seconds between heartbeats once the hosts have met (to name a host that died without a word)
LINGER = 10.0  # seconds the first host keeps the meeting open after failing, so the others read why
INTERVAL = 30.0  # seconds between two lines of a host that waits (each says why it still waits)


class HostsError(UserError):
    """The hosts of a multi-node run could not meet, or one of them failed; the message names it."""


class Interrupted(SystemExit):
    """SIGTERM while waiting for the other hosts: exit 143 with the reason for output/failure."""

    def __init__(self, reason: str):
        super().__init__(143)
        self.reason = reason


@contextmanager
def _sigterm_means(doing: str):
    """A SIGTERM inside the block (stop.Terminated, raised where the waits look at the stop's flag) ends it with a
    clear reason."""
    try:
        yield
    except SystemExit as e:
        if e.code == 143 and not isinstance(e, Interrupted):
            print(f"hosts: stopped by SIGTERM while {doing}", flush=True)
            raise Interrupted(f"stopped by SIGTERM while {doing}") from None
        raise


class Meeting:
    """This host's seat at the meeting: the store, its rank and the hosts' names."""

    def __init__(self, store, rank: int, names: list[str], timeout: float):
        self.store, self.rank, self.names, self.timeout = store, rank, names, timeout
        self.failed = False
        self.interrupted_by: str | None = None  # why the watcher stopped this host (another host failed)
        self._watching = None
        self._threads: list = []  # (thread, stop event) of the watcher and the heartbeat

    def close(self) -> None:
        """Stop this meeting's threads (at exit: a thread still inside the store while the interpreter
        ends would abort the process)."""
        for thread, stop in self._threads:
            stop.set()
        for thread, _ in self._threads:
            thread.join(timeout=2 * max(BEAT, WATCH))
        self._threads = []

    def watch(self) -> None:
        """Until arrive(): a daemon thread looks for a failed host every WATCH seconds and then asks the main
        thread to stop (as Ctrl-C does: stop.ask; sync and scan stop cleanly where they look at the flag), so
        that no host syncs for an hour for a job that has already failed. `interrupted_by` says why."""
        store, stop = self.store.clone(), threading.Event()  # a connection of its own for the thread

        def run():
            while not stop.wait(WATCH):
                try:
                    failed = [r for r in range(len(self.names)) if r != self.rank and store.check([f"failed/{r}"])]
                    why = (f"host {self.names[failed[0]]} failed: "
                           f"{store.get(f'failed/{failed[0]}').decode(errors='replace')}") if failed else None
                except Exception:  # noqa: BLE001  (the first host is gone)
                    why = self._lost()
                if why and not stop.is_set():
                    self.interrupted_by = why
                    print(f"hosts: {why}; stopping this host", flush=True)
                    ask(signal.SIGINT)  # the main thread's next look at the stop's flag raises it
                    return

        self._watching = stop
        thread = threading.Thread(target=run, daemon=True, name="dali_pipe-hosts-watch")
        self._threads.append((thread, stop))
        thread.start()

    def _stop_watching(self) -> None:
        if self._watching is not None:
            self._watching.set()

    @property
    def me(self) -> str:
        return self.names[self.rank]

    def _keys(self, prefix: str) -> list[str]:
        return [f"{prefix}/{r}" for r in range(len(self.names))]

    def arrive(self, plan: str = "", fingerprint: dict | None = None) -> None:
        """Wait until every host has arrived; raise HostsError naming a failed, missing or disagreeing host
        (another resume point, or another run fingerprint: data, classes, batch size, ...)."""
        with _sigterm_means("waiting for the other hosts"):
            self._arrive(plan, fingerprint or {})

    def _arrive(self, plan: str, fingerprint: dict) -> None:
        self._stop_watching()  # from here on this loop, and then the collectives, notice a failed host
        self.store.set(f"arrived/{self.rank}", json.dumps({"host": self.me, "plan": plan,
                                                           "fingerprint": fingerprint}))
        start = time.monotonic()
        deadline = start + self.timeout
        said_at = -INTERVAL
        while True:
            peer = self.peer_failure()
            if peer:
                raise HostsError(peer)
            missing = [self.names[r] for r, k in enumerate(self._keys("arrived")) if not self._check(k)]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise HostsError(f"host(s) {', '.join(missing)} did not arrive within {self.timeout:g} s "
                                 "(--dist-timeout); see their logs and output/failure, or raise --dist-timeout "
                                 "if their sync takes that much longer")
            now = time.monotonic()
            if now - said_at >= INTERVAL:  # at most one line per INTERVAL
                print(redact(f"hosts: {self.me} waiting for {', '.join(missing)} ({now - start:.0f} s of at most "
                             f"{self.timeout:g} s, --dist-timeout)"), flush=True)
                said_at = now
            sleep(POLL)  # SIGTERM, Ctrl-C: raised here (stop.py)
        arrived = [json.loads(self.store.get(k)) for k in self._keys("arrived")]
        if len({a["plan"] for a in arrived}) > 1:
            raise HostsError("the hosts disagree on where training starts: " +
                             "; ".join(f"{a['host']}: {a['plan']}" for a in arrived) +
                             ". Give every host the same checkpoints (SageMaker's checkpoint_s3_uri does), or "
                             "start over with --resume never")
        self._compare(arrived)
        print(f"hosts: all {len(self.names)} arrived ({', '.join(self.names)})", flush=True)
        self._beat()

    def _compare(self, arrived: list[dict]) -> None:
        """Every host must train on the same run: each rank takes its share of its own host's list of
        samples, so hosts with other data (another manifest, a sync that differs, another scan verdict) would
        train some samples twice and others never, or hang on unequal batch counts."""
        first = arrived[0]
        for other in arrived[1:]:
            diff = differences(other.get("fingerprint", {}), first.get("fingerprint", {}),
                               (f"on {other['host']}", f"on {first['host']}"))
            if diff:
                raise HostsError(f"host {other['host']} differs from host {first['host']}: " + "; ".join(diff) +
                                 ". Every host must read the same data with the same settings: give each the same "
                                 "channel (S3 prefix or manifest) and hyperparameters")

    def _beat(self) -> None:
        """A daemon thread counts this host's heartbeats in the store while it trains."""
        store, stop = self.store.clone(), threading.Event()

        def run():
            while not stop.is_set():
                try:
                    store.add(f"beat/{self.rank}", 1)
                except Exception:  # noqa: BLE001  (the first host is gone: nobody to tell)
                    return
                stop.wait(BEAT)

        thread = threading.Thread(target=run, daemon=True, name="dali_pipe-hosts-beat")
        self._threads.append((thread, stop))
        thread.start()

    def silent_hosts(self) -> list[str]:
        """The other hosts whose heartbeat stopped (killed, or their instance lost), over 2.5 beats;
        HostsError when the first host itself is gone."""
        try:
            before = [self.store.add(f"beat/{r}", 0) for r in range(len(self.names))]
            sleep(2.5 * BEAT)
            after = [self.store.add(f"beat/{r}", 0) for r in range(len(self.names))]
        except Exception:  # noqa: BLE001
            raise HostsError(self._lost()) from None
        return [self.names[r] for r in range(len(self.names)) if r != self.rank and after[r] == before[r]]

    def _check(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except Exception:  # noqa: BLE001  (the store's own error types vary by torch version)
            raise HostsError(self._lost()) from None

    def _lost(self) -> str:
        return (f"lost contact with host {self.names[0]} (the first host, which holds the meeting on "
                f"MASTER_PORT + 1): it failed or was stopped; see its log and output/failure")

    def peer_failure(self) -> str | None:
        """'host NAME failed: REASON' for the first other host that published a failure, else None."""
        for r, key in enumerate(self._keys("failed")):
            if r != self.rank and self._check(key):
                try:
                    self.store.set(f"seen/{self.rank}", "1")
                except Exception:  # noqa: BLE001
                    pass
                return f"host {self.names[r]} failed: {self.store.get(key).decode(errors='replace')}"
        return None

    def fail(self, reason: str, *, linger: bool = True) -> None:
        """Publish this host's failure (best effort). The first host then keeps the meeting open briefly,
        until the others have read it (not for a SIGTERM: every host gets one)."""
        if self.failed:
            return
        self.failed = True
        self._stop_watching()
        try:
            self.store.set(f"failed/{self.rank}", reason[:900])
        except Exception:  # noqa: BLE001  (the holder is gone: nobody to tell)
            return
        if self.rank != 0 or not linger:
            return
        deadline = time.monotonic() + LINGER
        others = [k for r, k in enumerate(self._keys("seen")) if r != self.rank]
        arrived = [r for r, k in enumerate(self._keys("arrived")) if r != self.rank and self._safe_check(k)]
        while time.monotonic() < deadline and arrived and not all(self._safe_check(k) for k in others):
            time.sleep(POLL)  # not stop.sleep: telling the others of a failure (a stop among them) is clean-up

    def _safe_check(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except Exception:  # noqa: BLE001
            return False


def fail_together(meeting: Meeting, error: BaseException) -> None:
    """Tell the other hosts why this one stops; when this host only failed because another did (a collective
    lost its peer), raise the other's reason instead."""
    if isinstance(error, KeyboardInterrupt) and meeting.interrupted_by:  # the watcher: another host failed
        raise HostsError(meeting.interrupted_by) from None
    if not isinstance(error, (UserError, SystemExit, KeyboardInterrupt)):  # e.g. a collective lost its peer
        first = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        try:
            peer = meeting.peer_failure()
            silent = [] if peer else meeting.silent_hosts()  # some seconds: a failing host publishes meanwhile
            peer = peer or meeting.peer_failure()
        except HostsError as lost:
            peer, silent = str(lost), []
        if not peer and silent:
            peer = (f"host {', '.join(silent)} stopped answering (killed, or its instance lost: it said no reason; "
                    "see its log)")
        if peer:
            meeting.fail(peer)
            raise HostsError(f"{peer}; then this host stopped too ({first})") from error
    if isinstance(error, UserError):
        reason = " ".join(str(error).split())
    elif isinstance(error, SystemExit):
        reason = getattr(error, "reason", None) or \
            ("stopped by SIGTERM" if error.code == 143 else f"exited with status {error.code}")
    else:
        reason = getattr(error, "reason", None) or \
            f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    meeting.fail(redact(reason), linger=not (isinstance(error, SystemExit) and error.code == 143))


def plan_text(plan) -> str:
    """What this host will do, in words the hosts compare before training together."""
    if plan.done_step is not None:
        return f"nothing to do (finished at step {plan.done_step})"
    if plan.ckpt_path is None:
        return "a fresh start"
    return f"resume from step {(read_meta(Path(plan.ckpt_path)) or {}).get('global_step', '?')}"


_current: Meeting | None = None


def current() -> Meeting | None:
    """This process's meeting, if it joined one."""
    return _current


def join(num_nodes: int, timeout: float) -> Meeting:
    """Join (node rank 0: open) the meeting of `num_nodes` hosts, from MASTER_ADDR, MASTER_PORT (default
    29500; the meeting uses the port after it) and NODE_RANK; names from DALI_PIPE_HOSTS. At most `timeout`
    seconds of connection attempts. Once per process: later calls return the same meeting."""
    global _current
    if _current is None:
        missing = [k for k in ("MASTER_ADDR", "NODE_RANK") if not os.environ.get(k)]
        if missing:
            raise HostsError(f"--num-nodes {num_nodes} needs {' and '.join(missing)} (and MASTER_PORT, default "
                             "29500) in the environment of every node, as Lightning does; SageMaker jobs get them "
                             "from resourceconfig.json")
        names = json.loads(os.environ.get("DALI_PIPE_HOSTS", "[]")) or [f"node {i}" for i in range(num_nodes)]
        _current = open_meeting(os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500")) + 1,
                                int(os.environ["NODE_RANK"]), names, timeout)

        atexit.register(_current.close)
        _current.watch()
    return _current


def open_meeting(addr: str, port: int, rank: int, names: list[str], timeout: float) -> Meeting:
    """Rank 0 opens the meeting's store on `port`; the others connect to it at `addr`, retrying until `timeout`."""
    from torch.distributed import TCPStore

    if rank == 0:
        try:
            with cpp_stderr_quiet():
                store = TCPStore(addr, port, None, True, timedelta(seconds=timeout), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001
            raise HostsError(f"host {names[0]} cannot open the hosts' meeting on port {port} (MASTER_PORT + 1): "
                             f"{str(e).splitlines()[0]}; free the port or set another MASTER_PORT") from None
    else:
        store = _connect(addr, port, names, rank, timeout)
    return Meeting(store, rank, names, timeout)


@contextmanager
def cpp_stderr_quiet():
    """While a TCPStore tries to connect or open: file descriptor 2 into a temporary file, dropped after.
    Its C++ logging writes stack traces there directly, past sys.stderr and our redaction; the failure
    itself comes back as the exception, which says it in one line. (This thread only waits meanwhile.)"""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to keep clean
        yield
        return
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def probe(addr: str, port: int, timeout: float) -> str | None:
    """None when something accepts a TCP connection at addr:port; else why not, as measured by a plain socket
    (TCPStore's client would say "timed out" for all of these, and print C++ stack traces on stderr)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return "nothing is listening on that port yet (connection refused)"
    except (socket.timeout, TimeoutError):
        return f"no answer within {timeout:g} s (the host is not up yet, or a firewall drops the connection)"
    except socket.gaierror as e:
        return f"the address does not resolve ({e.strerror})"
    except OSError as e:
        return e.strerror or type(e).__name__


def _connect(addr: str, port: int, names: list[str], rank: int, timeout: float):
    """Connect to the first host's meeting, retrying until `timeout`; SIGTERM ends the wait at once.

    Each try first probes the port with a plain socket, and builds a TCPStore client only when something
    accepts there: TCPStore's client writes C++ stack traces to stderr for every failed try (straight to the
    file descriptor, past our redaction) and reports a port with nothing listening as a timeout. A store
    attempt runs in a daemon thread that this one waits for in POLL slices: TCPStore's client blocks inside
    C++, past its own timeout, on a peer that accepts the connection but never answers (another program on
    MASTER_PORT + 1, a frozen first host), and a SIGTERM would wait for it too; after such a try, the next
    store attempt waits INTERVAL (probes go on). The wait prints at most one line per INTERVAL, saying why."""
    from torch.distributed import TCPStore

    start = time.monotonic()
    deadline = start + timeout
    said, said_at, next_store = None, -INTERVAL, 0.0
    with _sigterm_means(f"waiting for host {names[0]} (the first host)"):
        while True:
            left = max(0.1, min(CONNECT_TRY, deadline - time.monotonic()))
            error = probe(addr, port, left)
            if error is None and next_store <= time.monotonic() < deadline - CONNECT_TRY:
                result: dict = {}

                def attempt(left=left, result=result):
                    try:
                        result["store"] = TCPStore(addr, port, None, False, timedelta(seconds=left))
                    except Exception as e:  # noqa: BLE001  (DistNetworkError, RuntimeError, ... by torch version)
                        result["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__

                thread = threading.Thread(target=attempt, daemon=True, name="dali_pipe-hosts-connect")
                until = min(deadline, time.monotonic() + STORE_TRY)
                with cpp_stderr_quiet():
                    thread.start()
                    while thread.is_alive() and time.monotonic() <= until:
                        check()  # SIGTERM, Ctrl-C (stop.py), between the slices
                        thread.join(POLL)
                    stuck = thread.is_alive()
                    if stuck:  # on a silent peer: end its connections so the thread ends before we exit, and
                        ends = time.monotonic() + left + 10.0  # keep fd 2 quiet until it has (its retries can
                        while thread.is_alive() and time.monotonic() < ends:  # connect again: each is shut too)
                            _shutdown_connections(port)
                            thread.join(POLL)
                if "store" in result:
                    return result["store"]
                if stuck:
                    error = ("the connection was accepted but the meeting's store never answered: another program "
                             "may hold that port, or the first host is frozen")
                elif probe(addr, port, left) is not None:
                    error = "the first host closed the connection (it stopped, or is restarting)"
                else:
                    error = f"the meeting's store refused this host: {result.get('error', 'no answer')}"
                next_store = time.monotonic() + INTERVAL
            elif error is None:
                error = said or "waiting to try the meeting's store again"
            now = time.monotonic()
            if now > deadline:
                raise HostsError(redact(f"host {names[rank]} could not reach host {names[0]} (the first host) at "
                                        f"{addr}:{port} within {timeout:g} s (--dist-timeout): {error}. Check that it "
                                        "started, and that the hosts can reach each other on MASTER_PORT + 1"))
            if now - said_at >= INTERVAL:
                print(redact(f"hosts: {names[rank]} waiting for host {names[0]} at {addr}:{port}: {error} "
                             f"({now - start:.0f} s of at most {timeout:g} s, --dist-timeout)"), flush=True)
                said, said_at = error, now
            sleep(POLL)  # SIGTERM, Ctrl-C: raised here (stop.py)


def _shutdown_connections(port: int) -> None:
    """Shut down this process's TCP connections to `port` (Linux: found through /proc/self/fd), so that a
    connection attempt stuck inside TCPStore's C++ returns an error instead of outliving the interpreter
    (which aborts the process at exit)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:  # not a socket (or closed meanwhile)
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername()[1] == port:
                s.shutdown(socket.SHUT_RDWR)
        except (OSError, IndexError, TypeError):
            pass
        finally:
            s.close()  # the duplicate only; the shutdown applies to the connection itself
