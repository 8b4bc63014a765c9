"""What a phase measures for schedule.layer_weights = "grad_norm" (IST's importance, Yao et al.
2024, from what training computes anyway): each body layer it trains, the L2 norm of that layer's
gradient at the phase's last step, the full gradient (every rank's micro-batches, reduced), read
between its last backward and the optimizer's step. Rank 0 writes them to its phase folder
(``PhaseDir.grad_norms``) before it offers its state or writes its end: the orchestrator draws
the layers of later phases by them (``orchestrator.importance``). Under module units
(schedule.unit_weights = "grad_norm") each unit's norm, by which later phases' units are drawn."""

from __future__ import annotations

import math

from launch.contract.files import GradNorms, PhaseDir
from launch.record import Phase
from launch.save import carried_layer


def due(ph: Phase, micro: int) -> bool:
    """Whether the micro-batch ``micro`` just backpropagated ends the phase's last step (``ph.step``
    still the step's own number)."""
    return ph.spec.grad_norms and ph.step == ph.spec.end_step - 1 and micro == ph.built.gas - 1


def measure(ph: Phase) -> None:
    """Each trained body layer's gradient norm, into ``ph.grad_norms``; a collective (every rank
    calls it at the same step, ``Backend.full_grads``). With float16's loss scaling the gradients
    are still scaled here (the step unscales them): divided by the scale. A layer whose norm is not
    finite (a step the scaler skips) is not measured."""
    body, engine = ph.built.body, ph.built.engine
    grads = ph.backend.full_grads(engine, [p for _, p in body])
    scale = float(getattr(ph.backend.loss_scaler(engine), "cur_scale", 1.0) or 1.0)
    squares: dict[int | str, float] = {}
    for (name, _), g in zip(body, grads):
        key = _key(ph, name)
        squares[key] = squares.get(key, 0.0) + (0.0 if g is None else float(g.detach().double().pow(2).sum()))
    norms = {key: math.sqrt(v) / scale for key, v in sorted(squares.items())}
    ph.grad_norms = {key: v for key, v in norms.items() if math.isfinite(v)}


def _key(ph: Phase, name: str) -> int | str:
    """What a trained parameter's norm counts to: its module unit (``PhaseSpec.modules``), else its layer."""
    prefix = f"{ph.made.origin.layers_attr}."
    return next((u for u in ph.spec.modules if name.startswith(f"{prefix}{u}.")), None) or carried_layer(ph, name)


def write(ph: Phase) -> None:
    """Rank 0 writes what ``measure`` found (none: the phase did not end, or measures nothing)."""
    norms = ph.grad_norms
    if ph.rank == 0 and norms is not None:
        units = bool(ph.spec.modules)
        PhaseDir(ph.spec.phase_dir).write_grad_norms(GradNorms(
            phase=ph.spec.phase, step=ph.spec.end_step - 1, layers=[] if units else list(norms),
            units=list(norms) if units else [], norms=list(norms.values())))
