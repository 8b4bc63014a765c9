"""Launcher command lines as data, and checked by the launchers' own argument parsers."""

from __future__ import annotations

import pytest

from launch.commands import agent_command, command, first_host, launcher_of, rank_env_from_slurm
from launch.contract.spec import PhaseSpec

PY = "/venv/bin/python"
SPEC = "/runs/a/phases/phase-0002/spec.json"
PORT = 29617


def spec(**launch) -> PhaseSpec:
    return PhaseSpec.model_validate({
        "run_dir": "/runs/a", "phase_dir": "/runs/a/phases/phase-0002", "seed": 0, "phase": 2,
        "start_step": 20, "phase_start_step": 20, "end_step": 30, "layers": [0, 3], "restore": None,
        "model": {"path": "/models/tiny", "config": None, "dtype": "bfloat16", "persistent": None, "layers": None},
        "data": {"sources": [{"path": "/data/train.jsonl", "format": "tokens"}], "seq_len": 128, "batch_size": 32,
                 "micro_batch_size": 4, "shuffle": True},
        "optimizer": {"lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 1.0,
                      "lr_kind": "constant", "warmup_steps": 0, "total_steps": 30},
        "zero_stage": 2, "deepspeed_config": {}, "every_steps": 0,
        "launcher": "local", "nproc": 1, "nnodes": 1, "hostfile": None, "master_port": PORT, "orchestrator_pid": 1,
        **launch,
    })


def test_local_is_one_process_with_the_rank_variables():
    argv, env = command(spec(), SPEC, python=PY, environ={})
    assert argv == [PY, "-m", "launch.worker", SPEC]
    assert env == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(PORT)}


def test_local_with_several_processes_uses_deepspeed():
    s = spec(nproc=2)
    assert launcher_of(s) == "deepspeed"
    argv, env = command(s, SPEC, python=PY, environ={})
    assert argv[:3] == [PY, "-m", "deepspeed.launcher.runner"] and env == {}


def test_deepspeed_one_node():
    argv, env = command(spec(launcher="deepspeed", nproc=4), SPEC, python=PY, environ={})
    assert argv == [PY, "-m", "deepspeed.launcher.runner", "--master_port", str(PORT), "--no_local_rank",
                    "--num_gpus", "4", "--module", "launch.worker", SPEC]
    assert env == {}


def test_deepspeed_several_nodes_uses_the_hostfile():
    argv, _ = command(spec(launcher="deepspeed", nproc=8, nnodes=2, hostfile="/etc/hosts.ds"), SPEC, python=PY,
                      environ={})
    assert argv == [PY, "-m", "deepspeed.launcher.runner", "--master_port", str(PORT), "--no_local_rank",
                    "--hostfile", "/etc/hosts.ds", "--num_nodes", "2", "--num_gpus", "8",
                    "--module", "launch.worker", SPEC]


def test_deepspeed_parses_the_command():
    from deepspeed.launcher.runner import parse_args

    argv, _ = command(spec(launcher="deepspeed", nproc=8, nnodes=2, hostfile="/etc/hosts.ds"), SPEC, python=PY,
                      environ={})
    args = parse_args(argv[3:])
    assert (args.hostfile, args.num_nodes, args.num_gpus, args.master_port) == ("/etc/hosts.ds", 2, 8, PORT)
    # The worker's first argument must be the spec: no --local_rank in front of it.
    assert args.module and args.no_local_rank
    assert (args.user_script, args.user_args) == ("launch.worker", [SPEC])


def test_torchrun_one_node():
    argv, env = command(spec(launcher="torchrun", nproc=4), SPEC, python=PY, environ={})
    assert argv == [PY, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--nnodes", "1",
                    "--master_addr", "127.0.0.1", "--master_port", str(PORT), "-m", "launch.worker", SPEC]
    assert env == {}


def test_deepspeed_several_nodes_meet_at_a_given_master_addr():
    argv, _ = command(spec(launcher="deepspeed", nproc=8, nnodes=2, hostfile="/etc/hosts.ds", master_addr="10.1.2.3"),
                      SPEC, python=PY, environ={})
    from deepspeed.launcher.runner import parse_args

    assert parse_args(argv[3:]).master_addr == "10.1.2.3"


# The batch step of a two-node job, where the orchestrator runs.
BATCH = {"SLURM_JOB_ID": "812", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_CPUS_ON_NODE": "64"}


def test_torchrun_several_nodes_is_an_agent_a_node_through_srun():
    argv, env = command(spec(launcher="torchrun", nproc=8, nnodes=4, master_addr="10.1.2.3"), SPEC, python=PY,
                        environ=BATCH)
    assert argv == ["srun", "--nodes=4", "--ntasks-per-node=1", "--ntasks=4", "--relative=0", "--cpus-per-task=64",
                    "--kill-on-bad-exit=1", PY, "-m", "launch.agent", SPEC]
    assert env == {}


# The srun task of the second node's agent, and the first node's.
AGENT = {"SLURM_NODEID": "1", "SLURM_JOB_ID": "812", "SLURM_STEP_ID": "3", "SLURM_STEP_NODELIST": "gpu[07-08]",
         "SLURMD_NODENAME": "gpu08"}
HOST_AGENT = {**AGENT, "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu07"}


def test_torchrun_agents_meet_at_the_master_addr_the_first_node_hosting():
    s = spec(launcher="torchrun", nproc=8, nnodes=2, master_addr="127.0.0.1", rendezvous_seconds=42.5)
    argv = agent_command(s, SPEC, PY, HOST_AGENT)
    assert argv == [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "8",
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{PORT}", "--rdzv_id", "812.3",
                    "--rdzv_conf", "is_host=true,join_timeout=43,read_timeout=43", "--local_addr", "127.0.0.1",
                    "--max_restarts", "0", "-m", "launch.worker", SPEC]
    other = agent_command(s, SPEC, PY, AGENT)
    assert other[other.index("--rdzv_conf") + 1].startswith("is_host=false,")
    # The address by which this node reaches the rendezvous, so that rank 0's MASTER_ADDR resolves anywhere.
    assert other[other.index("--local_addr") + 1] == "127.0.0.1"


@pytest.mark.parametrize("task", [AGENT, HOST_AGENT])
def test_torchrun_parses_an_agent_command(task):
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(agent_command(spec(launcher="torchrun", nproc=8, nnodes=2, master_addr="10.1.2.3"),
                                                      SPEC, PY, task)[3:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_endpoint) == ("2", "8", "c10d",
                                                                                        f"10.1.2.3:{PORT}")
    assert (args.module, args.training_script, args.training_script_args, args.max_restarts) == (
        True, "launch.worker", [SPEC], 0)


def test_an_agent_without_a_reachable_rendezvous_says_so():
    with pytest.raises(ValueError, match="^the rendezvous address n1.invalid is not reachable from this node"):
        agent_command(spec(launcher="torchrun", nproc=1, nnodes=2, master_addr="n1.invalid"), SPEC, PY, AGENT)


def test_an_agent_outside_srun():
    with pytest.raises(ValueError, match="^not an srun task: SLURM_STEP_ID is not set$"):
        agent_command(spec(launcher="torchrun", nproc=1, nnodes=2), SPEC, PY,
                      {k: v for k, v in AGENT.items() if k != "SLURM_STEP_ID"})


def test_torchrun_parses_the_one_node_command():
    from torch.distributed.run import get_args_parser

    argv, _ = command(spec(launcher="torchrun", nproc=8), SPEC, python=PY, environ={})
    args = get_args_parser().parse_args(argv[3:])
    assert (args.nproc_per_node, args.nnodes, args.master_addr, args.master_port) == ("8", "1", "127.0.0.1", PORT)
    assert (args.module, args.training_script, args.training_script_args) == (True, "launch.worker", [SPEC])


def test_slurm():
    argv, env = command(spec(launcher="slurm", nproc=8, nnodes=2), SPEC, python=PY, environ=BATCH)
    assert argv == ["srun", "--nodes=2", "--ntasks-per-node=8", "--ntasks=16", "--relative=0", "--kill-on-bad-exit=1",
                    PY, "-m", "launch.worker", SPEC]
    assert env == {"MASTER_PORT": str(PORT)}


def test_slurm_outside_an_allocation_lets_srun_make_one():
    argv, _ = command(spec(launcher="slurm", nproc=8, nnodes=2), SPEC, python=PY, environ={})
    assert argv[:5] == ["srun", "--nodes=2", "--ntasks-per-node=8", "--ntasks=16", "--kill-on-bad-exit=1"]


SRUN_TASK = {"SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16", "SLURM_NODEID": "1",
             "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_NODELIST": "gpu[03,07-08]", "MASTER_PORT": "29617"}


def test_rank_env_from_slurm():
    assert rank_env_from_slurm(SRUN_TASK) == {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16",
                                              "MASTER_ADDR": "gpu07"}


def test_rank_env_from_slurm_meets_at_the_spec_s_master_addr():
    # SLURM's address of the first node (NodeAddr), or launch.master_addr: the node's name need not resolve.
    assert rank_env_from_slurm(SRUN_TASK, "10.0.0.5")["MASTER_ADDR"] == "10.0.0.5"
    # One in the environment is not the run's: only the spec says where the run meets.
    assert rank_env_from_slurm({**SRUN_TASK, "MASTER_ADDR": "10.9.9.9"})["MASTER_ADDR"] == "gpu07"


def test_rank_env_from_slurm_falls_back_to_the_job_nodes():
    task = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_NODELIST"}
    assert rank_env_from_slurm(task)["MASTER_ADDR"] == "gpu03"


@pytest.mark.parametrize("missing,message", [
    ("SLURM_PROCID", "not an srun task: SLURM_PROCID is not set"),
    ("SLURM_NTASKS", "not an srun task: SLURM_NTASKS is not set"),
])
def test_rank_env_from_slurm_outside_srun(missing, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        rank_env_from_slurm({k: v for k, v in SRUN_TASK.items() if k != missing})


def test_rank_env_from_slurm_without_any_node_list():
    task = {k: v for k, v in SRUN_TASK.items() if "NODELIST" not in k}
    with pytest.raises(ValueError, match="^not an srun task: neither SLURM_STEP_NODELIST nor a master address is given$"):
        rank_env_from_slurm(task)


@pytest.mark.parametrize("nodelist,host", [
    ("node1", "node1"),
    ("node1,node2", "node1"),
    ("gpu[07-09,12],cpu1", "gpu07"),
    ("gpu[12,07-09]", "gpu12"),
    ("rack[2-3]-node[001-004]", "rack2-node001"),
    ("a-b.example.org", "a-b.example.org"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_first_host_of_nothing():
    with pytest.raises(ValueError, match="not a Slurm hostlist"):
        first_host("")
