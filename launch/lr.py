"""The learning rate of a global step: a pure function of it, so resumes and phases agree. Torch-free,
so the orchestrator can tell whether a changed schedule changes the lr of steps already taken."""

from __future__ import annotations

import math


def lr_at(step: int, opt) -> float:
    """``opt``: lr, lr_kind, warmup_steps, total_steps (the phase spec's optimizer part)."""
    if opt.warmup_steps and step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    if opt.lr_kind == "constant":
        return opt.lr
    span = max(1, opt.total_steps - opt.warmup_steps)
    frac = min(1.0, (step - opt.warmup_steps) / span)
    if opt.lr_kind == "linear":
        return opt.lr * (1.0 - frac)
    return opt.lr * 0.5 * (1.0 + math.cos(math.pi * frac))
