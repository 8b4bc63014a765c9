"""Profiles for the benchmarks, off unless asked for by environment: where a switch's engine build
and restore spend their time (``RELAYER_PROFILE_SWITCH=1``, cProfile), and a phase's first two
steps beside each other (``RELAYER_PROFILE_STEPS=1``, torch.profiler: the first pays what a fresh
process has not paid yet, the second is a steady one)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def switch_profile(report: Path):
    """The engine build and the restore under cProfile, written to ``report``; otherwise nothing."""
    if not os.environ.get("RELAYER_PROFILE_SWITCH"):
        yield
        return
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(60)
        report.write_text(out.getvalue())


@contextlib.contextmanager
def step_profile(report: Path, index: int):
    """Step ``index`` of a phase (0 and 1 only) under torch.profiler, its table appended to ``report``."""
    if index > 1 or not os.environ.get("RELAYER_PROFILE_STEPS"):
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    with open(report, "a") as f:
        for key in ("self_cuda_time_total", "self_cpu_time_total") if cuda else ("self_cpu_time_total",):
            f.write(f"# step {index} of the phase, by {key}\n")
            f.write(averages.table(sort_by=key, row_limit=25, max_name_column_width=60) + "\n")
