"""The local launcher's supervision of its children: start them in their own process groups,
forward their output line by line with a ``[rank i]`` prefix, forward signals, stop everyone when
one fails, and reap every child and leftover grandchild (``python -m jddp.launch``)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from jddp.errors import PREEMPTED, STALLED
from jddp.launch.oom import oom_cause, oom_kills
from jddp.launch.supervise import (
    PROG,
    READER_JOIN_TIMEOUT,
    REAP_TIMEOUT,
    STARTUP_GRACE_S,
    STOP_GRACE_S,
    Aftermath,
    Output,
    Stalls,
    catches,
    exit_code_for,
    failure_report,
    first_cause,
    held_signals,
    is_stopped,
    killed_first,
    proc_group_has_live_member,
    pump,
    signal_name,
)
from jddp.proc.lifeline import die_with_parent, load_prctl

_POLL_INTERVAL = 0.05


class Launcher:
    """State for one launch: the children, their reader threads and the stop logic."""

    first_failure: tuple[int, int] | None = None  # (rank, returncode) of the cause, if any
    cause: str | None = None  # the first failure as said (rank 1 killed by signal SIGKILL)

    def __init__(self, command: list[str], nproc: int, kill_timeout: float) -> None:
        self.command = command
        self.nproc = nproc
        self.kill_timeout = kill_timeout
        self.held_signals = held_signals(command)
        self.stdout = Output("stdout")
        self.stderr = Output("stderr")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[threading.Thread] = []
        # Process groups we may still signal (pgid == child pid since start_new_session=True).
        self.live_groups: set[int] = set()
        self.signal_received: int | None = None
        self.stop_deadline: float | None = None  # when to escalate to SIGKILL
        self.killed_at: float | None = None  # when kill_all() first ran
        self.returncodes: dict[int, int] = {}  # rank -> Popen.returncode, filled by wait()
        self.started_at: dict[int, float] = {}  # pgid -> when its leader was started
        self.held: dict[int, int] = {}  # pgid -> a signal held until the leader catches it
        self.stalls = Stalls()  # which rank stalled, from the ranks' stall lines
        self.oom_kills = oom_kills()  # the memory cgroup's OOM kills before the ranks start

    # -- signalling -------------------------------------------------------------------------
    def signal_groups(self, sig: int) -> None:
        """Send ``sig`` to every process group we have not yet seen empty."""
        for pgid in list(self.live_groups):
            self._signal_group(pgid, sig)

    def forward(self, sig: int, groups: list[int] | None = None) -> None:
        """Send ``sig`` to ``groups`` (default: every live group) now, or, for a held signal
        (SIGUSR1, SIGHUP) and a leader in its first seconds that does not catch it yet, once it
        does (:meth:`send_held`)."""
        for pgid in list(self.live_groups) if groups is None else groups:
            if sig in self.held_signals and self._starting_without_handler(pgid, sig):
                self.held[pgid] = sig
            else:
                self._signal_group(pgid, sig)

    def send_held(self) -> None:
        """Send each held signal whose rank now catches it, has ended or is past its grace."""
        for pgid, sig in list(self.held.items()):
            if not self._starting_without_handler(pgid, sig) or pgid not in self.live_groups:
                del self.held[pgid]
                self._signal_group(pgid, sig)

    def _starting_without_handler(self, pgid: int, sig: int) -> bool:
        young = time.monotonic() - self.started_at.get(pgid, 0.0) < STARTUP_GRACE_S
        return young and not catches(pgid, sig)

    def _signal_group(self, pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            self._forget_group_if_reaped(pgid)
        except PermissionError:
            pass

    def _forget_group_if_reaped(self, pgid: int) -> None:
        for p in self.procs:
            if p.pid == pgid and p.returncode is not None:
                self.live_groups.discard(pgid)

    def _group_alive(self, pgid: int) -> bool:
        """Whether process group ``pgid`` has a member that is not a zombie.

        Orphaned grandchildren are reparented to init, which may reap them lazily; their
        zombies still count for ``killpg(pgid, 0)``, so on Linux we look at ``/proc`` instead.
        """
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return proc_group_has_live_member(pgid)

    def _prune_groups(self) -> None:
        """Forget groups whose leader is reaped and that have no members left."""
        for p in self.procs:
            if p.returncode is not None and p.pid in self.live_groups:
                if not self._group_alive(p.pid):
                    self.live_groups.discard(p.pid)

    def begin_stop(self, sig: int) -> None:
        """Send ``sig`` to all groups and arm the SIGKILL escalation after ``kill_timeout``."""
        self.signal_groups(sig)
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.kill_timeout

    def kill_all(self) -> None:
        """SIGKILL every remaining process group."""
        if self.killed_at is None:
            self.killed_at = time.monotonic()
        self.held.clear()
        self.signal_groups(signal.SIGKILL)

    def on_signal(self, signum: int, frame: object) -> None:
        """Signal handler: forward the first stop signal, escalate to SIGKILL on the next."""
        if self.signal_received is None and self.stop_deadline is None:
            self.signal_received = signum
            self.stderr.write(
                f"{PROG}: received {signal_name(signum)}; forwarding to "
                f"{self._alive_count()} processes\n"
            )
            self.forward(signum)
            # The ranks save at their next step, which may first need a compile (tens of
            # seconds on a GPU) and then the checkpoint: --kill-timeout is for failures.
            self.stop_deadline = time.monotonic() + max(self.kill_timeout, STOP_GRACE_S)
        else:
            if self.signal_received is None:
                self.signal_received = signum
            self.stderr.write(f"{PROG}: received {signal_name(signum)} again; killing all\n")
            self.kill_all()

    def _alive_count(self) -> int:
        """Children not yet seen exited (no poll(): reaping stays in :meth:`wait`)."""
        return len(self.procs) - len(self.returncodes)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, envs: list[dict[str, str]]) -> None:
        """Start the children (stopping early if a signal arrives meanwhile), then their output
        readers: the forks happen while no reader thread runs, since the ``preexec_fn`` that
        ties each child's life to the launcher's is only safe without other threads."""
        die_with_launcher = functools.partial(die_with_parent, load_prctl(), os.getpid())
        try:
            for env in envs:
                if self.signal_received is not None:
                    break
                proc = self._start_rank(env, die_with_launcher)
                self.procs.append(proc)
                self.started_at[proc.pid] = time.monotonic()
                self.live_groups.add(proc.pid)
                if self.signal_received is not None:  # arrived while Popen ran: forward it too
                    self.forward(self.signal_received, [proc.pid])
        finally:
            for rank, proc in enumerate(self.procs):
                prefix = f"[rank {rank}] "
                stderr_watch = functools.partial(self.stalls.see, rank)
                for pipe, out, watch, aftermath in (
                    (proc.stdout, self.stdout, None, None),
                    (proc.stderr, self.stderr, stderr_watch, (Aftermath(), rank)),
                ):
                    assert pipe is not None
                    t = threading.Thread(
                        target=pump,
                        args=(pipe, prefix, out, watch, aftermath),
                        name=f"{PROG}-rank{rank}",
                        daemon=True,
                    )
                    t.start()
                    self.readers.append(t)

    def _start_rank(
        self, env: dict[str, str], die_with_launcher: Callable[[], None]
    ) -> subprocess.Popen[bytes]:
        """One rank: a new process in its own session, tied to the launcher's life."""
        return subprocess.Popen(
            self.command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_launcher,
        )

    def wait(self, on_poll: Callable[[], None] = lambda: None) -> int:
        """Supervise the children until all have exited; return the launcher's exit code.
        ``on_poll`` is called at every poll (the restarts watch the run's workdir)."""
        failure: int | None = None  # exit code of the first failed rank
        while len(self.returncodes) < len(self.procs):
            on_poll()
            self.send_held()
            exited = []
            for rank, proc in enumerate(self.procs):
                if rank not in self.returncodes and proc.poll() is not None:
                    self.returncodes[rank] = proc.returncode
                    exited.append(rank)
            failed = [(rank, self.returncodes[rank]) for rank in exited]
            failed = [(rank, rc) for rank, rc in failed if rc != 0]
            # A failure while stopping (a signal forwarded, or after the first failure) was
            # expected: only the first one is reported, naming its cause.
            if failed and failure is None and self.signal_received is None:
                stall = self._stall(failed)
                self.cause = self._out_of_memory(failed) or first_cause(failed, stall)
                cause = failure_report(failed, self._alive_count(), stall, self.cause)
                self.first_failure = min(failed, key=killed_first)
                failure = exit_code_for(self.first_failure[1])
                self.stderr.write(f"{PROG}: {cause}\n")
                # Also signals the failed rank's own group, in case it left grandchildren.
                self.begin_stop(signal.SIGTERM)
            if len(self.returncodes) == len(self.procs):
                break
            now = time.monotonic()
            if self.killed_at is not None and now - self.killed_at > REAP_TIMEOUT:
                # Something survives SIGKILL (e.g. uninterruptible sleep): give up on it so the
                # launcher still exits within its time bound.
                self.stderr.write(f"{PROG}: some processes did not die after SIGKILL\n")
                break
            if (
                self.stop_deadline is not None
                and self.killed_at is None
                and now >= self.stop_deadline
            ):
                self.kill_all()
            time.sleep(_POLL_INTERVAL)
        self._cleanup_groups()
        self._join_readers()
        if failure is not None:
            return failure
        if self.signal_received is not None:
            codes = {exit_code_for(rc) for rc in self.returncodes.values()}
            if codes == {PREEMPTED}:  # every rank saved and stopped: rerun to continue
                return PREEMPTED
            return 128 + self.signal_received
        return 0

    def _out_of_memory(self, failed: list[tuple[int, int]]) -> str | None:
        """The cause's words when the rank killed by SIGKILL was the OOM killer's: the memory
        cgroup's count of OOM kills grew since the ranks started (:mod:`.oom`)."""
        killed = [rank for rank, rc in sorted(failed) if rc == -signal.SIGKILL]
        if not killed or self.oom_kills is None:
            return None
        now = oom_kills()
        if now is None or now <= self.oom_kills:
            return None
        return oom_cause(killed[0], self.command)

    def _stall(self, failed: list[tuple[int, int]]) -> tuple[int, str] | None:
        """The rank that stalled when a rank exited 124 (:class:`Stalls`): a rank still alive
        but stopped (SIGSTOP: it cannot say so), else the one the ranks' lines name."""
        if all(exit_code_for(rc) != STALLED for _, rc in failed):
            return None
        for rank, proc in enumerate(self.procs):
            if rank not in self.returncodes and is_stopped(proc.pid):
                self.stalls.stopped(rank)
        return self.stalls.culprit()

    def _cleanup_groups(self) -> None:
        """Terminate grandchildren left in the children's process groups."""
        self._prune_groups()
        if not self.live_groups:
            return
        if self.killed_at is None:
            self.begin_stop(signal.SIGTERM)
            assert self.stop_deadline is not None
            while self.live_groups and time.monotonic() < self.stop_deadline:
                time.sleep(_POLL_INTERVAL)
                self._prune_groups()
            self.kill_all()
        deadline = time.monotonic() + REAP_TIMEOUT
        while self.live_groups and time.monotonic() < deadline:
            time.sleep(_POLL_INTERVAL)
            self._prune_groups()

    def _join_readers(self) -> None:
        deadline = time.monotonic() + READER_JOIN_TIMEOUT
        for t in self.readers:
            t.join(max(0.0, deadline - time.monotonic()))

    def abort(self) -> None:
        """Kill and reap everything started so far (used when startup fails)."""
        self.kill_all()
        for p in self.procs:
            try:
                p.wait(REAP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        self._join_readers()
