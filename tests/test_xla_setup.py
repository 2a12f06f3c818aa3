"""jddp's XLA defaults: the XLA:CPU flag only where it is known and wanted, and the persistent
compilation cache. (Their speed is measured in experiments/bench_xla.py, not tested here.)"""

import os
import subprocess
import sys
import threading

import pytest

from jddp.proc import xla as xla_setup
from jddp.proc.cores import cores_per_process, expand_hostlist, slurm_step_tasks_here
from jddp.proc.xla import CPU_CONV_OFF_YNNPACK, YNN_FLAG, apply_cpu_flags
from tests.helpers import QUICK, THREADS_PROBE, run, run_python, train_cmd


def test_cpu_flag_is_added_on_cpu_once():
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_foo=1"}
    assert apply_cpu_flags(env) == [CPU_CONV_OFF_YNNPACK]
    assert env["XLA_FLAGS"] == f"--xla_foo=1 {CPU_CONV_OFF_YNNPACK}"
    assert apply_cpu_flags(env) == []  # already there: untouched


@pytest.mark.parametrize(
    "env",
    [
        {"JAX_PLATFORMS": "cpu", "JDDP_XLA_DEFAULTS": "0"},  # opted out
        {"JAX_PLATFORMS": "cuda"},  # a GPU run: XLA:CPU flags do not matter
        {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{YNN_FLAG}=default"},  # the user's own choice
    ],
)
def test_cpu_flag_is_left_out(env):
    before = dict(env)
    assert apply_cpu_flags(env) == []
    assert env == before


def test_the_flag_is_only_used_where_xla_knows_it(monkeypatch):
    monkeypatch.setattr(xla_setup, "KNOWN_JAXLIB_SERIES", ())  # force the library scan
    assert xla_setup._xla_knows(YNN_FLAG)  # the installed jaxlib (0.10) defines it
    assert not xla_setup._xla_knows("--xla_cpu_no_such_flag_in_any_release")
    monkeypatch.setattr(xla_setup, "_xla_knows", lambda flag: False)
    assert apply_cpu_flags({"JAX_PLATFORMS": "cpu"}) == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to divide")
def test_each_process_computes_on_its_share_of_the_cores():
    """Two processes on this machine (as jddp.launch says): each is pinned to half the cores
    and XLA:CPU starts that many compute (Eigen) threads; the input workers get the same share;
    a lone process keeps every core."""
    cores = len(os.sched_getaffinity(0))
    share = cores // 2
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JDDP_NUM_PROCESSES": "2"}
    env.pop("JDDP_CPU_THREADS", None)
    env.pop("XLA_FLAGS", None)
    seen = []
    for rank in ("0", "1"):
        rank_env = {**env, "JDDP_LOCAL_RANK": rank}
        out = subprocess.run([sys.executable, "-c", THREADS_PROBE], env=rank_env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        pinned, eigen, workers, affinity = out.stdout.split(maxsplit=3)
        assert (int(pinned), int(eigen), workers) == (share, share, str(share)), out.stdout
        seen.append(affinity)
    assert seen[0] != seen[1]  # different cores
    env.pop("JDDP_NUM_PROCESSES")
    out = subprocess.run([sys.executable, "-c", THREADS_PROBE], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.stdout.split()[:3] == ["0", str(cores), "None"], out.stdout


@pytest.mark.parametrize(("jax_min_s", "kept_s"), [(None, "0.5"), ("0", "0.0"), ("2", "2.0")])
def test_train_compilation_cache_dir_is_where_jax_caches(tmp_path, jax_min_s, kept_s):
    """``train.compilation_cache_dir`` (``~`` expanded) becomes JAX's persistent cache, and
    programs taking 0.5 s or more to compile are kept (JAX's default: 1 s), unless JAX's own
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise (the tests set 0)."""
    probe = (
        "import jax\n"
        "from jddp.proc.xla import enable_compilation_cache\n"
        "print(enable_compilation_cache('~/jddp-cache-probe'))\n"
        "print(jax.config.jax_compilation_cache_dir,"
        " jax.config.jax_persistent_cache_min_compile_time_secs)\n"
    )
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    if jax_min_s is not None:
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = jax_min_s
    out = run_python("-c", probe, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    folder = str(tmp_path / "jddp-cache-probe")
    assert out.stdout.split() == [folder, folder, kept_s]


@pytest.mark.slow
def test_a_new_process_loads_the_step_another_compiled(tmp_path):
    """The train step is one program whatever the process: a second run on the same cache (a
    restart, a resume, another rank), a new interpreter whose string hashes differ, loads the
    step the first compiled. (The step's flags were reduced in a set's order: under these two
    hash seeds the programs differed and the second compiled the step again.)"""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}  # fmt: skip
    logs = []
    for seed in ("0", "1"):  # the flags' set order: finish, stop, save; then save, finish, stop
        cmd = train_cmd(tmp_path / f"run{seed}", "train.steps=1", base=QUICK)
        out = run(cmd, env={**env, "PYTHONHASHSEED": seed}, fresh=True)  # fresh: its own hashes
        assert out.returncode == 0, out.stderr[-3000:]
        logs.append(out.stderr)
    assert "CACHE MISS for 'jit_step'" in logs[0]  # compiled, and written
    assert "cache hit for 'jit_step'" in logs[1], logs[1][-3000:]
    assert "CACHE MISS for 'jit_step'" not in logs[1]


def test_a_cache_entry_is_read_whole_or_not_at_all(tmp_path):
    """While a process writes a compilation-cache entry, a reader finds no entry or the whole
    one, never the part written so far (JAX writes in place: a part read is a warning on stderr
    and a compile again); the entry reads back as written, nothing else is left beside it."""
    from jax._src.lru_cache import LRUCache

    from jddp.compat.jax_cache import whole_cache_entries

    whole_cache_entries()  # as enable_compilation_cache does in every jddp process
    cache = LRUCache(str(tmp_path), max_size=-1)  # JAX's default: no size limit
    value = os.urandom(1 << 25)
    sizes, writing = [], threading.Event()

    def read():
        writing.wait()
        while True:
            found = cache.get("key")
            if found is not None:
                sizes.append(len(found))
                if len(found) == len(value):
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    writing.set()
    cache.put("key", value)
    reader.join(timeout=120)
    assert sizes and set(sizes) == {len(value)}, f"parts read: {sorted(set(sizes))[:5]}"
    assert cache.get("key") == value
    assert [p.name for p in tmp_path.iterdir()] == ["key-cache"]


@pytest.mark.parametrize(("gc_defaults", "young"), [(None, 50_000), ("0", 700)])
def test_a_command_collects_tracings_garbage_less_often(gc_defaults, young):
    """A jddp command collects Python's youngest generation every 50,000 allocations, not 700
    (tracing's short-lived objects: jddp/compat/collector.py, experiments/bench_gc.py);
    ``JDDP_GC_DEFAULTS=0`` keeps Python's settings."""
    probe = "import gc\nfrom jddp.cli import run\nrun(lambda s: print(*gc.get_threshold()) or 0)\n"
    env = {k: v for k, v in os.environ.items() if k != "JDDP_GC_DEFAULTS"}
    if gc_defaults is not None:
        env["JDDP_GC_DEFAULTS"] = gc_defaults
    out = run_python("-c", probe, env=env, fresh=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(young), "10", "10"]


SLURM_STEP_2_TASKS = {"SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}


@pytest.mark.parametrize(
    ("environ", "tasks"),
    [
        (SLURM_STEP_2_TASKS, 2),  # srun -n2: no SLURM_NTASKS_PER_NODE unless the job asked it
        ({**SLURM_STEP_2_TASKS, "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}, 3),
        ({**SLURM_STEP_2_TASKS, "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "1"}, 4),
        # A step on nodes 3-4 of a 4-node job: SLURM_NODEID counts the job's nodes (2 on
        # node3), the step's counts are in its own node list's order.
        (
            {
                **SLURM_STEP_2_TASKS,
                "SLURM_STEP_TASKS_PER_NODE": "3,1",
                "SLURM_STEP_NODELIST": "node[3-4]",
                "SLURMD_NODENAME": "node4",
                "SLURM_NODEID": "3",
            },
            1,
        ),
        (
            {
                **SLURM_STEP_2_TASKS,
                "SLURM_STEP_TASKS_PER_NODE": "2(x2),5",
                "SLURM_STEP_NODELIST": "gpu[008-009],cpu1",
                "SLURMD_NODENAME": "cpu1",
                "SLURM_NODEID": "0",
            },
            5,
        ),
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS_PER_NODE": "4"}, 4),  # an older srun's spelling
        ({"SLURM_NTASKS_PER_NODE": "4", "SLURM_TASKS_PER_NODE": "4"}, None),  # the batch script
        ({}, None),
    ],
)
def test_slurm_step_tasks_on_this_node(environ, tasks):
    assert slurm_step_tasks_here(environ) == tasks


@pytest.mark.parametrize(
    ("hostlist", "names"),
    [
        ("node1", ["node1"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
        ("a-b[9-10].c", ["a-b9.c", "a-b10.c"]),
        ("node[x-2]", []),
        ("", []),
    ],
)
def test_slurm_hostlists_expand_in_order(hostlist, names):
    assert expand_hostlist(hostlist) == names


@pytest.mark.parametrize(
    ("environ", "share"),
    [
        ({}, 16),  # one process owns its affinity
        (SLURM_STEP_2_TASKS, 8),  # two srun tasks on the node divide it
        ({**SLURM_STEP_2_TASKS, "SLURM_CPUS_PER_TASK": "3"}, 3),  # srun -c3 without binding
        ({"SLURM_CPUS_PER_TASK": "3", "SLURM_TASKS_PER_NODE": "2"}, 16),  # batch script: 1 process
        ({"JDDP_LOCAL_RANK": "0", "JDDP_NUM_PROCESSES": "4", "SLURM_CPUS_PER_TASK": "3"}, 4),
        ({"MPI_LOCALNRANKS": "2", **SLURM_STEP_2_TASKS, "SLURM_CPUS_PER_TASK": "1"}, 8),
        # jddp.ray: 4 processes, 2 of them on this node
        ({"JDDP_LOCAL_RANK": "1", "JDDP_NUM_PROCESSES": "4", "JDDP_LOCAL_WORLD_SIZE": "2"}, 8),
        # torchrun --nproc-per-node 4 under srun (one agent task per node)
        ({"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3", **SLURM_STEP_2_TASKS}, 4),
    ],
)
def test_cores_each_process_owns(monkeypatch, environ, share):
    """A 16-core affinity (no launcher binding), divided as the launcher says: under srun the
    step's tasks on this node, at most --cpus-per-task each; a process that jddp.launch or mpirun
    (also inside salloc, where the SLURM variables belong to the launcher's task) started is one
    of their local processes."""
    names = ("JDDP_CPU_THREADS", "JDDP_LOCAL_RANK", "JDDP_NUM_PROCESSES", "MPI_LOCALNRANKS",
             "JDDP_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_ID", "SLURM_STEP_TASKS_PER_NODE",
             "SLURM_NODEID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
             "SLURM_CPUS_PER_TASK")  # fmt: skip
    for name in names:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert cores_per_process() == share
