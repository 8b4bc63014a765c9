"""schedule.layer_weights = "grad_norm": the layers of a lisa run drawn by importance measured as it
trains (IST, Yao et al. 2024, scores layers online; here by what training computes anyway); and
schedule.unit_weights = "grad_norm", a misa run's module units the same way (``orchestrator.units``).

Each phase's last step measures the gradient norm of each layer it trains (``launch.importance``,
written to its phase folder before it offers its state or writes its end). Phase i draws its
layers in proportion to each layer's latest norm among phases 0 .. i - importance_lag; a layer not
measured by then weighs as the highest measured (so every layer is tried), and with none measured
all weigh alike. The draw is a function of the seed, i and those norms alone, so a resume (its
norms from the journal, or the phase folders of the phases it did not journal), at any process
count, draws what the run would have. The pre-warmed phases ahead are drawn before they start:
with importance_lag > launch.prewarm_depth, every one is drawn in time.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from launch.contract.files import RunDir
from orchestrator.choose import weighted_sample
from orchestrator.schedule import LoadedSchedule, Phase
from orchestrator.units import Misa
from shard_tools.history import journaled_norms

EVENT = "grad_norms"
"""The journal's record of a phase's norms: phase, step, layers, norms (``history.journaled_norms``)."""


def draw(seed: int, index: int, n: int, k: int, scores: dict[int, float], taken: set[int]) -> tuple[int, ...]:
    """Phase ``index``'s ``k`` layers of ``n``, none of ``taken`` (its window's), drawn by ``scores``."""
    top = max(scores.values(), default=0.0)
    weights = [scores.get(layer, top) if top > 0 else 1.0 for layer in range(n)]
    pool = [layer for layer in range(n) if layer not in taken]
    if sum(weights[x] > 0 for x in pool) < k:  # every measured norm 0 among those left: all alike
        weights = [1.0] * n
    return tuple(sorted(weighted_sample(random.Random(f"relayer-importance-{seed}-{index}"), pool, weights, k)))


def planned(loaded: LoadedSchedule, n: int, k: int) -> Callable[[int], tuple[tuple[int, ...], bool]]:
    """For ``orchestrator.plan``: phase i's layers as far as the plan can tell and whether they are
    drawn later. The first importance_lag phases draw by no norm at all: their draws are final;
    the later ones stand in (as many layers, drawn the same way) until the run draws them."""
    sc, drawn = loaded.schedule.schedule, []

    def layers(i: int) -> tuple[tuple[int, ...], bool]:
        chosen = draw(loaded.schedule.run.seed, i, n, k, {}, _window_taken(drawn, i, sc.window))
        drawn.append(chosen)
        return chosen, i >= sc.importance_lag
    return layers


def _window_taken(drawn: list[tuple[int, ...]], i: int, window: int | None) -> set[int]:
    """The layers the earlier phases of phase i's window drew (none without a window)."""
    start = i - i % window if window else i
    return {layer for chosen in drawn[start:i] for layer in chosen}


class Importance:
    """The norms the run's phases measured, and the draws by them, for the runner."""

    def __init__(self, loaded: LoadedSchedule, run_dir: Path, event: Callable[..., None]):
        sc = loaded.schedule.schedule
        self.on = sc.by_importance
        self.lag, self.window, self.seed = sc.importance_lag, sc.window, loaded.schedule.run.seed
        self.n, self.k = loaded.num_layers, sc.layers_per_phase
        self.misa = Misa(loaded) if self.on and sc.strategy == "misa" else None
        self.run_dir, self.event = run_dir, event
        self.norms: dict[int, dict[int | str, float]] = {}
        """Phase index -> layer (or unit) -> norm; a phase known to have measured nothing maps to {}."""

    def resume(self, phases: list[Phase], journal: list[dict], step: int) -> None:
        """The norms of the phases that ended by ``step`` (the restore point): the journal's, else
        their phase folders'; a later attempt's are not this one's (those phases train again)."""
        if not self.on:
            return
        ended = {p.index for p in phases if p.end_step <= step}
        for e in journal:
            if e.get("event") == EVENT and e.get("phase") in ended and (norms := journaled_norms(e)) is not None:
                self.norms[e["phase"]] = norms
        for index in sorted(ended - set(self.norms)):
            self.finished(phases[index])

    def finished(self, phase: Phase) -> None:
        """``phase`` ended whole: its norms from its phase folder, journaled ({} where it wrote none)."""
        if not self.on:
            return
        got = RunDir(self.run_dir).phase(phase.index).read_grad_norms()
        ok = got is not None and got.phase == phase.index
        layers, units, norms = (got.layers, got.units, got.norms) if ok else ([], [], [])
        self.norms[phase.index] = dict(zip(units or layers, norms))
        self.event(EVENT, phase=phase.index, step=phase.end_step, layers=layers, norms=norms,
                   **({"units": units} if units else {}))

    def draw_ready(self, phases: list[Phase]) -> None:
        """Draws, in order, every phase still drawn later whose norms are all in (those of phases
        0 .. i - lag), replacing it in ``phases``; stops at the first that must wait."""
        if not self.on:
            return
        for i, phase in enumerate(phases):
            if not phase.drawn_later:
                continue
            if any(j not in self.norms for j in range(i - self.lag + 1)):
                return
            if self.misa is not None:
                layers, units = self.misa(i, self.scores(i))
                phases[i] = phase.model_copy(update={"layers": layers, "modules": units, "drawn_later": False})
                continue
            taken = _window_taken([p.layers for p in phases], i, self.window)
            phases[i] = phase.model_copy(update={"layers": draw(self.seed, i, self.n, self.k, self.scores(i), taken),
                                                 "drawn_later": False})

    def scores(self, i: int) -> dict:
        """Each layer's (or unit's) latest norm among phases 0 .. i - lag."""
        latest: dict = {}
        for j in range(i - self.lag + 1):
            latest.update(self.norms.get(j, {}))
        return latest
