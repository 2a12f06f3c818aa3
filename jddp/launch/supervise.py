"""What every launcher shares when it supervises ranks (the local one, :mod:`.local`; on Ray,
:mod:`.ray_job`; on a remote host, :mod:`.remote`): line-atomic output and the pump that forwards a
child's pipe to it with a ``[rank i]`` prefix, how an exit is described and reported, which
signals are held for a rank still starting, and whether a process group still has a live member."""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO

from jddp.errors import STALLED, STOP_SIGNALS

PROG = "jddp.launch"
READER_JOIN_TIMEOUT = 5.0  # after all children are reaped, how long to wait for EOF on pipes
REAP_TIMEOUT = 2.0  # after SIGKILL, how long to wait for a child / group to disappear
_READ_LIMIT = 1 << 16  # longest piece of a newline-less line forwarded at once
# SIGUSR1 and SIGHUP kill a process that has no handler for them yet: a rank in its first
# moments (Python starting, before ``jddp.train`` catches them in its first statement) would die
# of a forwarded one with nothing said and nothing saved. The launcher holds such a signal until
# the rank catches it, for at most this long after the rank's start. SIGTERM too for a rank of
# jddp's own commands (:func:`held_signals`: it died, the launcher exited 143), not for another
# command, whose default is to die of it at once. SIGINT goes at once: Python catches it from
# its start (KeyboardInterrupt).
HELD_SIGNALS = (signal.SIGUSR1, signal.SIGHUP)
STARTUP_GRACE_S = 10.0


def held_signals(command: Sequence[str]) -> tuple[int, ...]:
    """The signals held for a starting rank of ``command``: :data:`HELD_SIGNALS`, and SIGTERM
    where the rank is one of jddp's commands (``python -m jddp.X``), which catches it first
    thing and saves on it."""
    jddp_command = len(command) >= 3 and command[1] == "-m" and command[2].startswith("jddp.")
    return (signal.SIGTERM, *HELD_SIGNALS) if jddp_command else HELD_SIGNALS


# How long the ranks get to save after a forwarded stop signal before SIGKILL (SLURM's
# --signal=USR1@120 gives a job the same); a second signal kills at once.
STOP_GRACE_S = 120.0


def describe_exit(returncode: int) -> str:
    """Describe a ``Popen.returncode``: ``exited with code 3`` / ``killed by signal SIGKILL``."""
    if returncode < 0:
        return f"killed by signal {signal_name(-returncode)}"
    return f"exited with code {returncode}"


class Stalls:
    """Which rank stalled, from what the ranks say and are: every rank's watchdog prints one
    line when the job makes no progress (``jddp: error: step N stalled: ... process P was
    waiting for W; stopping ...``, :mod:`jddp.proc.watchdog`) and exits 124, the rank that
    stalled and the peers waiting for it in the all-reduce alike, and the leader exits last.
    Fed each rank's stderr lines (:meth:`see`) and the ranks found stopped (SIGSTOP; they print
    nothing); :meth:`culprit` names the rank to blame. Thread-safe (the pumps feed it)."""

    LINE = re.compile(
        r"jddp: error: step \d+ stalled: .*?; process (\d+) was waiting for (.+?); stop"
    )

    def __init__(self) -> None:
        self._lines: list[tuple[int, str]] = []  # (rank, what it waited for), as they came
        self._stopped: list[int] = []
        self._lock = threading.Lock()

    def see(self, rank: int, line: str) -> None:
        """A line rank ``rank`` wrote on stderr."""
        if "stalled" in line:
            match = self.LINE.search(line)
            if match:
                with self._lock:
                    self._lines.append((rank, match[2]))

    def stopped(self, rank: int) -> None:
        """Rank ``rank``'s process is stopped (SIGSTOP, a debugger): it cannot progress."""
        with self._lock:
            if rank not in self._stopped:
                self._stopped.append(rank)

    def culprit(self) -> tuple[int, str] | None:
        """``(rank, how it stalled)``: a stopped rank; else the first whose line says it waited
        for its own work (its input pipeline, a host callback of its own), which its peers
        then waited for in the all-reduce; else the rank whose watchdog spoke first. None
        when no rank said it stalled."""
        from jddp.proc.watchdog import OWN_WAITS, WAITING

        with self._lock:
            if self._stopped:
                return self._stopped[0], ": its process is stopped (SIGSTOP or a debugger)"
            own = [WAITING[what] for what in OWN_WAITS]
            for rank, waited in self._lines:
                if any(waited.startswith(text) for text in own):
                    return rank, f", waiting for {waited}"
            if self._lines:
                rank, waited = self._lines[0]
                return rank, f", waiting for {waited}"
        return None


class Aftermath:
    """One rank's stderr once JAX's coordination service reports another process gone:
    process 0 hosts it, so when process 0 ends (its own one line said why), a peer still alive
    prints JAX's errors about the lost service (and process 0 likewise when a peer dies) —
    ``Polled an error from coordination service``, ``Terminating process because the JAX
    distributed service detected fatal errors``, gRPC's details, a stack dump as it aborts, its
    failed all-reduce — a page that says only that another process ended, which the launcher
    says itself. From the first of those lines on, the rank's lines are counted, not shown
    (:meth:`show`), and said in one line at its end (:meth:`summary`)."""

    START = (
        "Polled an error from coordination service",
        "Terminating process because the JAX distributed service detected fatal errors",
        "Failed to retrieve preemption notice from coordination service",
    )

    def __init__(self) -> None:
        self.hidden = 0

    def show(self, line: str) -> bool:
        """Whether to forward ``line`` (False once the rank's aftermath began)."""
        if not self.hidden and not any(start in line for start in self.START):
            return True
        self.hidden += 1
        return False

    def summary(self, rank: int) -> str | None:
        """The line that stands for the hidden ones, if any."""
        if not self.hidden:
            return None
        return (
            f"{PROG}: rank {rank}: {self.hidden} line{'s' if self.hidden > 1 else ''} of JAX's "
            "errors about the job's coordination service not shown: another process had ended "
            "(its own lines say why)\n"
        )


def killed_first(failed: tuple[int, int]) -> tuple[bool, int]:
    """The order of failed ranks' ``(rank, returncode)`` in a report and for the exit code:
    ranks killed by a signal first, then by rank."""
    return failed[1] >= 0, failed[0]


def named_first(
    failed: list[tuple[int, int]], stall: tuple[int, str] | None = None
) -> tuple[int, int]:
    """The ``(rank, returncode)`` among ``failed`` (seen exiting together) that a report names
    first: the rank that stalled (``stall``) when it is among them and exited 124, as the first
    did; else a rank killed by a signal (the OOM killer, a node's kill -9 takes its peers'
    collectives down with it, so it is named, not the survivor whose all-reduce then failed:
    "Connection closed by peer", exit 1); else the lowest rank."""
    first = min(failed, key=killed_first)
    if stall is not None and exit_code_for(first[1]) == STALLED:
        stalled = [f for f in failed if f[0] == stall[0] and exit_code_for(f[1]) == STALLED]
        return stalled[0] if stalled else first
    return first


def first_cause(failed: list[tuple[int, int]], stall: tuple[int, str] | None = None) -> str:
    """The cause among ``failed`` (``(rank, returncode)`` seen exiting together,
    :func:`named_first`). A stall (exit 124) names the rank that stalled (``stall``,
    :meth:`Stalls.culprit`), not the first to exit: every rank's watchdog fires, the waiting
    peers' too; with how it exited when it is among ``failed`` (a peer's collective fails as
    the stalled rank exits: both are often seen in one poll), else how the first one did."""
    rank, rc = named_first(failed, stall)
    text = f"rank {rank} {describe_exit(rc)}"
    if stall is None or exit_code_for(rc) != STALLED:
        return text
    stalled, how = stall
    exited = describe_exit(rc) if stalled == rank else text
    return f"rank {stalled} stalled{how} ({exited})"


def failure_report(
    failed: list[tuple[int, int]],
    alive: int,
    stall: tuple[int, str] | None = None,
    cause: str | None = None,
) -> str:
    """What the launcher says when ranks fail: ``failed`` holds ``(rank, returncode)`` of the
    failed ranks seen exiting together (one poll), ``alive`` how many ranks still run; the
    cause first (``cause``, else :func:`first_cause`), the others in brackets."""
    named = named_first(failed, stall)
    ordered = sorted(failed, key=killed_first)
    also = "; ".join(f"rank {r} {describe_exit(c)}" for r, c in ordered if (r, c) != named)
    text = (cause or first_cause(failed, stall)) + (f" (then {also})" if also else "")
    if alive:
        return f"{text}; stopping the other {alive} process{'es' if alive > 1 else ''}"
    return f"{text}; no other process is left"


def exit_code_for(returncode: int) -> int:
    """Map a child's ``Popen.returncode`` to a shell-style exit status (128+N for signals)."""
    return 128 - returncode if returncode < 0 else returncode


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``SigCgt`` of ``/proc/PID/status``);
    True where that cannot be read (not Linux, the process gone): then nothing is held."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return True


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state ``T``/``t`` in ``/proc/PID/stat``: SIGSTOP, a
    debugger); False where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] in (b"T", b"t")


class Wakeup:
    """A sleep that a stop signal ends at once, whichever thread the kernel gave it to and
    whenever it came. Two ways in, both into one pipe: the stop signals' Python handlers call
    :meth:`wake` (a signal that came just before the sleep, whose handler ran as the sleep was
    about to begin, ended nothing: the 600 s restart delay ran out), and during the sleep the
    pipe is the signals' wakeup fd, which the C-level handler writes from whichever thread
    received the signal (a Python handler runs on the main thread only, once that thread is back
    from C: a SIGTERM a reader thread, or one of Ray's, received left a plain sleep to run out).
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def wake(self, signum: int, frame: object = None) -> None:
        """A stop signal's handler (or part of one): ends the sleep under way, or the next."""
        self.received = self.received or signum
        try:
            os.write(self._write, bytes([signum]))
        except OSError:  # the pipe is full (a wake-up is waiting already) or closed
            pass

    def sleep(self, seconds: float) -> int | None:
        """Sleep ``seconds``, or until a stop signal arrives (or has arrived since the last
        sleep): the first one's number, or None."""
        on_main = threading.current_thread() is threading.main_thread()
        previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False) if on_main else -1
        try:
            ready, _, _ = select.select([self._read], [], [], seconds)
            numbers = os.read(self._read, 512) if ready else b""
        finally:
            if on_main:
                signal.set_wakeup_fd(previous)
        stops = [n for n in numbers if n in STOP_SIGNALS]
        if stops and self.received is None:  # (its Python handler has not run yet)
            self.received = stops[0]
        return self.received if stops else None

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def proc_group_has_live_member(pgid: int) -> bool:
    """Scan ``/proc`` for a non-zombie process in group ``pgid`` (True if ``/proc`` is absent)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile, or not readable
        # "pid (comm) state ppid pgrp ...": comm may contain spaces or parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


class Output:
    """Line-atomic, thread-safe writer to the launcher's stdout or stderr."""

    def __init__(self, name: str) -> None:
        self._name = name
        # Reentrant: the signal handler may write while the main thread holds the lock.
        self._lock = threading.RLock()
        self._broken = False

    def write(self, text: str) -> None:
        """Write ``text`` and flush; swallow broken pipes (children keep being drained)."""
        with self._lock:
            if self._broken:
                return
            stream: IO[str] | None = getattr(sys, self._name)
            if stream is None:
                return
            try:
                try:
                    stream.write(text)
                except UnicodeEncodeError:
                    enc = getattr(stream, "encoding", None) or "ascii"
                    stream.write(text.encode(enc, "backslashreplace").decode(enc))
                stream.flush()
            except (BrokenPipeError, ValueError):
                self._broken = True
            except OSError:
                pass


def pump(
    pipe: IO[bytes],
    prefix: str,
    out: Output,
    watch: Callable[[str], None] | None = None,
    aftermath: tuple[Aftermath, int] | None = None,
) -> None:
    """Forward ``pipe`` to ``out`` line by line, each line prefixed (and shown to ``watch``),
    but a rank's :class:`Aftermath` (``(its filter, the rank)``), said in one line at EOF;
    close the pipe at EOF."""
    try:
        while True:
            chunk = pipe.readline(_READ_LIMIT)
            if not chunk:
                break
            text = chunk.decode("utf-8", errors="replace")
            if not text.endswith("\n"):
                text += "\n"
            if watch is not None:
                watch(text)
            if aftermath is None or aftermath[0].show(text):
                out.write(prefix + text)
        summary = aftermath[0].summary(aftermath[1]) if aftermath is not None else None
        if summary:
            out.write(summary)
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass
