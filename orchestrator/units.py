"""Module units (MISA, Liu et al. 2025, arXiv 2511.00056): phases that train some modules of a layer, not the whole of it.

A unit is "<layer>.<module path>", the model's weights' names past its layer list
("3.self_attn.q_proj"). Explicit phases name theirs (``schedule.phases[i].modules``: any module
path, "3.mlp" taking every tensor under it); strategy "misa" draws them each phase from every
module of a body layer that holds a 2-D weight, without replacement, until the next would pass
``schedule.module_budget`` (a fraction of the body's parameters; MISA's budget, its draw
uniform here). The checks and the draw read the weights' headers (``LoadedSchedule.layer_tensors``).
"""

from __future__ import annotations

import math
import random
from typing import Callable

from orchestrator.errors import ScheduleError
from orchestrator.schedule import LoadedSchedule

Draw = Callable[[int], tuple[tuple[int, ...], tuple[str, ...]]]


def layer_units(tensors: dict[str, list[int]]) -> dict[str, int]:
    """A layer's units for the draw, with their parameters: each module that holds a 2-D weight
    (its "<path>.weight"; a bias counts with it). ``tensors``: name -> shape, of one layer."""
    modules = sorted(n.removesuffix(".weight") for n, shape in tensors.items()
                     if n.endswith(".weight") and "." in n and len(shape) == 2)
    return {m: sum(math.prod(shape) for n, shape in tensors.items() if n.startswith(m + ".")) for m in modules}


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
        if not any(n.startswith(path + ".") for n in held):
            modules = sorted({n.rpartition(".")[0] for n in held})
            raise ScheduleError(f"{key}: {unit!r}: layer {layer} holds no tensor under {path!r} (its modules: "
                                f"{', '.join(modules)})")


def misa(loaded: LoadedSchedule) -> Draw:
    """Phase i's layers and units under strategy misa: a seeded draw of its own (run.seed, i), so a
    resume and a plan draw the same."""
    units = [(f"{layer}.{m}", size) for layer in sorted(loaded.layer_tensors)
             for m, size in layer_units(loaded.layer_tensors[layer]).items()]
    body = sum(math.prod(shape) for t in loaded.layer_tensors.values() for shape in t.values())
    budget = int(loaded.schedule.schedule.module_budget * body)
    smallest = min((size for _, size in units), default=0)
    if not units or smallest > budget:
        raise ScheduleError(f"{loaded.source}: schedule.module_budget: {loaded.schedule.schedule.module_budget:g} of "
                            f"the body's {body:,} parameters is {budget:,}, less than its smallest unit "
                            f"({smallest:,})")
    seed = loaded.schedule.run.seed

    def draw(i: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        order = list(units)
        random.Random(f"misa/{seed}/{i}").shuffle(order)
        left, chosen = budget, []
        for name, size in order:
            if size <= left:
                chosen.append(name)
                left -= size
        chosen.sort(key=lambda u: (int(u.partition(".")[0]), u))
        return tuple(sorted({int(u.partition(".")[0]) for u in chosen})), tuple(chosen)

    return draw
