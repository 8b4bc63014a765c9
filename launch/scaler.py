"""The fp16 dynamic loss scale as tensors: saved with every checkpoint, restored into every fresh
engine, so a phase (or a resume) starts from the scale the run had reached instead of 2^16
and a string of skipped, overflowing steps."""

from __future__ import annotations

import torch

FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
PREFIX = "loss_scaler/"


def scaler_tensors(scaler) -> dict[str, torch.Tensor]:
    """``loss_scaler/<field>`` float64 scalars for the fields the scaler has; {} without one."""
    if scaler is None or not hasattr(scaler, "cur_scale"):
        return {}
    return {PREFIX + k: torch.tensor([float(getattr(scaler, k))], dtype=torch.float64)
            for k in FIELDS if hasattr(scaler, k)}


def restore_scaler(scaler, tensors: dict[str, torch.Tensor]) -> bool:
    """Sets the saved fields on ``scaler``; False when there is nothing to restore."""
    if scaler is None or not hasattr(scaler, "cur_scale"):
        return False
    saved = {k[len(PREFIX):]: t.item() for k, t in tensors.items() if k.startswith(PREFIX)}
    if not saved:
        return False
    for key, value in saved.items():
        if hasattr(scaler, key):
            setattr(scaler, key, value if key == "cur_scale" else int(value))
    return True
