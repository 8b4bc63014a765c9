"""The DeepSpeed config relayer derives from the schedule, spelled once for both sides: the plan
holds a schedule's ``deepspeed.config`` to the derived keys (``orchestrator.dsconfig``), and a
phase builds its engine from the whole config (``launch.engine``, whose backends add what their
optimizer mode needs). tests/launch/test_dsconfig.py holds the two to each other."""

from __future__ import annotations

from typing import Any

from launch.contract.spec import PhaseSpec


def accumulation_steps(batch_size: int, micro_batch_size: int, world: int) -> int:
    """The micro-batches each rank runs per optimizer step (the plan checks that they divide:
    ``orchestrator.plan.check_batch``)."""
    return batch_size // (micro_batch_size * world)


def derived(*, batch_size: int, micro_batch_size: int, world: int, grad_clip: float, zero_stage: int,
            dtype: str) -> dict[str, Any]:
    """The keys relayer derives from the schedule, nested as DeepSpeed reads them
    (``orchestrator.dsconfig.DERIVED`` names the schedule's key behind each)."""
    return {
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps(batch_size, micro_batch_size, world),
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
    }


def bucket_size(trainable_numel: int) -> int:
    """DeepSpeed's default 5e8-element buckets allocate GBs per gradient hook on a small model:
    sized to the trainable part instead."""
    return int(min(5e8, max(5e5, trainable_numel)))


def deepspeed_config(spec: PhaseSpec, world: int, trainable_numel: int, zero: dict[str, Any] | None = None) -> dict:
    """The config a phase's engine starts from: the derived keys, the buckets (and ``zero``, the
    optimizer mode's own ZeRO keys), DeepSpeed's own reports off, then the schedule's
    ``deepspeed.config`` merged in, key by key."""
    d, bucket = spec.data, bucket_size(trainable_numel)
    cfg = derived(batch_size=d.batch_size, micro_batch_size=d.micro_batch_size, world=world,
                  grad_clip=spec.optimizer.grad_clip, zero_stage=spec.zero_stage, dtype=spec.model.dtype)
    own = {"zero_optimization": {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket, **(zero or {})},
           "fp16": {"initial_scale_power": 16}, "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    return merged(merged(cfg, own), spec.deepspeed_config)


def merged(base: dict, over: dict) -> dict:
    """``base`` with ``over`` merged in, table by table."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def by_dotted_key(cfg: dict, prefix: str = "") -> dict[str, Any]:
    """``cfg``'s values by dotted key ("zero_optimization.stage")."""
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        out.update(by_dotted_key(v, f"{key}.") if isinstance(v, dict) else {key: v})
    return out
