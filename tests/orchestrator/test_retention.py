"""What retention spares (orchestrator.retention.in_use): the checkpoints a live phase may still
read, found by CI (the 60-phase LISA run of one-step phases, once in several): retention, journaling
a few phases behind, spared the preload of the group whose go closed the finished phase's switch,
while the phase running by then, still preparing, read its own preload; that preload's layer came
from an older checkpoint retention had just trimmed (``LostLayer``, the run failed). Real
checkpoints (``shard_tools.state.save_state``), real processes for the groups."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.groups import Group, Work
from orchestrator.retention import in_use, retain
from orchestrator.schedule import Phase
from shard_tools.state import run_weights
from shard_tools.manifest import read_manifest
from tests.shard_tools.test_state import run_of, same


@pytest.fixture
def procs():
    """A live process and one that has ended, for groups."""
    alive, ended = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["true"])
    ended.wait()
    yield alive, ended
    alive.kill()
    alive.wait()


def group(run: Path, index: int, proc, *, preload: Path | None = None, restore: Path | None = None,
          before: Path | None = None) -> Group:
    phase = Phase(index=index, start_step=2 * index, end_step=2 * index + 2, layers=(0,), nproc=1)
    return Group(work=Work(phase, phase.start_step, restore), phase_dir=run / "phases" / f"phase-{index:04d}", proc=proc,
                 log_path=run / "worker.log", t_start=time.time(), go_fd=None, world=1, port=0, preload=preload,
                 before=before)


def supervising(*groups: Group) -> SimpleNamespace:
    """A supervisor's chain as in_use follows it: the group running now, then the predecessors."""
    chain = None
    for g in reversed(groups):
        chain = SimpleNamespace(group=g, predecessor=chain)
    return chain


def test_the_phase_running_now_keeps_its_preload_and_what_it_composes_from(tmp_path, procs):
    """Step 4 composes layer 2 from step 2; the newest two (6, 8) trained it again. The phase running
    now (not the finished phase's successor any more) preloads step 4: spared, every layer it reads
    is there and the same, where before retention trimmed layer 2 from step 2 under it."""
    alive, ended = procs
    store = run_of(tmp_path, (2, [0, 1, 2]), (4, [1]), (6, [1, 2]), (8, [2]))
    preload = store.at(4)
    weights = run_weights(tmp_path, preload)
    stale = group(tmp_path, 3, ended, preload=store.at(6))  # the switch's successor, gone by now
    running = group(tmp_path, 4, alive, preload=preload, restore=store.at(8), before=store.at(6))
    spared = in_use(stale, supervising(running, group(tmp_path, 3, ended, preload=store.at(2))), [])
    assert spared == {preload, store.at(8), store.at(6)}  # nothing of a group that has ended
    events = []
    retain(store, 2, spared, lambda name, **kw: events.append(name))
    assert "retention_skipped" not in events
    assert same(run_weights(tmp_path, preload), weights) and store.source_faults(preload) == []
    # What was spared before, the switch's successor alone (gone by now): step 4 goes and step 2
    # keeps layer 0 alone, under a phase that may still be reading them.
    retain(store, 2, in_use(stale, None, []), lambda name, **kw: None)
    assert not preload.exists() and read_manifest(store.at(2)).stored_layers == [0]


def test_a_group_ahead_and_the_predecessor_it_takes_over_from(tmp_path, procs):
    """Pre-warmed groups keep their preloads; a group that took over keeps the checkpoint its
    predecessor started from (its go reads the layers trained since its preload there)."""
    alive, _ = procs
    store = run_of(tmp_path, (2, [0]), (4, [1]))
    ahead = group(tmp_path, 5, alive, preload=store.at(2))
    taking = group(tmp_path, 4, alive, restore=store.at(6), before=store.at(4))
    assert in_use(None, supervising(taking), [ahead]) == {store.at(2), store.at(6), store.at(4)}
