"""Module units (MISA, Liu et al. 2025, arXiv 2511.00056): phases that train some modules of a
layer, not the whole of it.

A unit is "<layer>.<module path>", the model's weights' names past its layer list
("3.self_attn.q_proj"). Explicit phases name theirs (``schedule.phases[i].modules``: any module
path, "3.mlp" taking every tensor under it); strategy "misa" draws them each phase from every
module of a body layer that holds a 2-D weight, without replacement, until the next would pass
``schedule.module_budget`` (a fraction of the body's parameters; MISA's budget), uniformly or
by the units' gradient norms (``schedule.unit_weights``, ``orchestrator.importance``). The
checks and the draw read the weights' headers (``LoadedSchedule.layer_tensors``).
"""

from __future__ import annotations

import math
import random

from orchestrator.errors import ScheduleError
from orchestrator.schedule import LoadedSchedule


def under(tensors: dict[str, list[int]], path: str) -> dict[str, list[int]]:
    """Of one layer's ``tensors`` (name -> shape, past its prefix and index), those under the module ``path``."""
    return {n: shape for n, shape in tensors.items() if n.startswith(path + ".")}


def unit_size(tensors: dict[str, list[int]], path: str) -> int:
    """The parameters of the unit ``path`` of a layer of ``tensors``."""
    return sum(math.prod(shape) for shape in under(tensors, path).values())


def layer_units(tensors: dict[str, list[int]]) -> dict[str, int]:
    """A layer's units for the draw, with their parameters: each module that holds a 2-D weight
    (its "<path>.weight"; a bias counts with it). ``tensors``: name -> shape, of one layer."""
    modules = sorted(n.removesuffix(".weight") for n, shape in tensors.items()
                     if n.endswith(".weight") and "." in n and len(shape) == 2)
    return {m: unit_size(tensors, m) for m in modules}


def check_units(loaded: LoadedSchedule, index: int, units: tuple[str, ...]) -> None:
    """Explicit phase ``index``'s units are in the model: its layer exists and holds a tensor under
    the path."""
    key = f"{loaded.source}: schedule.phases[{index}].modules"
    for unit in units:
        layer, _, path = unit.partition(".")
        held = loaded.layer_tensors.get(int(layer))
        if held is None:
            raise ScheduleError(f"{key}: {unit!r}: layer {layer} is out of range: the model has "
                                f"{loaded.num_layers} layers (0..{loaded.num_layers - 1})")
        if not under(held, path):
            modules = sorted({n.rpartition(".")[0] for n in held})
            raise ScheduleError(f"{key}: {unit!r}: layer {layer} holds no tensor under {path!r} (its modules: "
                                f"{', '.join(modules)})")


class Misa:
    """Strategy misa's draw: phase i's layers and units, a seeded draw of its own (run.seed, i) by
    weights (``scores``: unit -> its latest gradient norm, ``schedule.unit_weights = "grad_norm"``;
    one not measured weighs as the highest; none measured, or uniform: all alike), so a resume and
    a plan draw the same. The units are ordered by a weighted draw without replacement (each the
    key u ** (1 / weight) of a seeded uniform u, in descending order: Efraimidis and Spirakis 2006,
    n log n where a draw at a time is n squared), and taken in that order while they fit in what
    is left of the budget."""

    def __init__(self, loaded: LoadedSchedule):
        self.units = [(f"{layer}.{m}", size) for layer in sorted(loaded.layer_tensors)
                      for m, size in layer_units(loaded.layer_tensors[layer]).items()]
        body = sum(math.prod(shape) for t in loaded.layer_tensors.values() for shape in t.values())
        fraction = loaded.schedule.schedule.module_budget
        self.budget, self.seed = int(fraction * body), loaded.schedule.run.seed
        smallest = min((size for _, size in self.units), default=0)
        if not self.units or smallest > self.budget:
            raise ScheduleError(f"{loaded.source}: schedule.module_budget: {fraction:g} of the body's {body:,} "
                                f"parameters is {self.budget:,}, less than its smallest unit ({smallest:,})")

    def __call__(self, i: int, scores: dict[str, float] | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
        top = max((scores or {}).values(), default=0.0)
        weights = [(scores or {}).get(name, top) if top > 0 else 1.0 for name, _ in self.units]
        if not any(w > 0 for w in weights):
            weights = [1.0] * len(self.units)
        rng = random.Random(f"relayer-misa-{self.seed}-{i}")
        keys = [(rng.random() ** (1 / w) if w > 0 else -1.0, j) for j, w in enumerate(weights)]
        left, chosen = self.budget, []
        for name, size in (self.units[j] for key, j in sorted(keys, reverse=True) if key >= 0):
            if size <= left:
                chosen.append(name)
                left -= size
        chosen.sort(key=lambda u: (int(u.partition(".")[0]), u))
        return tuple(sorted({int(u.partition(".")[0]) for u in chosen})), tuple(chosen)
