"""``deepspeed.config``: what the schedule merges into the DeepSpeed config relayer generates, a
table of the schedule or a DeepSpeed JSON file (relative to the schedule), as LMFlow, axolotl and
LLaMA-Factory users keep theirs.

relayer derives some keys from the schedule (``DERIVED``); where deepspeed.config sets one too,
the two would disagree. Such a key may stay where it says ``"auto"`` (the Hugging Face Trainer's
word for "the trainer fills it in", which those files are full of) or what relayer derives;
anything else is refused, naming the key and where to set it. Every other ``"auto"`` (bucket
sizes, say) is dropped too: relayer's own value, or DeepSpeed's default, stands. A ``null``, which
a table cannot hold (and which DeepSpeed reads as a value, not as a key left out), is refused.

The run's copy of its schedule holds a file's table inlined (``recorded_raw``), so a resume
compares what is merged, as for a table: an edited file is a changed schedule, a moved one is not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launch.contract.dsconfig import by_dotted_key, derived
from orchestrator.dsauto import accept_trainer_blocks
from orchestrator.errors import ScheduleError
from orchestrator.libfacts import deepspeed_refusal
from orchestrator.modelcheck import need_file, resolve_path
from orchestrator.schedule import LoadedSchedule, Phase, Schedule, _show
from orchestrator.sections import MAX_NESTING, too_deep
from shard_tools.files import describe, read_regular

DERIVED = {
    "train_batch_size": "data.batch_size",
    "train_micro_batch_size_per_gpu": "data.micro_batch_size",
    "gradient_accumulation_steps": "data.batch_size / (data.micro_batch_size x processes)",
    "gradient_clipping": "optimizer.grad_clip",
    "optimizer": "[optimizer] (relayer builds its own AdamW)",
    "scheduler": "[lr_schedule]",
    "zero_optimization.stage": "deepspeed.zero_stage",
    "bf16.enabled": "model.dtype",
    "fp16.enabled": "model.dtype",
}
"""DeepSpeed config keys that relayer derives from the schedule, and from which keys."""
MERGED_TABLES = ("zero_optimization", "bf16", "fp16")
"""Sections of the generated config that deepspeed.config merges into, key by key."""
MAX_FILE_BYTES = 1 << 20
AUTO = "auto"


def deepspeed_config(sched: Schedule, base: Path, source: Path, phases: list[Phase]) -> dict[str, Any]:
    """The table to merge into every phase's DeepSpeed config, checked; ScheduleError naming the
    key (and the file it is in) otherwise."""
    given = sched.deepspeed.config
    if isinstance(given, dict):
        where, table = f"{source}: deepspeed.config.", given
    else:
        path = resolve_path(base, given)
        where, table = f"{path}: ", _read(path, source)
        if problem := deepspeed_refusal(table, sched.deepspeed.zero_stage):
            key, why = problem
            raise ScheduleError(f"{path}: {key.removeprefix('deepspeed.config.')}: {why}")
    for section in MERGED_TABLES:
        if section in table and not isinstance(table[section], dict):
            raise ScheduleError(f"{where}{section}: expected a table (merged into relayer's), got {_show(table[section])}")
    table = accept_trainer_blocks(table, sched, phases, where)  # a Trainer-style file's, "auto" or agreeing
    ours = planned(sched, phases)
    for key, by in DERIVED.items():
        value = _get(table, key)
        if value is not _MISSING and value != AUTO and (key not in ours or value != ours[key]):
            raise ScheduleError(f"{where}{key}: set by {by}; set it there")
    return _without_auto(table)


def _read(path: Path, source: Path) -> dict[str, Any]:
    need_file(path, "deepspeed.config", "a table or a DeepSpeed JSON file", source)
    try:
        table = json.loads(read_regular(path, MAX_FILE_BYTES), parse_constant=_no_constant)
    except OSError as e:
        raise ScheduleError(f"{source}: deepspeed.config: cannot read {path}: {describe(e)}") from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise ScheduleError(f"{path}: expected a DeepSpeed JSON config (deepspeed.config): "
                            f"{e if isinstance(e, ValueError) else f'nested deeper than {MAX_NESTING} levels'}") from None
    if deep := too_deep(table):
        raise ScheduleError(f"{path}: {deep}: nested deeper than {MAX_NESTING} levels (deepspeed.config)")
    if not isinstance(table, dict):
        raise ScheduleError(f"{path}: expected a JSON object (deepspeed.config), got {type(table).__name__}")
    if null := _null_key(table):
        raise ScheduleError(f"{path}: {null}: expected a value, got null (leave the key out for DeepSpeed's default)")
    return table


def _null_key(table: dict[str, Any], prefix: str = "") -> str | None:
    """The dotted key of the first null in ``table``, lists included, or None."""
    items = table.items() if isinstance(table, dict) else enumerate(table)
    for key, value in items:
        dotted = f"{prefix}[{key}]" if isinstance(key, int) else f"{prefix}{'.' if prefix else ''}{key}"
        if value is None:
            return dotted
        if isinstance(value, (dict, list)) and (inner := _null_key(value, dotted)):
            return inner
    return None


def recorded_raw(loaded: LoadedSchedule) -> dict[str, Any]:
    """The schedule as the run records it (its schedule.toml): ``loaded.raw``, with a deepspeed.config
    file inlined as the table it merges."""
    ds = loaded.raw.get("deepspeed")
    if not isinstance(ds, dict) or not isinstance(ds.get("config"), str):
        return loaded.raw
    return {**loaded.raw, "deepspeed": {**ds, "config": loaded.deepspeed_config}}


def _no_constant(name: str) -> float:
    raise ValueError(f"expected a finite number, got {name}")


def planned(sched: Schedule, phases: list[Phase]) -> dict[str, Any]:
    """What relayer sets the derived keys to (``launch.contract.dsconfig.derived``), by dotted key;
    those that differ between phases (gradient_accumulation_steps, with the process count) left out."""
    d = sched.data
    each = [by_dotted_key(derived(batch_size=d.batch_size, micro_batch_size=d.micro_batch_size,
                                  world=p.nproc * sched.launch.nnodes, grad_clip=sched.optimizer.grad_clip,
                                  zero_stage=sched.deepspeed.zero_stage, dtype=sched.model.dtype)) for p in phases]
    return {k: v for k, v in each[0].items() if all(e[k] == v for e in each)}


_MISSING = object()


def _get(table: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(table, dict) or part not in table:
            return _MISSING
        table = table[part]
    return table


def _without_auto(table: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_auto(v) if isinstance(v, dict) else v for k, v in table.items() if v != AUTO}
