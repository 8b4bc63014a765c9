"""Training a phase: its steps to the phase end (or a stop), the evaluations, the metrics each
logs, and the check that stops a run whose loss or gradients went non-finite."""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import time
from pathlib import Path

import psutil
import torch

from launch import handover, importance, procs
from launch.contract import faults
from launch.contract.files import RunDir
from launch.contract.spec import lr_at
from launch.data.examples import micro_batch, rows, step_targets
from launch.evaluation import BySource, generations, source_keys
from launch.profiling import step_profile
from launch.record import Phase
from launch.save import prepare_files, save
from launch.threads import set_threads
from shard_tools.files import open_append
from shard_tools.later import Later


class NonFinite(procs.PhaseError):
    """The loss or the gradient norm of a step is inf or NaN: training on would make garbage."""


def check_finite(phase: int, step: int, loss: float, bad_norm: bool, norm) -> None:
    """Raises NonFinite naming the phase and the step (numbered as ``orchestrator plan`` does)."""
    what = ([] if math.isfinite(loss) else [f"the loss is {loss}"]) + ([f"the gradient norm is {norm}"] if bad_norm else [])
    if what:
        raise NonFinite(f"phase {phase}, step {step}: {' and '.join(what)}; stopped there, nothing of this step "
                        "or after it is saved")


def train(ph: Phase, stop: dict) -> bool:
    """Runs to the phase end; returns False when a stop was requested (a checkpoint follows)."""
    spec, d = ph.spec, ph.spec.data
    metrics = RunDir(ph.run_dir).metrics
    step_times: list[float] = []
    ph.step = spec.start_step
    faults.point("phase.first_step", prewarm=spec.prewarm, phase=spec.phase)
    ph.stage("first step")
    while ph.step < spec.end_step:
        with step_profile(Path(spec.phase_dir) / f"steps-profile-rank{ph.rank}.txt", ph.step - spec.start_step):
            stop_asked = _step(ph, stop, metrics, step_times)
        if d.eval_every and ph.step % d.eval_every == 0:
            evaluate(ph, metrics)
        if stop_asked and ph.step < spec.end_step:
            return False
        if spec.every_steps and ph.step % spec.every_steps == 0 and ph.step < spec.end_step:
            save(ph, phase_complete=False)
            ph.files = Later.now(prepare_files(ph, ph.made))  # for the next one
    ph.timeline.mark("t_last_step_end")
    ph.timeline.add(step_seconds_median=statistics.median(step_times[1:] or step_times) if step_times else None,
                    memory_peak=(torch.cuda.max_memory_allocated() if torch.cuda.is_available()
                                 else psutil.Process().memory_info().rss))
    return True


def _step(ph: Phase, stop: dict, metrics: Path, step_times: list[float]) -> bool:
    """One optimizer step, checked and logged; returns whether any rank was asked to stop."""
    spec, d, engine = ph.spec, ph.spec.data, ph.built.engine
    t0 = time.perf_counter()
    lr = lr_at(ph.step, spec.optimizer, spec.phase_start_step)
    loss_sum, n_global = _accumulate(ph, lr)
    ph.step += 1
    # One small collective a step: the mean loss, whether any rank was asked to stop, and
    # whether any saw a non-finite gradient norm (fp16's loss scaler skips those steps).
    norm = engine.get_global_grad_norm()
    bad_norm = norm is not None and not engine.fp16_enabled() and not math.isfinite(float(norm))
    flags = torch.tensor([loss_sum / ph.built.gas, 1.0 if stop["signal"] else 0.0, float(bad_norm)], device=ph.device)
    torch.distributed.all_reduce(flags)
    # Every rank decides on the reduced values, so all stop at the same step, before it is logged or saved.
    check_finite(spec.phase, ph.step - 1, flags[0].item() / ph.world, flags[2].item() > 0, norm)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    step_times.append(dt)
    if ph.step == spec.start_step + 1:
        _first_step_done(ph, dt)
    if ph.rank == 0:
        log(ph, metrics, {
            "time": time.time(), "step": ph.step, "phase": spec.phase, "layers": spec.layers,
            "loss": flags[0].item() / ph.world, "lr": lr, "step_seconds": dt,
            "tokens_per_s": d.batch_size * d.seq_len / dt, "target_tokens": n_global,
        })
    return flags[1].item() > 0


def _accumulate(ph: Phase, lr: float) -> tuple[float, int]:
    """The step's micro-batches, forward, backward and the optimizer's step: (their summed loss,
    the global batch's target tokens).

    The step's loss is its summed token loss over N_global, its target tokens on every rank.
    DeepSpeed divides each micro-batch's loss by the accumulation steps and averages gradients
    over ranks, so micro-batch m's mean is scaled by c_m * gas * world / N_global (exactly 1.0
    with full rows: the results of unmasked data are as before). A step with no target tokens at
    all has zero gradients and is still an optimizer step (Adam's moments carry on, the step
    counts); its loss is logged as 0.0 with target_tokens 0."""
    d, made, engine, gas = ph.spec.data, ph.made, ph.built.engine, ph.built.gas
    for g in ph.backend.param_groups(engine):
        g["lr"] = lr
    loss_sum = 0.0
    n_global = step_targets(made.examples, made.order, ph.step, d.batch_size)
    for micro in range(gas):
        batch = micro_batch(made.examples, made.order, ph.step, d.batch_size, micro, ph.rank, ph.world,
                            d.micro_batch_size)
        mean, count = token_loss(engine, batch, ph.device)
        loss = mean * (count * gas * ph.world / n_global) if n_global else mean
        engine.backward(loss)
        if importance.due(ph, micro):  # between the last backward and the optimizer's step
            importance.measure(ph)
        engine.step()
        loss_sum += loss.item()
    return loss_sum, n_global


def _first_step_done(ph: Phase, seconds: float) -> None:
    ph.timeline.mark("t_first_step_end")  # before the orchestrator can see the step
    before = ph.timeline.get("gc_collections_before_switch", 0)
    ph.timeline.add(gc_collections_in_switch=procs.gc_collections() - before)
    gc.enable()  # off since the phase was prepared (``launch.phase``): the switch is over
    ph.timeline.add(first_step_seconds=seconds)  # for the switch's overhead (shard_tools.history)
    if ph.cores is not None:  # the switch was too short to tell the free cores: its first step too now
        set_threads(ph, ph.cores, "_after_first_step")
    ph.timeline.add(nice=os.getpriority(os.PRIO_PROCESS, 0))  # the priority it trains at
    if ph.made.staging is not None:
        ph.made.staging.unregister_later()  # the host weights are on the device: unpinned off the switch
    handover.carry_on(ph)  # the carried layers' copies, off the switch
    if ph.rank == 0 and ph.files.result() is None:
        ph.files = Later(prepare_files, ph, ph.made)  # it took over, and so made none while it waited


def evaluate(ph: Phase, metrics: Path) -> None:
    """Mean token loss over every target token of the validation rows, split over the ranks.
    Every rank runs the same number of forward passes (ZeRO-3 gathers parameters
    collectively); padding ones weigh 0."""
    val, mb, engine = ph.made.validation, ph.spec.data.micro_batch_size, ph.built.engine
    per_round = mb * ph.world
    total = torch.zeros(2, device=ph.device, dtype=torch.float64)
    by_source = BySource(ph, val)
    engine.eval()
    with torch.no_grad():
        for first in range(0, len(val), per_round):
            idx = list(range(first + ph.rank * mb, min(first + (ph.rank + 1) * mb, len(val))))
            batch = rows(val, idx or [0])
            mean, count, logits = token_loss(engine, batch, ph.device, logits=True)
            if idx:
                total += torch.stack([mean.double() * count, torch.tensor(float(count), device=ph.device,
                                                                          dtype=torch.float64)])
                by_source.add(logits, batch, idx)
        generated = generations(ph)
    engine.train()
    torch.distributed.all_reduce(total)
    sources = by_source.result()
    if ph.rank == 0 and total[1] > 0:
        log(ph, metrics, {"time": time.time(), "step": ph.step, "phase": ph.spec.phase,
                          "eval_loss": (total[0] / total[1]).item(), **sources,
                          **({"generations": generated} if generated else {})})


def log(ph: Phase, metrics: Path, record: dict) -> None:
    """One line of metrics.jsonl (rank 0), and the same scalars to TensorBoard when asked for."""
    with os.fdopen(open_append(metrics), "a") as f:  # never through a link out of the run
        f.write(json.dumps(record) + "\n")
    if ph.spec.tensorboard:
        if ph.tb is None:
            from torch.utils.tensorboard import SummaryWriter

            # What an earlier attempt logged from this phase's first step on (a branch --resume-from
            # set aside, steps a kill made train again) is hidden: the curves show one history.
            ph.tb = SummaryWriter(str(ph.run_dir / "tensorboard"), purge_step=ph.spec.start_step + 1)
        for key in ("loss", "eval_loss", "lr", "tokens_per_s", "step_seconds", *source_keys(record)):
            if key in record:
                ph.tb.add_scalar(key, record[key], record["step"], walltime=record["time"])
        for i, g in enumerate(record.get("generations", [])):
            ph.tb.add_text(f"generations/{i}", f"{g['prompt']}\n\n{g['text']}", record["step"], walltime=record["time"])
        ph.tb.flush()
    if ph.spec.wandb:
        if ph.wandb is None:
            from launch.report_wandb import WandbReport

            ph.wandb = WandbReport(ph.run_dir, ph.spec.phase, {"layers": ph.spec.layers, "seed": ph.spec.seed})
        ph.wandb.log(record)


def token_loss(engine, batch: dict[str, torch.Tensor], device: torch.device, logits: bool = False) -> tuple:
    """(the mean token loss of a micro-batch, its target tokens), the model's own loss with the
    batch's labels (``logits``: and the logits, third). Without targets the mean is 0 times the
    logits: a zero gradient, but every parameter's backward hook still runs (ZeRO reduces
    gradients in them, collectively)."""
    count = int((batch["labels"][:, 1:] != -100).sum())
    batch = {k: v.to(device) for k, v in batch.items()}
    if count:
        out = engine(**batch)
        return (out.loss, count, out.logits) if logits else (out.loss, count)
    made = engine(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return (made.sum() * 0.0, 0, made) if logits else (made.sum() * 0.0, 0)
