"""Preparing a phase: everything that does not depend on its predecessor's result (the process
group, the model with every weight known before the phase starts, the data, the next checkpoint's
files, a pre-warmed process's warm-up). The engine is built at the switch (``launch.switch``)."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import gc
import hashlib
import os
import sys
from pathlib import Path

import deepspeed
import psutil
import torch
from deepspeed.accelerator import get_accelerator
from torch import nn

from launch import handover, pinned, preload, procs, rendezvous, resident
from launch.basemodel import base_model, model_spec
from launch.contract import devmem, faults
from launch.contract.files import DATA_CACHE
from launch.contract.spec import PhaseSpec
from launch.data.examples import SampleOrder, load_examples, load_validation, micro_batch, prepare as prepare_data
from launch.ops import load_comm_ops, unlink_comm_buffers
from launch.record import Phase, Prepared
from launch.save import prepare_files
from launch.staging import Staging, cap_memory
from launch.data.templates import trained_template
from launch.train import token_loss
from shard_tools.later import Later
from shard_tools.model import DTYPES, build_skeleton, detect_parts, head_param_names, layer_param_names, \
    unit_param_names
from shard_tools.state import Origin, StateFiles, layer_weights


def prepare(ph: Phase) -> Prepared:
    """Everything that does not depend on the predecessor's result: imports, process group,
    DeepSpeed's one-time costs, the model with every weight known before this phase starts."""
    spec = ph.spec
    if spec.prewarm:
        ph.timeline.add(background=procs.background(True))
    staging = _start_group(ph)
    refusal = handover.refusal(ph) if spec.prewarm else "not pre-warmed"
    ph.timeline.add(handover_refusal=refusal)
    ph.stage("loading the model")
    # Nothing in training draws random numbers today, but a phase's stream must not depend on
    # how its process was started (seeded again after the warm-up, which draws its own);
    # mid-phase resumes restore the saved states instead.
    torch.manual_seed(hash_seed(spec.seed, spec.phase, ph.rank))
    made = _load(ph, staging, refusal)
    ph.timeline.mark("t_model_ready")
    if spec.prewarm:
        _warm(ph, made)
    else:  # made while the weights go to the device, the engine is built and the first steps run
        ph.files = Later(prepare_files, ph, made)
        ph.backend.compile_ahead(spec, ph.device, ph.world)
    torch.manual_seed(hash_seed(spec.seed, spec.phase, ph.rank))
    ph.timeline.mark("t_prepared")
    return made


def _warm(ph: Phase, made: Prepared) -> None:
    """While the warm-up waits for the device, a thread does the host side: this phase's
    checkpoint files (``prepare_files``) and, on CUDA, the weights put into one host buffer
    pinned in place for a fast upload at the go (``Staging.register_module``). Both done early:
    a preparation that ends during its predecessor's save slowed that save's gather from 0.07 to
    0.4-0.5 s on the H200. The warm-up does not touch this model."""
    ph.files = Later(_prepare_host_side, ph, made)
    modules = set(sys.modules)
    ph.stage("warming up")
    try:
        with _one_at_a_time(ph):
            warm_up(ph, made)
    finally:
        ph.files.result()
    if ph.device.type == "cuda":  # it waits beside a training phase: its allocator's cache goes back
        gc.collect()
        torch.cuda.empty_cache()
        ph.timeline.add(memory_waiting=memory_now())
        if ph.spec.memory_cap:  # under a budget its first step waits for its predecessor to be gone
            ph.listing = devmem.Listing()
    ph.timeline.mark("t_warmed_up")
    # What the fork server could import for every phase (launch.zygote.WARM_IMPORTS).
    ph.timeline.add(warm_up_imports=sorted(set(sys.modules) - modules)[:50])


@contextlib.contextmanager
def _one_at_a_time(ph: Phase):
    """On a GPU, the phases waiting pre-warmed warm up one at a time (an flock on the run's phases
    folder, dropped by the kernel with its holder): each warm-up holds the head and a layer with
    their optimizer state (about 8 GB at 7B), and three at once took an H100 from 35 to 62 GiB
    beside the phase training (benchmarks/results/2026-12-06-issue41-h100-resident)."""
    if ph.device.type != "cuda":
        yield
        return
    fd = os.open(Path(ph.spec.phase_dir).parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _start_group(ph: Phase) -> Staging | None:
    accel = get_accelerator()
    staging = None
    if ph.device.type == "cuda":
        # Before the process group, so NCCL binds each rank to its own device.
        torch.cuda.set_device(ph.device)
        waiting = ph.waits_in_a_share
        cap = ph.spec.waiting_cap if waiting else ph.spec.memory_cap
        ph.timeline.add(**{"memory_fraction_waiting" if waiting else "memory_fraction": cap_memory(ph.device, cap)})
        staging = Staging(ph.device)
    ph.stage("starting the process group")
    load_comm_ops()
    with rendezvous.bounded(ph.spec.rendezvous_seconds, Path(ph.spec.phase_dir), ph.rank):
        deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False)
    unlink_comm_buffers(ph.rank)
    ph.timeline.mark("t_group_ready")
    return staging


def _load(ph: Phase, staging: Staging | None, refusal: str | None) -> Prepared:
    """The model (taking every weight from its predecessor, only its structure), its parts, the
    data, and the weights known before the go."""
    spec, m = ph.spec, ph.spec.model
    # The host path reads into a host model; with the holder's weights (launch.resident), the
    # model is its block, mapped, and the phase reads as one with a host model would.
    skeleton = refusal is None and not spec.handover.shm_take and spec.resident is None
    bare = skeleton or spec.resident is not None
    model = setup_model(build_skeleton(model_spec(spec)) if bare else base_model(model_spec(spec), ph.prebuilt), spec)
    views = resident.map_into(ph, model) if spec.resident is not None else None
    persistent, layers_attr = detect_parts(model, m.persistent, m.layers)
    origin = Origin(base_model=model_spec(spec), tokenizer=m.tokenizer, persistent=persistent,
                    layers_attr=layers_attr, world_size=ph.world, zero_stage=ph.backend.stage,
                    chat_template=trained_template(spec.data))
    head_names = head_param_names(model, persistent)
    in_layers = [n for i in spec.layers for n in layer_param_names(model, layers_attr, i)]
    body_names = unit_param_names(in_layers, layers_attr, spec.modules) if spec.modules else in_layers
    preload_from = spec.preload or spec.restore
    moving = None if preload_from or spec.prewarm or views is not None else \
        _to_device_early(ph, model, staging, {*head_names, *body_names})
    ph.stage("preparing data")
    examples, validation = _load_data(ph)
    made = Prepared(
        staging=staging, refusal=refusal, model=model, skeleton=skeleton, origin=origin,
        head_names=head_names, body_names=body_names, examples=examples, validation=validation,
        order=SampleOrder(len(examples), spec.seed, spec.data.shuffle),
        preloaded=ph.checkpoints.layer_sources(Path(preload_from)) if preload_from else {}, trained={}, moving=moving,
        resident=views, parts=frozenset(in_layers) - frozenset(body_names))
    if made.taking:
        preload.preload_layers(ph, made)
    else:
        made.overlay(layer_weights(made.preloaded, mapped=True))
    return made


def _to_device_early(ph: Phase, model: nn.Module, staging: Staging | None, trainable: set[str]) -> Later[None] | None:
    """A phase started cold from the base model (the run's first): its host weights are final, so
    they go to the device in a thread while the data is prepared (1.65 s at 7B on the H200)."""
    if staging is None or ph.backend.partitions_weights:
        return None

    def move() -> None:
        torch.cuda.set_device(ph.device)  # per thread
        ph.backend.place(model, ph.device, staging, frozenset(trainable))

    return Later(move)


def setup_model(model: nn.Module, spec: PhaseSpec) -> nn.Module:
    """``model`` as a phase trains it: no key-value cache; rows packed whole attending per example
    through their position ids (``launch.data.examples``), on a GPU with flash-attn installed and a
    half-precision model by varlen flash attention, otherwise by the model's own attention (SDPA)
    with the block-diagonal mask transformers builds from them; gradient checkpointing where the
    schedule asks for it."""
    from transformers.utils import is_flash_attn_2_available

    model.config.use_cache = False
    if spec.data.layout == "whole" and torch.cuda.is_available() and spec.model.dtype != "float32" \
            and is_flash_attn_2_available():
        model.set_attn_implementation("flash_attention_2")
    if spec.model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpointed_layers_in_training(model)
    return model


def checkpointed_layers_in_training(model: nn.Module) -> None:
    """transformers checkpoints a layer only while the layer is in training mode, and a model read
    with from_pretrained is in eval mode: without this, ``model.gradient_checkpointing`` did nothing
    for a model read from a path (7B on an H100, micro batch 4: out of memory in the forward,
    benchmarks/results/2026-12-06-issue42-h100-7b). Only the layers' own flag: the modules inside
    them (dropout) keep the mode the model was built in."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m.training = True


def host_model(ph: Phase, made: Prepared) -> None:
    """A phase that prepared to take its predecessor's state but did not (``launch.handover``):
    the host model as a phase without a handover has it, built now."""
    model = setup_model(base_model(model_spec(ph.spec), ph.prebuilt), ph.spec)
    made.model, made.trained, made.skeleton = model, {}, False
    made.overlay(layer_weights(made.preloaded, mapped=True))


def _load_data(ph: Phase) -> tuple:
    """The training rows and the validation rows: prepared by the orchestrator before the first
    phase, or here by the first process (once)."""
    entry = prepare_data(ph.spec.data, ph.spec.model.tokenizer, ph.run_dir / DATA_CACHE)
    return load_examples(entry), load_validation(entry)


def _prepare_host_side(ph: Phase, made: Prepared) -> StateFiles | None:
    """This phase's checkpoint files, made ahead, its weights registered (see ``_warm``), and the
    host memory its engine will pin (``launch.pinned``)."""
    _pin_ahead(ph, made)
    if made.taking:
        # Taking over, it holds nothing that grows with the model while it waits: no host weights
        # (they come from the predecessor's device at the go), and no checkpoint files made ahead
        # (1.9 GB of page cache at 1.1B, 4.7 GB at 7B): it writes its own end off the critical
        # path, after handing over in turn; a stop or a mid-phase checkpoint writes without them.
        return None
    files = prepare_files(ph, made)
    ph.timeline.mark("t_files_prepared")
    if made.resident is not None:  # its weights are the holder's, on the device: nothing to register or own
        return files
    if made.staging is not None and not ph.backend.partitions_weights:
        with ph.timeline.span("t_register_start", "t_registered"):
            registered = made.staging.register_module(made.model)
        ph.timeline.add(weights_registered=registered, register_seconds=made.staging.register_seconds)
    else:
        # The head's weights get pages of their own now (a forked process shares the fork
        # server's until it writes them), not when the predecessor's are put in them.
        params = dict(made.model.named_parameters())
        for n in made.head_names:
            params[n].data = params[n].data.clone()
    return files


def _pin_ahead(ph: Phase, made: Prepared) -> None:
    """The host memory this phase's engine will pin as it is built, pinned now (``launch.pinned``)."""
    params = dict(made.model.named_parameters())
    numels = [params[n].numel() for n in dict.fromkeys([*made.head_names, *made.body_names])]
    size = ph.backend.host_buffers(ph.spec, ph.world, numels)
    if size:
        with ph.timeline.span("t_pin_ahead_start", "t_pinned_ahead"):
            made.arena = pinned.Arena(size, pin=ph.device.type == "cuda")


def warm_up(ph: Phase, made: Prepared) -> None:
    """Pays a process's one-time costs before its go, on a throwaway copy of the model with one
    layer and a vocabulary of at most ``TOY_VOCAB`` rows: the first ``deepspeed.initialize``
    (seconds), the communicator, and every kernel and handle a real step of this shape loads. On
    the H200 a 1.1B phase's first step took 0.43 s after a warm-up on a tiny linear layer, and a
    steady step's 0.09 s after this one
    (benchmarks/results/2026-11-29-nvidia-h200-v3/first_step.md). Its device memory (one
    layer and the head, with their optimizer state) is given back before the go.

    One process without room for it on the device (or in its share of launch.device_memory while
    it waits: at 7B under 24 GiB every one while the toy had the whole vocabulary; with its cut,
    ``_one_layer_fits`` lets it try, not yet seen on a GPU) warms up on the smallest toy instead
    (``_smallest``: DeepSpeed's first initialize, the communicator, the optimizer's and the
    offload's code paths, not this shape's kernels; at 7B the switch paid about 1.5 s of DeepSpeed's
    first config and 0.5 s of the first collective without it,
    benchmarks/results/2026-12-06-issue42-h100-7b). A rank
    of several out of memory fails (its phase is then started afresh when its turn comes), so under
    a budget several take the smallest toy from the start (a rank out of memory in a collective
    would leave the others waiting in it), and so does one whose share cannot hold the one-layer
    toy's weights and gradients (``_one_layer_fits``)."""
    small = (ph.world > 1 and ph.waits_in_a_share) or not _one_layer_fits(ph, made)
    said = _warm_or_oom(ph, made, small)
    if said is not None and not small:
        print(f"relayer: warm-up on one layer skipped, no room on the device ({said}); on the smallest toy",
              file=sys.stderr, flush=True)
        ph.timeline.add(warm_up_skipped=said)
        small = True
        said = _warm_or_oom(ph, made, small)
    if said is not None:  # not even that: the go pays DeepSpeed's first initialize
        ph.timeline.add(warm_up_small_skipped=said)
    ph.timeline.add(warm_up_small=small)


def _warm_or_oom(ph: Phase, made: Prepared, small: bool) -> str | None:
    """``_warm_on``; where one rank of one ran out of memory, what it said, once the toy's tensors are
    gone: the exception's frames held them, and a smallest toy warmed up in its ``except`` held them
    all along (1.7 GiB of a waiting phase's 1.9 at 7B under 24 GiB on an H100: runs above the budget,
    benchmarks/results/2026-12-07-issue42-h100-switch)."""
    try:
        _warm_on(ph, made, small)
        return None
    except torch.OutOfMemoryError as e:
        if ph.world > 1:
            raise
        said = str(e).splitlines()[0][:200]
    gc.collect()
    if ph.device.type == "cuda":
        torch.cuda.empty_cache()
    return said


def _one_layer_fits(ph: Phase, made: Prepared) -> bool:
    """Whether a phase waiting under a budget may hold the one-layer toy: its weights and gradients
    at 16 bits and its logits at the micro-batch (``LOGIT_BYTES`` an element) within its share
    (``waiting_cap``); elsewhere it tries. At 7B under 24 GiB, with the whole vocabulary: 2.5 GB against
    2.0 (an H100 saw every try run out of memory after filling the share); its vocabulary cut
    (``TOY_VOCAB``), 0.9 GB."""
    if not ph.waits_in_a_share:
        return True
    layer = set(layer_param_names(made.model, made.origin.layers_attr, 0))
    vocab = getattr(made.model.config, "vocab_size", 0)
    rows = min(1.0, TOY_VOCAB / vocab) if vocab else 1.0  # its head's, cut (``_cut_vocabulary``)
    numel = sum(p.numel() * (1 if n in layer else rows) for n, p in made.model.named_parameters()
                if n in layer or n in made.head_names)
    d = ph.spec.data
    logits = d.micro_batch_size * d.seq_len * min(vocab, TOY_VOCAB) * LOGIT_BYTES
    return 4 * numel + logits <= ph.spec.waiting_cap


LOGIT_BYTES = 10
"""The logits' bytes an element at their peak (the 16-bit logits, the loss's fp32 copy and its
gradient: ``orchestrator.estimate``'s count, which ``launch`` does not import)."""


def _warm_on(ph: Phase, made: Prepared, small: bool) -> None:
    """One warm-up on a toy of one layer (``small``: of the least widths), its memory given back."""
    engine = None
    try:
        faults.point("warm_up.toy", phase=ph.spec.phase, small=small)
        engine, gas = _toy_engine(ph, made, small)
        _toy_steps(ph, made, engine, gas, small)
    finally:
        if engine is not None:
            engine.destroy()
        engine = None
        gc.collect()  # DeepSpeed's optimizer sits in reference cycles: without this its state stays
        if ph.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


SMALLEST = {"hidden_size": 16, "n_embd": 16, "intermediate_size": 32, "n_inner": 32, "num_attention_heads": 2,
            "n_head": 2, "num_key_value_heads": 2, "head_dim": 8}
"""The least widths a toy of the model's family gets (``_smallest``): two heads of 8 (its vocabulary cut as
every toy's, ``TOY_VOCAB``)."""


def _smallest(config) -> object:
    """``config`` with its widths at their least (``SMALLEST``, each where the family has the key)."""
    for key, value in SMALLEST.items():
        if getattr(config, key, None) is not None:
            setattr(config, key, value)
    return config


def _toy_engine(ph: Phase, made: Prepared, small: bool = False) -> tuple[object, int]:
    """A DeepSpeed engine on a fresh copy of the model with one layer (``small``: of the least
    widths), and its accumulation steps. Only the engine is kept: it holds the optimizer, and
    nothing else may (``warm_up`` frees it)."""
    spec = ph.spec
    config = copy.deepcopy(made.model.config)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    if small:
        config = _smallest(config)
    _cut_vocabulary(config)
    with torch.device(ph.device):
        toy = setup_model(type(made.model)(config).to(DTYPES[spec.model.dtype]), spec)
    backend = ph.backend
    cfg = backend.config(spec, ph.world, sum(p.numel() for p in toy.parameters()))
    optimizer = backend.optimizer([{"params": list(toy.parameters())}], spec, ph.device, ph.world, lr=0.0)
    return backend.initialize(toy, optimizer, cfg), cfg["gradient_accumulation_steps"]


TOY_VOCAB = 1024
"""The warm-up toy's vocabulary, at most (``_cut_vocabulary``): the head's kernels are the same for any
number of rows, and at 7B the whole vocabulary's embedding and output layer with their optimizer state
were 3.7 GB of the one-layer toy's ~10, on the device beside the phase training and its switches
(benchmarks/results/2026-12-06-issue41-h100-resident: the switches with a warm-up in them 58.9 GB,
the others 46.7-50.9). ``orchestrator.estimate.warm_up_bytes`` still counts the whole vocabulary
(an upper bound) until a GPU run measures the cut toy."""


def _cut_vocabulary(config) -> None:
    """``config``'s vocabulary at most ``TOY_VOCAB`` rows, its special tokens within it (a padding row
    out of range is refused by the embedding); ``_toy_steps`` maps the phase's token ids into it."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= TOY_VOCAB:
        return
    config.vocab_size = TOY_VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, getattr(config, key) % TOY_VOCAB)


def _in_vocabulary(batch: dict[str, torch.Tensor], vocab: int) -> dict[str, torch.Tensor]:
    """The token ids and labels of ``batch`` taken modulo the toy's ``vocab`` (ignored labels stay -100)."""
    out = dict(batch)
    out["input_ids"] = batch["input_ids"] % vocab
    if "labels" in batch:
        out["labels"] = torch.where(batch["labels"] < 0, batch["labels"], batch["labels"] % vocab)
    return out


SMALL_TOKENS = 16
"""The tokens of the one row the smallest toy steps on (``small``): its logits keep the vocabulary, and
at the phase's micro-batch (4 x 512 x 32000 at 7B, 0.8 GB with the loss's copies) they did not fit a
waiting phase's share of a 24 GiB budget on an H100 (benchmarks/results/2026-12-07-issue42-h100)."""


def _toy_steps(ph: Phase, made: Prepared, engine, gas: int, small: bool = False) -> None:
    """One step of this phase's shape on the toy engine (``small``: on the first SMALL_TOKENS tokens
    of one row: the code paths, not the shape), and the step's small collective."""
    d = ph.spec.data
    for micro in range(gas):
        batch = micro_batch(made.examples, made.order, ph.spec.start_step, d.batch_size, micro, ph.rank,
                            ph.world, d.micro_batch_size)
        if small:
            batch = {k: v[:1, :SMALL_TOKENS] for k, v in batch.items()}
        batch = _in_vocabulary(batch, engine.module.config.vocab_size)
        engine.backward(token_loss(engine, batch, ph.device)[0])
        engine.step()
    flags = torch.zeros(2, device=ph.device)
    torch.distributed.all_reduce(flags)
    flags.tolist()


def memory_now() -> dict[str, float]:
    """Device memory on CUDA, this process's RSS elsewhere (bytes)."""
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "device_used": total - free, "device_free": free}
    return {"rss": psutil.Process().memory_info().rss}


def hash_seed(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1

