"""``python -m jddp.train ...`` (and jddp's other commands) for the price of a fork.

    python tests/cli_server.py SOCKET     (started by tests/helpers.py, one per pytest worker)

Imports the libraries jddp's commands load once (:func:`tests.preload.preload`), then serves
requests on the Unix socket ``SOCKET``: a JSON line ``{"python_args", "env", "cwd"}`` (and
``"session"``: its own session, as ``start_new_session``) with the write ends of its stdout and
stderr passed along. For each it forks a child that becomes ``python PYTHON_ARGS`` (``-m MODULE
ARGS``, or ``SCRIPT ARGS`` for the repository's own scripts: tests/helpers.py ``FORKED_SCRIPTS``)
as the interpreter starts one (:func:`tests.preload.become`: the module or script runs as
``__main__``; ``sys.argv``, ``sys.path[0]``, the working folder, the environment and the
standard streams as a new process has them; stdout and stderr the two pipes, which the test reads
to their end as ``subprocess.run`` does: until the command and every process that inherited them
ended; no stdin). It answers ``{"pid"}`` at once and ``{"code", "cpu_s"}`` when the child ended:
its exit code as ``subprocess`` reports it (``-N`` for a signal) and the CPU seconds it and the
children it waited for used. The child leaves the server's loop and ends as any ``python`` does:
``SystemExit``'s code, an uncaught exception's traceback and exit 1, atexit handlers run and
threads joined. A forked ``python -m jddp.launch`` forks its ranks of jddp's commands from these
imports in turn (:func:`tests.forked.fork_ranks`); jddp.launch itself starts them as new
interpreters.

What the imports read from the environment is the server's: :func:`tests.helpers.run` sends a
command here only when its environment differs from the server's in nothing those imports looked
up or set differently, nor in what native code may read while loading
(:func:`tests.preload.may_differ`).

Why: a tiny run on 4 fake devices with a warm compilation cache took 4.6 CPU-s as a process of
its own, 3.2 forked from here (2026-11-27, the 2-core VM): the interpreter's start and these
imports.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

import preload  # tests/preload.py, beside this script


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request: the two pipes' write ends (sent with its first byte), then its JSON line."""
    first, outputs, _, _ = socket.recv_fds(conn, 1, 2)
    if len(outputs) != 2:
        raise ConnectionError(f"expected 2 file descriptors with the request, got {len(outputs)}")
    with conn.makefile("rb") as rest:
        return json.loads(first + rest.readline()), outputs


def serve(path: str, read: set[str], set_by_imports: dict) -> tuple[dict, list[int]]:
    """Say ``{"ready", "read", "set"}`` (the variables the imports read, and those they set)
    on stdout, then answer requests until the pytest worker that started this server is gone,
    as many commands at a time as the worker asks for (a command it started and one it runs
    meanwhile); in a forked child, return its request and output pipes."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    # A child's end wakes the loop: SIGCHLD's number on this pipe (the handler itself is empty).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    running: dict[int, socket.socket] = {}  # pid -> the connection its end is answered on
    ready = {"ready": True, "read": sorted(read), "set": set_by_imports}
    print(json.dumps(ready), flush=True)
    while os.getppid() == parent:
        readable, _, _ = select.select([listener, wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        if listener in readable:
            conn, _ = listener.accept()
            conn.settimeout(None)
            request, outputs = _receive(conn)
            preload.flush_output()
            pid = os.fork()
            if pid == 0:  # no trace of the server: its sockets, pipe and SIGCHLD handler
                signal.set_wakeup_fd(-1)
                for sock in (listener, conn, *running.values()):
                    sock.close()
                os.close(wake_r)
                os.close(wake_w)
                if request.get("session"):
                    os.setsid()
                return request, outputs
            for fd in outputs:  # the child and what it starts hold them now: EOF when all end
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            running[pid] = conn
        for pid, conn in list(running.items()):
            ended, status, usage = os.wait4(pid, os.WNOHANG)
            if ended == 0:
                continue
            code = os.waitstatus_to_exitcode(status)
            cpu_s = usage.ru_utime + usage.ru_stime
            try:
                conn.sendall(json.dumps({"code": code, "cpu_s": cpu_s}).encode() + b"\n")
            except OSError:  # the test gave up on it (a timeout): nothing to answer
                pass
            conn.close()
            del running[pid]
    sys.exit(0)


def main() -> None:
    # The libraries once, what they read recorded; gc-frozen (tests/preload.py).
    imports = preload.preload()
    assert imports is not None, "the CLI server could not import jddp's libraries"
    import forked  # tests/forked.py, beside this script (it imports jddp: after the record)

    request, outputs = serve(sys.argv[1], imports.read, imports.set_by_imports)
    # The child: from here on what ``python -m MODULE`` (or ``python SCRIPT``) does after the
    # interpreter started.
    preload.become(request["python_args"], request["env"], request["cwd"], outputs)
    if request["python_args"][:2] == ["-m", "jddp.launch"]:
        forked.fork_ranks()  # its ranks forked from these imports too
    preload.run_main(request["python_args"])


if __name__ == "__main__":
    main()
