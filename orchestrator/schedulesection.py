"""The schedule file's [schedule] section: which layers (or module units) each phase trains, and
what their optimizer state does at a switch (``orchestrator.schedule`` holds the other sections).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.sections import KeyProblem, NonNegInt, PositiveInt, Section, Steps, _show, int_is_float


class PhaseEntry(Section):
    steps: Steps
    """Optimizer steps of this phase."""
    layers: Annotated[list[NonNegInt], Field(min_length=1)] | None = None
    """Body layers this phase trains (0-based), besides the head; a phase gives layers or modules."""
    modules: Annotated[list[str], Field(min_length=1)] | None = None
    """Instead of layers: the module units this phase trains, "<layer>.<module path>" as the model's
    weights name them past its layer list ("3.self_attn.q_proj"; "3.mlp": every tensor under it);
    the rest of each of those layers stays frozen (MISA: schedule.strategy)."""
    nproc: PositiveInt | None = None
    """Processes per node for this phase; None: launch.nproc. --nproc overrides both."""

    @field_validator("layers")
    @classmethod
    def _distinct(cls, v: list[int] | None) -> list[int] | None:
        twice = sorted({x for x in v if v.count(x) > 1}) if v else []
        if twice:
            raise ValueError(f"expected distinct layers, got {v} (layer {twice[0]} appears twice)")
        return v

    @field_validator("modules")
    @classmethod
    def _units(cls, v: list[str] | None) -> list[str] | None:
        for u in v or []:
            if not _UNIT.fullmatch(u):
                raise ValueError(f'expected "<layer>.<module path>" (such as "0.self_attn.q_proj"), got {_show(u)}')
        # Sorted, a unit's twin or a unit inside it comes right after it ("." sorts below every other
        # character a unit may hold): one pass, where a hostile list of 100,000 would take 10^10 pairs.
        ordered = sorted(v or [])
        for u, after in zip(ordered, ordered[1:]):
            if after == u or after.startswith(u + "."):
                raise ValueError(f"expected distinct units, none inside another, got {_show(u)} "
                                 f"{'twice' if after == u else f'and {_show(after)}'}")
        return v

    @model_validator(mode="after")
    def _layers_or_modules(self) -> PhaseEntry:
        if (self.layers is None) == (self.modules is None):
            raise ValueError("expected layers or modules (one of them), got "
                             f"{'both' if self.layers is not None else 'neither'}")
        return self

    @property
    def trained_layers(self) -> tuple[int, ...]:
        """Its layers: given, or those its modules are in."""
        return tuple(self.layers) if self.layers is not None else \
            tuple(sorted({int(u.partition(".")[0]) for u in self.modules or []}))


class ScheduleSection(Section):
    phases: list[PhaseEntry] | None = None
    """Explicit phases, in order: [{ steps = 10, layers = [0] }, ...]; or use strategy."""
    strategy: Literal["lisa", "ascending", "descending", "badam", "misa"] | None = None
    """lisa: layers sampled at random each phase (seeded by run.seed; LISA, Pan et al. 2024);
    ascending / descending: in turn; badam: the layers cut into blocks of layers_per_phase
    consecutive layers, each pass over all blocks in a seeded order reshuffled every pass (BAdam,
    Luo et al. 2024, switch_mode "random"; with optimizer_state = "drop-all" as BAdam); misa:
    module units, not layers (MISA, Liu et al. 2025): every module of a body layer that holds a 2-D
    weight (attention's q, k, v, o, the MLP's gate, up, down) is a unit, and each phase draws units
    at random (seeded; weighted by unit_weights), without replacement, taking each that fits in what
    is left of module_budget until none does; the rest of a layer (its norms) stays frozen, and
    its switches go through the checkpoint."""
    total_steps: Steps | None = None
    """With strategy: optimizer steps of the whole run; or epochs."""
    epochs: Annotated[float, Field(gt=0, le=1e6)] | None = None
    """With strategy, instead of total_steps: passes over the training rows; the run's steps are
    ceil(round(epochs x rows) / data.batch_size) (orchestrator plan shows both), the last step
    taking the next epoch's first rows where the division is not whole."""
    interval: Steps | None = None
    """With strategy: steps per phase (the last phase may be shorter)."""
    layers_per_phase: PositiveInt | None = None
    """With strategy (but misa): body layers trained per phase."""
    module_budget: Annotated[float, Field(gt=0, le=1)] | None = None
    """With strategy misa: the body parameters a phase trains, as a fraction of all the body's
    (MISA's delta); the units drawn fill it as far as they fit."""
    layer_weights: list[Annotated[float, Field(ge=0)]] | Literal["uniform", "grad_norm"] | None = None
    """With strategy lisa: a weight per body layer (as many as the model has), layers drawn in
    proportion to it without replacement within a phase (OwLore, Li et al. 2024, samples by its
    outlier ratios: `shard-tools outliers MODEL DATA` prints them, OWL's of Yin et al. 2023 over
    calibration rows); 0 never draws a layer; "uniform" or None: all alike. "grad_norm": by
    importance measured as the run trains (IST, Yao et al. 2024, scores layers online): each phase's
    last step measures its layers' gradient norms, and phase i draws in proportion to each layer's
    latest norm among phases 0 .. i - importance_lag (a layer not measured yet weighs as the highest
    measured, so every layer is tried; before any, all alike); the norms are journaled, and a
    resume, at any process count, draws the same layers."""
    unit_weights: Literal["uniform", "grad_norm"] | None = None
    """With strategy misa: how units are drawn. "uniform" or None: all alike (MISA's initial
    weights); "grad_norm": by importance measured as the run trains, as layer_weights = "grad_norm"
    does for layers but per unit (MISA scores modules by their gradients; its own update of the
    weights is not reproduced): each phase's last step measures its units' gradient norms, and phase
    i draws in proportion to each unit's latest norm among phases 0 .. i - importance_lag (a unit
    not measured yet weighs as the highest measured); journaled, so a resume draws the same."""
    importance_lag: PositiveInt = 4
    """With layer_weights (or unit_weights) = "grad_norm": phase i draws by the norms of the phases that ended
    importance_lag or more phases before it. The phases pre-warmed ahead (launch.prewarm_depth) are
    drawn before they start: at most importance_lag - 1 of them are."""
    window: PositiveInt | None = None
    """With strategy lisa: phases per window (0-based phases [0, window), [window, 2 x window) ...)
    within which no layer is drawn twice; window x layers_per_phase must not pass the layers drawable."""
    optimizer_state: Literal["reset", "drop-all", "keep"] = "reset"
    """What the optimizer's state does at a switch. reset (LISA): the body's layers start each
    phase with new Adam state (step 0), the head's carries on; drop-all (BAdam): the head's restarts
    too; keep (LMFlow's and axolotl's LISA callbacks): a layer trained before gets back its Adam
    state (moments and step) of the end of its last visit, parked in that phase's checkpoint beside
    its weights, never on the device, while a layer trained for the first time starts new and the
    head's carries on (the lr schedule stays the run's); every phase end then writes its
    checkpoint (a switch still hands the head's state over). Resuming inside a phase restores both,
    whichever. Which head modules train: model.persistent."""

    _epochs_float = field_validator("epochs", mode="before")(int_is_float)

    @property
    def by_importance(self) -> bool:
        """Layers (or units) drawn as the run goes, by the gradient norms its phases measure (IST)."""
        return self.layer_weights == "grad_norm" or self.unit_weights == "grad_norm"

    @field_validator("layer_weights", mode="before")
    @classmethod
    def _weights(cls, v: Any) -> Any:
        """One message naming the key (or the weight), not one per member of the union."""
        if isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, bool) or not isinstance(x, int | float) or not x >= 0:
                    raise KeyProblem(f"schedule.layer_weights[{i}]", f"expected a non-negative number, got {_show(x)}")
            return [int_is_float(x) for x in v]
        if v is not None and v not in ("uniform", "grad_norm"):
            raise KeyProblem("schedule.layer_weights", f'expected a list of weights, "uniform" or "grad_norm", '
                             f"got {_show(v)}")
        return v

    @model_validator(mode="after")
    def _one_form(self) -> ScheduleSection:
        per_phase = "module_budget" if self.strategy == "misa" else "layers_per_phase"
        strategy_keys = {k: getattr(self, k) for k in ("total_steps", "interval", per_phase)}
        self._modules_alone()
        for key in ("layer_weights", "window"):
            if getattr(self, key) is not None and self.strategy != "lisa":
                raise KeyProblem(f"schedule.{key}", f'takes schedule.strategy = "lisa", got strategy '
                                 f"{_show(self.strategy) if self.strategy else 'none (explicit phases)'}")
        if "importance_lag" in self.model_fields_set and not self.by_importance:
            raise KeyProblem("schedule.importance_lag", 'takes schedule.layer_weights (or unit_weights) = "grad_norm", '
                             f"got {_show(self.layer_weights) if self.layer_weights is not None else 'none'}")
        if self.phases is not None:
            given = [k for k in ("strategy", *strategy_keys, "layers_per_phase", "epochs") if getattr(self, k) is not None]
            if given:
                raise KeyProblem(f"schedule.{given[0]}", "expected either schedule.phases or schedule.strategy "
                                 "(with total_steps or epochs, interval, layers_per_phase), not both")
            if not self.phases:
                raise KeyProblem("schedule.phases", "expected at least one phase, got an empty list")
            return self
        if self.strategy is None:
            raise KeyProblem("schedule", "expected schedule.phases or schedule.strategy")
        if self.epochs is not None and self.total_steps is not None:
            raise KeyProblem("schedule.epochs", "expected schedule.total_steps or schedule.epochs, not both")
        missing = [k for k, v in strategy_keys.items() if v is None and not (k == "total_steps" and self.epochs)]
        if missing:
            also = " (or schedule.epochs)" if missing[0] == "total_steps" else ""
            raise KeyProblem(f"schedule.{missing[0]}",
                             f"required with schedule.strategy = {_show(self.strategy)}{also}, but missing")
        return self

    @property
    def by_modules(self) -> bool:
        """Its phases train module units, not whole layers (strategy misa, or phases' modules)."""
        return self.strategy == "misa" or any(p.modules is not None for p in self.phases or [])

    def _modules_alone(self) -> None:
        """The keys that module units leave out (``by_modules``), named."""
        misa = self.strategy == "misa"
        wrong = "module_budget" if self.module_budget is not None and not misa else \
            "unit_weights" if self.unit_weights is not None and not misa else \
            "layers_per_phase" if self.layers_per_phase is not None and misa else None
        if wrong in ("module_budget", "unit_weights"):
            raise KeyProblem(f"schedule.{wrong}", 'takes schedule.strategy = "misa", got '
                             f"{_show(self.strategy) if self.strategy else 'none (explicit phases)'}")
        if wrong:
            raise KeyProblem("schedule.layers_per_phase", "takes a strategy of whole layers (lisa, ascending, "
                             "descending, badam): misa draws module units to schedule.module_budget")
        if self.by_modules and self.optimizer_state == "keep":
            raise KeyProblem("schedule.optimizer_state", '"keep" parks a whole layer\'s Adam state: module units '
                             'take "reset" or "drop-all"')


_UNIT = re.compile(r"\d+(\.[A-Za-z_][A-Za-z0-9_]*)+")
"""A module unit: "<layer>.<module path>"."""
