"""What the installed transformers and DeepSpeed accept, read from their source files without
importing them (the orchestrator never imports either, and ``plan`` answers in well under a
second): the model types transformers builds as causal LMs, the DeepSpeed config keys DeepSpeed
has removed and refuses, and what else of ``deepspeed.config`` its engine refuses. Where a file
is not found or not as expected, the fact is unknown and nothing is refused on its account."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any


def _source(package: str, *parts: str) -> ast.Module | None:
    """The parsed module ``package/parts...`` of an installed package (found, not imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return ast.parse(Path(next(iter(spec.submodule_search_locations)), *parts).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _keys(module: ast.Module | None, name: str) -> frozenset[str] | None:
    """The string keys of the module-level ``name = {...}`` or ``name = OrderedDict([(k, v), ...])``."""
    for node in module.body if module is not None else ():
        if not (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            continue
        value = node.value
        if isinstance(value, ast.Dict):
            items = value.keys
        elif isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.List | ast.Tuple):
            items = [e.elts[0] for e in value.args[0].elts if isinstance(e, ast.Tuple) and e.elts]
        else:
            return None
        return frozenset(k.value for k in items if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return None


@functools.cache
def causal_lm_types() -> frozenset[str] | None:
    """Every ``model_type`` that transformers' AutoModelForCausalLM builds."""
    return _keys(_source("transformers", "models", "auto", "modeling_auto.py"), "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")


@functools.cache
def removed_deepspeed_keys() -> dict[str, frozenset[str]]:
    """Table ("" for the top level, "zero_optimization") -> the keys DeepSpeed refuses there as removed."""
    config = _source("deepspeed", "runtime", "config.py")
    found = {"": _keys(config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS"),
             "zero_optimization": _keys(config, "_REMOVED_ZERO_CONFIG_KEYS")}
    return {table: keys for table, keys in found.items() if keys}


def offloads_optimizer(config: dict[str, Any]) -> bool:
    """Whether ``config`` offloads the optimizer's state to the host (zero_optimization.offload_optimizer)."""
    zero = config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    return isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")


def deepspeed_refusal(config: dict[str, Any], zero_stage: int | None = None) -> tuple[str, str] | None:
    """(dotted key, why) of the first thing in ``deepspeed.config`` that DeepSpeed would refuse (or
    quietly ignore) once the first phase builds its engine, a minute after the start; or None.
    ``zero_stage``: deepspeed.zero_stage, where known."""
    todo = [("deepspeed.config", config)]
    while todo:
        where, table = todo.pop()
        for k, v in table.items():
            if "." in k:
                return (f'{where}."{k}"', "a quoted key with a dot, which DeepSpeed takes as one name and ignores; write "
                        "the table instead ([deepspeed.config.zero_optimization] stage = ...)")
            if isinstance(v, dict):
                todo.append((f"{where}.{k}", v))
    for table, keys in removed_deepspeed_keys().items():
        held = config.get(table) if table else config
        for k in sorted(keys & set(held)) if isinstance(held, dict) else ():
            return (f"deepspeed.config.{table + '.' if table else ''}{k}",
                    "removed from DeepSpeed, which refuses it (deepspeed/runtime/config.py says why)")
    every = config.get("steps_per_print")
    if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every > 0):
        return "deepspeed.config.steps_per_print", f"expected a positive integer (DeepSpeed divides by it), got {every!r}"
    return _offload_refusal(config, zero_stage) if offloads_optimizer(config) else None


def _offload_refusal(config: dict[str, Any], zero_stage: int | None) -> tuple[str, str] | None:
    """The optimizer's state on the host: at ZeRO 1 and 2, torch's AdamW steps the fp32 partitions
    there (relayer sets zero_force_ds_cpu_optimizer = false itself); not on NVMe, not at stage 0
    (relayer's own optimizer keeps its state on the device) nor 3 (not tested with relayer's state)."""
    key = "deepspeed.config.zero_optimization.offload_optimizer"
    if config["zero_optimization"]["offload_optimizer"]["device"] == "nvme":
        return key, 'expected device = "cpu": on NVMe DeepSpeed steps only its own optimizer, relayer steps torch\'s AdamW'
    if config.get("zero_force_ds_cpu_optimizer") is True:
        return ("deepspeed.config.zero_force_ds_cpu_optimizer",
                "expected false (or unset) with offload_optimizer: relayer steps torch's AdamW on the host")
    if zero_stage is not None and zero_stage not in (1, 2):
        return key, f"needs deepspeed.zero_stage 1 or 2, got {zero_stage}"
    return None
