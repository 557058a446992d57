"""Multi-process runs on ``jax.distributed``: joining within a deadline, and stopping together.

:func:`join` connects this process to the others and starts the backend (the CPU client
exchanges every process's devices through the coordinator), all within
``distributed.initialization_timeout`` seconds:

- The preemption service is turned off (``jax_enable_preemption_service``). Left on,
  ``jax.distributed.initialize`` installs its SIGTERM notifier, which swallows a SIGTERM that
  arrives before the train loop's own handler (the run went on as if nothing happened) and
  which ``signal.signal`` later replaces without a word. meshpar stops on SIGTERM by itself
  (:mod:`meshpar.processes.stop`), so SIGTERM is meshpar's alone.
- ``initialization_timeout``, ``heartbeat_timeout_seconds`` and ``shutdown_timeout_seconds``
  come from the ``distributed`` config section (jax's defaults, 300/100/300 s, would leave a
  survivor waiting minutes for a dead peer); inside :func:`stop_together` jax's heartbeat
  timeout is a backstop behind meshpar's own check (below). The CPU client's own waits for the other
  processes' devices (``jax_cpu_get_{local,global}_topology_timeout_minutes``, whole minutes,
  0 = fail at once) are set just above the deadline.
- When the coordinator cannot be reached, a peer never comes, or a peer joins but never
  starts its devices, jax's wait ends in a C++ ``LOG(FATAL)`` (SIGABRT, exit 134, a stack
  trace; and only after the limit plus several seconds) that no Python code can catch. A
  watchdog thread ends the wait first, at the deadline, with one line
  (``distributed error: ...``) and exit status 2; jax's own limit is set 10 s later, as a
  backstop.

:func:`stop_together` (the CLI wraps each run in it) makes one process's failure end every
process. Without it, a process that fails after the others joined (e.g. a ``data error:``
from its own ``data.corpus_dir``) exits, and the others wait in their next collective until
the heartbeat timeout aborts them from C++. Through the coordination service's key-value
store (:func:`meshpar.jax_compat.coordination_client`: jax has no public API for it):

- every process has a mailbox key, ``meshpar/stop_together/<process>``, on which a daemon
  watcher thread blocks;
- a process that fails (a one-line error, an unexpected exception, or SIGINT/SIGTERM outside
  the train loop, which then stops it at once) posts ``{process, line, exit status}`` into
  every other mailbox and waits (5 s at most) for each to acknowledge; each watcher prints
  ``<line> (on process K)`` and ends its process with that status (``os._exit``: its main
  thread may be inside a collective that will never complete);
- the failing process prints its own line as usual, then leaves through ``os._exit`` too: a
  normal exit would wait at jax's shutdown barrier for peers that are already gone and then
  abort (134) after ``shutdown_timeout_seconds``. (If every other process had already
  finished, they wait at that barrier, and a normal exit lets them all leave cleanly.)
  Process 0 holds the coordination service, whose end aborts every other process at once,
  so it leaves last: after each other process has posted ``.../gone/<process>`` (10 s at most);
- a process that finishes (or stops on SIGINT/SIGTERM inside the train loop, which every
  process does at the same step) posts ``done`` into its own mailbox, which wakes its
  watcher, and joins it: no watcher is left inside an RPC at interpreter exit (on Python
  3.12 that aborts the process).

A lost peer (killed outright: SIGKILL, the OOM killer, a lost machine) cannot tell anyone,
and jax would abort every survivor (134, a C++ stack trace) only after its heartbeat timeout.
meshpar's own liveness check (:mod:`meshpar.processes.liveness`: heartbeats through the same store,
from threads of their own) finds it first: process 0 tells every other survivor as above,
prints ``training error: lost process K (no heartbeat for N s); last checkpoint: step S in
DIR`` (the newest committed step in the checkpoint folder; the others add ``(on process 0)``),
and every survivor exits with status 1, process 0 last. gloo does fail a collective at once
when it was reading from the lost peer's connection (``Connection reset by peer``, seen with 4
processes): a process whose jax runtime fails first looks whether a peer's heartbeat stands
still, and if one does waits (the timeout and a few seconds at most) for process 0's verdict,
so that the lost process is named rather than the collective error it caused.

When process 0 (the coordination service) is the one killed, the others end within a second:
usually the watcher's read fails first and prints ``training error: lost the coordination
service (process 0): ...; last checkpoint: ...`` (exit 1), else jax's abort (134) wins the race.
A peer that is alive but hung (its Python still beating) is not detected at all: the others
wait in the collective, as in any SPMD program.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time

import jax

from meshpar.checkpoints.rundir import committed_steps
from meshpar.configuration.config import DistributedConfig
from meshpar.configuration.errors import DistributedError, TrainingError, describe
from meshpar.jax_compat import coordination_client
from meshpar.processes import liveness
from meshpar.processes.stop import Interrupted

# <_KEY>/<process>: its mailbox; <_KEY>/ack/<process>: it heard a failure; <_KEY>/gone/<process>: it is leaving
_KEY = "meshpar/stop_together"
_DONE = "done"
_BACKSTOP_S = 10  # jax's own initialization limit, past our deadline: the one line is ours
_ACK_S = 5.0  # how long a failing process waits for the others to hear it
_POLL_MS = 10 * 60 * 1000  # a watcher's blocking read; it just reads again when it times out


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _exit_now(line: str, status: int) -> None:
    """Print `line` on stderr and end the process with `status`, skipping interpreter shutdown."""
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 — a closed stdout must not keep the process alive
        pass
    try:
        print(line, file=sys.stderr, flush=True)
    finally:
        os._exit(status)


# ------------------------------------------------------------------------------------------
# Joining


@contextlib.contextmanager
def _deadline(seconds: float, describe_failure):
    """End the process with ``describe_failure()`` (one line, exit 2) if the block is still
    running after `seconds`. The block waits inside jax's C++ code, which releases the GIL."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            _exit_now(describe_failure(), 2)

    thread = threading.Thread(target=watch, name="meshpar-join-deadline", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _probe(address: str) -> str | None:
    """Why a TCP connection to `address` fails, or None if it opens."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return None
    except (OSError, ValueError) as e:
        return (getattr(e, "strerror", None) or str(e) or type(e).__name__).lower()


def _startup_failure(cfg: DistributedConfig, phase: str) -> str:
    who = f"process {cfg.process_id}" if cfg.process_id >= 0 else "this process"
    wait = f"within {cfg.initialization_timeout} s (distributed.initialization_timeout)"
    address = cfg.coordinator or "the coordinator"
    if phase == "backend":
        return (
            f"distributed error: {who}: the {cfg.num_processes} processes joined, but not all of them "
            f"started their devices {wait}"
        )
    if cfg.process_id == 0:
        return (
            f"distributed error: not all {cfg.num_processes} processes joined the coordinator at "
            f"{address} {wait}: a process never came"
        )
    why = _probe(cfg.coordinator) if cfg.coordinator else None
    if why:
        return (
            f"distributed error: {who} cannot reach the coordinator at {address} ({why}) {wait}; "
            f"process 0 must run there (distributed.coordinator)"
        )
    return (
        f"distributed error: {who} could not join the coordinator at {address} {wait}: "
        f"a process never came, or that address is not process 0's coordinator"
    )


def join(cfg: DistributedConfig, checkpoint_dir: str | None = None) -> None:
    """Connect this process to the others and start the backend (before any other JAX call).

    Raises DistributedError (one line) when jax refuses the settings; ends the process with
    one line and exit status 2 when the others cannot be reached in time (see module doc).
    CPU devices of different processes exchange collectives over gloo; accelerators use
    their own (NCCL on GPU), so the setting is harmless there. Inside :func:`stop_together`,
    meshpar watches for lost processes itself (`checkpoint_dir`: where the line it ends with
    looks for the last checkpoint) and jax's heartbeat timeout becomes the backstop.
    """
    jax.config.update("jax_enable_preemption_service", False)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    minutes = max(1, math.ceil(cfg.initialization_timeout / 60))
    jax.config.update("jax_cpu_get_local_topology_timeout_minutes", minutes)
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", minutes + 1)  # must be longer
    phase = "connect"
    with _deadline(cfg.initialization_timeout, lambda: _startup_failure(cfg, phase)):
        try:
            jax.distributed.initialize(
                cfg.coordinator or None,
                cfg.num_processes,
                None if cfg.process_id < 0 else cfg.process_id,
                initialization_timeout=cfg.initialization_timeout + _BACKSTOP_S,
                heartbeat_timeout_seconds=(
                    cfg.heartbeat_timeout_seconds
                    if _together is None
                    else liveness.jax_heartbeat_timeout(cfg.heartbeat_timeout_seconds)
                ),
                shutdown_timeout_seconds=cfg.shutdown_timeout_seconds,
            )
        except (RuntimeError, ValueError, TypeError) as e:  # bad ids, no cluster detected, joined twice
            keys = "distributed.coordinator, distributed.num_processes, distributed.process_id"
            raise DistributedError(f"cannot join the other processes: {_one_line(e)} ({keys})") from None
        phase = "backend"
        if _together is not None:
            # Before the backend: a peer failing (or lost) from here on is heard.
            _together.start(cfg.heartbeat_timeout_seconds, checkpoint_dir)
        try:
            jax.devices()
        except RuntimeError as e:
            raise DistributedError(
                f"process {jax.process_index()}: the processes' devices could not be gathered: {_one_line(e)}"
            ) from None


# ------------------------------------------------------------------------------------------
# Stopping together


def agree(name: str, value, combine, timeout_s: float = 600):
    """`combine` of every process's `value` (JSON-able), exchanged through the coordination
    service's key-value store (each process posts its own, then reads all); `value` itself in a
    single-process run. Every process gets the same result. Raises DistributedError when a
    peer has not posted within `timeout_s`."""
    if jax.process_count() == 1:
        return value
    client = coordination_client()
    prefix = f"meshpar/agree/{name}"
    try:
        client.key_value_set(f"{prefix}/{jax.process_index()}", json.dumps(value))
        values = [
            json.loads(client.blocking_key_value_get(f"{prefix}/{k}", int(timeout_s * 1000)))
            for k in range(jax.process_count())
        ]
    except Exception as e:  # noqa: BLE001 — jax's JaxRuntimeError: a peer never posted its value
        raise DistributedError(f"could not gather every process's {name}: {_one_line(e)}") from None
    return combine(values)


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
                _exit_now(describe(TrainingError(f"{what}: {status}; {self._last_checkpoint()}"))[0], 1)
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
    return f"training error: unexpected {type(error).__name__}: {_one_line(error)}", 1


@contextlib.contextmanager
def stop_together():
    """Run a command so that a failure on one process ends every process (see module doc).

    Does nothing until :func:`join` connects this process to others.
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
