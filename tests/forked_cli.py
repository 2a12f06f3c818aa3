"""Many ``python -m jddp.train`` command lines for the price of one interpreter's start.

    python tests/forked_cli.py CASES.json OUT_DIR [--watch DIR]

Imports jddp's CLI and the libraries its commands load (JAX, Flax, Optax, Orbax) once, then runs
each command line of ``CASES.json`` (a list of argument lists) in a child forked from that
state, as ``python -m jddp.train ARGS`` runs it: ``jddp.train.main``, its exit code the child's.
JAX's backend has not started before the fork (no device, no thread pool): each child starts
its own, as a new process would. Writes ``OUT_DIR/{i}.out``, ``{i}.err`` and ``{i}.code`` per
command, ``imports.err`` (what the imports printed on stderr: a CLI whose imports print a
warning breaks every "one line" promise), and with ``--watch`` ``{i}.watch``, DIR's
:func:`snapshot` after the command (JSON).

Why: tests/test_bad_input.py runs ~60 command lines that stop at a config or input check; as
separate processes, half of them paid ~1.5 CPU-s for the imports alone (2026-11-27, the
2-core VM).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path

COMMAND_TIMEOUT_S = 300  # a command still running then is killed (SIGALRM): exit -14


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder``: its relative path -> the SHA-256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    return e.code if isinstance(e.code, int) else 1  # sys.exit("message"): printed, exit 1


def _run_child(argv: list[str], out: Path, i: int) -> None:
    """In the forked child: ``python -m jddp.train ARGV`` with its output in files; never
    returns."""
    code = 1
    try:
        for fd, name in ((1, f"{i}.out"), (2, f"{i}.err")):
            target = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        signal.alarm(COMMAND_TIMEOUT_S)
        import jddp.train

        sys.argv = [jddp.train.__file__, *argv]
        try:
            code = jddp.train.main(argv)
        except SystemExit as e:
            code = _exit_code(e)
    except BaseException:  # noqa: BLE001 - the test sees the traceback and exit 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> int:
    cases, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    watch = Path(sys.argv[sys.argv.index("--watch") + 1]) if "--watch" in sys.argv else None
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, os.getcwd())  # as ``python -m``: the user's modules from the cwd
    saved = os.dup(2)
    imports_err = os.open(out / "imports.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(imports_err, 2)
    try:
        import jddp.run.trainer  # noqa: F401 - and with it JAX, Flax, Optax, Orbax
        import jddp.train  # noqa: F401
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(imports_err)
    for i, argv in enumerate(cases):
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(argv, out, i)
        _, status = os.waitpid(pid, 0)
        (out / f"{i}.code").write_text(str(os.waitstatus_to_exitcode(status)))
        if watch is not None:
            (out / f"{i}.watch").write_text(json.dumps(snapshot(watch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
