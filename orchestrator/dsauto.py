"""A Trainer-style DeepSpeed JSON's ``optimizer`` and ``scheduler`` blocks (axolotl's
``zero2.json``, LLaMA-Factory's ``ds_z2_config.json``), taken as the Hugging Face integration
takes them: every ``"auto"`` is what the trainer sets, here the schedule's key. relayer builds its
own AdamW and lr schedule from ``[optimizer]`` and ``[lr_schedule]``, so a block is accepted (and
dropped from the config relayer generates) where each of its values is ``"auto"`` or what the
schedule sets; any other value is refused, key by key, saying which schedule key sets it.

As ``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_process``
fills them: the optimizer's ``lr``, ``betas``, ``eps``, ``weight_decay``; the scheduler's
``warmup_max_lr`` (the lr), ``warmup_min_lr`` (0), ``warmup_num_steps`` and ``total_num_steps``.
"""

from __future__ import annotations

from typing import Any

from orchestrator.errors import ScheduleError
from orchestrator.schedule import Phase, Schedule, _show

AUTO = "auto"
OPTIMIZERS = ("adamw", "adam")
"""``optimizer.type`` values that are relayer's AdamW (DeepSpeed's "Adam" is AdamW unless
``adam_w_mode`` is false)."""
SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
"""DeepSpeed's schedulers by the ``lr_schedule.kind`` that is the same curve after the warm-up."""


def accept_trainer_blocks(table: dict[str, Any], sched: Schedule, phases: list[Phase], where: str) -> dict[str, Any]:
    """``table`` without its ``optimizer`` and ``scheduler`` blocks where each agrees with the
    schedule; ScheduleError naming the first key that does not, and the schedule key that sets it."""
    o, s = sched.optimizer, sched.lr_schedule
    if isinstance(table.get("optimizer"), dict):
        block = table["optimizer"]
        kind = block.get("type", AUTO)
        if kind != AUTO and str(kind).lower() not in OPTIMIZERS:
            raise ScheduleError(f"{where}optimizer.type: {_show(kind)}: relayer trains with its own AdamW "
                                "([optimizer]); leave the block out or say \"AdamW\"")
        _agree(block.get("params", {}), "optimizer.params", where, {
            "lr": (o.lr, "optimizer.lr"), "betas": (list(o.betas), "optimizer.betas"), "eps": (o.eps, "optimizer.eps"),
            "weight_decay": (o.weight_decay, "optimizer.weight_decay"), "adam_w_mode": (True, "relayer's AdamW"),
            "torch_adam": (None, None)})
        table = {k: v for k, v in table.items() if k != "optimizer"}
    if isinstance(table.get("scheduler"), dict):
        block = table["scheduler"]
        kind = block.get("type", AUTO)
        if kind != AUTO and SCHEDULERS.get(kind) != s.kind:
            same = f"lr_schedule.kind = \"{SCHEDULERS[kind]}\"" if kind in SCHEDULERS else "none of relayer's"
            raise ScheduleError(f"{where}scheduler.type: {_show(kind)} is {same}; the schedule has "
                                f"lr_schedule.kind = \"{s.kind}\": set it there")
        _agree(block.get("params", {}), "scheduler.params", where, {
            "warmup_max_lr": (o.lr, "optimizer.lr"), "warmup_min_lr": (0, "lr_schedule.warmup_from (from 0)"),
            "warmup_num_steps": (s.warmup_steps, "lr_schedule.warmup_steps"),
            "total_num_steps": (phases[-1].end_step, "the schedule's steps"), "warmup_type": ("linear", "relayer's warm-up")})
        table = {k: v for k, v in table.items() if k != "scheduler"}
    return table


def _agree(params: Any, prefix: str, where: str, relayer: dict[str, tuple[Any, str | None]]) -> None:
    if not isinstance(params, dict):
        raise ScheduleError(f"{where}{prefix}: expected a table, got {_show(params)}")
    for key, value in params.items():
        if key not in relayer:
            raise ScheduleError(f"{where}{prefix}.{key}: relayer's own optimizer and lr schedule have no such "
                                "setting; leave it out")
        ours, by = relayer[key]
        if value != AUTO and by is not None and value != ours:
            raise ScheduleError(f"{where}{prefix}.{key}: {_show(value)}, but relayer sets {_show(ours)} from {by}; "
                                "set it there, or say \"auto\"")
