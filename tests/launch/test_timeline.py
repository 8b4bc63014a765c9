"""The phase's records go through one Timeline: marks, spans, values, lists."""

import time

import pytest

from launch.timeline import Timeline


def test_marks_spans_values_and_lists():
    t = Timeline(rank=0, world_size=2)
    before = time.time()
    assert t.mark("t_go") >= before
    with t.span("t_register_start", "t_registered"):
        time.sleep(0.01)
    t.add(register_seconds=0.5, nice=0)
    t.append("checkpoints", {"step": 2})
    t.append("checkpoints", {"step": 4})
    records = t.as_records()
    assert records["rank"] == 0 and records["world_size"] == 2 and records["nice"] == 0
    assert before <= records["t_go"] <= records["t_register_start"] < records["t_registered"]
    assert records["checkpoints"] == [{"step": 2}, {"step": 4}]
    assert t.get("register_seconds") == 0.5 and t.get("absent") is None
    records["rank"] = 9  # a copy: what was written out does not change the timeline
    assert t.get("rank") == 0


def test_a_span_that_raises_records_nothing():
    t = Timeline()
    with pytest.raises(RuntimeError), t.span("t_a", "t_b"):
        raise RuntimeError("boom")
    assert t.as_records() == {}
