"""One phase inside one process group: build, restore, train, save. See ``launch.worker``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import deepspeed
import psutil
import safetensors
import torch
import transformers
from deepspeed.accelerator import get_accelerator
from torch import nn

from launch import faults, procs, zero_state
from launch.ops import load_comm_ops, unlink_comm_buffers
from launch.data import SampleOrder, load_examples, micro_batch, prepare, rows, step_targets
from launch.scaler import restore_scaler, scaler_tensors
from launch.contract import DATA_CACHE, PhaseSpec, lr_at
from launch.staging import Staging
from shard_tools.checkpoint import (
    BODY_OPTIM, HEAD, LAYERS, OPTIM_KEYS, STATE, PreparedFiles, flatten_optim_state, last_write_timing, layer_weights,
    load_tensors, optim_state, populate_pages, write_checkpoint,
)
from shard_tools.manifest import MANIFEST, CheckpointError, Manifest, checkpoints_dir, layer_sources, step_dir_name
from shard_tools.model import (
    DTYPES, ModelSpec, build_base_model, detect_parts, head_param_names, layer_param_names,
)

PREEMPTED = 75  # EX_TEMPFAIL: a checkpoint was written, run again to go on
HEAD_DECAY, HEAD_NO_DECAY, BODY_DECAY, BODY_NO_DECAY = range(4)
RELAYER_VERSION = "0.1.0"


def _page_faults() -> int:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def _dirty_page_cache() -> dict[str, int]:
    """Linux: MB of the page cache that is dirty and under writeback; nothing elsewhere."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return {}
    kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in lines) if k in ("Dirty", "Writeback")}
    return {f"{k.lower()}_mb": v // 1024 for k, v in kb.items()}


class NonFinite(procs.PhaseError):
    """The loss or the gradient norm of a step is inf or NaN: training on would make garbage."""


def check_finite(phase: int, step: int, loss: float, bad_norm: bool, norm) -> None:
    """Raises NonFinite naming the phase and the step (numbered as ``orchestrator plan`` does)."""
    what = ([] if math.isfinite(loss) else [f"the loss is {loss}"]) + ([f"the gradient norm is {norm}"] if bad_norm else [])
    if what:
        raise NonFinite(f"phase {phase}, step {step}: {' and '.join(what)}; stopped there, nothing of this step "
                        "or after it is saved")


def versions() -> dict[str, str]:
    return {
        "relayer": RELAYER_VERSION, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__, "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


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


class Phase:
    """State of one phase process; the methods run in the order build -> restore -> train -> save."""

    def __init__(self, spec: PhaseSpec, rank: int, world: int):
        self.spec, self.rank, self.world = spec, rank, world
        self.run_dir = Path(spec.run_dir)
        self.restore_path = spec.restore
        self.tb = None
        self.wandb = None
        self.records: dict = {"rank": rank, "world_size": world, "t_process_start": psutil.Process().create_time()}

    # -- build ---------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Everything that does not depend on the predecessor's result: imports, process group,
        DeepSpeed's one-time costs, the model with every weight known before this phase starts."""
        spec = self.spec
        if spec.prewarm:
            self.records["background"] = procs.background(True)
        accel = get_accelerator()
        if accel.device_name() == "cuda":
            # Before the process group, so NCCL binds each rank to its own device.
            local = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            self.staging: Staging | None = Staging(self.device)
        else:
            self.device = torch.device("cpu")
            self.staging = None
        self._stage("starting the process group")
        load_comm_ops()
        deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False)
        unlink_comm_buffers(self.rank)
        self.records["t_group_ready"] = time.time()
        self._stage("loading the model")
        m = spec.model
        # Nothing in training draws random numbers today, but a phase's stream must not depend on
        # how its process was started (seeded again after the warm-up, which draws its own);
        # mid-phase resumes restore the saved states instead.
        torch.manual_seed(hash_seed(spec.seed, spec.phase, self.rank))
        model = base_model(ModelSpec(path=m.path, config=m.config, dtype=m.dtype, seed=spec.seed))
        model.config.use_cache = False
        self.persistent, self.layers_attr = detect_parts(model, m.persistent, m.layers)
        self.head_names = head_param_names(model, self.persistent)
        self.body_names = [n for i in spec.layers for n in layer_param_names(model, self.layers_attr, i)]
        self.model = model
        # fp32 weights of the trainable parameters, to set the fp32 masters exactly after the engine
        # is built (the module itself may hold them in bf16).
        self.trained: dict[str, torch.Tensor] = {}
        self._stage("preparing data")
        # Prepared by the orchestrator before the first phase, or here by the first process (once).
        cache = self.run_dir / DATA_CACHE
        self.examples = load_examples(prepare(spec.data, m.tokenizer, cache))
        self.validation = (load_examples(prepare(spec.data.model_copy(update={"path": spec.data.validation_path}),
                                                 m.tokenizer, cache)) if spec.data.validation_path else None)
        if m.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.order = SampleOrder(len(self.examples), spec.seed, spec.data.shuffle)
        preload = Path(spec.preload) if spec.preload else (Path(spec.restore) if spec.restore else None)
        self.preloaded = layer_sources(self.run_dir, preload) if preload else {}
        self._overlay(layer_weights(self.preloaded, mapped=True))
        self.restored: Manifest | None = None
        self.populating: _Background | None = None
        """Maps the head's moments (``_read_delta``) while the engine is built."""
        self.delta: tuple[Path, str] | None = None
        """The checkpoint whose changes the host model holds, and its manifest's text."""
        self.records["t_model_ready"] = time.time()
        self.prepared: PreparedFiles | None = None
        if spec.prewarm:
            # While the warm-up waits for the device, a thread does the host side: this phase's
            # checkpoint files (``_prepare_files``) and, on CUDA, the weights put into one host
            # buffer pinned in place for a fast upload at the go (``Staging.register_module``).
            # Both done early: a preparation that ends during its predecessor's save slowed that
            # save's gather from 0.07 to 0.4-0.5 s on the H200. The warm-up does not touch this model.
            host_side = _Background(self._prepare_host_side)
            modules = set(sys.modules)
            self._stage("warming up")
            try:
                self._warm_up()
            finally:
                host_side.join()
            self.records["t_warmed_up"] = time.time()
            # What the fork server could import for every phase (launch.zygote.WARM_IMPORTS).
            self.records["warm_up_imports"] = sorted(set(sys.modules) - modules)[:50]
        else:
            self.prepared = self._prepare_files()
        torch.manual_seed(hash_seed(spec.seed, spec.phase, self.rank))
        self.records["t_prepared"] = time.time()

    def _prepare_host_side(self) -> None:
        self.prepared = self._prepare_files()
        self.records["t_files_prepared"] = time.time()
        if self.staging is not None and self.spec.zero_stage < 3:
            self._register()
        else:
            # The head's weights get pages of their own now (a forked process shares the fork
            # server's until it writes them), not when the predecessor's are put in them.
            params = dict(self.model.named_parameters())
            for n in self.head_names:
                params[n].data = params[n].data.clone()

    def _register(self) -> None:
        t0 = time.time()
        self.records["weights_registered"] = self.staging.register_module(self.model)
        self.records.update(t_registered=time.time(), register_seconds=self.staging.register_seconds,
                            t_register_start=t0)

    def _file_metadata(self) -> dict[str, dict[str, str]]:
        return {LAYERS: {"layers": ",".join(map(str, self.spec.layers)), "layers_prefix": self.layers_attr}}

    def _prepare_files(self) -> PreparedFiles | None:
        """Rank 0's head and layers files of the next checkpoint, made now (``PreparedFiles``)."""
        if self.rank != 0:
            return None
        named = list(self.model.named_parameters())
        shapes = zero_state.full_shapes(named)
        layouts = {HEAD: {f"{k}/{n}": (torch.float32, shapes[n]) for n in self.head_names for k in OPTIM_KEYS},
                   LAYERS: {n: (torch.float32, shapes[n]) for n in self.body_names}}
        try:
            return PreparedFiles(self.run_dir, layouts, self._file_metadata())
        except CheckpointError as e:
            print(f"relayer: {e}; the checkpoint will be written without them", file=sys.stderr, flush=True)
            return None

    def discard(self) -> None:
        if getattr(self, "prepared", None) is not None:
            self.prepared.discard()
            self.prepared = None

    def _overlay(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        keep = set(self.head_names) | set(self.body_names)
        with torch.no_grad():
            for name, t in weights.items():
                params[name].copy_(t.to(params[name].dtype))
                if name in keep:
                    self.trained[name] = t

    def _warm_up(self) -> None:
        """Pays a process's one-time costs before its go, on a throwaway copy of the model with one
        layer: the first ``deepspeed.initialize`` (seconds), the communicator, and every kernel and
        handle a real step of this shape loads. On the H200 a 1.1B phase's first step took 0.43 s
        after a warm-up on a tiny linear layer, and a steady step's 0.09 s after this one
        (benchmarks/results/2026-11-29-nvidia-h200-v3/first_step.md). Its device memory (one
        layer and the head, with their optimizer state) is given back before the go. One process
        without room for it on the device skips it; a rank of several fails (its phase is then
        started afresh when its turn comes)."""
        spec, d = self.spec, self.spec.data
        config = copy.deepcopy(self.model.config)
        config.num_hidden_layers = 1
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:1]
        engine = batch = None
        try:
            with torch.device(self.device):
                toy = type(self.model)(config).to(DTYPES[spec.model.dtype])
            toy.config.use_cache = False
            if spec.model.gradient_checkpointing:
                toy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            cfg = deepspeed_config(spec, self.world, sum(p.numel() for p in toy.parameters()))
            # Only the engine is kept: it holds the optimizer, and nothing else may (see finally).
            engine = deepspeed.initialize(model=toy, optimizer=torch.optim.AdamW(toy.parameters(), lr=0.0),
                                          config=cfg)[0]
            for micro in range(cfg["gradient_accumulation_steps"]):
                batch = micro_batch(self.examples, self.order, spec.start_step, d.batch_size, micro, self.rank,
                                    self.world, d.micro_batch_size)
                engine.backward(token_loss(engine, batch, self.device)[0])
                engine.step()
            flags = torch.zeros(2, device=self.device)
            torch.distributed.all_reduce(flags)
            flags.tolist()
        except torch.OutOfMemoryError as e:
            if self.world > 1:
                raise
            print(f"relayer: warm-up skipped, no room on the device ({e})", file=sys.stderr, flush=True)
        finally:
            if engine is not None:
                engine.destroy()
            engine = toy = batch = None
            gc.collect()  # DeepSpeed's optimizer sits in reference cycles: without this its state stays
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()

    def await_go(self) -> None:
        """A pre-warmed process waits here until its predecessor's processes are gone. Once the
        predecessor's checkpoint is committed (while its processes still exit), what it changed
        is read (the head file mapped) into host memory already: reading touches no device."""
        expected = checkpoints_dir(self.run_dir) / step_dir_name(self.spec.start_step)

        def read_early() -> None:
            if self.delta is None and (expected / MANIFEST).exists():
                self._foreground()  # this process is next: on the critical path from here
                self._read_delta(expected, early=True)

        go = procs.wait_for_go(Path(self.spec.go_fifo), read_early)
        self.records["t_go"] = time.time()
        self._foreground()
        self.restore_path = go["restore"]

    def _foreground(self) -> None:
        if self.records.get("background"):
            self.records["background"] = not procs.background(False)

    def _read_delta(self, restore: Path, early: bool = False) -> None:
        """Puts into the host model what changed since the weights it holds: the layers trained
        since, and the head; keeps the head's optimizer state for ``restore``."""
        t0 = time.time()
        try:
            text = (restore / MANIFEST).read_text()
            manifest = Manifest.from_json(text, restore)
            if early and manifest.created < self.records["t_process_start"]:
                return  # an older checkpoint at that step (damaged, being replaced): not the predecessor's
            sources = layer_sources(self.run_dir, restore)
            self._overlay(layer_weights({l: s for l, s in sources.items() if self.preloaded.get(l) != s}, mapped=True))
            t_layers = time.time()
            # The head file's pages, as its writer left them: the masters now, since they go into
            # the model before the engine is built; the moments while it is built (``restore``
            # waits for them), so that the go need not wait for them.
            self.head_state = optim_state(restore, HEAD, mapped=True, populate=False)
            populate_pages(list(self.head_state["master"].values()))
            self._overlay(self.head_state["master"])
        except (OSError, CheckpointError):
            if not early:
                raise
            return  # read again at the go, which names only a checkpoint the orchestrator checked
        self.populating = _Background(populate_pages, [t for k in zero_state.MOMENTS for t in self.head_state[k].values()])
        self.preloaded, self.restored, self.delta = sources, manifest, (restore, text)
        if early:
            self.records.update(t_early_read_start=t0, t_early_read_end=time.time(), t_early_read_layers=t_layers)

    def assemble(self) -> None:
        """Reads what the predecessor changed (its layers and the head), unless read already, and
        builds the engine."""
        spec = self.spec
        self._stage("building the engine")
        self.records["memory_start"] = memory_now()
        restore = Path(self.restore_path) if self.restore_path else None
        if restore is not None:
            if self.delta is not None and (self.delta[0] != restore
                                           or (restore / MANIFEST).read_text() != self.delta[1]):
                raise RuntimeError(f"the go names {restore}, but {self.delta[0]} was read before it")
            if self.delta is None:
                self._read_delta(restore)
        self.records["t_delta_loaded"] = time.time()
        model = self.model
        trainable = set(self.head_names) | set(self.body_names)
        for name, p in model.named_parameters():
            p.requires_grad_(name in trainable)
        groups, self.roles = param_groups(model, set(self.head_names), set(self.body_names), spec.optimizer)
        o = spec.optimizer
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.ds_config = deepspeed_config(spec, self.world, numel)
        self.gas = self.ds_config["gradient_accumulation_steps"]
        if self.staging is not None and spec.zero_stage < 3:
            self.staging.module_to_device(model)  # what deepspeed.initialize would do, at pinned speed
        self.records["t_on_device"] = time.time()
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.ds_config)
        named = dict(self.engine.module.named_parameters())
        self.head = [(n, named[n]) for n in self.head_names]
        self.body = [(n, named[n]) for n in self.body_names]
        self.records["memory_engine"] = memory_now()
        self.records["t_engine_built"] = time.time()

    # -- restore -------------------------------------------------------------------------------
    def restore(self) -> None:
        """Head optimizer state carries on; body state too only when resuming inside its phase."""
        m = self.restored
        if m is None:
            return
        spec = self.spec
        ckpt = Path(self.restore_path)
        same_phase = not m.phase_complete and m.phase == spec.phase
        body_step = m.body_step if same_phase else 0
        steps = [m.head_step if role in (HEAD_DECAY, HEAD_NO_DECAY) else body_step for role in self.roles]
        zero_state.materialise(self.engine, steps)
        if self.populating is not None:
            self.populating.join()
            self.populating = None
            self.records["t_head_populated"] = time.time()
        zero_state.set_state(self.head, self.head_state, with_moments=True, staging=self.staging)
        self.records["t_head_set"] = time.time()
        body_masters = {n: self.trained[n] for n, _ in self.body if n in self.trained}
        if same_phase:
            body = optim_state(ckpt, BODY_OPTIM)
            body["master"] = body_masters
            zero_state.set_state(self.body, body, with_moments=True)
        else:
            fresh = [(n, p) for n, p in self.body if n in body_masters]
            zero_state.set_state(fresh, {"master": body_masters}, with_moments=False, staging=self.staging)
        zero_state.refresh_lp(self.engine)
        # The loss scale carries across phases like the head's state does.
        restore_scaler(getattr(self.engine.optimizer, "loss_scaler", None), load_tensors(ckpt / STATE))
        if same_phase:
            self._restore_rng(ckpt)
        self.head_state = None  # on the device now; the mapping of the head file can go
        self.trained = {}
        self.records["t_restored"] = time.time()

    def _restore_rng(self, ckpt: Path) -> None:
        saved = load_tensors(ckpt / STATE, "rng/")
        key = f"cpu.rank{self.rank}"
        if key in saved:
            torch.set_rng_state(saved[key])
        if torch.cuda.is_available() and f"cuda.rank{self.rank}" in saved:
            torch.cuda.set_rng_state(saved[f"cuda.rank{self.rank}"])

    # -- train ---------------------------------------------------------------------------------
    def train(self, stop: dict) -> bool:
        """Runs to the phase end; returns False when a stop was requested (a checkpoint follows)."""
        spec, d = self.spec, self.spec.data
        examples, order = self.examples, self.order
        base = self.engine.optimizer.optimizer
        metrics = self.run_dir / "metrics.jsonl"
        step_times: list[float] = []
        self.step = spec.start_step
        faults.point("phase.first_step", prewarm=spec.prewarm)
        self._stage("first step")
        while self.step < spec.end_step:
            t0 = time.perf_counter()
            lr = lr_at(self.step, spec.optimizer)
            for g in base.param_groups:
                g["lr"] = lr
            loss_sum = 0.0
            # The step's loss is its summed token loss over N_global, its target tokens on every
            # rank. DeepSpeed divides each micro-batch's loss by the accumulation steps and averages
            # gradients over ranks, so micro-batch m's mean is scaled by c_m * gas * world / N_global
            # (exactly 1.0 with full rows: the results of unmasked data are as before). A step with
            # no target tokens at all has zero gradients and is still an optimizer step (Adam's
            # moments carry on, the step counts); its loss is logged as 0.0 with target_tokens 0.
            n_global = step_targets(examples, order, self.step, d.batch_size)
            for micro in range(self.gas):
                batch = micro_batch(examples, order, self.step, d.batch_size, micro, self.rank, self.world,
                                    d.micro_batch_size)
                mean, count = token_loss(self.engine, batch, self.device)
                loss = mean * (count * self.gas * self.world / n_global) if n_global else mean
                self.engine.backward(loss)
                self.engine.step()
                loss_sum += loss.item()
            self.step += 1
            # One small collective a step: the mean loss, whether any rank was asked to stop, and
            # whether any saw a non-finite gradient norm (fp16's loss scaler skips those steps).
            norm = self.engine.get_global_grad_norm()
            bad_norm = norm is not None and not self.engine.fp16_enabled() and not math.isfinite(float(norm))
            flags = torch.tensor([loss_sum / self.gas, 1.0 if stop["signal"] else 0.0, float(bad_norm)],
                                 device=self.device)
            torch.distributed.all_reduce(flags)
            # Every rank decides on the reduced values, so all stop at the same step, before it is logged or saved.
            check_finite(spec.phase, self.step - 1, flags[0].item() / self.world, flags[2].item() > 0, norm)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            step_times.append(dt)
            if self.step == spec.start_step + 1:
                self.records["t_first_step_end"] = time.time()  # before the orchestrator can see the step
                self.records["nice"] = os.getpriority(os.PRIO_PROCESS, 0)  # the priority it trains at
                if self.staging is not None:
                    self.staging.unregister_later()  # the host weights are on the device: unpinned off the switch
            if self.rank == 0:
                self._log(metrics, {
                    "time": time.time(), "step": self.step, "phase": spec.phase, "layers": spec.layers,
                    "loss": flags[0].item() / self.world, "lr": lr, "step_seconds": dt,
                    "tokens_per_s": d.batch_size * d.seq_len / dt, "target_tokens": n_global,
                })
            if d.eval_every and self.step % d.eval_every == 0:
                self.evaluate(metrics)
            if flags[1].item() > 0 and self.step < spec.end_step:
                return False
            if spec.every_steps and self.step % spec.every_steps == 0 and self.step < spec.end_step:
                self.save(phase_complete=False)
                self.prepared = self._prepare_files()  # for the next one
        self.records["t_last_step_end"] = time.time()
        self.records["step_seconds_median"] = statistics.median(step_times[1:] or step_times) if step_times else None
        self.records["memory_peak"] = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
                                       else psutil.Process().memory_info().rss)
        return True

    def evaluate(self, metrics: Path) -> None:
        """Mean token loss over every target token of the validation rows, split over the ranks.
        Every rank runs the same number of forward passes (ZeRO-3 gathers parameters
        collectively); padding ones weigh 0."""
        val, mb = self.validation, self.spec.data.micro_batch_size
        per_round = mb * self.world
        total = torch.zeros(2, device=self.device, dtype=torch.float64)
        self.engine.eval()
        with torch.no_grad():
            for first in range(0, len(val), per_round):
                idx = list(range(first + self.rank * mb, min(first + (self.rank + 1) * mb, len(val))))
                mean, count = token_loss(self.engine, rows(val, idx or [0]), self.device)
                if idx:
                    total += torch.stack([mean.double() * count, torch.tensor(float(count), device=self.device,
                                                                              dtype=torch.float64)])
        self.engine.train()
        torch.distributed.all_reduce(total)
        if self.rank == 0 and total[1] > 0:
            self._log(metrics, {"time": time.time(), "step": self.step, "phase": self.spec.phase,
                                "eval_loss": (total[0] / total[1]).item()})

    def _stage(self, name: str) -> None:
        """What this phase is doing before its first step, for the progress display (rank 0)."""
        if self.rank == 0:
            with open(Path(self.spec.phase_dir) / "stages.jsonl", "a") as f:
                f.write(json.dumps({"time": time.time(), "stage": name}) + "\n")

    def _log(self, metrics: Path, record: dict) -> None:
        """One line of metrics.jsonl (rank 0), and the same scalars to TensorBoard when asked for."""
        with open(metrics, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.spec.tensorboard:
            if self.tb is None:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
            for key in ("loss", "eval_loss", "lr", "tokens_per_s", "step_seconds"):
                if key in record:
                    self.tb.add_scalar(key, record[key], record["step"], walltime=record["time"])
            self.tb.flush()
        if self.spec.wandb:
            if self.wandb is None:
                from launch.report_wandb import WandbReport

                self.wandb = WandbReport(self.run_dir, self.spec.phase, {"layers": self.spec.layers,
                                                                         "seed": self.spec.seed})
            self.wandb.log(record)

    # -- save ----------------------------------------------------------------------------------
    def save(self, phase_complete: bool) -> Path | None:
        """Gathers full tensors on every rank (collectives); rank 0 copies them into its prepared
        files (so on a GPU the copy from the device is the write) and commits the checkpoint."""
        t0 = time.time()
        writer = self.rank == 0
        faults0, cache0 = _page_faults(), _dirty_page_cache() if writer else {}
        views = self.prepared.views if writer and self.prepared is not None else {}
        gather = {"keep": writer, "staging": self.staging}
        zero_state.relink(self.engine)
        head = zero_state.get_state(self.head, into=views.get(HEAD), **gather)
        steps = zero_state.group_steps(self.engine)
        into_layers = views.get(LAYERS, {})
        if phase_complete:
            layers, body = zero_state.get_masters(self.body, into=into_layers, **gather), {}
        else:
            body = zero_state.get_state(self.body, into={f"master/{n}": t for n, t in into_layers.items()}, **gather)
            layers = body.pop("master", {})
        state = self._state_tensors()
        t_gathered = time.time()
        # Why a gather was slow: pages that had to be faulted in again (cleaned by writeback since
        # they were prepared), and how much of the page cache was dirty or under writeback.
        gather_faults = _page_faults() - faults0
        if not writer:
            torch.distributed.barrier()
            return None
        by_role = dict(zip(self.roles, range(len(self.roles))))
        head_step = max(steps.get(by_role.get(r, -1), 0) for r in (HEAD_DECAY, HEAD_NO_DECAY))
        body_step = max((steps.get(by_role.get(r, -1), 0) for r in (BODY_DECAY, BODY_NO_DECAY)), default=0)
        files = {HEAD: flatten_optim_state(head), LAYERS: layers, STATE: state}
        if not phase_complete:
            files[BODY_OPTIM] = flatten_optim_state(body)
        spec = self.spec
        manifest = Manifest(
            global_step=self.step, phase=spec.phase, layers=list(spec.layers), phase_complete=phase_complete,
            head_step=head_step, body_step=body_step, world_size=self.world, zero_stage=spec.zero_stage,
            dtype=spec.model.dtype, files={}, versions=versions(), created=0.0,
            extra={"data_position": self.step * spec.data.batch_size, "persistent": self.persistent,
                   "base_model": {"path": spec.model.path, "config": spec.model.config, "seed": spec.seed,
                                  "dtype": spec.model.dtype},
                   "tokenizer": spec.model.tokenizer, "layers_attr": self.layers_attr,
                   "lr": lr_at(max(self.step - 1, 0), spec.optimizer)},
        )
        prepared, self.prepared = self.prepared, None
        # A phase end is made durable by the orchestrator, after the next phase has its go.
        path = write_checkpoint(self.run_dir, manifest, files, self._file_metadata(), durable=not phase_complete,
                                prepared=prepared,
                                on_file_written=lambda name: faults.point("checkpoint.file_written", name=name))
        self.records.setdefault("checkpoints", []).append(
            {"step": self.step, "gather_seconds": t_gathered - t0, "write_seconds": time.time() - t_gathered,
             "prepared": prepared is not None, **{f"{k}_seconds": v for k, v in last_write_timing.items()},
             "gather_page_faults": gather_faults, **cache0})
        torch.distributed.barrier()
        self.records["t_saved"] = time.time()
        return path

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        """Every rank's RNG states (gathered), the data position and the loss scaler, as tensors."""
        out = {"data_position": torch.tensor([self.step * self.spec.data.batch_size], dtype=torch.int64),
               "global_step": torch.tensor([self.step], dtype=torch.int64)}
        cpu_state = torch.get_rng_state()
        gathered = [torch.empty_like(cpu_state) for _ in range(self.world)]
        if self.device.type == "cuda":
            on_dev = cpu_state.to(self.device)
            gathered_dev = [torch.empty_like(on_dev) for _ in range(self.world)]
            torch.distributed.all_gather(gathered_dev, on_dev)
            gathered = [g.cpu() for g in gathered_dev]
            cuda_state = torch.cuda.get_rng_state().to(self.device)
            cuda_all = [torch.empty_like(cuda_state) for _ in range(self.world)]
            torch.distributed.all_gather(cuda_all, cuda_state)
            out.update({f"rng/cuda.rank{r}": t.cpu() for r, t in enumerate(cuda_all)})
        else:
            torch.distributed.all_gather(gathered, cpu_state)
        out.update({f"rng/cpu.rank{r}": t for r, t in enumerate(gathered)})
        out.update(scaler_tensors(getattr(self.engine.optimizer, "loss_scaler", None)))
        return out

    def write_records(self) -> None:
        if self.rank == 0:
            path = Path(self.spec.phase_dir) / "records.json"
            tmp = path.with_name(f".tmp-records.{os.getpid()}")
            tmp.write_text(json.dumps(self.records, indent=1))
            os.replace(tmp, path)


def run_phase(spec: PhaseSpec, rank: int, world: int, stop: dict) -> int:
    # The process group is not destroyed: the process exits right after (launch.worker), which
    # frees it and all device memory; an orderly NCCL teardown would only delay the next phase.
    phase = Phase(spec, rank, world)
    try:
        phase.prepare()
        if spec.prewarm:
            phase.await_go()
        with _profiled(Path(spec.phase_dir) / f"switch-profile-rank{rank}.txt"):
            phase.assemble()
            phase.restore()
        done = phase.train(stop)
        phase.save(phase_complete=done)
        if phase.wandb is not None:
            phase.wandb.finish()
    except BaseException:
        phase.discard()
        raise
    phase.write_records()
    return 0 if done else PREEMPTED


@contextlib.contextmanager
def _profiled(report: Path):
    """For the benchmarks (``RELAYER_PROFILE_SWITCH=1``): where the engine build and the restore
    spend their time, as cProfile sees it, written to ``report``; otherwise nothing."""
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


class _Background(threading.Thread):
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


def token_loss(engine, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """(the mean token loss of a micro-batch, its target tokens), the model's own loss with the
    batch's labels. Without targets the mean is 0 times the logits: a zero gradient, but every
    parameter's backward hook still runs (ZeRO reduces gradients in them, collectively)."""
    count = int((batch["labels"][:, 1:] != -100).sum())
    batch = {k: v.to(device) for k, v in batch.items()}
    if count:
        return engine(**batch).loss, count
    logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits.sum() * 0.0, 0


def hash_seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


PREBUILT: dict[str, nn.Module] = {}
"""Set by ``launch.zygote``: base models built before it forks phase processes, by ``model_key``."""


def model_key(spec: ModelSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def base_model(spec: ModelSpec) -> nn.Module:
    prebuilt = PREBUILT.pop(model_key(spec), None)
    return prebuilt if prebuilt is not None else build_base_model(spec)
