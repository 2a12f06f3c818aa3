"""``jddp.distributed.detect_launch`` for every way a process can be started, in-process: each
launcher is imitated by the environment variables it sets (nothing is joined)."""

import pytest

from jddp.config import ConfigError, DistConfig
from jddp.distributed import MPI_RANK_VARIABLES, Launch, detect_launch, require_mpi_launch

# every variable detect_launch reads, cleared before each test so the host's own (a CI job under
# SLURM, say) cannot leak in
LAUNCH_VARIABLES = (
    "JDDP_COORDINATOR_ADDRESS",
    "JDDP_NUM_PROCESSES",
    "JDDP_PROCESS_ID",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_PROCID",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NNODES",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_LOCALID",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "CUDA_VISIBLE_DEVICES",
    "SKYPILOT_NODE_RANK",
    "SKYPILOT_NODE_IPS",
    "SKYPILOT_NUM_NODES",
    "JDDP_COORDINATOR_PORT",
)


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_env(**variables: str) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_env


def test_nothing_set_is_a_single_process(env):
    assert detect_launch(DistConfig()) == Launch("single")


def test_explicit_keys_win_over_every_launcher(env):
    env(SLURM_NTASKS="4", SLURM_PROCID="1", OMPI_COMM_WORLD_SIZE="4", PMI_SIZE="4")
    cfg = DistConfig(coordinator_address="10.0.0.1:1234", num_processes=3, process_id=0)
    assert detect_launch(cfg) == Launch("explicit", "10.0.0.1:1234", 3, 0)


def test_explicit_keys_all_or_none(env):
    with pytest.raises(ConfigError, match="dist.num_processes, dist.process_id must be set"):
        detect_launch(DistConfig(coordinator_address="h:1"))
    with pytest.raises(ConfigError, match=r"dist.process_id=3 is not in \[0, .*=3\)"):
        detect_launch(DistConfig(coordinator_address="h:1", num_processes=3, process_id=3))


def test_jddp_launch_variables(env):
    env(JDDP_COORDINATOR_ADDRESS="localhost:4321", JDDP_NUM_PROCESSES="2", JDDP_PROCESS_ID="1")
    assert detect_launch(DistConfig()) == Launch("explicit", "localhost:4321", 2, 1)


def test_jax_variables(env):
    env(JAX_COORDINATOR_ADDRESS="h:9", JAX_NUM_PROCESSES="4", JAX_PROCESS_ID="0")
    assert detect_launch(DistConfig()) == Launch("explicit", "h:9", 4, 0)


def test_a_config_key_overrides_its_variable(env):
    env(JDDP_COORDINATOR_ADDRESS="localhost:4321", JDDP_NUM_PROCESSES="2", JDDP_PROCESS_ID="1")
    assert detect_launch(DistConfig(process_id=0)) == Launch("explicit", "localhost:4321", 2, 0)


def test_a_non_integer_variable_is_named(env):
    env(JDDP_COORDINATOR_ADDRESS="h:1", JDDP_NUM_PROCESSES="two", JDDP_PROCESS_ID="0")
    with pytest.raises(ConfigError, match="JDDP_NUM_PROCESSES='two' is not an integer"):
        detect_launch(DistConfig())


def test_slurm_one_node_several_tasks(env):
    # what `srun -N1 -n2` sets in each task
    env(
        SLURM_NTASKS="2",
        SLURM_NPROCS="2",
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_JOB_NUM_NODES="1",
        SLURM_STEP_NODELIST="node1",
    )
    assert detect_launch(DistConfig()) == Launch("slurm")


def test_slurm_several_nodes(env):
    # `srun -N2 --ntasks-per-node=4`: JAX's SlurmCluster reads the node list and SLURM_PROCID
    env(
        SLURM_NTASKS="8",
        SLURM_PROCID="5",
        SLURM_LOCALID="1",
        SLURM_JOB_NUM_NODES="2",
        SLURM_STEP_NODELIST="node[1-2]",
    )
    assert detect_launch(DistConfig()) == Launch("slurm")


def test_slurm_older_ntasks_spelling(env):
    env(SLURM_NPROCS="2", SLURM_PROCID="0")
    assert detect_launch(DistConfig()) == Launch("slurm")


def test_slurm_batch_script_itself_is_a_single_process(env):
    # the sbatch script (or `salloc` shell) has the allocation's variables but no SLURM_PROCID
    # of a step, or a one-task step: jddp runs alone there
    env(SLURM_NTASKS="2", SLURM_JOB_NUM_NODES="1")
    assert detect_launch(DistConfig()) == Launch("single")
    env(SLURM_NTASKS="1", SLURM_PROCID="0")
    assert detect_launch(DistConfig()) == Launch("single")


def test_open_mpi(env):
    env(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="2", OMPI_COMM_WORLD_LOCAL_RANK="2")
    assert detect_launch(DistConfig()) == Launch("ompi")
    env(OMPI_COMM_WORLD_SIZE="1", OMPI_COMM_WORLD_RANK="0")
    assert detect_launch(DistConfig()) == Launch("single")


def test_mpich_pmi(env):
    env(PMI_SIZE="2", PMI_RANK="1")
    assert detect_launch(DistConfig()) == Launch("mpich")
    env(PMI_SIZE="1", PMI_RANK="0")
    assert detect_launch(DistConfig()) == Launch("single")


def test_slurm_wins_over_the_mpi_variables_it_also_sets(env):
    # srun --mpi=pmi2 sets PMI_SIZE/PMI_RANK as well as SLURM_*: SLURM's detection is used
    env(SLURM_NTASKS="2", SLURM_PROCID="0", PMI_SIZE="2", PMI_RANK="0")
    assert detect_launch(DistConfig()) == Launch("slurm")


def test_mpi_backend_needs_mpi_rank_variables(env, monkeypatch):
    """dist.backend=mpi checks its launch before MPI starts: a plain process is told to use
    mpirun, a task of plain `srun` (no PMI plugin, so MPI would see one rank) `srun --mpi=pmi2`;
    pmi2 and mpirun set PMI_RANK, which is enough."""
    for name in MPI_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match=r"'mpirun -np N python -m jddp.train"):
        require_mpi_launch()
    env(SLURM_NTASKS="2", SLURM_PROCID="1")
    with pytest.raises(ConfigError, match=r"under SLURM run it as 'srun --mpi=pmi2 "):
        require_mpi_launch()
    env(PMI_RANK="1", PMI_SIZE="2")
    require_mpi_launch()


def test_torchrun_one_process_per_node(env):
    """Kubeflow's PyTorchJob (no torchrun): the coordinator is MASTER_ADDR:MASTER_PORT."""
    env(MASTER_ADDR="trainer-master-0", MASTER_PORT="23456", WORLD_SIZE="4", RANK="3")
    assert detect_launch(DistConfig()) == Launch("torchrun", "trainer-master-0:23456", 4, 3)


def test_torchrun_one_process_per_gpu(env):
    """torchrun --nproc-per-node 8 on 2 nodes: its agent's store holds MASTER_PORT, so the
    coordinator takes the next port; each process takes its LOCAL_RANK'th GPU."""
    env(MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", WORLD_SIZE="16", RANK="9", LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="8", TORCHELASTIC_RUN_ID="none")  # fmt: skip
    assert detect_launch(DistConfig()) == Launch("torchrun", "10.0.0.1:29501", 16, 9, (1,))
    env(CUDA_VISIBLE_DEVICES="1")  # the launcher already gave each process one GPU
    assert detect_launch(DistConfig()).local_device_ids is None


def test_torchrun_world_of_one_is_a_single_process(env):
    env(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", WORLD_SIZE="1", RANK="0")
    assert detect_launch(DistConfig()) == Launch("single")


def test_torchrun_wins_over_slurm_and_explicit_wins_over_torchrun(env):
    """srun torchrun ...: SLURM's tasks are the agents, torchrun's variables the processes."""
    env(SLURM_NTASKS="2", SLURM_PROCID="1", MASTER_ADDR="n1", MASTER_PORT="29500",
        WORLD_SIZE="16", RANK="12")  # fmt: skip
    assert detect_launch(DistConfig()).kind == "torchrun"
    env(JAX_COORDINATOR_ADDRESS="n0:1234", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")
    assert detect_launch(DistConfig()).kind == "explicit"


@pytest.mark.parametrize(
    "variables,words",
    [
        ({"WORLD_SIZE": "2", "RANK": "0"},
         "WORLD_SIZE=2, RANK=0 set but not MASTER_ADDR, MASTER_PORT"),
        ({"MASTER_ADDR": "a", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "2"},
         "RANK=2 is not in [0, WORLD_SIZE=2)"),
        ({"MASTER_ADDR": "a", "MASTER_PORT": "1", "WORLD_SIZE": "4", "RANK": "1",
          "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"},
         "LOCAL_RANK=2 is not in [0, LOCAL_WORLD_SIZE=2)"),
        ({"MASTER_ADDR": "a", "MASTER_PORT": "1", "WORLD_SIZE": "3", "RANK": "1",
          "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"},
         "WORLD_SIZE=3 is not a multiple of LOCAL_WORLD_SIZE=2"),
        ({"SKYPILOT_NODE_RANK": "0"}, "SKYPILOT_NODE_RANK=0 set but no SKYPILOT_NODE_IPS"),
        ({"SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "a\nb", "SKYPILOT_NUM_NODES": "3"},
         "SKYPILOT_NUM_NODES=3 but SKYPILOT_NODE_IPS lists 2 nodes"),
        ({"SKYPILOT_NODE_RANK": "2", "SKYPILOT_NODE_IPS": "a\nb"},
         "SKYPILOT_NODE_RANK=2 is not in [0, 2)"),
    ],
)  # fmt: skip
def test_inconsistent_launcher_variables_are_named(env, variables, words):
    env(**variables)
    with pytest.raises(ConfigError) as err:
        detect_launch(DistConfig())
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_skypilot_nodes(env):
    env(SKYPILOT_NODE_RANK="1", SKYPILOT_NODE_IPS="10.1.0.4\n10.1.0.5\n", SKYPILOT_NUM_NODES="2")
    assert detect_launch(DistConfig()) == Launch("skypilot", "10.1.0.4:8476", 2, 1)
    env(JDDP_COORDINATOR_PORT="9000")
    assert detect_launch(DistConfig()).coordinator_address == "10.1.0.4:9000"
    env(SKYPILOT_NODE_RANK="0", SKYPILOT_NODE_IPS="10.1.0.4", SKYPILOT_NUM_NODES="1")
    assert detect_launch(DistConfig()) == Launch("single")
