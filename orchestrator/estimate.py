"""How much device memory each phase needs, per process, from config.json and the schedule alone.

    orchestrator plan schedule.toml --device-memory 80GiB

Per process, for one phase of a model with P parameters of which T train (head + the phase's layers):

    weights      P x dtype bytes; partitioned over the processes under ZeRO-3
    optimizer    T x 12 bytes (fp32 master weights, Adam exp_avg, exp_avg_sq); partitioned under ZeRO >= 1;
                 none on the device where deepspeed.config offloads it (zero_optimization.offload_optimizer)
    gradients    T x dtype bytes; partitioned under ZeRO >= 2; under ZeRO 1 and 2 also DeepSpeed's
                 reduce bucket (reduce_bucket_size x dtype bytes); offloaded, only that bucket and the
                 largest trainable parameter x (dtype + 4) bytes (DeepSpeed's device buffer for its
                 gradient and the fp32 copy made on the way to the host); under ZeRO 0 (relayer's
                 MasterAdamW) T x (dtype + 4) bytes: its fp32 gradient buffer beside the gradients as
                 they come (a bound: with one micro-batch a step on one GPU its kernel needs no buffer)
    activations  micro_batch x seq_len x hidden x layers x ACTIVATION_VALUES x dtype bytes; with
                 model.gradient_checkpointing, micro_batch x seq_len x hidden x dtype bytes x
                 (layers x CHECKPOINTED_VALUES + ACTIVATION_VALUES): each layer keeps only its input
                 and backward recomputes one layer at a time (``activation_bytes``); and the logits,
                 micro_batch x seq_len x vocab x LOGIT_BYTES

At a switch that hands the state over on the device (``launch.handover``, orchestrator/handover.py),
the finished phase P and its successor S are both alive on one device for a while, beside the
phases that wait pre-warmed. The overlap's peak on one device, as NVML sees it:

    let_go(P) + offered (ZeRO: P's gathered copy) + taking(S) + waiting
    let_go       a finished phase once it offered: its weights + its optimizer state (under ZeRO its
                 gradients too) x RESERVE + PROCESS_BYTES; it gives its gradients and its allocator's
                 cache back as it offers (``launch.handover``)
    on_device    a phase's weights + the rest of its total x RESERVE + PROCESS_BYTES; with the
                 holder's copy, at ZeRO stage 0 the optimizer's state (relayer's MasterAdamW, flat
                 buffers allocated once) without the reserve too, in this and in let_go
    taking       with the holder's copy, S's on_device where its copy of the offer (dropped once its
                 engine holds the state, before its first step) stands for its gradients and
                 activations, whichever is more; with a copy per phase, offered + on_device(S)
    offered      head x 12 bytes (fp32 masters, exp_avg, exp_avg_sq of the whole head, gathered: not
                 ZeRO's partition) + P's layers x per_layer x 4 bytes (their fp32 masters); under
                 ZeRO 0 P offers its optimizer's own memory, so it counts only in S's copy
    waiting      the phases pre-warmed beyond S (launch.prewarm_depth, as many as are left): with the
                 holder's copy each its CUDA context (CONTEXT_BYTES) and one warm-up (they warm up one
                 at a time: a toy of one layer, its whole phase); under launch.device_memory, or with
                 a copy per phase, each PROCESS_BYTES

With one copy of the model per device (``launch.resident``, on a GPU by default), the holder keeps
the model's weights (P x dtype bytes) and its CUDA context (``CONTEXT_BYTES``) for the whole run,
and a phase's weights are only what it trains (T x dtype bytes, its own copies): the overlap counts
one model, not two, and so does a device budget (``orchestrator.budget``).

P holds its whole phase's memory and, beside it, the copies it gathered to offer; S has copied the
same bytes into its own memory before it answers and before P lets go of anything; its engine is
built right after, and its first step (gradients, activations) comes once the copy is dropped,
while P may still be alive (writing its checkpoint). The phase totals below count
allocated bytes; a device holds more: every CUDA process a fixed part (``PROCESS_BYTES``: its
context, library workspaces, what a phase's warm-up leaves), and a training process's caching
allocator a reserve above its allocated peak (``RESERVE``), counted on all but the weights, which
lie in blocks allocated once (the frozen ones in one, ``launch.staging``; the trained ones in the
optimizer's flat buffers). At 7B under a budget of 24 GiB on an H100 (micro-batches of 4, gradient
checkpointing, the optimizer on the host, one phase waiting) the phase's total is 16.9 GB against
16.1-16.5 GB allocated at its peak, and the plan's 22.9 GB against NVML's 22.8 GB outside the
switches (benchmarks/results/2026-12-06-issue42-h100-7b). The constants were measured on an H200
(benchmarks/results/2026-12-01-handover-h200, NVML per process): a waiting phase held 2.54 GB at
1.1B and 2.12 GB at 7B; a training process 12.6 GB at 1.1B (8.5 GB allocated at its peak) and
41.35 GB at 7B (31.8 GB). At 7B on one H200 the formula gives 102.4 GB with three phases waiting;
NVML saw 83-103.5 GB (run7). With the holder's copy (one H100, 7B, stage 0,
benchmarks/results/2026-12-06-issue41-h100-resident): 61.6 GB planned with three phases waiting against
NVML's 58.9 GB at the switches one of them warmed up in, and 46.1-49.2 GB where none waits against
45.0-46.7 GB. The successor's worker compares this number
(``HandoverPart.peak_bytes``) with its device's memory and reads the checkpoint instead where it
does not fit.

Not counted in a phase's total: the CUDA context and allocator slack (counted by ``on_device``),
ZeRO-3's prefetch and the layers it gathers while they run. Treat the total as a lower bound with
a margin.

Parameter counts follow the modules transformers builds for each family; tests compare them with
real models. No torch here: the orchestrator never imports it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from launch.contract.dsconfig import bucket_size
from orchestrator.errors import ScheduleError
from orchestrator.libfacts import offloads_optimizer
from orchestrator.modelcheck import CONFIG, num_layers_of
from orchestrator.resident import resident_reason
from orchestrator.schedule import LoadedSchedule, Phase
from orchestrator.units import unit_size
from shard_tools.sizes import parse_size

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAM_BYTES = 12
MASTER_BYTES = 4
# Values a transformer layer keeps for backward per token per hidden unit, without gradient
# checkpointing: 34 bytes per token per hidden unit in 16-bit in Korthikanti et al. 2022
# ("Reducing Activation Recomputation in Large Transformer Models", table 2), without the
# attention-score term that SDPA / flash attention no longer keep. Every layer counts, trained or
# frozen: the embedding trains, so the backward pass runs through the whole stack.
ACTIVATION_VALUES = 17
# With gradient checkpointing (transformers' ``gradient_checkpointing_enable``, non-reentrant
# torch.utils.checkpoint around each decoder layer) a layer keeps for backward only its input, the
# hidden state: 2sbh bytes in 16-bit, the "full activation recomputation" row of the same table 2
# (Korthikanti et al. 2022, section 4; Chen et al. 2016, "Training Deep Nets with Sublinear Memory
# Cost", for the scheme). In backward each layer's forward runs again, its activations held
# (ACTIVATION_VALUES) only until its own backward ends: one layer's worth on top of the inputs.
CHECKPOINTED_VALUES = 1
# What NVML sees on a device beyond a phase's allocated bytes (see the module's docstring), rounded
# up from the H200 measurements: per CUDA process, and the caching allocator's reserve.
PROCESS_BYTES = 2_600_000_000
# Of it, the part outside a process's caching allocator: its CUDA context and library handles (a bare
# process that initialised CUDA held about 0.5 GB on the H100 and the H200). The rest is what a phase
# waiting pre-warmed may allocate under a budget (``budget.waiting_cap``).
CONTEXT_BYTES = 600_000_000
RESERVE = 1.25
# The logits' bytes per element (micro_batch x seq_len x vocab) at their peak: the model's bf16 logits,
# the loss's fp32 copy and log-softmax, and in backward an fp32 gradient of one of them; at 7B (micro
# batch 4 x 512, vocab 32000) 0.79 GB, where the phase's allocated peak was 16.1-16.5 GB on an H100
# with the terms above (benchmarks/results/2026-12-06-issue42-h100-7b).
LOGIT_BYTES = 12

# Config defaults of each family's transformers config class, for keys a config.json leaves out.
_LLAMA = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
          "num_key_value_heads": None, "head_dim": None, "tie_word_embeddings": False, "attention_bias": False,
          "mlp_bias": False}
_DEFAULTS = {
    "llama": _LLAMA,
    "mistral": {**_LLAMA, "intermediate_size": 14336, "num_key_value_heads": 8},
    "qwen2": {**_LLAMA, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32},
    "qwen3": {**_LLAMA, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32, "head_dim": 128},
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_head": 12, "n_inner": None,
             "tie_word_embeddings": True},
}
# Families whose attention projections carry biases whatever the config says (q, k, v; not o).
_QKV_BIAS = {"qwen2"}
SUPPORTED = tuple(_DEFAULTS)


class EstimateError(ValueError):
    """The model's config cannot be sized (an unknown family or a missing key)."""


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a model by part: each head module, one body layer, and how many layers."""

    head: dict[str, int]
    """Module prefix -> parameters; a tied lm_head counts 0 (its weight is the embedding's)."""
    per_layer: int
    num_layers: int
    hidden: int
    vocab: int = 0
    """The logits' width (0: not counted)."""

    @property
    def total(self) -> int:
        return sum(self.head.values()) + self.per_layer * self.num_layers


def _int(cfg: dict[str, Any], key: str) -> int:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise EstimateError(f"{key}: expected a positive integer, got {value!r}")
    return value


def param_count(config: dict[str, Any]) -> ParamCount:
    """Parameter counts from a Hugging Face config dict (config.json or an inline model.config)."""
    family = config.get("model_type")
    if family not in _DEFAULTS:
        raise EstimateError(f"model type {family!r} has no parameter count formula "
                            f"(known: {', '.join(SUPPORTED)})")
    cfg = {**_DEFAULTS[family], **config}
    layers = num_layers_of(cfg)
    if layers is None:
        raise EstimateError("num_hidden_layers: expected a positive integer")
    if family == "gpt2":
        return _gpt2(cfg, layers)
    return _llama_like(cfg, family, layers)


def _llama_like(cfg: dict[str, Any], family: str, layers: int) -> ParamCount:
    vocab, hidden, inter = _int(cfg, "vocab_size"), _int(cfg, "hidden_size"), _int(cfg, "intermediate_size")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = cfg["num_key_value_heads"] or heads
    head_dim = cfg["head_dim"] or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    if family in _QKV_BIAS:
        attention += q + 2 * kv
    elif cfg.get("attention_bias"):
        attention += q + 2 * kv + hidden
    mlp = 3 * hidden * inter + (2 * inter + hidden if cfg.get("mlp_bias") else 0)
    qk_norms = 2 * head_dim if family == "qwen3" else 0
    per_layer = attention + mlp + qk_norms + 2 * hidden
    embed = vocab * hidden
    head = {"model.embed_tokens": embed, "lm_head": 0 if cfg["tie_word_embeddings"] else embed, "model.norm": hidden}
    return ParamCount(head=head, per_layer=per_layer, num_layers=layers, hidden=hidden, vocab=vocab)


def _gpt2(cfg: dict[str, Any], layers: int) -> ParamCount:
    vocab, positions, hidden = _int(cfg, "vocab_size"), _int(cfg, "n_positions"), _int(cfg, "n_embd")
    inner = cfg["n_inner"] or 4 * hidden
    # ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj (Conv1D: weight and bias each).
    per_layer = 2 * hidden + (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) + 2 * hidden \
        + (hidden * inner + inner) + (inner * hidden + hidden)
    embed = vocab * hidden
    head = {"transformer.wte": embed, "transformer.wpe": positions * hidden, "transformer.ln_f": 2 * hidden,
            "lm_head": 0 if cfg["tie_word_embeddings"] else embed}
    return ParamCount(head=head, per_layer=per_layer, num_layers=layers, hidden=hidden, vocab=vocab)


@dataclass(frozen=True)
class PhaseMemory:
    """Estimated bytes one process of a phase holds on its device."""

    weights: int
    optimizer: int
    gradients: int
    activations: int
    flat_optimizer: bool = False
    """The optimizer's state lies in buffers allocated once (relayer's MasterAdamW, ZeRO stage 0): no
    allocator reserve above it, as above the weights. Counted so with the holder's copy of the model
    (measured so on an H100); the H200's constants, of a copy per phase, keep the reserve."""

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.gradients + self.activations

    @property
    def unreserved(self) -> int:
        """The bytes NVML sees as allocated, without the caching allocator's reserve above them."""
        return self.weights + (self.optimizer if self.flat_optimizer else 0)


def activation_bytes(count: ParamCount, *, width: int, micro_batch: int, seq_len: int,
                     checkpointing: bool = False) -> int:
    """Bytes the forward pass keeps for backward, at its peak: every layer's activations, or with
    ``checkpointing`` every layer's input and one layer's recomputed activations."""
    values = (count.num_layers * CHECKPOINTED_VALUES + ACTIVATION_VALUES if checkpointing
              else count.num_layers * ACTIVATION_VALUES)
    return micro_batch * seq_len * count.hidden * values * width


def phase_memory(count: ParamCount, trainable: int, *, dtype: str, zero_stage: int, world: int,
                 micro_batch: int, seq_len: int, checkpointing: bool = False, offload: bool = False,
                 bucket: int = 0, largest: int = 0, resident: bool = False) -> PhaseMemory:
    """``bucket``: ZeRO's reduce bucket in elements (stages 1 and 2); ``largest``: the largest
    trainable parameter's elements (what the offload stages on the device); ``resident``: the
    model's weights are the holder's (``launch.resident``), the phase's own only what it trains."""
    width = DTYPE_BYTES[dtype]
    return PhaseMemory(
        weights=trainable * width if resident else math.ceil(count.total * width / (world if zero_stage >= 3 else 1)),
        optimizer=0 if offload else math.ceil(trainable * ADAM_BYTES / (world if zero_stage >= 1 else 1)),
        gradients=gradient_bytes(trainable, width=width, zero_stage=zero_stage, world=world, offload=offload,
                                 bucket=bucket, largest=largest),
        activations=activation_bytes(count, width=width, micro_batch=micro_batch, seq_len=seq_len,
                                     checkpointing=checkpointing) + micro_batch * seq_len * count.vocab * LOGIT_BYTES,
        flat_optimizer=zero_stage == 0 and resident,
    )


def gradient_bytes(trainable: int, *, width: int, zero_stage: int, world: int, offload: bool, bucket: int,
                   largest: int) -> int:
    """The gradients' device memory: relayer's MasterAdamW's (stage 0); ZeRO's partition and its
    reduce bucket (stages 1-2; 3 its partition); offloaded, the bucket, and the largest parameter's
    gradient staged for the host (DeepSpeed's buffer of it) and copied to fp32 before the copy out."""
    if zero_stage == 0:
        return trainable * (width + MASTER_BYTES)
    reduce = bucket * width if zero_stage in (1, 2) else 0
    if offload:
        return reduce + largest * (width + MASTER_BYTES)
    return math.ceil(trainable * width / (world if zero_stage >= 2 else 1)) + reduce


def offered_bytes(count: ParamCount, head: int, layers: int) -> int:
    """What one process of a finished phase gathers for its successor: the ``head`` parameters' fp32
    masters and Adam moments in full, and the fp32 masters of its ``layers`` body layers."""
    return head * ADAM_BYTES + layers * count.per_layer * MASTER_BYTES


def on_device(memory: PhaseMemory) -> int:
    """Bytes NVML sees for one training process of a phase: its weights, the rest with its allocator's
    reserve, and its fixed part. The weights lie in one block (the frozen ones, ``launch.staging``)
    and at ZeRO stage 0 the optimizer's state in flat buffers, each allocated once: no reserve above
    them."""
    return memory.unreserved + math.ceil((memory.total - memory.unreserved) * RESERVE) + PROCESS_BYTES


def let_go(memory: PhaseMemory, zero: bool) -> int:
    """Bytes NVML sees for a finished phase once it has offered its state: its gradients and its
    allocator's cache are given back (``launch.handover``); under ZeRO (``zero``) its gradient
    partitions and reduce buckets are counted still."""
    reserved = (0 if memory.flat_optimizer else memory.optimizer) + (memory.gradients if zero else 0)
    return memory.unreserved + math.ceil(reserved * RESERVE) + PROCESS_BYTES


def taking(memory: PhaseMemory, offered: int) -> int:
    """Bytes NVML sees for the successor at its peak in a handover: its whole phase, where the copy it
    made of the offer (dropped once its engine holds the state, before its first step) stands in
    for its gradients and activations, whichever is more."""
    reserved = memory.total - memory.unreserved - memory.gradients - memory.activations
    return memory.unreserved + math.ceil((reserved + max(offered, memory.gradients + memory.activations)) * RESERVE) \
        + PROCESS_BYTES


def overlap_peak(before: PhaseMemory, after: PhaseMemory, offered: int, waiting: int, gathered: bool = True,
                 resident: bool = False) -> int:
    """Bytes on one device while a phase hands over to its successor: the finished phase as it is
    once it offered (``let_go``), the offer where ``gathered`` (ZeRO's; relayer's MasterAdamW offers
    its own memory), the successor's copy of it and its whole phase, and ``waiting``: the bytes of
    the phases waiting pre-warmed beside them (``waiting_bytes``). With the holder's copy of the
    model (``resident``: measured so, on an H100) the copy counts inside the successor's peak
    (``taking``); with a copy of the model per phase as the H200's constants were measured, beside it.
    The switch holds less since (no copy of the offer, the body's moments given back, the warm-up's
    vocabulary cut: docs/design.md); until measured on a GPU this counts as measured, an upper bound."""
    successor = taking(after, offered) if resident else offered + on_device(after)
    return let_go(before, gathered) + (offered if gathered else 0) + successor + waiting


def warm_up_bytes(count: ParamCount, *, dtype: str, zero_stage: int, world: int, micro_batch: int, seq_len: int,
                  checkpointing: bool, offload: bool, bucket: int) -> int:
    """Bytes NVML sees for a waiting phase's warm-up beyond its context: a toy of the model with one
    layer, every parameter trained (``launch.prepare.warm_up``), one step of the phase's shape. Its
    memory goes back before the go, and the waiting phases warm up one at a time on a GPU."""
    toy = ParamCount(head=count.head, per_layer=count.per_layer, num_layers=1, hidden=count.hidden, vocab=count.vocab)
    m = phase_memory(toy, toy.total, dtype=dtype, zero_stage=zero_stage, world=world, micro_batch=micro_batch,
                     seq_len=seq_len, checkpointing=checkpointing, offload=offload, bucket=bucket,
                     largest=max(count.head.values(), default=0))
    # Its weights are its own, its optimizer's buffers as flat as a phase's.
    return on_device(replace(m, flat_optimizer=zero_stage == 0)) - PROCESS_BYTES


def waiting_bytes(waiting: int, warm_up: int, resident: bool, capped: bool) -> int:
    """Bytes of ``waiting`` phases pre-warmed beside a handover: with the holder's copy of the model
    (``resident``) and no device budget, each its CUDA context (its parameters map the holder's
    block) and one warm-up, as they warm up one at a time (measured so on an H100); else each
    ``PROCESS_BYTES``: under a budget (``capped``) that is its share (``orchestrator.budget``: its
    allocator capped at that less its context), with a copy per phase the H200's constant."""
    if capped or not resident:
        return waiting * PROCESS_BYTES
    return waiting * CONTEXT_BYTES + (warm_up if waiting else 0)


def waiting_beside(loaded: LoadedSchedule, phases: list[Phase], successor: int) -> int:
    """How many pre-warmed phases wait on the device while phase ``successor`` takes over: up to
    ``launch.prewarm_depth`` of the phases after it (the runner starts one more at its go)."""
    launch = loaded.schedule.launch
    if not launch.prewarm or launch.nnodes > 1 or launch.launcher == "slurm":
        return 0
    return min(launch.prewarm_depth, len(phases) - successor - 1)


def model_config(loaded: LoadedSchedule) -> dict[str, Any]:
    if loaded.schedule.model.config is not None:
        return loaded.schedule.model.config
    assert loaded.model_path is not None
    return json.loads((loaded.model_path / CONFIG).read_text())


@dataclass(frozen=True)
class PlanEstimate:
    phases: list[PhaseMemory]
    count: ParamCount
    unsized: list[str]
    """model.persistent entries that are not a head module the formula knows: counted as 0."""
    overlaps: list[int]
    """Per switch (phase i to i + 1, so one fewer than phases), the overlap's peak on one device
    were it to hand over on the device (``overlap_peak``), whether or not it will; it falls
    towards the run's end, as fewer phases wait pre-warmed. With ``resident``, the holder's too."""
    resident: int = 0
    """Bytes the holder keeps on each device for the whole run (the model's weights, in one block
    its allocator reserves exactly, and its CUDA context, ``CONTEXT_BYTES``: it only copies;
    ``launch.resident`` on a GPU); 0: every phase has a copy of its own."""


def trained_head(loaded: LoadedSchedule, count: ParamCount) -> int:
    """The head parameters every phase trains (model.persistent; all of the head by default)."""
    persistent = loaded.schedule.model.persistent
    return sum(count.head.get(p, 0) for p in (persistent if persistent is not None else count.head))


def estimate_plan(loaded: LoadedSchedule, phases: list[Phase]) -> PlanEstimate:
    """Per phase, the memory one of its processes needs, and per switch the handover's overlap peak,
    in the layout of a GPU (the holder's copy of the model where ``orchestrator.resident`` says so);
    raises EstimateError for an unknown family."""
    s = loaded.schedule
    count = param_count(model_config(loaded))
    persistent = s.model.persistent if s.model.persistent is not None else list(count.head)
    head = sum(count.head.get(p, 0) for p in persistent)
    # The largest trainable parameter: a head module (the embedding), or a layer's largest matrix,
    # taken as a quarter of the layer (a Llama layer's MLP matrix is 0.22 of it).
    largest = max([count.head.get(p, 0) for p in persistent] + [count.per_layer // 4])
    resident = resident_reason(loaded, phases, gpus=1) is None  # on a GPU: what this counts
    out = [phase_memory(count, trainable, dtype=s.model.dtype, zero_stage=s.deepspeed.zero_stage,
                        world=ph.nproc * s.launch.nnodes, micro_batch=s.data.micro_batch_size, seq_len=s.data.seq_len,
                        checkpointing=s.model.gradient_checkpointing, offload=offloads_optimizer(loaded.deepspeed_config),
                        bucket=reduce_bucket(loaded, trainable), largest=largest, resident=resident)
           for ph in phases for trainable in [head + body_trained(loaded, ph, count)]]
    held = count.total * DTYPE_BYTES[s.model.dtype] + CONTEXT_BYTES if resident else 0
    warm = warm_up_bytes(count, dtype=s.model.dtype, zero_stage=s.deepspeed.zero_stage,
                         world=phases[0].nproc * s.launch.nnodes if phases else 1, micro_batch=s.data.micro_batch_size,
                         seq_len=s.data.seq_len, checkpointing=s.model.gradient_checkpointing,
                         offload=offloads_optimizer(loaded.deepspeed_config),
                         bucket=reduce_bucket(loaded, sum(count.head.values()) + count.per_layer))
    capped = s.launch.device_memory is not None
    overlaps = [held + overlap_peak(out[i], out[i + 1], offered_bytes(count, head, len(phases[i].layers)),
                                    waiting_bytes(waiting_beside(loaded, phases, i + 1), warm, resident, capped),
                                    gathered=s.deepspeed.zero_stage > 0, resident=resident)
                for i in range(len(phases) - 1)]
    return PlanEstimate(phases=out, count=count, unsized=[p for p in persistent if p not in count.head],
                        overlaps=overlaps, resident=held)


def body_trained(loaded: LoadedSchedule, phase: Phase, count: ParamCount) -> int:
    """The body parameters ``phase`` trains: its layers whole, or its module units' tensors (as the
    weights' headers count them; the rest of those layers waits on the host)."""
    if not phase.modules:
        return len(phase.layers) * count.per_layer
    return sum(unit_size(loaded.layer_tensors[int(layer)], path)
               for layer, _, path in (unit.partition(".") for unit in phase.modules))


def reduce_bucket(loaded: LoadedSchedule, trainable: int) -> int:
    """ZeRO's reduce bucket in elements: the schedule's deepspeed.config where it sets one, else
    relayer's (``launch.contract.dsconfig.bucket_size``)."""
    zero = loaded.deepspeed_config.get("zero_optimization")
    size = zero.get("reduce_bucket_size") if isinstance(zero, dict) else None
    return int(size) if isinstance(size, (int, float)) and not isinstance(size, bool) else bucket_size(trainable)


def size_option(text: str, option: str) -> int:
    """Bytes from 80GiB, 80GB, 141e9 or 1.5TiB (``parse_size``); a ScheduleError naming ``option`` otherwise."""
    size = parse_size(text)
    if size is None:
        raise ScheduleError(f"{option}: expected a size such as 80GiB, 80GB or 141e9 (bytes), got {text!r}")
    return size
