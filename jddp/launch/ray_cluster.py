"""A jddp job on a Ray cluster: one ``python -m jddp.train`` per Ray worker, wired for
``jax.distributed`` and supervised like ``python -m jddp.launch`` does its local ranks.

Usage::

    python -m jddp.ray --num-workers N [--address ADDR] [--cpus-per-worker C]
        [--gpus-per-worker G] [--devices-per-proc K] [--placement-strategy S]
        [--placement-timeout S] [--kill-timeout S] [--max-restarts K [--min-workers M]
        [--restart-delay S]] [--env NAME[=VALUE] ...] -- <command ...>

What it does, in order:

1. connects to the cluster at ``--address`` (else ``RAY_ADDRESS``, else ``auto``: a cluster
   started on this machine); nothing answering there within :data:`CONNECT_TIMEOUT_S` is one
   line, exit 2;
2. reserves ``N`` bundles of ``{CPU: C, GPU: G}`` in a placement group (``PACK`` by default) and
   waits at most ``--placement-timeout`` seconds for them: a request the cluster cannot hold is
   one line naming what is missing, exit 2 (exit 1 when the cluster has it but other work holds
   it);
3. starts one actor per bundle (:class:`jddp.launch.remote.RankProcess`); ranks are numbered so
   that each node's are consecutive, rank 0 on the first actor's node; the coordinator is rank
   0's node at a port free there;
4. each actor runs ``<command>`` as a subprocess on its node (a leading ``python`` is the
   actor's interpreter), in the driver's folder, with the node's environment plus
   ``JDDP_COORDINATOR_ADDRESS``, ``JDDP_NUM_PROCESSES``, ``JDDP_PROCESS_ID``,
   ``JDDP_LOCAL_RANK`` (the rank among this node's), ``JDDP_CPU_THREADS=C`` (on CPUs jddp pins
   each rank to that many cores; it also sizes ``data.workers``) and the driver's variables
   named ``JAX_*``, ``XLA_*``, ``JDDP_*``, ``NCCL_*``, ``MLFLOW_*``, ``WANDB_*`` (plus ``--env``);
   Ray sets ``CUDA_VISIBLE_DEVICES`` to the worker's GPUs;
5. prints every line a rank writes with a ``[rank i] `` prefix (stdout to stdout, stderr to
   stderr) and stops the job as ``jddp.launch`` does: a rank that fails (or whose actor dies)
   is named with its node, the others get SIGTERM and SIGKILL after ``--kill-timeout``, and
   the driver exits with that rank's code (128 + signal for a signal death, 1 for a lost actor);
   SIGINT, SIGTERM, SIGUSR1 and SIGHUP to the driver are forwarded to every rank (exit 75 when
   every rank saved and exited 75), a second one kills them all.

The ranks die with their actors (``PR_SET_PDEATHSIG``), and the actors with the driver (Ray ends
a job's actors when its driver goes), so ``kill -9`` of the driver leaves nothing running.

With ``--max-restarts K`` a failed job (a rank, actor or node lost; not a preemption, bad input
or a stop signal) starts again by itself from its newest checkpoint, on fewer workers down to
``--min-workers`` when Ray cannot place N (:mod:`jddp.launch.elastic`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from jddp.errors import FAILURE, INTERRUPTED, STOP_SIGNALS
from jddp.launch import DEFAULT_KILL_TIMEOUT, DEFAULT_RESTART_DELAY, MAX_KILL_TIMEOUT
from jddp.launch.elastic import batch_of, worker_counts
from jddp.launch.ray_job import PROG, LaunchError, RayJob, first_line
from jddp.launch.restarts import (
    Restarts,
    workdir_of,
)
from jddp.launch.supervise import Output, Wakeup

CONNECT_TIMEOUT_S = 10.0  # how long a TCP connection to the cluster's address may take
DEFAULT_PLACEMENT_TIMEOUT = 60.0
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
FORWARDED_PREFIXES = ("JAX_", "XLA_", "JDDP_", "NCCL_", "MLFLOW_", "WANDB_")
# Set per rank, never taken from the driver's environment.
WIRING = (
    "JDDP_COORDINATOR_ADDRESS",
    "JDDP_NUM_PROCESSES",
    "JDDP_PROCESS_ID",
    "JDDP_LOCAL_RANK",
    "JDDP_LAUNCHER_PID",
    "JDDP_CPU_THREADS",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
)
_QUIET_WAIT_S = 10.0  # a longer wait for resources the cluster lacks now says so at once


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise LaunchError(message)


def _build_parser() -> _Parser:
    parser = _Parser(
        prog=f"python -m {PROG}",
        usage=f"python -m {PROG} --num-workers N [options] -- <command ...>",
        description="Run a jddp job with one process per worker of a Ray cluster.",
    )
    add = parser.add_argument
    add("--num-workers", type=int, required=True, metavar="N", help="processes to start (>= 1)")
    add(
        "--address",
        default=None,
        help="the cluster (host:port of its head, or ray://host:port); default: RAY_ADDRESS, "
        "else 'auto' (a cluster started on this machine)",
    )
    add("--cpus-per-worker", type=float, default=1.0, metavar="C", help="default 1")
    add("--gpus-per-worker", type=float, default=0.0, metavar="G", help="default 0")
    add(
        "--devices-per-proc",
        type=int,
        default=None,
        metavar="K",
        help="K fake CPU devices per process (XLA_FLAGS, JAX_PLATFORMS=cpu): the CPU test rig",
    )
    add(
        "--placement-strategy",
        default="PACK",
        choices=PLACEMENT_STRATEGIES,
        help="how Ray spreads the workers over nodes (default PACK)",
    )
    add(
        "--placement-timeout",
        type=float,
        default=DEFAULT_PLACEMENT_TIMEOUT,
        metavar="S",
        help=f"seconds to wait for the workers' resources (default {DEFAULT_PLACEMENT_TIMEOUT:g})",
    )
    add(
        "--kill-timeout",
        type=float,
        default=DEFAULT_KILL_TIMEOUT,
        metavar="S",
        help=f"seconds between SIGTERM and SIGKILL when stopping the ranks after a failure "
        f"(default {DEFAULT_KILL_TIMEOUT:g}, at most {MAX_KILL_TIMEOUT:g})",
    )
    add(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="when a rank, its actor or its node dies, start the job again from its newest "
        "checkpoint, at most K times (default 0); a preemption (exit 75), bad input (2), Ctrl-C "
        "or a stop signal to the driver is not restarted",
    )
    add(
        "--min-workers",
        type=int,
        default=None,
        metavar="M",
        help="a restart may run on fewer workers, down to M, when Ray cannot place N (a lost "
        "node): the largest count whose devices split data.global_batch_size; N again once "
        "the cluster holds them (default: N, never fewer)",
    )
    add(
        "--restart-delay",
        type=float,
        default=DEFAULT_RESTART_DELAY,
        metavar="S",
        help=f"seconds to wait before a restart (default {DEFAULT_RESTART_DELAY:g})",
    )
    add(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="also pass this variable (its value here, or VALUE) to every rank; repeatable",
    )
    return parser


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split ``argv`` at the first ``--``; return the flags and the command, or raise
    :class:`LaunchError` naming the flag."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, command = argv[:split], argv[split + 1 :]
    args = _build_parser().parse_args(own)
    if args.num_workers < 1:
        raise LaunchError(f"--num-workers must be >= 1, got {args.num_workers}")
    if args.cpus_per_worker <= 0:
        raise LaunchError(f"--cpus-per-worker must be > 0, got {args.cpus_per_worker:g}")
    if args.gpus_per_worker < 0:
        raise LaunchError(f"--gpus-per-worker must be >= 0, got {args.gpus_per_worker:g}")
    if args.devices_per_proc is not None:
        if args.devices_per_proc < 1:
            raise LaunchError(f"--devices-per-proc must be >= 1, got {args.devices_per_proc}")
        if args.gpus_per_worker:
            raise LaunchError(
                "--devices-per-proc (fake CPU devices) and --gpus-per-worker exclude each other"
            )
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.min_workers is None:
        args.min_workers = args.num_workers
    if not 1 <= args.min_workers <= args.num_workers:
        raise LaunchError(
            f"--min-workers must be between 1 and --num-workers {args.num_workers}, got "
            f"{args.min_workers}"
        )
    if not 0 <= args.restart_delay <= 3600:
        raise LaunchError(f"--restart-delay must be in 0..3600 s, got {args.restart_delay:g}")
    if args.placement_timeout <= 0:
        raise LaunchError(f"--placement-timeout must be > 0, got {args.placement_timeout:g}")
    if not 0 <= args.kill_timeout <= MAX_KILL_TIMEOUT:
        raise LaunchError(
            f"--kill-timeout must be between 0 and {MAX_KILL_TIMEOUT:g} seconds, "
            f"got {args.kill_timeout:g}"
        )
    for item in args.env:
        if not item.partition("=")[0].isidentifier():
            raise LaunchError(f"--env {item!r}: expected NAME or NAME=VALUE")
    if not command:
        raise LaunchError("no command given after '--' (usage: ... --num-workers N -- <command>)")
    return args, command


def forwarded_env(environ: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """The driver's variables every rank gets: those named with :data:`FORWARDED_PREFIXES`
    (the wiring excepted) and each ``--env NAME`` (its value here) or ``NAME=VALUE``."""
    env = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES) and k not in WIRING}
    for item in extra:
        name, eq, value = item.partition("=")
        if eq:
            env[name] = value
        elif name in environ:
            env[name] = environ[name]
    return env


def import_ray() -> Any:
    """``ray``, or :class:`LaunchError` saying how to install it."""
    try:
        import ray
    except ImportError as e:
        raise LaunchError(
            f"Ray is not installed here ({e}): pip install 'jddp[ray]' "
            "(the Ray version of the cluster)"
        ) from None
    return ray


def connect(ray: Any, address: str | None) -> str:
    """Join the cluster at ``address`` (``RAY_ADDRESS``, else ``auto``); returns the address.

    The head's port is tried first with a bounded TCP connect: Ray's own client retries an
    unreachable address for minutes.
    """
    if address:
        named = f"--address {address}"
    elif os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        named = f"RAY_ADDRESS={address}"
    else:
        address = "auto"
        named = "--address auto (a cluster started on this machine)"
    target = address.split("://", 1)[1] if "://" in address else address
    if "://" not in address:
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address(address) or target
        except Exception as e:  # 'auto': none (or several) started on this machine
            raise LaunchError(f"cannot find the Ray cluster of {named}: {first_line(e)}") from None
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S):
            pass
    except (OSError, ValueError) as e:
        raise LaunchError(
            f"no Ray cluster at {named} ({target}: {getattr(e, 'strerror', None) or e}); "
            "start one with 'ray start --head' or give its head's host:port"
        ) from None
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    except Exception as e:
        raise LaunchError(
            f"cannot join the Ray cluster at {address}: {first_line(e)}", FAILURE
        ) from None
    return address


def _amounts(resources: Mapping[str, float], names: Sequence[str]) -> str:
    return ", ".join(f"{resources.get(k, 0):g} {k}" for k in names)


def placement_shortfall(
    bundle: Mapping[str, float], count: int, strategy: str, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why ``count`` bundles can never be placed on ``nodes`` (the alive nodes' resources) as
    they are now, or None when the cluster is big enough (then other work holds what is
    missing)."""
    names = list(bundle)
    need = {k: v * count for k, v in bundle.items()}
    total = {k: sum(n.get(k, 0) for n in nodes) for k in names}
    if any(need[k] > total[k] + 1e-9 for k in names):
        return f"they need {_amounts(need, names)} in all, the cluster has {_amounts(total, names)}"
    fits = [n for n in nodes if all(n.get(k, 0) >= v for k, v in bundle.items())]
    if not fits:
        return f"no node has {_amounts(bundle, names)}"
    if strategy == "STRICT_SPREAD" and len(fits) < count:
        return f"STRICT_SPREAD needs {count} such nodes, the cluster has {len(fits)}"
    if strategy == "STRICT_PACK" and not any(
        all(n.get(k, 0) >= v for k, v in need.items()) for n in nodes
    ):
        return f"STRICT_PACK needs one node with {_amounts(need, names)}, none has"
    return None


def _bundle(args: argparse.Namespace) -> dict[str, float]:
    bundle = {"CPU": args.cpus_per_worker}
    if args.gpus_per_worker:
        bundle["GPU"] = args.gpus_per_worker
    return bundle


def _alive_nodes(ray: Any) -> list[Mapping[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def place(
    ray: Any,
    args: argparse.Namespace,
    out: Output,
    count: int | None = None,
    timeout: float | None = None,
) -> Any:
    """A ready placement group of ``count`` (default ``--num-workers``) bundles, or
    :class:`LaunchError` after ``timeout`` (default ``--placement-timeout``) seconds naming what
    is missing (when the cluster as it is cannot hold them, a wait over 10 s says so at once:
    an autoscaler may still add nodes)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = _bundle(args)
    n = count or args.num_workers
    strategy, timeout = args.placement_strategy, timeout or args.placement_timeout
    what = f"{n} worker{'s' if n > 1 else ''} of {_amounts(bundle, list(bundle))} ({strategy})"

    def shortfall() -> str | None:
        return placement_shortfall(bundle, n, strategy, _alive_nodes(ray))

    group = placement_group([dict(bundle)] * n, strategy=strategy)
    if group.wait(timeout_seconds=min(timeout, 1.0)):
        return group
    short = shortfall()
    if short is not None and timeout > _QUIET_WAIT_S:
        out.write(
            f"{PROG}: waiting up to {timeout:g} s (--placement-timeout) for {what}: {short}\n"
        )
    if group.wait(timeout_seconds=max(0.0, timeout - 1.0)):
        return group
    remove_placement_group(group)
    short = shortfall()
    if short is not None:
        raise LaunchError(f"cannot place {what}: {short}")
    free = ray.available_resources()
    raise LaunchError(
        f"cannot place {what} within --placement-timeout {timeout:g} s: the cluster has the "
        f"resources but only {_amounts(free, list(bundle))} are free (other work holds the rest)",
        FAILURE,
    )


class _Stopped(Exception):
    """A stop signal arrived before the ranks started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop_early(signum: int, frame: object) -> None:
    raise _Stopped(signum)


RESTART_TRY_S = 15.0  # how long a restart waits for a larger placement before trying fewer


def place_elastic(ray: Any, args: argparse.Namespace, out: Output, counts: list[int]) -> Any:
    """A restart's placement group: of the first of ``counts`` (largest first) that Ray can
    place, each but the last tried for at most :data:`RESTART_TRY_S` (a lost node may still
    count as alive for a while), the last for ``--placement-timeout``."""
    if not counts:
        raise LaunchError(
            f"no worker count from --num-workers {args.num_workers} down to --min-workers "
            f"{args.min_workers} splits the job's data.global_batch_size over its devices "
            "(and micro-batches) evenly"
        )
    for count in counts[:-1]:
        if placement_shortfall(_bundle(args), count, args.placement_strategy, _alive_nodes(ray)):
            continue  # the cluster as it is cannot hold that many
        try:
            return place(ray, args, out, count, min(args.placement_timeout, RESTART_TRY_S))
        except LaunchError:
            continue
    return place(ray, args, out, counts[-1])


def run(args: argparse.Namespace, command: list[str]) -> int:
    """Connect, place, start and supervise the job (see the module docstring), restarting it
    after a failure with ``--max-restarts`` (:mod:`jddp.launch.elastic`); the exit code."""
    ray = import_ray()
    connect(ray, args.address)
    out = Output("stderr")
    workdir = workdir_of(command) if args.max_restarts else None  # (only restarts read it)
    devices_per_worker = args.devices_per_proc or max(1, int(args.gpus_per_worker))
    restarts = Restarts(args.max_restarts, workdir)
    group = job = None
    # Until the ranks start, a stop signal ends the driver (128 + N); then the job forwards it.
    previous = {sig: signal.signal(sig, _stop_early) for sig in STOP_SIGNALS}
    try:
        group = place(ray, args, out)
        while True:
            job = RayJob(
                ray,
                group,
                command,
                cpus=args.cpus_per_worker,
                gpus=args.gpus_per_worker,
                devices_per_proc=args.devices_per_proc,
                env=forwarded_env(os.environ, args.env),
                kill_timeout=args.kill_timeout,
            )
            for sig in STOP_SIGNALS:
                signal.signal(sig, job.on_signal)
            job.start()
            code = job.wait(restarts.watch)
            cause = job.failure or f"the job exited {code}"
            # a stop signal that came as the job ended is still a stop: not restarted
            stopped = job.signal_received or (job.signals[0] if job.signals else None)
            lost = any(rank.lost for rank in job.ranks)  # a lost actor or node: no bug to loop on
            refusal = restarts.refusal(code, stopped, cause, may_loop=not lost)
            if refusal is not None:
                if refusal:
                    out.write(f"{PROG}: {refusal}\n")
                return code
            for sig in STOP_SIGNALS:
                signal.signal(sig, _stop_early)
            job.cleanup()
            _remove(group)
            job = group = None
            wakeup = Wakeup()
            for sig in STOP_SIGNALS:
                signal.signal(sig, wakeup.wake)
            wakeup.sleep(args.restart_delay)
            stop = wakeup.received
            for sig in STOP_SIGNALS:
                signal.signal(sig, _stop_early)
            wakeup.close()
            if stop is not None:
                raise _Stopped(stop)
            batch = batch_of(command) if args.min_workers < args.num_workers else None
            counts = worker_counts(args.num_workers, args.min_workers, devices_per_worker, batch)
            group = place_elastic(ray, args, out, counts)
            workers = group.bundle_count
            on = f" on {workers} worker{'s' if workers > 1 else ''} of {args.num_workers}"
            out.write(f"{PROG}: {restarts.restarting(cause)}{on}\n")
    except _Stopped as e:
        name = signal.Signals(e.signum).name
        print(f"{PROG}: received {name} before the ranks started; stopped", file=sys.stderr)
        return 128 + e.signum
    finally:
        if job is not None:
            job.cleanup()
        if group is not None:
            _remove(group)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.shutdown()


def _remove(group: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(group)
    except Exception:
        pass


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    try:
        args, command = parse_args(sys.argv[1:] if argv is None else argv)
        return run(args, command)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.exit_code
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted before the ranks started", file=sys.stderr)
        return INTERRUPTED
