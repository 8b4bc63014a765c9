"""Preparing a phase: everything that does not depend on its predecessor's result (the process
group, the model with every weight known before the phase starts, the data, the next checkpoint's
files, a pre-warmed process's warm-up), and building the engine once the predecessor's result is in."""

from __future__ import annotations

import copy
import dataclasses
import gc
import hashlib
import json
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import deepspeed
import psutil
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

from launch import handover, procs, rendezvous
from launch.contract import DATA_CACHE, PhaseSpec
from launch.data import SampleOrder, load_examples, micro_batch, prepare as prepare_data
from launch.ops import load_comm_ops, unlink_comm_buffers
from launch.save import prepare_files
from launch.staging import Staging
from launch.train import token_loss
from launch.zero_state import BODY_DECAY, BODY_NO_DECAY, HEAD_DECAY, HEAD_NO_DECAY
from shard_tools.checkpoint import layer_weights
from shard_tools.manifest import layer_sources
from shard_tools.model import (
    DTYPES, ModelSpec, build_base_model, build_skeleton, detect_parts, head_param_names, layer_param_names,
)

if TYPE_CHECKING:
    from launch.phase import Phase

def prepare(ph: Phase) -> None:
    """Everything that does not depend on the predecessor's result: imports, process group,
    DeepSpeed's one-time costs, the model with every weight known before this phase starts."""
    spec = ph.spec
    if spec.prewarm:
        ph.timeline.add(background=procs.background(True))
    _start_group(ph)
    ph.refusal = handover.refusal(ph) if spec.prewarm else "not pre-warmed"
    ph.timeline.add(handover_refusal=ph.refusal)
    ph.stage("loading the model")
    # Nothing in training draws random numbers today, but a phase's stream must not depend on
    # how its process was started (seeded again after the warm-up, which draws its own);
    # mid-phase resumes restore the saved states instead.
    torch.manual_seed(hash_seed(spec.seed, spec.phase, ph.rank))
    _load_model(ph)
    ph.stage("preparing data")
    _load_data(ph)
    ph.timeline.mark("t_model_ready")
    if spec.prewarm:
        # While the warm-up waits for the device, a thread does the host side: this phase's
        # checkpoint files (``prepare_files``) and, on CUDA, the weights put into one host
        # buffer pinned in place for a fast upload at the go (``Staging.register_module``).
        # Both done early: a preparation that ends during its predecessor's save slowed that
        # save's gather from 0.07 to 0.4-0.5 s on the H200. The warm-up does not touch this model.
        host_side = Background(_prepare_host_side, ph)
        modules = set(sys.modules)
        ph.stage("warming up")
        try:
            warm_up(ph)
        finally:
            host_side.join()
        ph.timeline.mark("t_warmed_up")
        # What the fork server could import for every phase (launch.zygote.WARM_IMPORTS).
        ph.timeline.add(warm_up_imports=sorted(set(sys.modules) - modules)[:50])
    else:
        ph.prepared = prepare_files(ph)
    torch.manual_seed(hash_seed(spec.seed, spec.phase, ph.rank))
    ph.timeline.mark("t_prepared")


def _start_group(ph: Phase) -> None:
    accel = get_accelerator()
    if accel.device_name() == "cuda":
        # Before the process group, so NCCL binds each rank to its own device.
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        ph.device = torch.device("cuda", local)
        ph.staging = Staging(ph.device)
    ph.stage("starting the process group")
    load_comm_ops()
    with rendezvous.bounded(ph.spec.rendezvous_seconds, Path(ph.spec.phase_dir), ph.rank):
        deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False)
    unlink_comm_buffers(ph.rank)
    ph.timeline.mark("t_group_ready")


def _load_model(ph: Phase) -> None:
    spec, m = ph.spec, ph.spec.model
    # Taking every weight from its predecessor, the phase needs only the model's structure.
    model = build_skeleton(_model_spec(ph)) if ph.refusal is None else base_model(_model_spec(ph), ph.prebuilt)
    model.config.use_cache = False
    ph.persistent, ph.layers_attr = detect_parts(model, m.persistent, m.layers)
    ph.head_names = head_param_names(model, ph.persistent)
    ph.body_names = [n for i in spec.layers for n in layer_param_names(model, ph.layers_attr, i)]
    ph.model = model


def _model_spec(ph: Phase) -> ModelSpec:
    m = ph.spec.model
    return ModelSpec(path=m.path, config=m.config, dtype=m.dtype, seed=ph.spec.seed)


def host_model(ph: Phase) -> None:
    """A phase that prepared to take its predecessor's state but did not (``launch.handover``):
    the host model as a phase without a handover has it, built now."""
    m = ph.spec.model
    model = base_model(_model_spec(ph), ph.prebuilt)
    model.config.use_cache = False
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ph.model, ph.trained, ph.refusal = model, {}, "not taken"
    overlay(ph, layer_weights(ph.preloaded, mapped=True))


def _load_data(ph: Phase) -> None:
    spec, m = ph.spec, ph.spec.model
    # Prepared by the orchestrator before the first phase, or here by the first process (once).
    cache = ph.run_dir / DATA_CACHE
    ph.examples = load_examples(prepare_data(spec.data, m.tokenizer, cache))
    ph.validation = (load_examples(prepare_data(spec.data.model_copy(update={"path": spec.data.validation_path}),
                                                m.tokenizer, cache)) if spec.data.validation_path else None)
    if m.gradient_checkpointing:
        ph.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ph.order = SampleOrder(len(ph.examples), spec.seed, spec.data.shuffle)
    preload = Path(spec.preload) if spec.preload else (Path(spec.restore) if spec.restore else None)
    ph.preloaded = layer_sources(ph.run_dir, preload) if preload else {}
    if ph.refusal is None:
        handover.preload_layers(ph)
    else:
        overlay(ph, layer_weights(ph.preloaded, mapped=True))


def _prepare_host_side(ph: Phase) -> None:
    if ph.refusal is None:
        # Taking over, it holds nothing that grows with the model while it waits: no host weights
        # (they come from the predecessor's device at the go), and no checkpoint files made ahead
        # (1.9 GB of page cache at 1.1B, 4.7 GB at 7B): it writes its own end off the critical
        # path, after handing over in turn; a stop or a mid-phase checkpoint writes without them.
        return
    ph.prepared = prepare_files(ph)
    ph.timeline.mark("t_files_prepared")
    if ph.staging is not None and ph.spec.zero_stage < 3:
        with ph.timeline.span("t_register_start", "t_registered"):
            registered = ph.staging.register_module(ph.model)
        ph.timeline.add(weights_registered=registered, register_seconds=ph.staging.register_seconds)
    else:
        # The head's weights get pages of their own now (a forked process shares the fork
        # server's until it writes them), not when the predecessor's are put in them.
        params = dict(ph.model.named_parameters())
        for n in ph.head_names:
            params[n].data = params[n].data.clone()


def overlay(ph: Phase, weights: dict[str, torch.Tensor]) -> None:
    """Puts ``weights`` into the host model; keeps the trainable ones' fp32 values in ``ph.trained``."""
    params = dict(ph.model.named_parameters())
    keep = set(ph.head_names) | set(ph.body_names)
    with torch.no_grad():
        for name, t in weights.items():
            params[name].copy_(t.to(params[name].dtype))
            if name in keep:
                ph.trained[name] = t


def warm_up(ph: Phase) -> None:
    """Pays a process's one-time costs before its go, on a throwaway copy of the model with one
    layer: the first ``deepspeed.initialize`` (seconds), the communicator, and every kernel and
    handle a real step of this shape loads. On the H200 a 1.1B phase's first step took 0.43 s
    after a warm-up on a tiny linear layer, and a steady step's 0.09 s after this one
    (benchmarks/results/2026-11-29-nvidia-h200-v3/first_step.md). Its device memory (one
    layer and the head, with their optimizer state) is given back before the go. One process
    without room for it on the device skips it; a rank of several fails (its phase is then
    started afresh when its turn comes)."""
    spec, d = ph.spec, ph.spec.data
    config = copy.deepcopy(ph.model.config)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    engine = batch = None
    try:
        with torch.device(ph.device):
            toy = type(ph.model)(config).to(DTYPES[spec.model.dtype])
        toy.config.use_cache = False
        if spec.model.gradient_checkpointing:
            toy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        cfg = deepspeed_config(spec, ph.world, sum(p.numel() for p in toy.parameters()))
        # Only the engine is kept: it holds the optimizer, and nothing else may (see finally).
        engine = deepspeed.initialize(model=toy, optimizer=torch.optim.AdamW(toy.parameters(), lr=0.0),
                                      config=cfg)[0]
        for micro in range(cfg["gradient_accumulation_steps"]):
            batch = micro_batch(ph.examples, ph.order, spec.start_step, d.batch_size, micro, ph.rank,
                                ph.world, d.micro_batch_size)
            engine.backward(token_loss(engine, batch, ph.device)[0])
            engine.step()
        flags = torch.zeros(2, device=ph.device)
        torch.distributed.all_reduce(flags)
        flags.tolist()
    except torch.OutOfMemoryError as e:
        if ph.world > 1:
            raise
        print(f"relayer: warm-up skipped, no room on the device ({e})", file=sys.stderr, flush=True)
    finally:
        if engine is not None:
            engine.destroy()
        engine = toy = batch = None
        gc.collect()  # DeepSpeed's optimizer sits in reference cycles: without this its state stays
        if ph.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def build_engine(ph: Phase) -> None:
    """Freezes all but the head and this phase's layers and builds the DeepSpeed engine on the host
    model, which holds the predecessor's weights by now."""
    spec, model = ph.spec, ph.model
    trainable = set(ph.head_names) | set(ph.body_names)
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    groups, ph.roles = param_groups(model, set(ph.head_names), set(ph.body_names), spec.optimizer)
    o = spec.optimizer
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ph.ds_config = deepspeed_config(spec, ph.world, numel)
    ph.gas = ph.ds_config["gradient_accumulation_steps"]
    if ph.staging is not None and spec.zero_stage < 3:
        ph.staging.module_to_device(model)  # what deepspeed.initialize would do, at pinned speed
    ph.timeline.mark("t_on_device")
    ph.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ph.ds_config)
    named = dict(ph.engine.module.named_parameters())
    ph.head = [(n, named[n]) for n in ph.head_names]
    ph.body = [(n, named[n]) for n in ph.body_names]
    ph.timeline.add(memory_engine=memory_now())
    ph.timeline.mark("t_engine_built")


def memory_now() -> dict[str, float]:
    """Device memory on CUDA, this process's RSS elsewhere (bytes)."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "device_used": total - free, "device_free": free}
    return {"rss": psutil.Process().memory_info().rss}


def param_groups(model: nn.Module, head: set[str], body: set[str], opt) -> tuple[list[dict], list[int]]:
    """Four groups (head/body x decay/no-decay; 1-D parameters never decay), empty ones dropped.

    The head and the body must not share a group: Adam's step (bias correction) is per group.
    """
    buckets: list[list[nn.Parameter]] = [[], [], [], []]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim < 2
        role = (HEAD_NO_DECAY if no_decay else HEAD_DECAY) if name in head else (BODY_NO_DECAY if no_decay else BODY_DECAY)
        assert name in head or name in body, name
        buckets[role].append(p)
    groups, roles = [], []
    for role, params in enumerate(buckets):
        if params:
            wd = 0.0 if role in (HEAD_NO_DECAY, BODY_NO_DECAY) else opt.weight_decay
            groups.append({"params": params, "weight_decay": wd})
            roles.append(role)
    return groups, roles


def deepspeed_config(spec: PhaseSpec, world: int, trainable_numel: int) -> dict:
    d = spec.data
    # The default 5e8-element buckets allocate GBs per gradient hook on a small model; size them to it.
    bucket = int(min(5e8, max(5e5, trainable_numel)))
    zero: dict = {"stage": spec.zero_stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if spec.zero_stage == 3:
        zero.update({"stage3_prefetch_bucket_size": bucket, "stage3_param_persistence_threshold": 0,
                     "memory_efficient_linear": False})
    cfg = {
        "train_batch_size": d.batch_size,
        "train_micro_batch_size_per_gpu": d.micro_batch_size,
        "gradient_accumulation_steps": d.batch_size // (d.micro_batch_size * world),
        "gradient_clipping": spec.optimizer.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": spec.model.dtype == "bfloat16"},
        "fp16": {"enabled": spec.model.dtype == "float16", "initial_scale_power": 16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return _merge(cfg, spec.deepspeed_config)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def hash_seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def model_key(spec: ModelSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def base_model(spec: ModelSpec, prebuilt: dict[str, nn.Module]) -> nn.Module:
    """The model ``prebuilt`` holds for ``spec`` (taken out of it), or one built now."""
    model = prebuilt.pop(model_key(spec), None)
    return model if model is not None else build_base_model(spec)


class Background(threading.Thread):
    """Runs ``target(*args)`` in a thread; ``join`` raises what it raised."""

    def __init__(self, target, *args):
        super().__init__(name=target.__name__.strip("_"), daemon=True)
        self.work, self.args_, self.error = target, args, None
        self.start()

    def run(self) -> None:
        try:
            self.work(*self.args_)
        except BaseException as e:  # noqa: BLE001 - handed to join's caller
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error
