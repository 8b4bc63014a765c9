"""The base model a run trains, as every process builds it: from the phase spec's model part
(``model_spec``), keyed for the fork server's copy (``model_key``), taken from that copy where the
process was forked with one (``base_model``)."""

from __future__ import annotations

import dataclasses
import json

from torch import nn

from launch.contract.spec import PhaseSpec
from shard_tools.model import ModelSpec, build_base_model


def model_spec(spec: PhaseSpec) -> ModelSpec:
    m = spec.model
    return ModelSpec(path=m.path, config=m.config, dtype=m.dtype, seed=spec.seed)


def model_key(spec: ModelSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def base_model(spec: ModelSpec, prebuilt: dict[str, nn.Module]) -> nn.Module:
    """The model ``prebuilt`` holds for ``spec`` (taken out of it), or one built now."""
    model = prebuilt.pop(model_key(spec), None)
    return model if model is not None else build_base_model(spec)
