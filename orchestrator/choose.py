"""Which body layers a strategy's phases train: deterministic functions of the schedule and the
seed, phase after phase (``orchestrator.plan`` walks them in order).

lisa draws ``k`` of ``n`` layers per phase, uniformly (Python's ``random.sample``, as ever) or by
weight (OwLore), optionally without replacement within a window of phases; badam walks blocks of
``k`` consecutive layers in an order reshuffled every pass (BAdam's "random" switch mode);
ascending / descending take them in turn.
"""

from __future__ import annotations

import random
from typing import Callable

Chooser = Callable[[int], tuple[int, ...]]
"""Phase index -> its layers, sorted; called for phases 0, 1, 2 ... in order."""


def chooser(strategy: str, n: int, k: int, seed: int, weights: list[float] | None = None,
            window: int | None = None) -> Chooser:
    if strategy == "lisa":
        return _lisa(random.Random(f"relayer-lisa-{seed}"), n, k, weights, window)
    if strategy == "badam":
        return _badam(random.Random(f"relayer-badam-{seed}"), n, k)

    def in_turn(i: int) -> tuple[int, ...]:
        walk = ((i * k + j) % n for j in range(k))
        return tuple(sorted(walk if strategy == "ascending" else (n - 1 - x for x in walk)))
    return in_turn


def _lisa(rng: random.Random, n: int, k: int, weights: list[float] | None, window: int | None) -> Chooser:
    if weights is None and window is None:  # the draws of every lisa run before these keys
        return lambda i: tuple(sorted(rng.sample(range(n), k)))
    drawn: set[int] = set()

    def draw(i: int) -> tuple[int, ...]:
        if i % (window or 1) == 0:  # without a window, each phase draws from all
            drawn.clear()
        pool = [x for x in range(n) if x not in drawn]
        chosen = rng.sample(pool, k) if weights is None else weighted_sample(rng, pool, weights, k)
        drawn.update(chosen)
        return tuple(sorted(chosen))
    return draw


def weighted_sample(rng: random.Random, pool: list[int], weights: list[float], k: int) -> list[int]:
    """``k`` distinct items of ``pool``, each draw in proportion to its weight among those left;
    items of weight 0 never (the caller makes sure k are drawable)."""
    left = [x for x in pool if weights[x] > 0]
    chosen = []
    for _ in range(k):
        x, acc, j = rng.random() * sum(weights[y] for y in left), 0.0, 0
        for j, y in enumerate(left):
            acc += weights[y]
            if x < acc:
                break
        chosen.append(left.pop(j))
    return chosen


def _badam(rng: random.Random, n: int, k: int) -> Chooser:
    blocks = [tuple(range(b, min(b + k, n))) for b in range(0, n, k)]
    order: list[int] = []

    def walk(i: int) -> tuple[int, ...]:
        if i % len(blocks) == 0:  # a new pass over the blocks, in a new order
            order[:] = range(len(blocks))
            rng.shuffle(order)
        return blocks[order[i % len(blocks)]]
    return walk


def drawable(n: int, weights: list[float] | None) -> int:
    """How many layers a lisa draw can choose from."""
    return n if weights is None else sum(w > 0 for w in weights)
