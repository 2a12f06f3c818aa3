"""``python -m jddp.train ...`` (and jddp's other commands) for the price of a fork.

    python -m tests.cli_server SOCKET     (started by tests/helpers.py, one per pytest worker)

Imports the libraries jddp's commands load (:data:`PRELOADED`) once, then serves one request
at a time on the Unix socket ``SOCKET``: a JSON line ``{"module", "args", "env", "cwd"}`` with
the write ends of two pipes passed along. For each it forks a child that becomes ``python -m
MODULE ARGS`` as the interpreter starts one (``runpy``'s ``-m`` entry: the module runs as
``__main__``; ``sys.argv``, ``sys.path[0]``, the working folder and the environment as a new
process has them; stdout and stderr the two pipes, which the test reads to their end as
``subprocess.run`` does: until the command and every process that inherited them ended; no
stdin). It answers ``{"pid"}`` at once and ``{"code", "cpu_s"}`` when the child ended: its exit
code as ``subprocess`` reports it (``-N`` for a signal) and the CPU seconds it used. The child
leaves the server's loop and ends as any ``python -m`` does: ``SystemExit``'s code, an uncaught
exception's traceback and exit 1, atexit handlers run and threads joined.

JAX's backend has not started before the fork (no device, no thread pool; ``XLA_FLAGS`` is read
when it starts): each child starts its own, as a new process would. What the imports read from
the environment is the server's: :func:`tests.helpers.run` sends a command here only when its
environment differs from the server's in nothing those imports looked up or set differently, nor
in what native code may read while loading (:func:`may_differ`).

Why: a tiny run on 4 fake devices with a warm compilation cache took 4.6 CPU-s as a process of
its own, 3.2 forked from here (2026-11-27, the 2-core VM): the interpreter's start and these
imports.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import socket
import sys

# Variables that native code may read while the libraries load (the loader, the interpreter,
# OpenMP/OpenBLAS, TSL's logging, JAX's and XLA's plugins) or that a library reads by iterating
# over the environment (tqdm's TQDM_*): a command whose environment differs from the server's in
# one of them gets a process of its own. XLA_FLAGS is not among them: XLA reads it when JAX's
# backend starts, in the child (4 fake devices from a child's own XLA_FLAGS, checked).
READ_WHILE_LOADING = ("PYTHON", "LD_", "GLIBC_", "MALLOC_", "OMP_", "OPENBLAS_", "GOTO", "TF_",
                      "JAX_", "XLA_", "TPU_", "CUDA", "NVIDIA", "NCCL_", "TQDM_")  # fmt: skip


def may_differ(name: str, value: str | None, read: set[str], set_by_imports: dict) -> bool:
    """Whether the variable ``name`` may be ``value`` in a command the server runs while the
    server's own differs: neither the server's Python imports read it (``read``) nor may
    native code have, or the imports set it (``set_by_imports``: tensorboardX sets
    CRC32C_SW_MODE) and a new process's imports would have found or set the same."""
    if name in set_by_imports and value in (None, set_by_imports[name]):
        return True
    if name in read:
        return False
    return name == "XLA_FLAGS" or not name.startswith(READ_WHILE_LOADING)


@contextlib.contextmanager
def recording_reads(read: set[str]):
    """Add to ``read`` every variable Python code looks up in ``os.environ`` meanwhile
    (``os.environ[...]``, ``.get``, ``os.getenv``, ``in``)."""
    environ = type(os.environ)
    getitem, contains = environ.__getitem__, environ.__contains__

    def recorded_getitem(self, key):
        # Not a walk over every variable (``.items()``, ``.values()``: tqdm's for TQDM_*,
        # wsgiref's copy), which would count every variable as read; ``.get`` is a lookup.
        caller = sys._getframe(1).f_code
        if caller.co_name != "__iter__" or caller.co_filename != "<frozen _collections_abc>":
            read.add(key)
        return getitem(self, key)

    def recorded_contains(self, key):
        read.add(key)
        return contains(self, key)

    environ.__getitem__, environ.__contains__ = recorded_getitem, recorded_contains
    try:
        yield read
    finally:
        environ.__getitem__, environ.__contains__ = getitem, contains


def _become(request: dict, outputs: list[int]) -> str:
    """In the forked child: the process ``python -m MODULE ARGS`` would be, up to running the
    module, its stdout and stderr the two pipes ``outputs``; returns the module's name."""
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    for fd, target in zip((1, 2), outputs, strict=True):
        os.dup2(target, fd)
        os.close(target)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # as ``python -m``: the cwd first
    sys.argv = ["-m", *request["args"]]  # runpy puts the module's file in argv[0]
    sys.orig_argv = [sys.executable, "-m", request["module"], *request["args"]]
    return request["module"]


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request: the two pipes' write ends (sent with its first byte), then its JSON line."""
    first, outputs, _, _ = socket.recv_fds(conn, 1, 2)
    if len(outputs) != 2:
        raise ConnectionError(f"expected 2 file descriptors with the request, got {len(outputs)}")
    with conn.makefile("rb") as rest:
        return json.loads(first + rest.readline()), outputs


def serve(path: str, read: set[str], set_by_imports: dict) -> tuple[dict, list[int]]:
    """Say ``{"ready", "read", "set"}`` (the variables the imports read, and those they set)
    on stdout, then answer requests until the pytest worker that started this server is gone;
    in a forked child, return its request and output pipes."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(1.0)
    ready = {"ready": True, "read": sorted(read), "set": set_by_imports}
    print(json.dumps(ready), flush=True)
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(None)
            request, outputs = _receive(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                return request, outputs
            for fd in outputs:  # the child and what it starts hold them now: EOF when all end
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status, usage = os.wait4(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            cpu_s = usage.ru_utime + usage.ru_stime
            try:
                conn.sendall(json.dumps({"code": code, "cpu_s": cpu_s}).encode() + b"\n")
            except OSError:  # the test gave up on it (a timeout): nothing to answer
                pass
    sys.exit(0)


# What a tiny training run imports besides: ``jddp.run.trainer`` brings JAX, Flax, Optax and
# Orbax; lowering the first program loads XLA's MLIR dialect (~80 ms), the loader grain, the
# event files tensorboardX.
PRELOADED = ("jddp.run.trainer", "jaxlib.mlir.dialects.mhlo", "grain", "tensorboardX")


def main() -> None:
    read: set[str] = set()
    before = dict(os.environ)
    with recording_reads(read):
        for name in PRELOADED:
            importlib.import_module(name)
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}

    gc.collect()
    # The imports' objects out of the collector's reach, in the server and (never unfrozen) in
    # every child: a child's collections do not touch, and so copy, the pages they are on. They
    # live as long as the process anyway. (Unfrozen, the child's first full collection copied
    # them all: a config error's child 0.11 -> 0.42 CPU-s.)
    gc.freeze()
    request, outputs = serve(sys.argv[1], read, set_by_imports)
    # The child: from here on what ``python -m MODULE`` does after the interpreter started.
    module = _become(request, outputs)
    runpy._run_module_as_main(module, alter_argv=True)


if __name__ == "__main__":
    main()
