"""Reading and writing per-parameter optimizer state of a DeepSpeed ZeRO optimizer, or of
relayer's own where DeepSpeed runs no ZeRO (``launch.master_adamw``, whose parameters carry views of
its state: no collective, no copy).

Facts this relies on (DeepSpeed 0.19.8, verified on CPU/gloo for ZeRO 1, 2 and 3 at world sizes 1
and 2; ``tests/launch/test_equivalence.py`` holds the results to an independent PyTorch
reference): the getters and setters are collectives; ``step`` lives only in the wrapped
optimizer's state of each flat fp32 tensor; state is created lazily at the first step, so a fresh
engine's state is materialised here first.
"""

from __future__ import annotations

import torch
from deepspeed.utils import (
    safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from torch import nn

from launch.master_adamw import MasterAdamW, slot_of
from launch.staging import Staging

MOMENTS = ("exp_avg", "exp_avg_sq")
# The roles of a phase's param groups (``launch.prepare.param_groups``): Adam's step is per group.
HEAD_DECAY, HEAD_NO_DECAY, BODY_DECAY, BODY_NO_DECAY = range(4)


def base_optimizer(engine) -> torch.optim.Optimizer:
    """The optimizer whose param groups carry the lr (DeepSpeed's ZeRO wraps relayer's AdamW)."""
    opt = engine.optimizer
    return opt if isinstance(opt, MasterAdamW) else opt.optimizer


def flat_partitions(engine) -> list[tuple[torch.Tensor, int]]:
    """(flat fp32 partition, param group index) for every partition this rank's optimizer steps."""
    opt = engine.optimizer
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3: groups split into sub-groups
        return [(t, opt.sub_group_to_group_id[i]) for i, t in enumerate(opt.fp32_partitioned_groups_flat)]
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        return [(t, i) for i, t in enumerate(opt.single_partition_of_fp32_groups)]
    if hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer
        return [(t, i) for i, t in enumerate(opt.fp32_groups_flat_partition)]
    raise TypeError(f"unsupported DeepSpeed optimizer {type(opt).__name__}")


def _base(engine) -> torch.optim.Optimizer:
    return engine.optimizer.optimizer


def materialise(engine, steps_by_group: list[int]) -> None:
    """Creates zero moments and the given step in every flat partition, as a first step would."""
    if isinstance(engine.optimizer, MasterAdamW):
        engine.optimizer.set_steps(steps_by_group)
        return
    base = _base(engine)
    for flat, group in flat_partitions(engine):
        # A fused AdamW (on CUDA: launch.prepare.adamw) keeps its step beside the moments, others on the host.
        where = flat.device if base.param_groups[group].get("fused") else "cpu"
        base.state[flat] = {
            "step": torch.tensor(float(steps_by_group[group]), dtype=torch.float32, device=where),
            "exp_avg": torch.zeros_like(flat),
            "exp_avg_sq": torch.zeros_like(flat),
        }
    relink(engine)


def relink(engine) -> None:
    """Links per-parameter fragments to the optimizer state (upstream links only the first group)."""
    opt = engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):  # (a MasterAdamW's are linked from the start)
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def group_steps(engine) -> dict[int, int]:
    """Optimizer steps taken so far, per param group (0 where the group has not stepped)."""
    if isinstance(engine.optimizer, MasterAdamW):
        return engine.optimizer.group_steps()
    base, out = _base(engine), {}
    for flat, group in flat_partitions(engine):
        step = base.state.get(flat, {}).get("step", 0)
        out[group] = int(step.item() if torch.is_tensor(step) else step)
    return out


KEYS = ("master", *MOMENTS)


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


def _shape(p: nn.Parameter) -> torch.Size:
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape  # ZeRO-3 keeps the full shape aside


def full_shapes(named: list[tuple[str, nn.Parameter]]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(_shape(p)) for n, p in named}


def get_state(named: list[tuple[str, nn.Parameter]], into: dict[str, dict[str, torch.Tensor]] | None = None,
              keep: bool = True, staging: Staging | None = None,
              on_device: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Full fp32 master weights and moments on the host, {key: {name: tensor}}. Collective: all
    ranks, same order. ``into``: host tensors, {key: {name: tensor}}, to copy into; ``keep=False``:
    gather only, for ranks that write nothing (the result is empty); ``on_device``: left where the
    gather put them (on every rank: a phase's offer to its successor, ``launch.handover``)."""
    into = into or {}
    out: dict[str, dict[str, torch.Tensor]] = {
        "master": get_masters(named, into.get("master"), keep, staging, on_device), "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in named:
        for key in MOMENTS:
            full = _full_state(p, key)
            if keep:
                out[key][name] = _kept(full, p, into.get(key, {}).get(name), staging, on_device)
    return out if keep else {}


def get_masters(named: list[tuple[str, nn.Parameter]], into: dict[str, torch.Tensor] | None = None,
                keep: bool = True, staging: Staging | None = None, on_device: bool = False) -> dict[str, torch.Tensor]:
    into = into or {}
    out = {}
    for n, p in named:
        full = _full_state(p, "master")
        if keep:
            out[n] = _kept(full, p, into.get(n), staging, on_device)
    return out


def _full_state(p: nn.Parameter, key: str) -> torch.Tensor:
    """The full fp32 master ("master") or moment of ``p``: a view of a MasterAdamW's own, else
    gathered by DeepSpeed (a collective)."""
    if (slot := slot_of(p)) is not None:
        return getattr(slot, key)
    return safe_get_full_fp32_param(p) if key == "master" else safe_get_full_optimizer_state(p, key)


def _kept(full: torch.Tensor, p: nn.Parameter, out: torch.Tensor | None, staging: Staging | None,
          on_device: bool) -> torch.Tensor:
    return full.detach().float().view(_shape(p)) if on_device else to_host(full, _shape(p), out, staging)


def set_state(named: list[tuple[str, nn.Parameter]], state: dict[str, dict[str, torch.Tensor]], with_moments: bool,
              staging: Staging | None = None) -> None:
    """Writes master weights (and moments) into the partitions. Collective: all ranks, same order."""
    for name, p in named:
        def put(t: torch.Tensor) -> torch.Tensor:
            if t.device == p.device:  # taken over on the device (``launch.handover``)
                return t
            return staging.to_device(t) if staging is not None and p.device.type == "cuda" else t.to(p.device)

        keys = ("master", *MOMENTS) if with_moments else ("master",)
        if (slot := slot_of(p)) is not None:
            with torch.no_grad():
                for key in keys:
                    getattr(slot, key).copy_(put(state[key][name]).view(p.shape))
            continue
        safe_set_full_fp32_param(p, put(state["master"][name]))
        for key in keys[1:]:
            safe_set_full_optimizer_state(p, put(state[key][name]), key)


def refresh_lp(engine) -> None:
    """Copies the fp32 masters into the low-precision weights the forward pass uses."""
    opt = engine.optimizer
    if isinstance(opt, MasterAdamW):
        opt.refresh_lp()
    elif hasattr(opt, "fp32_partitioned_groups_flat"):
        for i in range(len(opt.fp32_partitioned_groups_flat)):
            opt._reassign_or_swap_out_partitioned_parameters(i)
    elif hasattr(opt, "update_lp_params"):
        opt.update_lp_params()
