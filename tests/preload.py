"""jddp's commands started by fork from an interpreter that has already imported their libraries:
the tests' CLI server (tests/cli_server.py) imports what ``python -m jddp.train`` (and evaluate,
export, predict) load once (:data:`PRELOADED`: JAX, Flax, Optax, Orbax, grain, tensorboardX),
then forks each command from itself instead of starting a new interpreter that imports them
again (~1.4 CPU-s a command on the 2-core VM). Test machinery only: jddp itself starts every
process as a new interpreter.

A forked command is the process ``python -m MODULE ARGS`` would be (:func:`become`,
:func:`run_as_main`): its own ``__main__``, ``sys.argv``, ``sys.path[0]``, working folder,
environment, standard streams, signal handlers and NumPy's global generator's seed, ending as the
interpreter ends (``SystemExit``'s code, an uncaught exception's traceback and exit 1, Ctrl-C's
death by SIGINT; threads joined and atexit handlers run). It shares its parent's string hash seed
and the interpreter's options (the server has none). JAX's backend has not
started before the fork (no device, no thread pool; ``XLA_FLAGS`` and the CUDA variables are read
when it starts, in the child), but what the imports read from the environment is the importer's: a
command is forked only when its environment differs from the one the imports saw in nothing they
looked up, nor in what native code may read while loading (:func:`may_differ`). ``ps`` shows it as
``python -m MODULE ARGS`` where its parent's arguments had room for that
(:func:`show_command_line`). :func:`become` and :func:`run_main` also make the process of
``python SCRIPT ARGS`` (the tests' server forks the repository's own scripts).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import importlib.machinery
import io
import os
import runpy
import shutil
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# What a tiny training run imports besides: ``jddp.run.trainer`` brings JAX, Flax, Optax and
# Orbax; lowering the first program loads XLA's MLIR dialect (~80 ms), the loader grain, the
# event files tensorboardX.
PRELOADED = ("jddp.run.trainer", "jaxlib.mlir.dialects.mhlo", "grain", "tensorboardX")
# jddp's commands that run forked: those that import JAX. Not ``jddp.pack``: it never imports
# JAX, and a command that finds JAX imported behaves otherwise (a failed pack would skip the
# interpreter's teardown, and its pool's semaphores leak with a warning: jddp/cli.py
# ``stop_peers``). Not a user's script: it may set ``JAX_*`` variables before importing JAX.
FORKED_MODULES = ("jddp.train", "jddp.evaluate", "jddp.export")
# The repository's own scripts, forked too: none sets a variable the imports read before it
# imports JAX (what a user's script may do).
_REPO = Path(__file__).resolve().parents[1]
FORKED_SCRIPTS = frozenset(
    path.resolve() for path in (*_REPO.glob("examples/*.py"), *_REPO.glob("tests/*_worker.py"))
)
# Variables that native code may read while the libraries load (the loader, the interpreter,
# OpenMP/OpenBLAS, TSL's logging, JAX's and XLA's plugins) or that a library reads by iterating
# over the environment (tqdm's TQDM_*): a command whose environment differs in one of them is not
# forked. XLA_FLAGS is not among them: XLA reads it when JAX's backend starts, in the child (4
# fake devices from a child's own XLA_FLAGS, checked); nor PYTHONUNBUFFERED, which :func:`become`
# applies to the streams it makes.
READ_WHILE_LOADING = ("PYTHON", "LD_", "GLIBC_", "MALLOC_", "OMP_", "OPENBLAS_", "GOTO", "TF_",
                      "JAX_", "XLA_", "TPU_", "CUDA", "NVIDIA", "NCCL_", "TQDM_",
                      "LC_", "LANG")  # fmt: skip
READ_IN_THE_CHILD = ("XLA_FLAGS", "PYTHONUNBUFFERED")  # the exceptions above


@dataclass
class Imports:
    """What :func:`preload` imported under: the variables the imports looked up (``read``), those
    they set (``set_by_imports``: tensorboardX sets CRC32C_SW_MODE) and the whole environment
    they saw."""

    read: set[str]
    set_by_imports: dict[str, str]
    environ: dict[str, str] = field(default_factory=dict)

    def allows(self, env: Mapping[str, str]) -> bool:
        """Whether a command with environment ``env`` may run forked from these imports."""
        names = set(env) | set(self.environ)
        differs = [name for name in names if env.get(name) != self.environ.get(name)]
        return all(may_differ(n, env.get(n), self.read, self.set_by_imports) for n in differs)


_imports: Imports | None = None  # this process's (and, inherited, its forked children's)


def may_differ(name: str, value: str | None, read: set[str], set_by_imports: dict) -> bool:
    """Whether the variable ``name`` may be ``value`` in a forked command while the environment
    the imports saw had another value: neither the imports read it (``read``) nor may native code
    have, or the imports set it (``set_by_imports``) and a new process's imports would have found
    or set the same."""
    if name in set_by_imports and value in (None, set_by_imports[name]):
        return True
    if name in read:
        return False
    return name in READ_IN_THE_CHILD or not name.startswith(READ_WHILE_LOADING)


@contextlib.contextmanager
def recording_reads(read: set[str]) -> Iterator[set[str]]:
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


def preload(environ: Mapping[str, str] | None = None) -> Imports | None:
    """Import :data:`PRELOADED` once per process, recording what the imports read, with
    ``os.environ`` set to ``environ`` meanwhile (default: as it is); the record, or None where
    forking is not for this process: not Linux, JAX imported already by someone else (what it
    read is unknown), an import failed (the command, started anew, will say why)."""
    global _imports
    if _imports is not None:
        return _imports
    if not sys.platform.startswith("linux") or "jax" in sys.modules:
        return None
    before = dict(os.environ)
    saw = dict(before if environ is None else environ)
    read: set[str] = set()
    os.environ.clear()
    os.environ.update(saw)
    try:
        with recording_reads(read):
            for name in PRELOADED:
                importlib.import_module(name)
    except Exception:
        return None
    finally:
        set_by_imports = {k: v for k, v in os.environ.items() if saw.get(k) != v}
        os.environ.clear()
        os.environ.update(before)
    gc.collect()
    # The imports' objects out of the collector's reach, here and (never unfrozen) in every
    # child: a child's collections do not touch, and so copy, the pages they are on. They live
    # as long as the process anyway. (Unfrozen, a forked child's first full collection copied
    # them all: a config error's child 0.11 -> 0.42 CPU-s, 2026-11-27.)
    gc.freeze()
    _imports = Imports(read, set_by_imports, saw)
    return _imports


def forked_module(command: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The jddp module of ``command`` when it is ``PYTHON -m MODULE ...`` with MODULE one of
    :data:`FORKED_MODULES` and PYTHON this interpreter (as found on ``env``'s PATH); else None."""
    if len(command) < 3 or command[1] != "-m" or command[2] not in FORKED_MODULES:
        return None
    if interpreter_options():  # -O, -W, -X, -E, -I, ...: the command's interpreter has none
        return None
    return command[2] if _this_interpreter(command[0], env) else None


def forked_args(command: Sequence[str], env: Mapping[str, str], cwd: str) -> list[str] | None:
    """The arguments after ``python`` in ``command`` when it may run forked from these imports:
    ``-m MODULE ...`` (:func:`forked_module`) or ``SCRIPT ...`` for one of
    :data:`FORKED_SCRIPTS` (its path relative to ``cwd``) with this interpreter, started with
    no options; else None."""
    module = forked_module(command, env)
    if module is not None:
        return ["-m", module, *command[3:]]
    if len(command) < 2 or command[1].startswith("-") or interpreter_options():
        return None
    if (Path(cwd) / command[1]).resolve() not in FORKED_SCRIPTS:
        return None
    return list(command[1:]) if _this_interpreter(command[0], env) else None


def _this_interpreter(python: str, env: Mapping[str, str]) -> bool:
    """Whether ``python`` (as found on ``env``'s PATH) is this interpreter."""
    found = shutil.which(python, path=env.get("PATH", os.defpath))
    if found is None:
        return False
    found, own = os.path.abspath(found), os.path.abspath(sys.executable)
    # ``python`` and ``python3`` of one virtual environment: the same folder, the same file.
    return found == own or (
        os.path.dirname(found) == os.path.dirname(own) and os.path.samefile(found, own)
    )


def interpreter_options() -> list[str]:
    """The options this interpreter was started with before its module, script or ``-c``
    (``python -O -m ...``: ``["-O"]``), whose effect a forked command would inherit; not ``-u``
    (:func:`become` makes the streams as the command's environment says)."""
    options = []
    for arg in sys.orig_argv[1:]:
        if arg in ("-m", "-c") or not arg.startswith("-"):
            break
        options.append(arg)
    return [option for option in options if option != "-u"]


def flush_output() -> None:
    """Flush Python's stdout and stderr and C's stdio buffers: what a forked child would
    otherwise write a second time."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


def reset_signal_handlers() -> None:
    """Every signal's handler as a new interpreter has it: SIGINT raises KeyboardInterrupt,
    whatever Python code caught is back to the default (ignored ones stay ignored, as across
    ``exec``)."""
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        if sig == signal.SIGINT:
            signal.signal(sig, signal.default_int_handler)
        elif callable(handler):
            signal.signal(sig, signal.SIG_DFL)


def _text_stream(fd: int, like: io.TextIOBase, writing: bool, unbuffered: bool) -> io.TextIOWrapper:
    """A standard stream over ``fd`` as the interpreter makes it at start (``like``'s encoding):
    stderr and a terminal line-buffered, stderr's undecodable characters escaped,
    ``PYTHONUNBUFFERED`` writing through."""
    raw = io.FileIO(fd, "w" if writing else "r", closefd=False)
    if writing and unbuffered:
        buffer: io.RawIOBase | io.BufferedIOBase = raw
    else:
        buffer = io.BufferedWriter(raw) if writing else io.BufferedReader(raw)
    line_buffered = writing and (fd == 2 or os.isatty(fd))
    return io.TextIOWrapper(
        buffer,
        encoding=getattr(like, "encoding", None) or "utf-8",
        errors="backslashreplace" if fd == 2 else getattr(like, "errors", None) or "strict",
        line_buffering=line_buffered and not unbuffered,
        write_through=writing and unbuffered,
    )


def become(python_args: Sequence[str], env: Mapping[str, str], cwd: str,
           outputs: Sequence[int]) -> None:  # fmt: skip
    """In a forked child: the process ``python PYTHON_ARGS`` would be, up to running its main
    (:func:`run_main`); ``PYTHON_ARGS`` is ``["-m", MODULE, *ARGS]`` or ``[SCRIPT, *ARGS]``:
    stdin ``/dev/null``, stdout and stderr the two file descriptors ``outputs`` (closed here:
    the child holds them as 1 and 2), the working folder ``cwd``, first on ``sys.path`` for a
    module (a script's own folder for a script), the environment ``env``, a new ``__main__``
    and signal handlers as a new interpreter's."""
    reset_signal_handlers()
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    for fd, target in zip((1, 2), outputs, strict=True):
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = _text_stream(0, sys.__stdin__, False, unbuffered)
    sys.stdout = sys.__stdout__ = _text_stream(1, sys.__stdout__, True, unbuffered)
    sys.stderr = sys.__stderr__ = _text_stream(2, sys.__stderr__, True, unbuffered)
    if python_args[0] == "-m":
        sys.path[0] = cwd  # as ``python -m``: the working folder first
        sys.argv = ["-m", *python_args[2:]]  # runpy puts the module's file in argv[0]
    else:  # as ``python SCRIPT``: the script's own folder first, its path as given in argv[0]
        sys.path[0] = os.path.dirname(os.path.realpath(python_args[0]))
        sys.argv = list(python_args)
    sys.orig_argv = [sys.executable, *python_args]
    sys.modules["__main__"] = types.ModuleType("__main__")
    show_command_line(python_args)
    # Python's ``random`` reseeds itself in a forked child; NumPy's global generator does not:
    # from fresh entropy, as in a new process (forked ranks would otherwise draw alike).
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def run_main(python_args: Sequence[str]) -> None:
    """After :func:`become`: run the module as ``__main__`` as ``python -m`` does, or the
    script in the new ``__main__`` as ``python SCRIPT`` does (``__file__`` the path given, made
    absolute, not normalised)."""
    if python_args[0] == "-m":
        # Not imported yet, as in a new interpreter: a launcher that forked this rank may have
        # imported it (jddp.launch's restarts read jddp.train's arguments); runpy would warn
        # "found in sys.modules ... may result in unpredictable behaviour" on the rank's stderr.
        sys.modules.pop(python_args[1], None)
        runpy._run_module_as_main(python_args[1], alter_argv=True)
        return
    path = os.path.join(os.getcwd(), python_args[0])
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:  # as the interpreter says it, and its exit status
        print(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    main = sys.modules["__main__"]
    loader = importlib.machinery.SourceFileLoader("__main__", path)
    main.__dict__.update(__file__=path, __loader__=loader, __cached__=None, __annotations__={},
                         __builtins__=sys.modules["builtins"])  # fmt: skip
    # dont_inherit: not this module's ``from __future__ import annotations``
    exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)


def show_command_line(args: Sequence[str]) -> bool:
    """Make ``ps`` and ``/proc/self/cmdline`` show the interpreter's own first word and then
    ``args``, written over the process's original arguments (the launcher's ``... -- python -m
    jddp.train ARGS`` holds a rank's), as ``setproctitle`` does on Linux; padded with NULs.
    CPython reads those bytes only at start; the first word (glibc's program name) is kept.
    False, nothing changed, where they do not fit or the kernel does not say where they are."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5), 48 and 49)
        with open("/proc/self/cmdline", "rb") as f:
            first = f.read().split(b"\0", 1)[0]
    except (OSError, IndexError, ValueError):
        return False
    shown = b"\0".join([first, *(os.fsencode(a) for a in args)]) + b"\0"
    if not start or len(shown) > end - start:
        return False
    ctypes.memmove(start, shown.ljust(end - start, b"\0"), end - start)
    return True


def _system_exit_code(exit: SystemExit) -> int:
    """The exit status the interpreter makes of an uncaught ``SystemExit`` (a message: printed,
    status 1)."""
    code = exit.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_as_main(python_args: Sequence[str], first: Callable[[], object] | None = None) -> int:
    """In a forked child after :func:`become`: run ``first`` (the launcher unblocks the signals
    it held) and ``python_args``' main (:func:`run_main`), and end as the interpreter ends it
    (non-daemon threads joined, atexit handlers run, streams flushed); the exit status for
    ``os._exit``, which then skips what the interpreter's teardown would add (finalisers of
    objects still alive, C's atexit handlers: jddp's commands close what they write themselves).
    An uncaught KeyboardInterrupt (Ctrl-C before the command's handler, as in a new
    interpreter's start) ends the process by SIGINT, as the interpreter does."""
    interrupted = False
    try:
        if first is not None:
            first()
        run_main(python_args)
        code = 0
    except SystemExit as e:
        code = _system_exit_code(e)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 130, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls
    atexit._run_exitfuncs()
    flush_output()  # C's stdio too: what native code printed
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code
