"""Stopping a multi-process run together: a failure on one process (a one-line error, an
unexpected exception, SIGINT/SIGTERM outside the train loop) ends every process with its line
and ``(on process K)``, and a lost peer (no heartbeat: :mod:`meshpar.processes.liveness`) is
named in one line with the last checkpoint, instead of jax's abort after its heartbeat timeout.
Messages go through the coordination service's key-value store, one mailbox per process. The
design: docs/multi-process.md, "How processes start and stop together"."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import sys
import threading
import time

import jax

from meshpar.checkpoints.rundir import committed_steps
from meshpar.configuration.errors import TrainingError, describe
from meshpar.jax_compat import coordination_client
from meshpar.processes import liveness
from meshpar.processes.lines import exit_now, one_line
from meshpar.processes.stop import Interrupted

# <_KEY>/<process>: its mailbox; <_KEY>/ack/<process>: it heard a failure; <_KEY>/gone/<process>: it is leaving
_KEY = "meshpar/stop_together"
_DONE = "done"
_ACK_S = 5.0  # how long a failing process waits for the others to hear it
_POLL_MS = 10 * 60 * 1000  # a watcher's blocking read; it just reads again when it times out


class _Together:
    """The watcher of this process's mailbox, the failure report to the others, and the
    liveness check (heartbeats on every process but 0, their monitor on process 0)."""

    def __init__(self) -> None:
        self.client = None
        self.process = 0
        self.num_processes = 1
        self.thread: threading.Thread | None = None
        self.liveness: threading.Thread | None = None
        self.quiet = threading.Event()  # set once this process is finishing or failing itself
        self.finished = threading.Event()  # set when this process's command is over: heartbeats stop
        self.lock = threading.Lock()  # who decides how this process ends: see _claim
        self.lost: set[int] = set()  # processes found lost: nobody waits for them
        self.lost_after = 0.0  # heartbeat_timeout_seconds; 0 = no liveness check
        self.period = 1.0  # of the heartbeats, and of the monitor's reads
        self.checkpoint_dir: str | None = None
        self.exit_status: int | None = None
        self.handlers: dict = {}  # signal -> the handler before ours

    def start(self, lost_after: float = 0, checkpoint_dir: str | None = None) -> None:
        self.client = coordination_client()
        if self.client is None:
            return
        self.process, self.num_processes = jax.process_index(), jax.process_count()
        self.checkpoint_dir = checkpoint_dir
        # Registered after jax's own atexit hook (jax is imported above), so it runs first.
        atexit.register(self._exit_after_failure)
        self.thread = threading.Thread(target=self._watch, name="meshpar-stop-together", daemon=True)
        self.thread.start()
        if lost_after > 0 and self.num_processes > 1:
            self.lost_after, self.period = lost_after, liveness.period(lost_after)
            beat = self._monitor if self.process == 0 else self._beat
            self.liveness = threading.Thread(target=beat, name="meshpar-liveness", daemon=True)
            self.liveness.start()
        if threading.current_thread() is threading.main_thread():
            # Outside the train loop (which takes them over and stops at a step every process
            # agrees on) SIGINT/SIGTERM stop this process at once, and it tells the others.
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.handlers[sig] = signal.signal(sig, _stop_at_once)

    def restore_handlers(self) -> None:
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        self.handlers.clear()

    def _mailbox(self, process: int) -> str:
        return f"{_KEY}/{process}"

    def _claim(self) -> bool:
        """Whether the caller is the first to end this process after a failure (here or
        elsewhere), or to finish it: every other path then stays quiet."""
        with self.lock:
            if self.quiet.is_set():
                return False
            self.quiet.set()
            return True

    def _last_checkpoint(self) -> str:
        """Where a rerun with ``--resume`` would start: the newest committed step on disk."""
        if not self.checkpoint_dir:
            return "last checkpoint: none"
        try:
            steps = committed_steps(self.checkpoint_dir)
        except OSError:
            steps = []
        return f"last checkpoint: {f'step {steps[-1]}' if steps else 'none'} in {self.checkpoint_dir}"

    def _watch(self) -> None:
        while True:
            asked = time.monotonic()
            try:
                value = self.client.blocking_key_value_get(self._mailbox(self.process), _POLL_MS)
            except Exception as e:  # noqa: BLE001 — jax's JaxRuntimeError
                if time.monotonic() - asked >= _POLL_MS / 1000:
                    continue  # the read timed out (jax gives no public status code to tell by)
                if not self._claim():
                    return
                # The coordination service failed, or is gone with process 0; jax's error poller
                # is ending this process too, with a stack trace. Say it in one line first.
                status = (str(e).strip() or type(e).__name__).splitlines()[0]  # gRPC details follow
                what = (
                    "lost the coordination service (process 0)" if self.process else "the coordination service failed"
                )
                exit_now(describe(TrainingError(f"{what}: {status}; {self._last_checkpoint()}"))[0], 1)
                return
            if value == _DONE:
                return
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{_KEY}/ack/{self.process}", "1")
            if not self._claim():
                return  # this process is ending anyway and reports its own outcome
            report = json.loads(value)
            self._leave(int(report["status"]), f"{report['line']} (on process {report['process']})")

    # ------------------------------------------------------------------------------------------
    # Liveness

    def _beat(self) -> None:
        """Every process but 0: the heartbeat, until this process's command is over."""
        liveness.beat(self.client, self.process, self.period, self.finished)

    def _monitor(self) -> None:
        """Process 0: end every process once another one is lost."""
        silence = liveness.Silence(list(range(1, self.num_processes)), self.lost_after, time.monotonic())
        while silence.watching() and not self.finished.wait(self.period):
            now = time.monotonic()
            try:
                lost = silence.update(liveness.read(self.client), now)
            except Exception:  # noqa: BLE001 — this process is ending (the service shuts down with it)
                return
            if lost:
                self._report_lost(lost, silence.silent_for(lost, now))
                return

    def _report_lost(self, lost: list[int], silent: float) -> None:
        """Process 0: tell every other survivor, say it, and end (the others first)."""
        if not self._claim():
            return  # this process is already ending, for its own reason or another's
        self.lost.update(lost)
        who = f"process {lost[0]}" if len(lost) == 1 else f"processes {', '.join(map(str, lost))}"
        line = describe(TrainingError(f"lost {who} (no heartbeat for {silent:.0f} s); {self._last_checkpoint()}"))[0]
        self._tell_others(line, 1)
        self._leave(1, line)

    # ------------------------------------------------------------------------------------------
    # Failing, finishing, leaving

    def _a_peer_stands_still(self) -> bool:
        peers = [k for k in range(1, self.num_processes) if k != self.process]
        try:
            return liveness.one_stands_still(self.client, peers, self.period)
        except Exception:  # noqa: BLE001 — the service is gone with process 0: the watcher says so
            return False

    def fail(self, line: str, status: int, runtime_error: bool = False) -> None:
        """Tell every other process that this one failed; wait briefly until they heard.

        `runtime_error`: jax's runtime failed (e.g. a collective). gloo fails a collective at
        once when a peer's connection drops, so when a peer's heartbeat stands still this waits
        (``heartbeat_timeout_seconds`` and a few seconds at most) for process 0's verdict: the
        lost process is named, rather than the collective error it caused."""
        if runtime_error and self.liveness is not None and self._a_peer_stands_still():
            self.quiet.wait(self.lost_after + 2 * self.period + _ACK_S)
        if not self._claim():
            # A peer's failure or a lost process is ending this process already (os._exit, in
            # a few seconds at most): its report is the one the others get.
            time.sleep(4 * _ACK_S)
            return
        told = self._tell_others(line, status)
        self.stop()
        if told:
            # The others leave through os._exit, never reaching jax's shutdown barrier: waiting
            # there for them would end in an abort after shutdown_timeout_seconds. (When every
            # other process had already finished, they are waiting at that barrier: a normal
            # exit lets them all leave cleanly.)
            self.exit_status = status

    def _tell_others(self, line: str, status: int) -> list[int]:
        """Post ``{process, line, status}`` into every other survivor's mailbox and wait (5 s
        at most) for each to acknowledge. Returns those posted to."""
        report = json.dumps({"process": self.process, "line": line, "status": status})
        told = []
        for k in range(self.num_processes):
            if k == self.process or k in self.lost:
                continue
            try:
                self.client.key_value_set(self._mailbox(k), report)
                told.append(k)
            except Exception:  # noqa: BLE001 — that process finished, or another failure reached it first
                pass
        deadline = time.monotonic() + _ACK_S
        for k in told:
            left = deadline - time.monotonic()
            try:
                self.client.blocking_key_value_get(f"{_KEY}/ack/{k}", max(1, int(left * 1000)))
            except Exception:  # noqa: BLE001 — gone, or stuck: it ends by the heartbeat timeout
                break
        return told

    def stop(self) -> None:
        """This process's command is over: stop the heartbeat (saying ``done``), wake the
        mailbox watcher and wait for both."""
        self.quiet.set()
        self.finished.set()
        if self.liveness is not None and self.liveness is not threading.current_thread():
            self.liveness.join(timeout=10)  # a heartbeat writes DONE as it stops
            self.liveness = None
        if self.thread is None:
            return
        with contextlib.suppress(Exception):  # a report got there first: the watcher reads that instead
            self.client.key_value_set(self._mailbox(self.process), _DONE)
        self.thread.join(timeout=10)
        self.thread = None

    def _exit_after_failure(self) -> None:
        """atexit: after a failure this process leaves without jax's shutdown barrier (the others
        are gone: it would wait ``shutdown_timeout_seconds`` and then abort)."""
        if self.exit_status is not None:
            self._leave(self.exit_status)

    def _leave(self, status: int, line: str | None = None) -> None:
        """End this process now, after a failure somewhere. Process 0 holds the coordination
        service, and every other process aborts (134) the moment it goes: so it goes last,
        once the others have said they are leaving (or after a few seconds)."""
        if line is not None:
            print(line, file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            if self.process == 0:
                deadline = time.monotonic() + 2 * _ACK_S
                for k in range(1, self.num_processes):
                    if k in self.lost:
                        continue
                    left = max(1, int((deadline - time.monotonic()) * 1000))
                    self.client.blocking_key_value_get(f"{_KEY}/gone/{k}", left)
                time.sleep(0.1)  # the last one is between saying so and its exit
            else:
                self.client.key_value_set(f"{_KEY}/gone/{self.process}", "1")
        os._exit(status)


_together: _Together | None = None


def current() -> _Together | None:
    """The watcher of the :func:`stop_together` block this process runs in (None outside one):
    :func:`meshpar.processes.joining.join` starts it once this process has joined the others."""
    return _together


class _StoppedAtOnce(BaseException):
    """SIGINT/SIGTERM outside the train loop (or a second one inside it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop_at_once(signum, frame) -> None:
    raise _StoppedAtOnce(signum)


def _failure(error: BaseException) -> tuple[str, int]:
    """(line, exit status) this process ends with, for the others to repeat."""
    described = describe(error) if isinstance(error, Exception) else None
    if described:
        return described
    if isinstance(error, _StoppedAtOnce):
        name = signal.Signals(error.signum).name
        return f"stopped by {name} at once, not at a step: no checkpoint saved for it", 128 + error.signum
    if isinstance(error, KeyboardInterrupt):
        return "stopped by SIGINT", 128 + signal.SIGINT
    if isinstance(error, SystemExit):
        return f"exited with status {error.code}", error.code if isinstance(error.code, int) else 1
    return f"training error: unexpected {type(error).__name__}: {one_line(error)}", 1


@contextlib.contextmanager
def stop_together():
    """Run a command so that a failure on one process ends every process (see module doc).

    Does nothing until :func:`meshpar.processes.joining.join` connects this process to others.
    """
    global _together
    together = _together = _Together()
    try:
        yield
    except Interrupted:  # every process stops at the same step: not a failure
        together.stop()
        raise
    except BaseException as e:
        if together.thread is None:
            raise
        line, status = _failure(e)
        together.fail(line, status, runtime_error=isinstance(e, jax.errors.JaxRuntimeError))
        if isinstance(e, _StoppedAtOnce):
            print(line, file=sys.stderr)
            raise SystemExit(status) from None
        raise
    else:
        together.stop()
    finally:
        together.restore_handlers()
        _together = None
