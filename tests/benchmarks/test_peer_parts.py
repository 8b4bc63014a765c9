"""The benchmarks' own logic for issue #29, without starting a run: the verdict on the body's
optimizer state, axolotl's callback loaded without its package's heavy ``__init__``, the disk and
memory plan of a lent machine, and the cause given to each late piece of a switch."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

from _peer_report import peer_comebacks, relayer_comebacks, verdict  # noqa: E402
from _shapes import SHAPES, layer_walk  # noqa: E402
from _space import plan, retained_disk  # noqa: E402
from _switch_gaps import analyse  # noqa: E402

GB = 1_000_000_000
H200 = 150_754_820_096  # 143,771 MiB
HOST = 128 * 2**30


# -- the body's optimizer state ---------------------------------------------------------------------
def comeback(before: int, steps: int, adam: int | None) -> dict:
    return {"phase": 1, "layer": 0, "trained_before": before, "steps_in_phase": steps, "adam_step_end": adam}


def test_verdict_tells_a_reset_from_a_kept_state_and_says_when_it_cannot():
    assert verdict([comeback(20, 20, 20), comeback(40, 19, 19)]) == "reset"
    assert verdict([comeback(20, 20, 40), comeback(40, 19, 59)]) == "kept"
    assert verdict([comeback(20, 20, 20), comeback(40, 19, 59)]) == "mixed"
    assert verdict([]) == "no layer came back"
    assert verdict([comeback(20, 20, None)]).startswith("unknown")


def test_relayer_comebacks_read_each_phase_ends_body_step():
    phases = [{"phase": 0, "layers": [0, 1], "steps": 3}, {"phase": 1, "layers": [2, 3], "steps": 2},
              {"phase": 2, "layers": [1, 2], "steps": 4}]
    manifests = {f"step-{s}": {"global_step": s, "phase_complete": True, "body_step": b}
                 for s, b in ((3, 3), (5, 2), (9, 4))}
    manifests["step-7"] = {"global_step": 7, "phase_complete": False, "body_step": 2}  # mid-phase: not a phase end
    got = relayer_comebacks(phases, manifests)
    assert [(c["layer"], c["trained_before"], c["steps_in_phase"], c["adam_step_end"]) for c in got] == \
        [(1, 3, 4, 4), (2, 2, 4, 4)]
    assert verdict(got) == "reset"


def test_peer_comebacks_take_the_optimizer_state_the_recorder_saw():
    phases = [{"phase": 0, "steps": 2, "at_start": {"0": {"trained_before": 0, "adam_step": 0, "exp_avg_abs_sum": 0.0}},
               "at_end": {"0": {"adam_step": 2}}},
              {"phase": 1, "steps": 3, "at_start": {"0": {"trained_before": 2, "adam_step": 2, "exp_avg_abs_sum": 0.5}},
               "at_end": {"0": {"adam_step": 5}}}]
    got = peer_comebacks(phases)
    assert got == [{"phase": 1, "layer": 0, "steps_in_phase": 3, "trained_before": 2, "adam_step_start": 2,
                    "exp_avg_abs_sum_start": 0.5, "adam_step_end": 5}]
    assert verdict(got) == "kept"


# -- axolotl's callback -----------------------------------------------------------------------------
def test_axolotls_lisa_module_loads_without_its_packages_init(tmp_path: Path, monkeypatch):
    pkg = tmp_path / "axolotl" / "utils" / "callbacks"
    pkg.mkdir(parents=True)
    (tmp_path / "axolotl" / "__init__.py").write_text("")
    (tmp_path / "axolotl" / "utils" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("raise ImportError('the heavy extras: evaluate, wandb, trl')\n")
    (pkg / "lisa.py").write_text(textwrap.dedent("""
        def lisa_callback_factory(trainer):
            return ("axolotl's callback for", trainer)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "axolotl" or m.startswith("axolotl.")]:
        monkeypatch.delitem(sys.modules, name)
    from _lisa_callback import load_axolotl

    try:
        factory, about = load_axolotl()
        assert factory("T") == ("axolotl's callback for", "T")
        assert about["name"] == "axolotl" and about["source"] == str(pkg / "lisa.py")
    finally:
        for name in [m for m in sys.modules if m == "axolotl" or m.startswith("axolotl.")]:
            del sys.modules[name]


# -- the lent machine's disk and memory --------------------------------------------------------------
def test_retention_keeps_only_checkpoints_holding_a_newest_layer():
    one = lambda layers: 1  # noqa: E731 - every checkpoint the same size
    # The same layers every phase: the newest two stay, beside the one just written and one in flight.
    assert retained_disk([[0, 1]] * 6, one) == 4
    # Every layer once: every checkpoint holds the newest copy of its layers and stays.
    assert retained_disk([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]], one) == 6


def test_plan_at_13b_hands_over_with_the_shapes_micro_batches():
    """With one copy of the model per GPU (launch.resident) the overlap of two 13B phases counts 26 GB
    of weights once: micro batches of 4 (the shape's) hand over on an H200, where two copies allowed 2."""
    shape = SHAPES["13b"]
    p = plan(shape, layer_walk("walk", 8, 40, 0), free_disk=60 * GB, free_shm=130 * GB, ram=HOST, device=H200, final_model=False,
             peer_output=False, want_handover=True, prewarm=True)
    assert p.fits and p.handover_fits and p.micro_batch == shape["micro_batch_size"] == 4 and p.prewarm_depth == 3
    assert (p.model_on, p.work_on) == ("shm", "disk")  # 26 GB of model and 52 GB of checkpoints: not both on 60 GB


def test_plan_at_30b_goes_through_the_checkpoint_without_prewarming():
    shape = SHAPES["30b"]
    p = plan(shape, [[0, 1], [2, 3], [4, 5], [6, 7]], free_disk=60 * GB, free_shm=130 * GB, ram=HOST, device=H200,
             final_model=False, peer_output=False, want_handover=True, prewarm=True)
    # Two phases never fit the device, and a phase pre-warmed for the checkpoint path holds a copy of
    # the 65 GB of weights beside the model in /dev/shm: the host leaves room for none.
    assert p.fits and not p.handover_fits and p.prewarm_depth == 0
    assert p.need_ram < HOST


def test_plan_says_when_nothing_fits():
    p = plan(SHAPES["30b"], [[0, 1]] * 4, free_disk=10 * GB, free_shm=20 * GB, ram=32 * GB, device=H200,
             final_model=True, peer_output=False, want_handover=True, prewarm=True)
    assert not p.fits and p.why.startswith("does not fit")


# -- the causes of a late switch ----------------------------------------------------------------------
class Threads:
    def __init__(self, intervals):
        self.intervals = intervals

    def between(self, who, t0, t1):
        return [i for i in self.intervals if i["who"] == who and i["t1"] >= t0 and i["t0"] <= t1]


class MemInfo:
    def at(self, t):
        return {"dirty": 3 * GB, "writeback": GB}


def records(offered: float, go_read: float, taken: float, **succ) -> list[dict]:
    return [{"phase": 0, "layers": [0, 1], "t_last_step_end": 10.0, "t_gone": 5.0},
            {"phase": 1, "layers": [2, 3], "t_last_step_end": 14.0, "t_offered": offered, "t_answered": taken + 0.01},
            {"phase": 2, "layers": [4, 5], "t_go": go_read, "t_taken": taken, "t_first_step_end": taken + 0.3, **succ}]


def journal(go: float, *events: tuple[str, float]) -> list[dict]:
    return [{"event": e, "time": t} for e, t in events] + [{"event": "phase_started", "phase": 2, "time": go}]


def test_a_go_late_behind_a_journal_fsync_is_told_from_a_busy_successor():
    fsync = [{"who": "orchestrator", "t0": 13.9, "t1": 14.5, "state": "D", "wchan": "jbd2_log_wait_commit",
              "syscall": "74"}]
    got = analyse(records(14.02, 14.52, 14.6)[1:], journal(14.5, ("preparing_paused", 13.85)), {}, Threads(fsync),
                  MemInfo())
    assert len(got) == 1
    assert "loop in a disk wait" in got[0]["causes"][0] and "preparing_paused" in got[0]["causes"][0]
    assert got[0]["gaps"]["offer_to_go"] == pytest.approx(0.48)

    refresh = [{"who": "phase 2", "t0": 14.03, "t1": 14.5, "state": "R", "wchan": "0", "syscall": "running"}]
    manifests = {"step-40": {"phase_complete": True, "layers": [4, 9], "created": 13.7}}
    got = analyse(records(14.02, 14.5, 14.6, layers_refreshed=[4])[1:], journal(14.03), manifests, Threads(refresh),
                  MemInfo())
    assert got[0]["causes"] and got[0]["causes"][0].startswith("successor refreshing layers [4]")
    assert "0.330 s before the go" in got[0]["causes"][0]

    got = analyse(records(14.02, 14.04, 14.6, layers_at_go=[5])[1:], journal(14.03), {}, Threads([]), MemInfo())
    assert got[0]["causes"] == ["layers [5] read from checkpoints at the go, before the answer"]


def test_a_go_late_while_the_loop_journals_a_finished_phase():
    got = analyse(records(14.02, 14.42, 14.5), journal(14.4, ("checkpoint_committed", 13.9), ("phase_done", 13.91)),
                  {}, Threads([]), MemInfo())
    assert got[0]["from"] == 1 and any("checkpoint_committed, phase_done" in c for c in got[0]["causes"])


# -- a switch's pieces (benchmarks/breakdown.py) ----------------------------------------------------
def test_gone_to_go_read_is_shown_only_where_the_switch_waited_on_it():
    from breakdown import go_after_gone, rows

    before = {"phase": 0, "t_gone": 10.0}
    assert go_after_gone(before, {"t_prepared": 5.0, "t_go": 10.25}) == "0.25"  # waited for the go
    assert go_after_gone(before, {"t_prepared": 5.0, "t_go": 9.5}) == "-"  # handed over: go at the offer
    assert go_after_gone(before, {"t_prepared": 12.0, "t_go": 12.5}) == "-"  # still preparing when k was gone
    assert go_after_gone(before, {"t_prepared": 5.0}) == "-"  # a cold start reads no go
    phases = [{"phase": 0, "t_last_step_end": 9.0, "t_gone": 10.0},
              {"phase": 1, "t_prepared": 5.0, "t_go": 9.5, "t_first_step_end": 11.0}]
    table = rows({"phases": phases, "switches": [{"from": 0, "to": 1, "overhead_seconds": 0.3}]})
    assert table[-1].split(" | ")[6] == "-" and "-0.50" not in table[-1]


# -- one step way by way (benchmarks/step_cost.py) --------------------------------------------------
def test_step_cost_table_puts_each_way_beside_the_peer():
    from step_cost import PEER, WAYS, build, table

    rows = [{"way": PEER, "step_median": 0.2, "step_min": 0.19, "memory_peak": 2e9},
            {"way": "ds-zero2", "step_median": 0.25, "step_min": 0.24, "memory_peak": 3e9}]
    lines = table(rows)
    assert lines[2].split(" | ")[3] == "1.000 x" and lines[3].split(" | ")[3] == "1.250 x"
    assert table(rows[1:])[2].split(" | ")[3] == "-"  # no peer measured: no ratio
    assert PEER in WAYS and callable(build)
