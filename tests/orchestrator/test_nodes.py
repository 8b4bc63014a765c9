"""orchestrator/nodes.py without a cluster: the rendezvous address (a stand-in scontrol answers),
plan's checks and lines, and how a launcher's ranks ended, read from their phase directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch.contract.files import PhaseDir
from orchestrator import nodes
from orchestrator.errors import ScheduleError
from orchestrator.schedule import LaunchSection
from tests.orchestrator.test_cli_plan import build, invoke, on_path, setting

SOURCE = Path("/runs/s.toml")
JOB = {"SLURM_JOB_ID": "812", "SLURM_JOB_NODELIST": "gpu[07-08]"}

SCONTROL = """#!/bin/sh
case "$2" in
  hostnames) printf 'gpu07\\ngpu08\\n' ;;
  node) echo "NodeName=$4 Arch=x86_64 CoresPerSocket=8 NodeAddr={addr} NodeHostName=$4 Version=22.05.8" ;;
esac
"""


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A scontrol on PATH that knows gpu07 and gpu08, both at the address it is given."""
    def with_addr(addr: str) -> None:
        nodes.node_address.cache_clear()
        on_path(monkeypatch, tmp_path, "scontrol")
        (tmp_path / "bin" / "scontrol").write_text(SCONTROL.format(addr=addr))
    yield with_addr
    nodes.node_address.cache_clear()


def launch(**values) -> LaunchSection:
    return LaunchSection(**{"launcher": "slurm", "nproc": 8, "nnodes": 2, **values})


def test_one_node_meets_at_the_loopback_whatever_node_srun_picks():
    assert nodes.master_addr(launch(nnodes=1), JOB) == "127.0.0.1"


def test_several_nodes_meet_at_the_first_node_s_nodeaddr(scontrol):
    scontrol("10.0.0.7")
    assert nodes.master_addr(launch(), JOB) == "10.0.0.7"
    assert nodes.master_addr(launch(launcher="torchrun"), JOB) == "10.0.0.7"


def test_a_given_master_addr_wins(scontrol):
    scontrol("10.0.0.7")
    assert nodes.master_addr(launch(master_addr="ib0-gpu07"), JOB) == "ib0-gpu07"


def test_outside_an_allocation_or_for_deepspeed_there_is_none_to_look_up():
    assert nodes.master_addr(launch(), {}) is None
    assert nodes.master_addr(launch(launcher="deepspeed", hostfile="h"), JOB) is None


def test_plan_refuses_a_rendezvous_that_does_not_resolve(scontrol):
    with pytest.raises(ScheduleError) as e:
        nodes.check_launch(launch(master_addr="n1.invalid"), SOURCE, JOB)
    assert str(e.value).startswith("/runs/s.toml: launch.master_addr: the rendezvous address 'n1.invalid' "
                                   "(launch.master_addr) does not resolve on this node (")
    scontrol("gpu07.invalid")
    with pytest.raises(ScheduleError, match="'gpu07.invalid' \\(SLURM's NodeAddr of the allocation's first node\\) "
                                            "does not resolve on this node"):
        nodes.check_launch(launch(), SOURCE, JOB)
    scontrol("127.0.0.1")
    nodes.check_launch(launch(), SOURCE, JOB)


def test_plan_says_where_scontrol_failed(tmp_path, monkeypatch):
    nodes.node_address.cache_clear()
    on_path(monkeypatch, tmp_path, "scontrol")  # exits 1
    with pytest.raises(ScheduleError, match="^/runs/s.toml: launch.master_addr: scontrol show hostnames gpu\\[07-08\\] "
                                            "failed \\(exit code 1, no output\\): set launch.master_addr$"):
        nodes.check_launch(launch(), SOURCE, JOB)


def test_torchrun_on_several_nodes_needs_srun(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ScheduleError) as e:
        nodes.check_launch(launch(launcher="torchrun"), SOURCE, {})
    assert str(e.value) == ('/runs/s.toml: launch.launcher: "torchrun" on 2 nodes starts an agent on each node with '
                            'srun, which is not on PATH: outside SLURM, use "deepspeed" with a hostfile')
    nodes.check_launch(launch(launcher="torchrun", nnodes=1), SOURCE, {})


def test_plan_names_the_address_and_the_cold_switch(scontrol):
    scontrol("10.0.0.7")
    assert nodes.plan_lines(launch(), JOB) == [
        "2 nodes meet at 10.0.0.7, SLURM's address (NodeAddr) of gpu[07-08]'s first node"]
    assert "looked up inside the allocation" in nodes.plan_lines(launch(), {})[0]
    assert nodes.plan_lines(launch(nnodes=1)) == []
    assert nodes.cold_switch(launch()).startswith("launch.nnodes = 2: every switch starts the next phase cold")
    assert nodes.cold_switch(launch(nnodes=1)).startswith('launch.launcher = "slurm": every switch')
    assert nodes.cold_switch(launch(launcher="torchrun", nnodes=1)) is None


def test_plan_cli_refuses_an_unresolvable_master_addr(tmp_path, tiny_model, tiny_data):
    sched = build(tmp_path, tiny_model, tiny_data, setting("launch", launcher="deepspeed", nnodes=2, nproc=1,
                                                           hostfile="hosts", master_addr="n1.invalid"))
    (tmp_path / "hosts").write_text("n1 slots=1\nn2 slots=1\n")
    r = invoke("plan", str(sched))
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"orchestrator: {sched.resolve()}: launch.master_addr: the rendezvous address "
                               "'n1.invalid' (launch.master_addr) does not resolve on this node")
    assert not (tmp_path / "run").exists()


def ranks(tmp_path: Path, *how: str) -> Path:
    """A phase directory whose rank N started on node nN and ended as ``how[N]`` says: an exit code,
    "error" (its reason written, no exit code yet) or "silent"."""
    files = PhaseDir(tmp_path / "phase-0001")
    for rank, end in enumerate(how):
        files.record_pid(f"rank-{rank}", 1000 + rank, 1.0, f"n{rank + 1}")
        if end == "error":
            files.write_error(rank, RuntimeError("Connection closed by peer"))
        elif end != "silent":
            files.write_exit(rank, int(end), 2.0)
    return files.path


def test_a_rank_that_left_no_word_is_named_with_its_node(tmp_path):
    phase = ranks(tmp_path, "1", "silent", "error")
    assert nodes.silent_ranks(phase, 4) == [
        "rank 1 on node n2 (pid 1001) ended without an exit code or an error: killed by a signal, or lost with its node"]


def test_a_phase_stopped_from_outside_is_every_rank_exiting_75(tmp_path):
    assert nodes.stopped_outside(ranks(tmp_path / "a", "75", "75"), 2)
    assert not nodes.stopped_outside(ranks(tmp_path / "b", "75", "silent"), 2)
    assert not nodes.stopped_outside(ranks(tmp_path / "c", "75", "1"), 2)
    assert not nodes.stopped_outside(ranks(tmp_path / "d", "75"), 2)  # rank 1 never started
