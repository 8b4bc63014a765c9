"""The phase spec a phase's processes start from (``launch.contract.spec.PhaseSpec``), built from the
schedule for one piece of work.

Built typed, so it is validated here, before the phase's processes start: a ValidationError is a
bug in relayer (the schedule was validated long before), and surfaces as one, not as bad input.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable

from launch.contract.spec import DataPart, ModelPart, OptimizerPart, PhaseSpec
from orchestrator.budget import memory_cap, waiting_cap
from orchestrator.datastep import data_spec
from orchestrator.estimate import EstimateError, PlanEstimate, estimate_plan
from orchestrator.groups import Work
from orchestrator.handover import handover_part
from orchestrator.machine import this_machine
from orchestrator.modelcheck import tokenizer_of
from orchestrator.nodes import master_addr
from orchestrator.plan import check_batch
from orchestrator.ports import free_port
from orchestrator.resident import resident_dir
from orchestrator.schedule import LoadedSchedule, Phase


def phase_spec(loaded: LoadedSchedule, phases: list[Phase], work: Work, phase_dir: Path,
               estimate: PlanEstimate | None, resident: Path | None = None) -> PhaseSpec:
    """The spec of ``work``, whose processes keep their files in ``phase_dir``; ``estimate``: the
    run's (``plan_estimate``), made once per run; ``resident``: the holder's folder where the phases
    map its weights (``orchestrator.resident``)."""
    s, ph = loaded.schedule, work.phase
    check_batch(s.data, ph.nproc, loaded.source, ph.index, nnodes=s.launch.nnodes)
    return PhaseSpec(
        run_dir=str(loaded.output_dir), phase_dir=str(phase_dir), seed=s.run.seed,
        tensorboard=s.run.tensorboard or "tensorboard" in s.run.report_to, wandb="wandb" in s.run.report_to,
        eval_prompts=s.eval.prompts, eval_max_new_tokens=s.eval.max_new_tokens, phase=ph.index, start_step=work.start_step, phase_start_step=ph.start_step, end_step=ph.end_step,
        layers=list(ph.layers), modules=list(ph.modules), restore=str(work.restore) if work.restore else None,
        model=_model_part(loaded), data=DataPart(**data_spec(loaded)),
        optimizer=_optimizer_part(loaded, total_steps=phases[-1].end_step),
        zero_stage=s.deepspeed.zero_stage, deepspeed_config=loaded.deepspeed_config,
        every_steps=s.checkpoint.every_steps, launcher=s.launch.launcher, nproc=ph.nproc, nnodes=s.launch.nnodes,
        hostfile=str((loaded.source.parent / s.launch.hostfile).resolve()) if s.launch.hostfile else None,
        master_port=free_port(), master_addr=master_addr(s.launch), rendezvous_seconds=s.launch.rendezvous_seconds,
        orchestrator_pid=os.getpid(), orchestrator_host=socket.gethostname(),
        handover=handover_part(loaded, phases, ph.index, estimate), optimizer_state=s.schedule.optimizer_state,
        grad_norms=s.schedule.by_importance,
        memory_cap=memory_cap(loaded, phases, ph.index, held=estimate.resident if resident and estimate else 0),
        waiting_cap=waiting_cap(loaded),
        resident=str(resident) if resident is not None else None,
    )


def spec_maker(loaded: LoadedSchedule, phases: list[Phase]) -> Callable[[Work, Path], PhaseSpec]:
    """``phase_spec`` for this run's work, with what is decided once per run: the handovers' planned
    peaks (``plan_estimate``) and where the phases map the model's weights (``resident_dir``; exit 2
    where ``launch.resident = "on"`` cannot be)."""
    estimate = plan_estimate(loaded, phases)
    holder = resident_dir(loaded, phases, this_machine().gpus, sized=estimate is not None)
    return lambda work, phase_dir: phase_spec(loaded, phases, work, phase_dir, estimate, holder)


def plan_estimate(loaded: LoadedSchedule, phases: list[Phase]) -> PlanEstimate | None:
    """The memory estimate of ``loaded``'s run (``phases`` are its phases); None for a model it
    cannot size, whose handovers then plan no peak (``HandoverPart.peak_bytes`` 0)."""
    try:
        return estimate_plan(loaded, phases)
    except EstimateError:
        return None


def recorded_base(loaded: LoadedSchedule) -> dict[str, Any]:
    """The base model as every phase records it (``launch.prepare.model_spec``: a manifest's
    ``extra.base_model``), from the same model part and seed as the phases' specs."""
    m = _model_part(loaded)
    return {"path": m.path, "config": m.config, "dtype": m.dtype, "seed": loaded.schedule.run.seed}


def _model_part(loaded: LoadedSchedule) -> ModelPart:
    m = loaded.schedule.model
    tokenizer = tokenizer_of(m, loaded.source.parent)
    return ModelPart(path=str(loaded.model_path) if loaded.model_path else None, config=m.config, dtype=m.dtype,
                     persistent=m.persistent, layers=m.layers, gradient_checkpointing=m.gradient_checkpointing,
                     tokenizer=str(tokenizer) if tokenizer else None)


def _optimizer_part(loaded: LoadedSchedule, total_steps: int) -> OptimizerPart:
    """``total_steps``: the run's last global step, for the lr's decay."""
    s = loaded.schedule
    return OptimizerPart(lr=s.optimizer.lr, weight_decay=s.optimizer.weight_decay, betas=tuple(s.optimizer.betas),
                         eps=s.optimizer.eps, grad_clip=s.optimizer.grad_clip, lr_kind=s.lr_schedule.kind,
                         warmup_steps=s.lr_schedule.warmup_steps, total_steps=total_steps,
                         warmup_from=s.lr_schedule.warmup_from, phase_warmup_steps=s.lr_schedule.phase_warmup_steps)
