"""The base model a run starts from, and which of its parameters are head and which are body layers.

Both the phase worker and ``shard-tools export`` build the base model here, so a run's weights are
the same wherever they are composed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Known families: head prefixes and the layer list. Anything else is detected from the module tree.
_FAMILIES: dict[str, tuple[list[str], str]] = {
    "llama": (["model.embed_tokens", "lm_head", "model.norm"], "model.layers"),
    "mistral": (["model.embed_tokens", "lm_head", "model.norm"], "model.layers"),
    "qwen2": (["model.embed_tokens", "lm_head", "model.norm"], "model.layers"),
    "qwen3": (["model.embed_tokens", "lm_head", "model.norm"], "model.layers"),
    "gpt2": (["transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"], "transformer.h"),
}


@dataclass(frozen=True)
class ModelSpec:
    path: str | None
    config: dict[str, Any] | None
    dtype: str
    seed: int


def build_base_model(spec: ModelSpec) -> nn.Module:
    """The run's starting weights on the CPU, in ``spec.dtype``.

    A config-only model is a random init under ``spec.seed``: the same seed and torch version
    give the same bytes, so no copy of the base weights is kept in the run directory.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = DTYPES[spec.dtype]
    if spec.path is not None:
        config_json = Path(spec.path) / "config.json"
        _known_model_type(json.loads(config_json.read_text()).get("model_type"), f"model.path: {config_json}")
        # use_safetensors: a pickle file is never opened, even beside a safetensors file.
        model, info = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, use_safetensors=True,
                                                           output_loading_info=True)
        _strict(spec.path, info)
        return model
    cfg = dict(spec.config or {})
    _known_model_type(cfg.get("model_type"), "model.config")
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype)


def build_skeleton(spec: ModelSpec) -> nn.Module:
    """The base model's structure with its parameters on the meta device (no weight read, none
    initialised) and its buffers real: for a phase that takes every weight from its predecessor
    (``launch.handover``), so that it holds no host copy of the model while it waits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec.path is not None:
        config_json = Path(spec.path) / "config.json"
        _known_model_type(json.loads(config_json.read_text()).get("model_type"), f"model.path: {config_json}")
        config = AutoConfig.from_pretrained(spec.path)
    else:
        cfg = dict(spec.config or {})
        _known_model_type(cfg.get("model_type"), "model.config")
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # what accelerate's init_empty_weights does
    try:
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[spec.dtype])
    finally:
        nn.Module.register_parameter = register


def _known_model_type(model_type: Any, where: str) -> None:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{where}: model_type {model_type!r} is not a model type this transformers "
                         f"knows")


def _strict(path: str, info: dict[str, Any]) -> None:
    """Every weight the config implies comes from the files, and every tensor in them is used:
    a missing weight would otherwise train from a random init. Tied weights are not missing."""
    problems = []
    for what, keys in (("missing from the files", info["missing_keys"]),
                       ("in the files but not in the model", info["unexpected_keys"])):
        if keys:
            named = ", ".join(sorted(keys)[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
            problems.append(f"{len(keys)} weight(s) {what}: {named}")
    for name, *shapes in sorted(info["mismatched_keys"])[:8]:
        problems.append(f"{name} has shape {shapes[0]} in the files, the config implies {shapes[1]}")
    problems += info["error_msgs"]
    if problems:
        raise ValueError(f"model.path: {path}: the weights do not match config.json: " + "; ".join(problems))


def detect_parts(model: nn.Module, persistent: list[str] | None, layers: str | None) -> tuple[list[str], str]:
    """(head module prefixes, attribute path of the layer list), overridable from the schedule."""
    family = _FAMILIES.get(getattr(model.config, "model_type", ""))
    if persistent is None:
        persistent = family[0] if family else _detect_head(model)
    if layers is None:
        layers = family[1] if family else _detect_layers(model)
    names = dict(model.named_modules())
    for prefix in persistent:
        if prefix not in names:
            raise ValueError(f"model.persistent: the model has no module {prefix!r}")
    if not isinstance(names.get(layers), nn.ModuleList):
        raise ValueError(f"model.layers: {layers!r} is not a layer list (nn.ModuleList) of the model")
    return list(persistent), layers


def _detect_layers(model: nn.Module) -> str:
    n = getattr(model.config, "num_hidden_layers", None)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n:
            return name
    raise ValueError("model.layers: cannot detect the layer list; set it in the schedule")


def _detect_head(model: nn.Module) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    head = []
    for mod in (model.get_input_embeddings(), model.get_output_embeddings()):
        if mod is not None and id(mod) in names and names[id(mod)] not in head:
            head.append(names[id(mod)])
    for name, _ in model.named_modules():
        if name.split(".")[-1] in ("norm", "ln_f", "final_layernorm", "final_layer_norm") and name.count(".") <= 1:
            head.append(name)
    return head


def head_param_names(model: nn.Module, persistent: list[str]) -> list[str]:
    """Unique parameters under the head prefixes; a tied lm_head appears once (as its embedding)."""
    return [n for n, _ in model.named_parameters() if any(n == p or n.startswith(p + ".") for p in persistent)]


def layer_param_names(model: nn.Module, layers_attr: str, index: int) -> list[str]:
    prefix = f"{layers_attr}.{index}."
    return [n for n, _ in model.named_parameters() if n.startswith(prefix)]


def unit_param_names(names: list[str], layers_attr: str, units: list[str]) -> list[str]:
    """Of ``names``, those under one of the module ``units`` ("<layer>.<module path>")."""
    prefixes = tuple(f"{layers_attr}.{u}." for u in units)
    return [n for n in names if n.startswith(prefixes)]
