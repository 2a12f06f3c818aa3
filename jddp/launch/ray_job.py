"""The ranks of a ``python -m jddp.ray`` job on their Ray actors: start them wired for
``jax.distributed``, relay their output with a ``[rank i] `` prefix, forward the driver's stop
signals, stop everyone when one fails, and clean up (:mod:`jddp.launch.ray_cluster` is the
command line and the cluster; :mod:`jddp.launch.remote` the actor on each node)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jddp.errors import BAD_INPUT, FAILURE, PREEMPTED, STALLED
from jddp.launch.supervise import (
    STOP_GRACE_S,
    Aftermath,
    Output,
    Stalls,
    exit_code_for,
    failure_report,
    killed_first,
)

PROG = "jddp.ray"
_POLL_INTERVAL = 0.1
_RPC_TIMEOUT_S = 60.0  # an actor that does not answer a poll for this long counts as lost
_REAP_GRACE_S = 5.0  # SIGTERM to SIGKILL for what a finished rank left in its group
# A failure is named once every rank has ended, or this long after the first seen to fail,
# from the ranks seen ending meanwhile: a rank's exit reaches the driver by one poll per actor,
# and a killed rank's can come after its peer's, whose collective failed because of the kill
# (46 ms after it, measured): the killed one is the cause. In the suite under load the kill
# once reached the driver more than 1 s after the peer's exit (not reproduced in 3 runs beside
# two busy loops, where it came 3 ms after the kill); a rank that still runs after a peer
# failed is stopped this much later.
_SETTLE_S = 5.0


class LaunchError(Exception):
    """A bad command line, or a cluster that cannot run the job: one line, with its exit code
    (2 for what the command line can fix, 1 otherwise)."""

    def __init__(self, message: str, exit_code: int = BAD_INPUT) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (Ray's run to many lines), else its type."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@dataclass
class _Rank:
    """One rank as the driver sees it."""

    actor: Any
    node: str  # the node's IP address
    host: str
    local_rank: int = 0
    pid: int | None = None
    returncode: int | None = None  # Popen's, once exited
    drained: bool = False  # all its output relayed (after the exit)
    lost: str | None = None  # why its actor is gone, if it is

    @property
    def where(self) -> str:
        """``IP (host name)`` of its node."""
        return f"{self.node} ({self.host})"

    @property
    def exited(self) -> bool:
        """The rank's process has ended (or its actor is gone)."""
        return self.returncode is not None or self.lost is not None

    @property
    def finished(self) -> bool:
        """Exited, with all its output relayed: nothing more to poll."""
        return self.lost is not None or (self.returncode is not None and self.drained)


class RayJob:
    """The job's ranks on their actors: start, relay output, stop, clean up."""

    def __init__(
        self,
        ray: Any,
        group: Any,
        command: Sequence[str],
        *,
        cpus: float,
        gpus: float,
        devices_per_proc: int | None,
        env: Mapping[str, str],
        kill_timeout: float,
    ) -> None:
        """``command`` on each bundle of the placement ``group`` (``cpus`` and ``gpus`` each),
        with ``env`` added to each node's environment; ``kill_timeout``: SIGTERM to SIGKILL
        when stopping the ranks after a failure."""
        self.ray, self.group, self.command = ray, group, list(command)
        self.cpus, self.gpus, self.devices_per_proc = cpus, gpus, devices_per_proc
        self.env, self.kill_timeout = dict(env), kill_timeout
        self.stdout, self.stderr = Output("stdout"), Output("stderr")
        self.ranks: list[_Rank] = []
        self.signals: list[int] = []  # received by the driver, handled by the loop
        self.signal_received: int | None = None
        self.stop_deadline: float | None = None
        self.killed_at: float | None = None
        self.failure: str | None = None  # the first failure, as said (a restart's cause)
        self.stalls = Stalls()  # which rank stalled, from the ranks' stall lines
        self.aftermath: dict[int, Aftermath] = {}  # per rank: JAX's lines once process 0 ended

    # -- start ------------------------------------------------------------------------------
    def start(self) -> None:
        """Create the actors, number the ranks by node, pick the coordinator, start the ranks."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from jddp.launch.remote import RankProcess

        ray = self.ray
        actor_class = ray.remote(RankProcess)
        actors = [
            actor_class.options(
                num_cpus=self.cpus,
                num_gpus=self.gpus,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(self.group.bundle_count)
        ]
        try:
            where = ray.get([a.node.remote() for a in actors], timeout=_RPC_TIMEOUT_S)
        except Exception as e:  # e.g. jddp missing on a node: the actor class does not import
            raise LaunchError(
                f"the Ray workers did not start: {first_line(e)} (jddp, and the driver's "
                "Python and Ray versions, must be installed on every node)",
                FAILURE,
            ) from None
        order = list(dict.fromkeys(ip for ip, _ in where))  # nodes by first appearance
        ranked = sorted(range(len(actors)), key=lambda i: (order.index(where[i][0]), i))
        for i in ranked:
            ip, host = where[i]
            local = sum(r.node == ip for r in self.ranks)
            self.ranks.append(_Rank(actors[i], ip, host, local))
        port = ray.get(self.ranks[0].actor.free_port.remote(), timeout=_RPC_TIMEOUT_S)
        coordinator = f"{self.ranks[0].node}:{port}"
        base = self.env | {
            "JDDP_COORDINATOR_ADDRESS": coordinator,
            "JDDP_NUM_PROCESSES": str(len(self.ranks)),
            "JDDP_CPU_THREADS": str(max(1, int(self.cpus))),
        }
        cwd = os.getcwd()
        started = [
            r.actor.start.remote(
                self.command,
                {
                    **base,
                    "JDDP_PROCESS_ID": str(i),
                    "JDDP_LOCAL_RANK": str(r.local_rank),
                    "JDDP_LOCAL_WORLD_SIZE": str(sum(o.node == r.node for o in self.ranks)),
                },
                cwd,
                self.devices_per_proc,
            )
            for i, r in enumerate(self.ranks)
        ]
        nodes = ", ".join(
            f"{ip} ({_span([i for i, r in enumerate(self.ranks) if r.node == ip])})" for ip in order
        )
        self.stderr.write(
            f"{PROG}: {_count(len(self.ranks), 'process', 'processes')} on "
            f"{_count(len(order), 'node', 'nodes')}: {nodes}; coordinator {coordinator}\n"
        )
        for i, (rank, ref) in enumerate(zip(self.ranks, started, strict=True)):
            try:
                rank.pid, note = ray.get(ref, timeout=_RPC_TIMEOUT_S)
            except Exception as e:  # the command could not start (or the actor died)
                cause = getattr(e, "cause", None) or e  # a RayTaskError carries the OSError
                raise LaunchError(
                    f"rank {i} (node {rank.where}): cannot start {self.command[0]!r}: "
                    f"{first_line(cause)}",
                    127 if isinstance(cause, FileNotFoundError) else 126,  # as a shell says
                ) from None
            if note:
                self.stderr.write(f"{PROG}: rank {i}: {note}\n")

    # -- supervise --------------------------------------------------------------------------
    def on_signal(self, signum: int, frame: object) -> None:
        """Signal handler: record; the loop forwards (Ray calls are not made from handlers)."""
        self.signals.append(signum)

    def _handle_signals(self) -> None:
        while self.signals:
            signum = self.signals.pop(0)
            name = signal.Signals(signum).name
            if self.signal_received is None and self.stop_deadline is None:
                self.signal_received = signum
                self.stderr.write(
                    f"{PROG}: received {name}; forwarding to {len(self._live())} processes\n"
                )
                self._signal_all(signum)
                self.stop_deadline = time.monotonic() + max(self.kill_timeout, STOP_GRACE_S)
            else:
                self.signal_received = self.signal_received or signum
                self.stderr.write(f"{PROG}: received {name} again; killing all\n")
                self._kill_all()

    def _live(self) -> list[_Rank]:
        return [r for r in self.ranks if not r.finished]

    def _running(self) -> int:
        return sum(not r.exited for r in self.ranks)

    def _signal_all(self, sig: int) -> None:
        for r in self._live():
            r.actor.signal.remote(sig)

    def _kill_all(self) -> None:
        if self.killed_at is None:
            self.killed_at = time.monotonic()
        self._signal_all(signal.SIGKILL)

    def _poll(self) -> list[int]:
        """Relay every live rank's new output; return the ranks seen exiting now."""
        live = self._live()
        refs = [r.actor.poll.remote() for r in live]
        ended = []
        for rank, ref in zip(live, refs, strict=True):
            index = self.ranks.index(rank)
            try:
                lines, returncode, rank.drained = self.ray.get(ref, timeout=_RPC_TIMEOUT_S)
            except Exception as e:  # the actor died (its node, the OOM killer) or hangs
                rank.lost = first_line(e)
                ended.append(index)
                continue
            aftermath = self.aftermath.setdefault(index, Aftermath())
            for stream, text in lines:
                out = self.stdout if stream == "stdout" else self.stderr
                if stream == "stderr":
                    self.stalls.see(index, text)
                if stream == "stdout" or aftermath.show(text):
                    out.write(f"[rank {index}] {text}")
            if rank.drained and aftermath.hidden:
                self.stderr.write(aftermath.summary(index) or "")
                aftermath.hidden = 0  # said once
            if returncode is not None and rank.returncode is None:
                rank.returncode = returncode
                ended.append(index)
        return ended

    def _describe(self, ended: list[int]) -> str:
        """The line naming the first failure among ``ended`` and where it ran."""
        lost = [i for i in ended if self.ranks[i].lost]
        alive = self._running()
        if lost:
            i = lost[0]
            text = f"rank {i}'s Ray actor died ({self.ranks[i].lost})"
            others = (
                f"; stopping the other {_count(alive, 'process', 'processes')}" if alive else ""
            )
            return f"{text}{others} (rank {i}: node {self.ranks[i].where})"
        failed = [(i, self.ranks[i].returncode) for i in ended if self.ranks[i].returncode]
        first, code = min(failed, key=killed_first)
        stall = self.stalls.culprit()
        if stall is not None and exit_code_for(code) == STALLED:
            first = stall[0]  # the rank that stalled, where it ran
        rank = self.ranks[first]
        report = failure_report(failed, alive, stall)
        return f"{report} (rank {first}: node {rank.where}, pid {rank.pid})"

    def wait(self, on_poll: Callable[[], None] = lambda: None) -> int:
        """Supervise the ranks until all have finished; return the driver's exit code
        (``on_poll``: called at every poll; the restarts watch the run's workdir)."""
        failure: int | None = None
        bad: list[int] = []  # failed ranks seen while no stop was under way, not yet named
        settled_at: float | None = None  # when the first of them is named
        while self._live():
            on_poll()
            ended = self._poll()
            stopping = failure is not None or self.signal_received is not None
            if not stopping:
                bad += [i for i in ended if self.ranks[i].lost or self.ranks[i].returncode]
                if bad and settled_at is None:
                    settled_at = time.monotonic() + _SETTLE_S
            settled = settled_at is not None and (
                time.monotonic() >= settled_at or not self._running() or self.signals
            )
            if bad and not stopping and settled:
                gone = [i for i in bad if self.ranks[i].lost]
                self.failure = (  # short: Ray's own error stays in the line below
                    f"rank {gone[0]}'s Ray actor died (node {self.ranks[gone[0]].where})"
                    if gone
                    else self._describe(bad)
                )
                self.stderr.write(f"{PROG}: {self._describe(bad)}\n")
                lost = any(self.ranks[i].lost for i in bad)  # named first, as in _describe
                failure = FAILURE if lost else self._first_code(bad)
                self._signal_all(signal.SIGTERM)
                self.stop_deadline = time.monotonic() + self.kill_timeout
            self._handle_signals()  # after the failure: a signal then stops what is left
            now = time.monotonic()
            if self.stop_deadline is not None and self.killed_at is None:
                if now >= self.stop_deadline:
                    self._kill_all()
            elif self.killed_at is not None and now - self.killed_at > _RPC_TIMEOUT_S / 4:
                self.stderr.write(f"{PROG}: some processes did not end after SIGKILL\n")
                break
            if self._live():
                time.sleep(_POLL_INTERVAL)
        if failure is not None:
            return failure
        if self.signal_received is not None:
            codes = {exit_code_for(r.returncode) for r in self.ranks if r.returncode is not None}
            if codes == {PREEMPTED} and not any(r.lost for r in self.ranks):
                return PREEMPTED
            return 128 + self.signal_received
        return 0

    def _first_code(self, bad: list[int]) -> int:
        failed = [(i, self.ranks[i].returncode) for i in bad if self.ranks[i].returncode]
        return exit_code_for(min(failed, key=killed_first)[1])

    def cleanup(self) -> None:
        """End what the ranks left in their process groups, then the actors."""
        refs = []
        for r in self.ranks:
            if r.lost is None:
                refs.append(r.actor.reap.remote(_REAP_GRACE_S))
        try:
            self.ray.get(refs, timeout=_REAP_GRACE_S + 10)
        except Exception:
            pass  # the actors are killed below: their ranks die with them (PDEATHSIG)
        for r in self.ranks:
            try:
                self.ray.kill(r.actor)
            except Exception:
                pass


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _span(ranks: list[int]) -> str:
    """``ranks 0-3`` for consecutive ranks, else ``ranks 0, 2``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))
