"""The worker side of the driver's pipe: commands in (``run K`` | ``profile`` | ``quit``), one
``TAG`` JSON line per reply out; under MPI, rank 0 relays commands and gathers replies."""

from __future__ import annotations

import json
import os
import resource
import sys
import time

from .common import TAG


def send(msg: dict) -> None:
    sys.stdout.write(TAG + json.dumps(msg) + "\n")
    sys.stdout.flush()


def threads_now() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def replier(world=None):
    """How a worker answers the driver: one ``TAG`` line on stdout, or under MPI (``world``:
    mpi4py's ``COMM_WORLD``) a ``gather`` to rank 0, which sends every rank's message in rank
    order (so the driver reads the same messages from one ``mpirun`` as from P processes)."""
    if world is None:
        return send

    def reply(msg: dict) -> None:
        msgs = world.gather(msg, root=0)
        if msgs is not None:  # rank 0
            for m in msgs:
                send(m)

    return reply


def commands(world=None):
    """The driver's commands, split into words: stdin lines, or under MPI rank 0's stdin lines
    relayed to every rank (``mpirun`` gives stdin to rank 0 only). Ends on
    ``quit`` (kept) or when stdin closes (every rank stops)."""
    if world is None:
        for line in sys.stdin:
            yield line.split()
        return
    rank = world.Get_rank()
    while True:
        if rank == 0:
            line = sys.stdin.readline()
            cmd = line.split() if line else None
            for other in range(1, world.Get_size()):
                world.send(cmd, dest=other, tag=7)
        else:
            # Not a blocking bcast: MPICH busy-polls while it waits, so an idle rank would
            # burn a core for hours while the other configurations are being timed. Poll
            # and sleep instead (a 2 ms delay on a command is nothing next to a step).
            while not world.Iprobe(source=0, tag=7):
                time.sleep(0.002)
            cmd = world.recv(source=0, tag=7)
        if cmd is None:  # rank 0 read EOF: the driver is gone
            return
        yield cmd


def serve(step_once, profile_once, finish, world=None) -> None:
    """The worker's command loop: ``run K`` | ``profile`` | ``quit`` on stdin (under MPI: rank 0
    reads them and relays them to the other ranks, see :func:`commands`)."""
    reply = replier(world)
    for cmd in commands(world):
        if not cmd:
            continue
        if cmd[0] == "run":
            times, losses = [], []
            for _ in range(int(cmd[1])):
                t, loss = step_once()
                times.append(t)
                losses.append(loss)
            reply({"step_s": times, "loss": losses})
        elif cmd[0] == "profile":
            reply({"profile": profile_once()})
        elif cmd[0] == "quit":
            extra = finish()
            reply({"maxrss_mib": maxrss_mib(), "threads": threads_now(), **extra})
            return
