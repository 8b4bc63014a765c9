"""The fp16 dynamic loss scale: saved with every checkpoint (``shard_tools.state.RunState.scaler``),
restored into every fresh engine, so a phase (or a resume) starts from the scale the run had
reached instead of 2^16 and a string of skipped, overflowing steps."""

from __future__ import annotations

FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def scaler_fields(scaler) -> dict[str, float]:
    """The fields the scaler has, as floats; {} without one."""
    if scaler is None or not hasattr(scaler, "cur_scale"):
        return {}
    return {k: float(getattr(scaler, k)) for k in FIELDS if hasattr(scaler, k)}


def restore_scaler(scaler, fields: dict[str, float]) -> bool:
    """Sets the saved fields on ``scaler``; False when there is nothing to restore."""
    if scaler is None or not hasattr(scaler, "cur_scale") or not fields:
        return False
    for key, value in fields.items():
        if hasattr(scaler, key):
            setattr(scaler, key, value if key == "cur_scale" else int(value))
    return True
