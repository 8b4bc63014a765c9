"""The phase's engine: DeepSpeed's, with the optimizer of the phase's mode, chosen once from its spec
(``backend_for``) and asked for what differs without being asked what it is. ``ZeroBackend`` for
``deepspeed.zero_stage`` 1-3: torch's AdamW, which ZeRO wraps with its fp32 partitions.
``MasterBackend`` for 0: relayer's ``MasterAdamW`` (``launch.master_adamw``), DeepSpeed wrapping
nothing around it. A backend owns the mode's DeepSpeed config, its optimizer, where the weights go
before the engine is built, and the optimizer state: read and written per parameter (full fp32
masters and moments, ``get_state`` / ``set_state``), and per param group (the steps).

Facts the ZeRO backend relies on (DeepSpeed 0.19.8, verified on CPU/gloo for ZeRO 1, 2 and 3 at
world sizes 1 and 2; ``tests/launch/test_equivalence.py`` holds the results to an independent
PyTorch reference): the getters and setters are collectives; ``step`` lives only in the wrapped
optimizer's state of each flat fp32 tensor; state is created lazily at the first step, so a fresh
engine's state is materialised here first. A ``MasterAdamW``'s parameters carry views of its state
(``slot_of``): no collective, no copy.
"""

from __future__ import annotations

import contextlib

import deepspeed
import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.utils import (
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from torch import nn

from launch import adamw_kernel
from launch.contract.dsconfig import accumulation_steps, bucket_size, deepspeed_config
from launch.contract.spec import PhaseSpec
from launch.master_adamw import MasterAdamW, detach_engine_reduction, kernel_grad_dtype, slot_of
from launch.staging import Staging
from shard_tools.later import Later
from shard_tools.model import DTYPES

MOMENTS = ("exp_avg", "exp_avg_sq")
KEYS = ("master", *MOMENTS)
Named = list[tuple[str, nn.Parameter]]
State = dict[str, dict[str, torch.Tensor]]


def backend_for(spec: PhaseSpec) -> Backend:
    """The phase's optimizer mode, chosen once."""
    return MasterBackend() if spec.zero_stage == 0 else ZeroBackend(spec.zero_stage)


class Backend:
    """What both modes share: building the engine, and the per-parameter state's traffic. The
    subclasses own what differs."""

    stage: int
    """``deepspeed.zero_stage``, as a checkpoint's origin records it."""
    partitions_weights = False
    """The engine partitions the weights over the ranks: the host model is not put on the device
    whole beforehand, nor its host copy pinned for it."""
    refusal: str | None = None
    """Why a phase of this mode does not take its predecessor's state over (``launch.handover``)."""

    # -- building ---------------------------------------------------------------------------------
    def config(self, spec: PhaseSpec, world: int, trainable_numel: int) -> dict:
        raise NotImplementedError

    def optimizer(self, groups: list[dict], spec: PhaseSpec, device: torch.device, world: int,
                  lr: float | None = None, body_from: int | None = None) -> torch.optim.Optimizer:
        """The optimizer of ``groups``; ``body_from``: the index of the first of the body's groups."""
        raise NotImplementedError

    def place(self, model: nn.Module, device: torch.device, staging: Staging | None, trainable: frozenset[str]) -> None:
        """The host model on the device before ``deepspeed.initialize``, as it would put it, pinned."""
        if staging is not None and not self.partitions_weights:
            staging.module_to_device(model, trainable)

    def initialize(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: dict):
        """DeepSpeed's engine on ``model``, stepped by ``optimizer``."""
        with _no_broadcast_to_itself():
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine

    def host_buffers(self, spec: PhaseSpec, world: int, numels: list[int]) -> int:
        """Bytes of host memory the engine's build pins (``launch.pinned``); 0: none."""
        return 0

    def masters_on_host(self, spec: PhaseSpec) -> bool:
        """Whether the fp32 masters live in host memory (the optimizer offloaded)."""
        return False

    def compile_ahead(self, spec: PhaseSpec, device: torch.device, world: int) -> None:
        """Starts compiling what the first step would (a phase started cold), in a thread."""

    # -- per param group ----------------------------------------------------------------------------
    def param_groups(self, engine) -> list[dict]:
        """The param groups that carry the lr."""
        raise NotImplementedError

    def full_grads(self, engine, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
        """The whole gradients of ``params`` of the step about to be taken (between its last backward
        and the optimizer's step), on every rank: DeepSpeed's ``safe_get_full_grad``, which gathers a
        ZeRO partition's (a collective at stages 1-3)."""
        return [safe_get_full_grad(p) for p in params]

    def materialise(self, engine, steps_by_group: list[int]) -> None:
        """Zero moments and the given step in every param group, as a first step would make them."""
        raise NotImplementedError

    def group_steps(self, engine) -> dict[int, int]:
        """Optimizer steps taken so far, per param group (0 where the group has not stepped)."""
        raise NotImplementedError

    def relink(self, engine) -> None:
        """Before the state is read: per-parameter fragments linked to the optimizer state."""

    def let_go(self, engine) -> None:
        """After the phase's last step: the gradients go (no step needs them any more)."""
        engine.optimizer.zero_grad(set_to_none=True)

    def refresh_lp(self, engine) -> None:
        """Copies the fp32 masters into the low-precision weights the forward pass uses."""
        raise NotImplementedError

    def loss_scaler(self, engine):
        """The engine's loss scaler, None where it has none."""
        return None

    # -- per parameter --------------------------------------------------------------------------------
    def shape(self, p: nn.Parameter) -> torch.Size:
        return p.shape

    def _full(self, p: nn.Parameter, key: str) -> torch.Tensor:
        """The full fp32 master ("master") or moment of ``p``."""
        raise NotImplementedError

    def _set(self, p: nn.Parameter, key: str, t: torch.Tensor) -> None:
        raise NotImplementedError

    def full_shapes(self, named: Named) -> dict[str, tuple[int, ...]]:
        return {n: tuple(self.shape(p)) for n, p in named}

    def get_state(self, named: Named, into: State | None = None, keep: bool = True, staging: Staging | None = None,
                  on_device: bool = False) -> State:
        """Full fp32 master weights and moments on the host, {key: {name: tensor}}. Collective: all
        ranks, same order. ``into``: host tensors, {key: {name: tensor}}, to copy into; ``keep=False``:
        gather only, for ranks that write nothing (the result is empty); ``on_device``: left where the
        gather put them (on every rank: a phase's offer to its successor, ``launch.handover``)."""
        into = into or {}
        out: State = {"master": self.get_masters(named, into.get("master"), keep, staging, on_device),
                      "exp_avg": {}, "exp_avg_sq": {}}
        for name, p in named:
            for key in MOMENTS:
                full = self._read(p, key, on_device)
                if keep:
                    out[key][name] = self._kept(full, p, into.get(key, {}).get(name), staging, on_device)
        return out if keep else {}

    def get_masters(self, named: Named, into: dict[str, torch.Tensor] | None = None, keep: bool = True,
                    staging: Staging | None = None, on_device: bool = False) -> dict[str, torch.Tensor]:
        into = into or {}
        out = {}
        for n, p in named:
            full = self._read(p, "master", on_device)
            if keep:
                out[n] = self._kept(full, p, into.get(n), staging, on_device)
        return out

    def _read(self, p: nn.Parameter, key: str, on_device: bool) -> torch.Tensor:
        """``_full``; wanted on the host, where it lies whole there (``_live``), that tensor itself
        (what reads it copies it out or writes it before the next step, ``launch.save``)."""
        live = None if on_device else self._live(p, key)
        return self._full(p, key) if live is None else live

    def _live(self, p: nn.Parameter, key: str) -> torch.Tensor | None:
        """``p``'s own fp32 master or moment where it lies whole in host memory, no rank else holding
        part of it (no collective); None elsewhere."""
        return None

    def _kept(self, full: torch.Tensor, p: nn.Parameter, out: torch.Tensor | None, staging: Staging | None,
              on_device: bool) -> torch.Tensor:
        shape = self.shape(p)
        return full.detach().float().view(shape) if on_device else to_host(full, shape, out, staging)

    def set_state(self, named: Named, state: State, with_moments: bool, staging: Staging | None = None) -> None:
        """Writes master weights (and moments) into the partitions. Collective: all ranks, same order."""
        keys = KEYS if with_moments else ("master",)
        for name, p in named:
            for key in keys:
                t = state[key][name]
                if (live := self._live(p, key)) is not None and t.device.type == "cpu":
                    live.copy_(t.reshape(-1))  # host to host, not by way of the device: half the restore's time
                    continue
                if t.device != p.device:  # else taken over on the device (``launch.handover``)
                    t = staging.to_device(t) if staging is not None and p.device.type == "cuda" else t.to(p.device)
                self._set(p, key, t)


class ZeroBackend(Backend):
    """ZeRO stage 1, 2 or 3 around torch's AdamW."""

    def __init__(self, stage: int):
        self.stage = stage
        self.partitions_weights = stage == 3
        self.refusal = "ZeRO-3" if stage == 3 else None

    def config(self, spec: PhaseSpec, world: int, trainable_numel: int) -> dict:
        zero = {"stage3_prefetch_bucket_size": bucket_size(trainable_numel), "stage3_param_persistence_threshold": 0,
                "memory_efficient_linear": False} if self.stage == 3 else {}
        cfg = deepspeed_config(spec, world, trainable_numel, zero)
        if offloads(cfg):  # torch's AdamW steps the fp32 partitions on the host (orchestrator.libfacts)
            cfg.setdefault("zero_force_ds_cpu_optimizer", False)
            cfg["zero_optimization"] = {**cfg["zero_optimization"], "offload_optimizer": with_pinned(cfg)}
        return cfg

    def host_buffers(self, spec: PhaseSpec, world: int, numels: list[int]) -> int:
        """Bytes of host memory DeepSpeed pins as it builds this engine (``launch.pinned``), for
        trainable parameters of ``numels`` elements: with the optimizer on the host and its buffers
        pinned, per rank the fp32 masters' and gradients' partitions and a 16-bit copy of the masters,
        the largest parameter's 16-bit gradient, with accumulation a 16-bit buffer per parameter, and
        a page of alignment per buffer; 0 otherwise."""
        cfg = self.config(spec, world, sum(numels))
        if self.stage not in (1, 2) or not offloads(cfg) or not cfg["zero_optimization"]["offload_optimizer"]["pin_memory"]:
            return 0
        width = 4 if spec.model.dtype == "float32" else 2
        partition = -(-sum(numels) // world)
        accumulate = sum(numels) * width if cfg["gradient_accumulation_steps"] > 1 else 0
        return partition * (4 + width + 4) + max(numels, default=0) * width + accumulate + (len(numels) + 64) * 4096

    def masters_on_host(self, spec: PhaseSpec) -> bool:
        return offloads(spec.deepspeed_config)

    def optimizer(self, groups: list[dict], spec: PhaseSpec, device: torch.device, world: int,
                  lr: float | None = None, body_from: int | None = None) -> torch.optim.Optimizer:
        # Offloaded, it steps the partitions on the host: fused there too (``adamw``).
        host = offloads(spec.deepspeed_config)
        return adamw(groups, spec.optimizer, torch.device("cpu") if host else device, lr, fused=True if host else None)

    def param_groups(self, engine) -> list[dict]:
        return engine.optimizer.optimizer.param_groups

    def _flat_partitions(self, engine) -> list[tuple[torch.Tensor, int]]:
        """(flat fp32 partition, param group index) for every partition this rank's optimizer steps."""
        opt = engine.optimizer
        if self.stage == 3:  # groups split into sub-groups
            return [(t, opt.sub_group_to_group_id[i]) for i, t in enumerate(opt.fp32_partitioned_groups_flat)]
        # DeepSpeed picks its BF16_Optimizer for ZeRO-1 with bf16 weights and fp32 gradient accumulation.
        flats = opt.fp32_groups_flat_partition if isinstance(opt, BF16_Optimizer) else opt.single_partition_of_fp32_groups
        return [(t, i) for i, t in enumerate(flats)]

    def materialise(self, engine, steps_by_group: list[int]) -> None:
        base = engine.optimizer.optimizer
        for flat, group in self._flat_partitions(engine):
            # A fused AdamW (on CUDA: ``adamw``) keeps its step beside the moments, others on the host.
            where = flat.device if base.param_groups[group].get("fused") else "cpu"
            base.state[flat] = {
                "step": torch.tensor(float(steps_by_group[group]), dtype=torch.float32, device=where),
                "exp_avg": torch.zeros_like(flat),
                "exp_avg_sq": torch.zeros_like(flat),
            }
        self.relink(engine)

    def group_steps(self, engine) -> dict[int, int]:
        base, out = engine.optimizer.optimizer, {}
        for flat, group in self._flat_partitions(engine):
            step = base.state.get(flat, {}).get("step", 0)
            out[group] = int(step.item() if torch.is_tensor(step) else step)
        return out

    def relink(self, engine) -> None:
        """Upstream links only the first group; ZeRO-3's fragments need no link."""
        if self.stage < 3:
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()

    def refresh_lp(self, engine) -> None:
        opt = engine.optimizer
        if self.stage == 3:
            for i in range(len(opt.fp32_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(i)
        else:
            opt.update_lp_params()

    def loss_scaler(self, engine):
        return getattr(engine.optimizer, "loss_scaler", None)

    def shape(self, p: nn.Parameter) -> torch.Size:
        return getattr(p, "ds_shape", p.shape)  # ZeRO-3 keeps the full shape aside once it partitions

    def _full(self, p: nn.Parameter, key: str) -> torch.Tensor:
        return safe_get_full_fp32_param(p) if key == "master" else safe_get_full_optimizer_state(p, key)

    def _live(self, p: nn.Parameter, key: str) -> torch.Tensor | None:
        """Stages 1-2, the optimizer offloaded, one rank: the host partition's fragment that is all of
        ``p``. DeepSpeed's getter copies it to the device and reduces it, ``to_host`` back: 3.8 s of
        the host path's offer at 7B on an H100 (benchmarks/results/2026-12-07-issue42-h100)."""
        mapping = getattr(p, "_hp_mapping", None)
        if self.stage == 3 or mapping is None or mapping.lp_fragment_address.numel != p.numel():
            return None
        fragment = mapping.get_hp_fragment(None if key == "master" else key)
        if fragment.device.type != "cpu" or torch.distributed.get_world_size(getattr(p, "_dp_group", None)) != 1:
            return None
        return fragment.detach()

    def _set(self, p: nn.Parameter, key: str, t: torch.Tensor) -> None:
        if key == "master":
            safe_set_full_fp32_param(p, t)
        else:
            safe_set_full_optimizer_state(p, t, key)


class MasterBackend(Backend):
    """No ZeRO: relayer's ``MasterAdamW`` keeps the fp32 masters and clips."""

    stage = 0

    def config(self, spec: PhaseSpec, world: int, trainable_numel: int) -> dict:
        return without_zero(deepspeed_config(spec, world, trainable_numel))

    def optimizer(self, groups: list[dict], spec: PhaseSpec, device: torch.device, world: int,
                  lr: float | None = None, body_from: int | None = None) -> torch.optim.Optimizer:
        o = spec.optimizer
        return MasterAdamW(groups, lr=o.lr if lr is None else lr, betas=o.betas, eps=o.eps,
                           weight_decay=o.weight_decay, grad_clip=o.grad_clip, device=device, world=world,
                           accumulate=_accumulates(spec, world), apart_from=body_from)

    def place(self, model: nn.Module, device: torch.device, staging: Staging | None, trainable: frozenset[str]) -> None:
        if staging is not None:
            staging.module_to_device(model, trainable)
        else:
            model.to(device)  # a MasterAdamW puts the trainable weights in its flat block where they are

    def initialize(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: dict):
        """The engine leaves the gradients' reduction to the ``MasterAdamW``."""
        engine = super().initialize(model, optimizer, config)
        detach_engine_reduction(engine)
        return engine

    def host_buffers(self, spec: PhaseSpec, world: int, numels: list[int]) -> int:
        """Bytes of host memory the engine's build pins (``launch.pinned``); 0: none."""
        return 0

    def compile_ahead(self, spec: PhaseSpec, device: torch.device, world: int) -> None:
        """The kernel of ``launch.adamw_kernel``, compiled in a thread, not at the first step."""
        if device.type == "cuda":
            dtype = DTYPES[spec.model.dtype]
            Later(adamw_kernel.compile_ahead, device, dtype, kernel_grad_dtype(dtype, _accumulates(spec, world), world))

    def param_groups(self, engine) -> list[dict]:
        return engine.optimizer.param_groups

    def let_go(self, engine) -> None:
        """The gradients, and the body's moments (``MasterAdamW.release_apart``)."""
        engine.optimizer.release_grads()
        engine.optimizer.release_apart()

    def full_grads(self, engine, params: list[nn.Parameter]) -> list[torch.Tensor | None]:
        return engine.optimizer.full_grads(params)

    def materialise(self, engine, steps_by_group: list[int]) -> None:
        engine.optimizer.set_steps(steps_by_group)

    def group_steps(self, engine) -> dict[int, int]:
        return engine.optimizer.group_steps()

    def refresh_lp(self, engine) -> None:
        engine.optimizer.refresh_lp()

    def _full(self, p: nn.Parameter, key: str) -> torch.Tensor:
        return getattr(slot_of(p), key)

    def _set(self, p: nn.Parameter, key: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            getattr(slot_of(p), key).copy_(t.view(p.shape))


def _accumulates(spec: PhaseSpec, world: int) -> bool:
    """Whether a step sums the gradients of several micro-batches or ranks (in fp32, ``MasterAdamW``)."""
    d = spec.data
    return accumulation_steps(d.batch_size, d.micro_batch_size, world) > 1 or world > 1


def offloads(cfg: dict) -> bool:
    """Whether ``cfg`` offloads ZeRO's optimizer state to the host (``offload_optimizer``)."""
    zero = cfg.get("zero_optimization")
    return isinstance(zero, dict) and isinstance(zero.get("offload_optimizer"), dict) \
        and zero["offload_optimizer"].get("device") == "cpu"


def with_pinned(cfg: dict) -> dict:
    """``cfg``'s offload_optimizer with DeepSpeed's host buffers pinned unless the schedule says
    otherwise (``pin_memory``, off by DeepSpeed's default): every micro-batch's gradients go to the
    host and, accumulated, back (1.34 GB each way at 7B), and a pageable copy is staged by the driver."""
    return {"pin_memory": True, **cfg["zero_optimization"]["offload_optimizer"]}


def without_zero(cfg: dict) -> dict:
    """``cfg`` for relayer's ``MasterAdamW``, which keeps the fp32 masters and clips: DeepSpeed wraps
    nothing around it (no ZeRO, no bf16 or fp16 optimizer, no clipping of its own)."""
    return {**cfg, "gradient_clipping": 0.0, "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "zero_optimization": {"stage": 0}}


def adamw(groups: list[dict], o, device: torch.device, lr: float | None = None,
          fused: bool | None = None) -> torch.optim.AdamW:
    """The client optimizer ZeRO steps: torch's AdamW, fused on CUDA (one kernel over each flat
    fp32 partition: 4 ms of a 7B LISA step where the default multi-tensor one took 15,
    benchmarks/results/2026-12-03-step-cost-h200) and where ``fused`` asks for it on the host (the
    offloaded partitions: one pass over each, where the default makes one per op and allocates
    temporaries of the partition's size), the default elsewhere."""
    fused = True if device.type == "cuda" else fused
    return torch.optim.AdamW(groups, lr=o.lr if lr is None else lr, betas=o.betas, eps=o.eps,
                             weight_decay=o.weight_decay, fused=fused)


def to_host(t: torch.Tensor, shape: torch.Size, out: torch.Tensor | None, staging: Staging | None) -> torch.Tensor:
    """The fp32 full tensor on the host: copied into ``out`` where given (a prepared checkpoint
    file's view, so the copy from the device is the write), else a host tensor of its own."""
    t = t.detach().float().view(shape)
    if out is not None:
        if staging is not None and t.device.type == "cuda":
            staging.to_host(t, out)
        else:
            out.copy_(t)
        return out
    return t if t.device.type == "cpu" else t.cpu()  # on the CPU the accessors return a fresh tensor


@contextlib.contextmanager
def _no_broadcast_to_itself():
    """In a process group of one, the engine's build broadcasts every parameter to itself (291 calls
    at 7B, 10 ms of a switch on an H100): skipped, changing nothing, where the engine names it so."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    if torch.distributed.get_world_size() != 1 or not hasattr(DeepSpeedEngine, "_broadcast_model"):
        yield
        return
    original = DeepSpeedEngine._broadcast_model
    DeepSpeedEngine._broadcast_model = lambda self: None
    try:
        yield
    finally:
        DeepSpeedEngine._broadcast_model = original
