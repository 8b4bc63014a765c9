"""The learning rate is a pure function of the global step: warmup, then constant, linear or cosine."""

import math

import pytest

from launch.contract import OptimizerPart, lr_at


def opt(kind: str, warmup: int = 0) -> OptimizerPart:
    return OptimizerPart(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, grad_clip=1.0, lr_kind=kind,
                         warmup_steps=warmup, total_steps=110)


def test_warmup_ramps_linearly_to_the_peak():
    o = opt("constant", warmup=10)
    assert [lr_at(s, o) for s in (0, 4, 9, 10, 100)] == pytest.approx([1e-4, 5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("kind, mid, end", [("linear", 0.5e-3, 0.0), ("cosine", 0.5e-3, 0.0), ("constant", 1e-3, 1e-3)])
def test_decay_over_the_run_after_warmup(kind, mid, end):
    o = opt(kind, warmup=10)
    assert lr_at(10, o) == pytest.approx(1e-3)
    assert lr_at(60, o) == pytest.approx(mid)
    assert lr_at(110, o) == pytest.approx(end, abs=1e-12)


def test_cosine_shape():
    o = opt("cosine")
    assert lr_at(55, o) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))
