"""tests/preload.py and tests/forked.py, the tests' CLI server's machinery: which commands run
forked from preloaded libraries, and that a forked command is the process ``python -m MODULE
ARGS`` would be (a test's outcome must not depend on how its command was started)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

from tests import preload
from tests.helpers import run

PY = sys.executable


def test_only_jddps_commands_with_this_python_run_forked(tmp_path):
    env = dict(os.environ)
    assert preload.forked_module([PY, "-m", "jddp.train", "x=1"], env) == "jddp.train"
    assert preload.forked_module([PY, "-m", "jddp.evaluate", "w"], env) == "jddp.evaluate"
    # Found on PATH: ``python`` of this interpreter's own folder.
    env_on_path = {**env, "PATH": os.path.dirname(PY)}
    name = os.path.basename(PY)
    assert preload.forked_module([name, "-m", "jddp.export"], env_on_path) == "jddp.export"
    assert preload.forked_module([PY, "-m", "jddp.pack", "a", "b"], env) is None  # no JAX
    assert preload.forked_module([PY, "examples/lm_stdlib.py"], env) is None  # a script
    assert preload.forked_module([PY, "-u", "-m", "jddp.train"], env) is None  # an option
    other = tmp_path / "python"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    assert preload.forked_module([str(other), "-m", "jddp.train"], env) is None
    assert preload.forked_module(["no-such-python", "-m", "jddp.train"], env) is None
    # A launcher started with interpreter options: a new ``python -m`` would not have them.
    probe = "import sys; from tests import preload; print(preload.forked_module(sys.argv[1:], {}))"
    cases = (([], "jddp.train"), (["-u"], "jddp.train"), (["-O"], "None"), (["-X", "dev"], "None"))
    for options, said in cases:
        out = run([PY, *options, "-c", probe, PY, "-m", "jddp.train"], timeout=60, check=True)
        assert out.stdout.strip() == said, (options, out.stdout)


def test_a_forked_launchers_ranks_fork_jddps_commands_and_the_repositorys_scripts(tmp_path):
    """What a launcher the tests' CLI server forked forks of its ranks (tests/forked.py
    ``fork_ranks``): jddp's commands, and the repository's examples and test workers by their
    path from the launcher's folder; not another script, nor one under interpreter options."""
    env, repo = dict(os.environ), str(Path(__file__).resolve().parents[1])
    train = [PY, "-m", "jddp.train", "x=1"]
    assert preload.forked_args(train, env, str(tmp_path)) == ["-m", "jddp.train", "x=1"]
    example = [PY, "examples/lm_stdlib.py", "a=1"]
    assert preload.forked_args(example, env, repo) == ["examples/lm_stdlib.py", "a=1"]
    assert preload.forked_args(example, env, str(tmp_path)) is None  # not the repository's
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "lm_stdlib.py").write_text("print('a user script')\n")
    assert preload.forked_args(example, env, str(tmp_path)) is None
    worker = [PY, str(Path(repo) / "tests" / "parity_worker.py")]
    assert preload.forked_args(worker, env, str(tmp_path)) == worker[1:]
    assert preload.forked_args([PY, "-u", "examples/lm_stdlib.py"], env, repo) is None
    assert preload.forked_args(["no-such-python", "examples/lm_stdlib.py"], env, repo) is None


def test_a_command_runs_forked_only_where_the_imports_saw_its_environment():
    # tensorboardX looks CRC32C_SW_MODE up and sets it where it is not set.
    read = {"JDDP_SEEN", "HOME", "CRC32C_SW_MODE"}
    imports = preload.Imports(read, {"CRC32C_SW_MODE": "auto"}, {"HOME": "/h"})
    assert imports.allows({"HOME": "/h"})
    # Not read by the imports, nor by native code while loading: may be anything.
    assert imports.allows({"HOME": "/h", "JDDP_PROCESS_ID": "1", "XLA_FLAGS": "--x=1"})
    assert imports.allows({"HOME": "/h", "PYTHONUNBUFFERED": "1"})  # become() applies it
    assert imports.allows({"HOME": "/h", "CRC32C_SW_MODE": "auto"})  # what the imports set
    assert not imports.allows({"HOME": "/elsewhere"})  # read by the imports
    assert not imports.allows({"HOME": "/h", "JDDP_SEEN": "1"})
    assert not imports.allows({"HOME": "/h", "JAX_ENABLE_X64": "1"})  # JAX reads it at import
    assert not imports.allows({"HOME": "/h", "LD_PRELOAD": "x.so"})
    assert not imports.allows({"HOME": "/h", "CRC32C_SW_MODE": "none"})


# The driver forks each module of MODULES and the script SCRIPT with jddp.launch's own function,
# from a process with a handler for SIGUSR1 and SIGTERM (as the launcher has), and prints what
# came back.
MODULES = {
    "shows": """
        import os, signal, sys
        print(__name__, sys.argv[1:], os.getcwd() == sys.path[0], os.environ.get("PROBE"))
        print(signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
              signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
              signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              sys.stdin.read() == "", sys.orig_argv[1:3])
        with open("/proc/self/cmdline", "rb") as f:  # what ps shows
            print(f.read().rstrip(b"\\0").split(b"\\0")[1:])
        """,
    "ends": """
        import atexit, threading, time
        atexit.register(lambda: print("atexit ran", flush=True))
        def late():
            time.sleep(0.3)
            print("thread joined", flush=True)
        threading.Thread(target=late).start()
        print("main done", flush=True)
        """,
    "code3": "import sys; sys.exit(3)",
    "message": "import sys; sys.exit('a message for stderr')",
    "raises": "raise ValueError('boom')",
    "interrupted": "raise KeyboardInterrupt",
    "unbuffered": "import os, sys; sys.stdout.write('no newline'); os._exit(0)",
    "draws": "import numpy; print(numpy.random.randint(1 << 62))",
    "draws_again": "import numpy; print(numpy.random.randint(1 << 62))",
}
# A package's module that the forking process imported first, as jddp.launch imports jddp.train
IMPORTED = "if __name__ == '__main__': print('as __main__')"
SCRIPT = """
    import os, sys
    print(__name__, sys.argv, sys.path[0], __file__, os.environ.get("PROBE"))
    def annotated(x: int): pass  # evaluated: not under the forking module's __future__ import
    print(sys.orig_argv[1:], __spec__, annotated.__annotations__["x"])
    with open("/proc/self/cmdline", "rb") as f:
        print(f.read().rstrip(b"\\0").split(b"\\0")[1:], flush=True)
    raise RuntimeError("from the script")
    """
DRIVER = """
import json, os, signal, sys
import numpy  # imported before the forks, as the CLI server's preload does
numpy.random.random()  # and drawn from: the generator's state is set (it seeds at first use)
from tests.forked import start_forked
sys.path.insert(0, sys.argv[1])
import pkg.imported  # the forking process has the module a rank runs
del sys.path[0]
signal.signal(signal.SIGUSR1, lambda *a: None)
signal.signal(signal.SIGTERM, lambda *a: None)
folder = sys.argv[1]
results = {}
for name in sys.argv[2:]:
    env = {**os.environ, "PROBE": "seen", "PYTHONUNBUFFERED": "1"}
    main = [name] if name.endswith(".py") else ["-m", name]  # a script, else a module
    rank = start_forked([*main, "a1", "a2"], env, lambda: None, [], cwd=folder)
    out, err = rank.stdout.read().decode(), rank.stderr.read().decode()
    results[name] = [rank.wait(10), out, err]
print(json.dumps(results))
"""


def test_a_forked_command_is_what_python_dash_m_would_be(tmp_path):
    """Its own __main__, argv, working folder first on sys.path, environment, stdin /dev/null,
    signal handlers as a new interpreter's (not the forking process's), its command line in
    ``ps``, NumPy's global generator seeded anew; and its end as the
    interpreter's: threads joined before atexit handlers, SystemExit's code or message, an
    uncaught exception's traceback and 1, Ctrl-C's death by SIGINT; PYTHONUNBUFFERED honoured;
    a module the forking process imported runs as __main__ without a word."""
    for name, body in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "imported.py").write_text(IMPORTED)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tool.py").write_text(textwrap.dedent(SCRIPT))
    scripts = ["bin/tool.py", "bin/missing.py"]
    out = run([PY, "-c", DRIVER, str(tmp_path), *MODULES, "pkg.imported", *scripts], timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    code, printed, err = got["shows"]
    assert (code, err) == (0, ""), err
    assert printed.splitlines() == [
        "__main__ ['a1', 'a2'] True seen",
        "True True True True ['-m', 'shows']",
        "[b'-m', b'shows', b'a1', b'a2']",
    ]
    assert got["ends"] == [0, "main done\nthread joined\natexit ran\n", ""]
    assert got["code3"] == [3, "", ""]
    assert got["message"] == [1, "", "a message for stderr\n"]
    code, _, err = got["raises"]
    assert code == 1 and err.startswith("Traceback") and "ValueError: boom" in err, err
    code, _, err = got["interrupted"]
    assert code == -2 and "KeyboardInterrupt" in err, err
    assert got["unbuffered"] == [0, "no newline", ""]
    # not runpy's warning that the module "found in sys.modules ... may result in
    # unpredictable behaviour": as a new interpreter, it has not imported it
    assert got["pkg.imported"] == [0, "as __main__\n", ""]
    assert got["draws"][0] == got["draws_again"][0] == 0  # NumPy's generator seeded anew
    assert got["draws"][1] != got["draws_again"][1]
    # A script as ``python bin/tool.py a1 a2`` runs it: its folder first on sys.path, argv[0]
    # and ps as given, __file__ absolute; its traceback names it.
    code, printed, err = got["bin/tool.py"]
    assert code == 1 and err.startswith("Traceback") and "RuntimeError: from the script" in err
    assert f'File "{tmp_path}/bin/tool.py", line 8' in err, err
    assert printed.splitlines() == [
        f"__main__ ['bin/tool.py', 'a1', 'a2'] {tmp_path}/bin {tmp_path}/bin/tool.py seen",
        "['bin/tool.py', 'a1', 'a2'] None <class 'int'>",
        "[b'bin/tool.py', b'a1', b'a2']",
    ]
    code, printed, err = got["bin/missing.py"]  # as the interpreter: one line, exit 2
    assert (code, printed) == (2, "") and err == (
        f"{PY}: can't open file '{tmp_path}/bin/missing.py': [Errno 2] No such file or directory\n"
    )
