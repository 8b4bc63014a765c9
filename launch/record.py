"""The state of one phase process, declared in one place: the record ``launch.phase.run_phase``
keeps (``Phase``), and the typed results the stages return into it, each made once: what
``launch.prepare`` made (``Prepared``), where the switch carries on from (``Source``) and what
``launch.switch.assemble`` put together (``Assembled``). The stages import this module and no
module imports them back."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

from launch.carried import HostCarry
from launch.contract.files import PhaseDir
from launch.contract.spec import PhaseSpec
from launch.data.examples import SampleOrder
from launch.engine import Backend, backend_for
from launch.pinned import Arena
from launch.staging import Staging
from launch.timeline import Timeline
from shard_tools.later import Later
from shard_tools.state import Origin, PhaseState, StateFiles
from shard_tools.store import Checkpoints


@dataclass
class Prepared:
    """What ``launch.prepare`` made before the go: the host model and what is known of its weights,
    the data, and whether the phase will take its predecessor's state over."""

    staging: Staging | None
    """On CUDA, pinned host buffers for fast copies to and from the device."""
    refusal: str | None
    """Why it will not take its predecessor's state over (``launch.handover``); None: it will, if offered."""
    model: nn.Module
    """The host model: base weights, every layer's newest trained ones in; or a skeleton."""
    skeleton: bool
    """``model``'s parameters are on the meta device: the predecessor's come at the go, or ``host_model``."""
    origin: Origin
    """What its checkpoints record of where they come from: the base model, the head's parts, the layers' place."""
    head_names: list[str]
    body_names: list[str]
    """The parameter names of the head (trained in every phase) and of this phase's layers."""
    examples: Any
    validation: Any
    order: SampleOrder
    """The training rows, the validation rows (with a validation path), which rows each step takes."""
    preloaded: dict[int, Path]
    """Layer -> the checkpoint its host model weights (taking over: device masters) came from."""
    trained: dict[str, torch.Tensor]
    """fp32 weights of the trainable parameters, for their fp32 masters (the module may be bf16);
    emptied once they are in the engine."""
    moving: Later[None] | None = None
    """A phase started cold from the base model: its weights going to the device meanwhile (``launch.prepare``)."""
    carried: dict[str, torch.Tensor] = field(default_factory=dict)
    """fp32 masters of other layers than this phase's, trained by phases since the last checkpoint
    whose ends wrote none (``checkpoint.every_seconds``), taken over from the predecessor: its
    checkpoint, or its offer to its successor, holds them too. On the host (``launch.carried``),
    once ``host`` has settled."""
    parts: frozenset[str] = frozenset()
    """Under module units (``PhaseSpec.modules``): the other parameters of this phase's layers, which
    it does not train; their fp32 weights wait in ``carried`` (``hold_parts``), so that its
    checkpoints hold each of its layers whole."""
    host: HostCarry = field(default_factory=HostCarry)
    """The shared host memory ``carried`` lies in."""
    arena: Arena | None = None
    """Host memory pinned ahead for the engine's pinned buffers (``launch.pinned``), where it pins any."""
    resident: dict[str, torch.Tensor] | None = None
    """Where the model's weights are the holder's (``launch.resident``): its block's views by name,
    which ``model`` is made of (until the phase's own trainable copies, ``resident.own``)."""

    @property
    def taking(self) -> bool:
        """It will take its predecessor's state over if offered, into a model of no host weights
        (a skeleton, or the holder's block): its layers' masters wait pinned (``preload.preload_layers``)."""
        return self.refusal is None and (self.skeleton or self.resident is not None)

    def overlay(self, weights: dict[str, torch.Tensor]) -> None:
        """Puts ``weights`` into the host model; keeps the trainable ones' fp32 values in ``trained``.
        With the holder's weights, only that: its block has every layer's newest weights already,
        and no phase but the one that trained them writes there (``resident.write_back``)."""
        params = dict(self.model.named_parameters())
        keep = set(self.head_names) | set(self.body_names)
        with torch.no_grad():
            for name, t in weights.items():
                if self.resident is None:
                    params[name].copy_(t.to(params[name].dtype))
                if name in keep:
                    self.trained[name] = t
                elif name in self.parts:
                    self.carried[name] = t

    def hold_parts(self) -> None:
        """The fp32 weights of ``parts`` that no checkpoint held (``overlay`` took the others): the
        base model's, as the model has them."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name in self.parts - set(self.carried):
                self.carried[name] = params[name].detach().to("cpu", torch.float32, copy=True)


@dataclass
class Source:
    """Where the phase carries on from: the checkpoint it restores, or its predecessor's offer."""

    restore: Path | None
    """The checkpoint to restore from (None: the base model); taking over, the one the predecessor commits."""
    carried: PhaseState | None
    """The state carried on (steps, the head's, the loss scale, mid-phase the body's); None from the
    base model, and once it is in the engine."""
    taken: bool = False
    """It took its predecessor's state over on the device (``launch.handover.take``)."""
    before: Path | None = None
    """Taken over: the checkpoint its predecessor built on (its offer's ``Carried.restore``)."""
    awaiting: Path | None = None
    """The predecessor's checkpoint, not yet committed at the go: this phase commits nothing before it."""
    populating: Later[None] | None = None
    """Maps the head's moments (``launch.switch.read_delta``) while the engine is built."""
    kept: dict[str, dict[str, torch.Tensor]] | None = None
    """optimizer_state "keep", a new phase: the kept Adam state of its layers trained before
    (``shard_tools.state.kept_state``), on the host until ``launch.switch.restore`` puts it in."""
    kept_from: dict[str, str] = field(default_factory=dict)
    """Per parameter of ``kept``: the checkpoint it was kept in, "phase P step S"."""


@dataclass
class Assembled:
    """What ``launch.switch.assemble`` put together: the DeepSpeed engine on the predecessor's result."""

    engine: Any
    head: list[tuple[str, nn.Parameter]]
    body: list[tuple[str, nn.Parameter]]
    """The engine's parameters of the head and of this phase's layers, by name."""
    roles: list[int]
    """The role (``engine.HEAD_DECAY``...) of each of the optimizer's param groups."""
    starts: list[int]
    """The Adam step each param group starts the phase from where it is the body's
    (``engine.param_groups``; the head's come from the state carried on)."""
    group_of: dict[str, int]
    """The param group of each of the body's parameters, by name."""
    gas: int
    """Gradient accumulation steps."""
    source: Source


def device_of() -> torch.device:
    """Where this rank trains: its local GPU, or the CPU."""
    if get_accelerator().device_name() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class Phase:
    """One phase process: who it is, its timings, and the stages' results as they come (``made``
    by prepare, ``built`` by assemble), in the order prepare -> await_go -> assemble -> restore
    -> train -> save. ``files``: rank 0's files of its next checkpoint, being made or made
    (``launch.save`` makes and uses them)."""

    def __init__(self, spec: PhaseSpec, rank: int, world: int, prebuilt: dict[str, nn.Module] | None = None):
        self.spec, self.rank, self.world = spec, rank, world
        self.run_dir = Path(spec.run_dir)
        self.checkpoints = Checkpoints(self.run_dir)
        self.device = device_of()
        self.backend: Backend = backend_for(spec)
        """The optimizer mode's: the engine's config, optimizer and state (``launch.engine``)."""
        self.timeline = Timeline(rank=rank, world_size=world, t_process_start=psutil.Process().create_time())
        """Every timing and measurement of this process: its records.json."""
        self.prebuilt = prebuilt if prebuilt is not None else {}
        """Base models built before this process was forked (``launch.zygote``), by ``basemodel.model_key``."""
        self.made: Prepared | None = None
        self.built: Assembled | None = None
        self.files: Later[StateFiles | None] = Later.now(None)
        self.step = spec.start_step
        """The global step: steps done so far."""
        self.tb = self.wandb = None
        """TensorBoard's writer and the Weights & Biases run, once the first metric is logged to them."""
        self.grad_norms: dict[int | str, float] | None = None
        """Each trained layer's gradient norm at the phase's last step (``launch.importance``)."""
        self.blob: Later | None = None
        """The host path's file for its offer, made ahead (``launch.hostpath.prepare``): its mapping."""
        self.leaving: int | None = None
        """Under a budget, the predecessor whose exit the first step waits for (``handover.await_leaving``)."""
        self.listing = None
        """Under a budget on a GPU, NVML's list of the device's processes (``devmem.Listing``), opened
        while it waits for its go."""
        self.cores = None
        """Where the switch was too short to measure the free cores: the measure (``launch.threads``),
        taken again at the first step's end."""

    @property
    def waits_in_a_share(self) -> bool:
        """Whether it waits for its go on a GPU beside a training phase, in its share of the device
        budget (``PhaseSpec.waiting_cap``), to have the whole budget at its go."""
        return self.spec.prewarm and self.spec.waiting_cap > 0 and self.device.type == "cuda"

    def stage(self, name: str) -> None:
        """What this phase is doing before its first step, for the progress display (rank 0)."""
        if self.rank == 0:
            PhaseDir(self.spec.phase_dir).append_stage(name)

    def write_records(self) -> None:
        if self.rank == 0:
            PhaseDir(self.spec.phase_dir).write_records(self.timeline.as_records())

    def discard(self) -> None:
        files, self.files = self.files, Later.now(None)
        if (made := files.result()) is not None:
            made.discard()
