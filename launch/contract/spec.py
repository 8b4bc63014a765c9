"""The phase spec: the one JSON file through which the orchestrator tells a phase what to do
(unknown keys are errors, so drift between the two sides fails loudly), and the learning rate of a
step (both sides must agree on it)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from launch.contract.data import DataPart


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelPart(_Spec):
    path: str | None
    config: dict[str, Any] | None
    dtype: Literal["float32", "bfloat16", "float16"]
    persistent: list[str] | None
    layers: str | None
    gradient_checkpointing: bool = False
    tokenizer: str | None = None
    """The tokenizer's directory (the schedule's model.tokenizer, default model.path); text,
    instruction and chat data need one."""


class OptimizerPart(_Spec):
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    grad_clip: float
    lr_kind: Literal["constant", "linear", "cosine"]
    warmup_steps: int
    total_steps: int
    """The run's last global step, for the decay schedules."""
    warmup_from: Literal["zero", "one_step"] = "zero"  # lr_schedule.warmup_from
    phase_warmup_steps: int = 0  # lr_schedule.phase_warmup_steps: a warm-up after each switch


class HandoverPart(_Spec):
    """The device handover at a phase's boundaries (``launch.handover``, ``launch.handover`` the module)."""

    offer: bool = False
    """At its end (complete) it offers its state, waits for the answer, then writes its checkpoint."""
    take: bool = False
    """Pre-warmed without a host copy of the model, it takes its predecessor's state at its go."""
    host: bool = False
    """Also without a GPU, through a file (``launch.handover = "on"``); on CUDA: CUDA IPC."""
    peak_bytes: int = 0
    """The overlap's planned peak on one device; a smaller device does not take over. 0: not planned."""
    next_layers: list[int] = []
    """Where it offers: the layers its successor trains (their carried masters go on the device ahead)."""
    shm_offer: bool = False
    """Its end goes through host memory (the host path, ``launch.handover = "host"``, or where the
    overlap is above launch.device_memory): its fp32 state into shared memory, then its device
    memory freed before it waits for the answer."""
    shm_take: bool = False
    """Its start takes the fp32 state from host memory into the host model it prepared (no
    skeleton: the model's frozen weights never move)."""


class PhaseSpec(_Spec):
    run_dir: str
    tensorboard: bool = False
    wandb: bool = False
    eval_prompts: list[str] = []
    """``eval.prompts``: generated from, greedily, at each evaluation."""
    eval_max_new_tokens: int = 16
    phase_dir: str
    """Where this phase's processes record their pids and the launcher its log."""
    seed: int
    phase: int
    start_step: int
    """The global step this process group starts at (inside the phase when resuming)."""
    phase_start_step: int
    end_step: int
    layers: list[int]
    modules: list[str] = []
    """Module units ("<layer>.<module path>", e.g. "3.self_attn.q_proj") this phase trains of ``layers``;
    empty: each layer whole. The layers' other parameters stay frozen, and its checkpoints hold the
    layers whole (``Prepared.parts``)."""
    restore: str | None
    """Checkpoint to start from; None: the base model. A pre-warmed phase learns it at its go."""
    prewarm: bool = False
    """Start early, prepare, then wait on ``go_fifo`` until the predecessor's processes are gone."""
    preload: str | None = None
    """Pre-warmed: the checkpoint whose layers are known before the go (the predecessor's start)."""
    go_fifo: str | None = None
    model: ModelPart
    data: DataPart
    optimizer: OptimizerPart
    zero_stage: Literal[0, 1, 2, 3]
    deepspeed_config: dict[str, Any]
    every_steps: int
    launcher: Literal["local", "deepspeed", "torchrun", "slurm"]
    nproc: int
    nnodes: int
    hostfile: str | None
    master_port: int
    master_addr: str | None = None
    """Where the processes meet: launch.master_addr, the first node's NodeAddr, or 127.0.0.1."""
    rendezvous_seconds: float = 300.0
    """How long its processes may take to meet (launch.rendezvous_seconds)."""
    orchestrator_pid: int | None
    """The worker stops itself when this process is gone (it may have been SIGKILLed)."""
    orchestrator_host: str | None = None
    """Where orchestrator_pid lives: ranks on other nodes cannot watch it (their launcher does)."""
    handover: HandoverPart = HandoverPart()
    """The device handover at this phase's start (``take``) and end (``offer``)."""
    optimizer_state: Literal["reset", "drop-all", "keep"] = "reset"
    """schedule.optimizer_state: "drop-all" starts the head's Adam state anew at the phase's start too;
    "keep" gives a layer trained before its Adam state of the end of its last visit back."""
    grad_norms: bool = False
    """schedule.layer_weights = "grad_norm": the phase's last step measures each of its body layers'
    gradient norm (``launch.importance``), by which the orchestrator draws later phases' layers."""
    memory_cap: int = 0
    """Bytes this phase's caching allocator may reserve on its device (launch.device_memory less the
    fixed part of every process beside it: orchestrator/budget.py); 0: no cap."""
    waiting_cap: int = 0
    """Bytes its caching allocator may reserve while it waits pre-warmed, its warm-up included (the
    part of launch.device_memory a waiting phase is counted at); memory_cap from its go on. 0: no cap."""
    resident: str | None = None
    """The run's holder directory (``launch.resident``, ``launch.resident`` the module): the phase maps
    the model's weights the holder keeps for the whole run instead of a copy of its own; None: it copies."""
    holds: bool = False
    """This spec starts the holder (in ``resident``), not a phase: it puts the model's weights on its
    device once (the base model with ``restore``'s layers in) and keeps them until the run ends."""

    @classmethod
    def read(cls, path: str | Path) -> PhaseSpec:
        return cls.model_validate(json.loads(Path(path).read_text()))

    def changed(self, **update: Any) -> PhaseSpec:
        """``model_copy(update=...)``, validated: model_copy takes any value unchecked and drops an
        unknown key silently, so a change the worker would refuse is caught here instead."""
        return self.model_validate(self.model_dump() | update)


def lr_at(step: int, opt, phase_start: int = 0) -> float:
    """Step ``step``'s lr (from 0; "zero": transformers' get_scheduler's); ``opt``: an OptimizerPart;
    ``phase_start``: the first step of the step's phase, for ``phase_warmup_steps``."""
    lr = _schedule_lr(step, opt)
    in_phase = step - phase_start
    if 0 <= in_phase < opt.phase_warmup_steps:
        lr *= (in_phase + 1) / (opt.phase_warmup_steps + 1)
    return lr


def _schedule_lr(step: int, opt) -> float:
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + (opt.warmup_from == "one_step")) / opt.warmup_steps
    if opt.lr_kind == "constant":
        return opt.lr
    span = max(1, opt.total_steps - opt.warmup_steps)
    frac = min(1.0, (step - opt.warmup_steps) / span)
    if opt.lr_kind == "linear":
        return opt.lr * (1.0 - frac)
    return opt.lr * 0.5 * (1.0 + math.cos(math.pi * frac))
