"""The schedule file's typed, validated sections and the phase table's rows (pydantic's errors in
the schedule's own words: ``orchestrator.schema_errors``).

Reading a file and checking it against the model, the data and the launch is ``orchestrator.validate``;
the model folder's checks are ``orchestrator.modelcheck``; the phase table is ``orchestrator.plan``.
Nothing here imports torch. docs/schedule.md is generated from the sections' field docstrings.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.datasection import DataSection, SourceSection  # noqa: F401 - the [data] section, its own module
from orchestrator.libfacts import deepspeed_refusal
from orchestrator.schedulesection import PhaseEntry, ScheduleSection  # noqa: F401 - [schedule], its own module
from orchestrator.sections import (  # noqa: F401
    KeyProblem, NonNegInt, NonNegSeconds, NonNegSteps, PositiveInt, Seconds, Section, Steps, _show, int_is_float,
)
from shard_tools.sizes import parse_size


class RunSection(Section):
    output_dir: str = "runs/default"
    """The run directory; relative to the schedule file."""
    seed: NonNegInt = 0
    """Seeds data order, random init and the lisa layer sampling: one seed, one run."""
    tensorboard: bool = False
    """Also write loss, lr, throughput and eval loss as TensorBoard events to RUN_DIR/tensorboard."""
    report_to: list[Literal["tensorboard", "wandb"]] = []
    """Where the metrics also go: "tensorboard" (as run.tensorboard; extra relayer[tensorboard]) and
    "wandb" (Weights & Biases, one W&B run per run directory, project $WANDB_PROJECT or relayer;
    extra relayer[wandb]). RUN_DIR/metrics.jsonl always has them."""
    final_model: bool = True
    """When the run completes, write the trained model as a Hugging Face folder (tokenizer files
    included, no reference to model.path) to RUN_DIR/final."""
    group_readable: bool = False
    """Make the run directory 0750 and its files 0640 (the group may read them) instead of 0700 / 0600;
    applies to what is written from then on."""


class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model directory (config.json + safetensors)."""
    config: dict[str, Any] | None = None
    """Or an inline config: a random init from it, seeded by run.seed."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Precision of the weights and the training step; the optimizer keeps fp32 masters."""
    persistent: list[str] | None = None
    """Module prefixes of the always-trained head; None: detected from the model family."""
    layers: str | None = None
    """Attribute path of the transformer layer list; None: detected."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory for about a third more compute (the
    same forward computed again). orchestrator plan counts each layer's input and one layer
    recomputed instead of every layer's activations (at 7B, batch 4 x 512: 0.77 GiB, not 8.5)."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer directory (tokenizer.json ...), relative to the schedule file;
    None: model.path. Text, instruction and chat data need one."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.path is None) == (self.config is None):
            raise KeyProblem("model", "expected exactly one of model.path and model.config")
        if self.config is not None and "model_type" not in self.config:
            raise KeyProblem("model.config", 'expected a model_type key (for example model_type = "llama")')
        if self.config is not None and not (isinstance(self.config["model_type"], str) and self.config["model_type"]):
            raise KeyProblem("model.config.model_type",
                             f'expected a model type name such as "llama", got {_show(self.config["model_type"])}')
        return self


class OptimizerSection(Section):
    lr: Annotated[float, Field(gt=0)] = 1e-3
    """Peak learning rate (AdamW)."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """AdamW weight decay; 1-D parameters (norms, biases) never decay."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """AdamW [beta1, beta2]."""
    eps: Annotated[float, Field(gt=0)] = 1e-8
    """AdamW epsilon."""
    grad_clip: Annotated[float, Field(ge=0)] = 1.0
    """Max global gradient norm; 0 turns clipping off."""

    _int_is_float = field_validator("lr", "weight_decay", "eps", "grad_clip", mode="before")(int_is_float)

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, v: Any) -> Any:
        if not isinstance(v, list | tuple) or len(v) != 2:
            raise KeyProblem("optimizer.betas", f"expected two numbers [beta1, beta2], got {_show(v)}")
        return tuple(int_is_float(x) for x in v)


class LrScheduleSection(Section):
    kind: Literal["constant", "linear", "cosine"] = "constant"
    """How the lr moves over the run's global steps after the warm-up: constant, linear or cosine decay to 0."""
    warmup_steps: NonNegSteps = 0
    """Steps of linear warm-up to lr, from where warmup_from says."""
    warmup_from: Literal["zero", "one_step"] = "zero"
    """zero: step s of the warm-up trains at lr x s / warmup_steps, so step 0 at 0, as Hugging
    Face's get_scheduler; one_step: at lr x (s + 1) / warmup_steps, so step 0 already at lr /
    warmup_steps (relayer's only warm-up before this key: runs started then resume with it)."""
    phase_warmup_steps: NonNegInt = 0
    """A warm-up after each switch: step s of every phase (from 0, the first phase too) trains at
    the lr above x (s + 1) / (phase_warmup_steps + 1) while s < phase_warmup_steps, so the new
    layers' fresh Adam state takes small steps first; 0: none."""


class DeepSpeedSection(Section):
    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage; checkpoints are the same for every stage. 0: no ZeRO, relayer's own
    AdamW over the same fp32 masters, one pass over each parameter's memory a step on CUDA: the
    fastest step on one GPU (bfloat16 or float32 models; every rank holds the whole optimizer state).
    Unset: 0 where every phase runs one process, the model is not float16 and no deepspeed.config
    is given (on one H100 the 7B LISA step was 1.020 x the Hugging Face Trainer's at 0, 1.127 x at
    2); else 2. ``orchestrator plan`` says which it chose."""
    config: dict[str, Any] | str = Field(default_factory=dict)
    """Merged into the generated DeepSpeed config: a table, or a DeepSpeed JSON file (relative to
    the schedule file) such as LMFlow, axolotl and LLaMA-Factory use. A key relayer derives from
    the schedule (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
    gradient_clipping, optimizer, scheduler, zero_optimization.stage, bf16.enabled, fp16.enabled)
    may appear only as "auto" or as relayer sets it; any other "auto" is dropped (relayer's or
    DeepSpeed's default stands). zero_optimization.offload_optimizer = { device = "cpu" } (ZeRO 1
    or 2) keeps the optimizer's state on the host, where torch's fused AdamW steps it (one pass over
    the partition), with DeepSpeed's host buffers pinned unless `pin_memory = false` is given: no
    optimizer state on the device, a slower step, the same AdamW up to rounding."""

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage(cls, v: Any) -> Any:
        if isinstance(v, bool):  # true == 1 to Python: read as stage 1
            raise KeyProblem("deepspeed.zero_stage", f"expected 0, 1, 2 or 3, got {_show(v)}")
        return v

    @field_validator("config", mode="before")
    @classmethod
    def _table_or_file(cls, v: Any) -> Any:
        if not isinstance(v, (dict, str)):  # not "dict[str,any]: expected a table" and "str: expected a string"
            raise KeyProblem("deepspeed.config", f"expected a table, or a DeepSpeed JSON file's path, got {_show(v)}")
        return v

    @model_validator(mode="after")
    def _engine_takes(self) -> DeepSpeedSection:
        """What DeepSpeed would refuse (or quietly ignore) once the first phase builds its engine."""
        # A file's table is checked where it is read (orchestrator.dsconfig), naming the file.
        if isinstance(self.config, dict) and (problem := deepspeed_refusal(self.config, self.zero_stage)):
            raise KeyProblem(*problem)
        return self


class LaunchSection(Section):
    launcher: Literal["local", "deepspeed", "torchrun", "slurm"] = "local"
    """How a phase's processes start: local (the fork server), deepspeed, torchrun or slurm (srun)."""
    nproc: PositiveInt = 1
    """Processes per node."""
    nnodes: PositiveInt = 1
    """Nodes; more than one needs launcher deepspeed (with hostfile), or slurm or torchrun in a SLURM allocation."""
    hostfile: str | None = None
    """DeepSpeed hostfile for several nodes; relative to the schedule file."""
    master_addr: Annotated[str, Field(min_length=1)] | None = None
    """Where phases on several nodes meet: an address of the first node that every node resolves;
    None: its NodeAddr under SLURM (scontrol show node), the hostfile's first host for deepspeed."""
    rendezvous_seconds: Seconds = 300.0
    """How long a phase's processes may take to meet before it fails, naming the address they waited at."""
    grace_seconds: Seconds = 30.0
    """How long a phase gets to stop after SIGTERM before SIGKILL."""
    stall_seconds: Seconds = 600.0
    """A phase that makes no progress (no step, no start-up stage, no checkpoint byte written) this
    long is stalled: its ranks' stacks are written, it is ended, the run exits 1. Before its first
    step and while it writes a checkpoint, where a phase may be quiet for long, it gets 4 times this
    (and at least 300 s for its imports, until its first start-up stage)."""
    prewarm: bool = True
    """Start each phase's processes while earlier ones train, to hide imports and setup."""
    prewarm_depth: PositiveInt = 3
    """How many phases ahead to start: more where a phase trains for less time than a start takes
    (each waiting phase holds a CUDA context and a host copy of the model)."""
    pause_preparing_seconds: NonNegSeconds = 30.0
    """While a phase switches (from the finished phase's last step to the next one's first), the
    phases still preparing further ahead are paused (SIGSTOP), for at most this long; 0: never."""
    handover: Literal["auto", "on", "off", "host"] = "auto"
    """How a finished phase's state reaches its pre-warmed successor: "auto" on the device (CUDA
    IPC) where the successor runs on the same GPUs with the same process count and ZeRO stage 1
    or 2 and the overlap fits, through host memory where the overlap is above launch.device_memory,
    else through the checkpoint; "on" also without a GPU (through a file: for testing the
    choreography on a CPU); "host" always through host memory (the predecessor's fp32 state in
    shared memory, its device memory freed before its successor builds; for a card that cannot
    hold two phases); "off" always through the checkpoint."""
    resident: Literal["auto", "on", "off"] = "auto"
    """Where the model's weights live: "auto" in one copy per GPU for the whole run, kept by a holder
    process that every phase maps instead of copying them (one model on the device at a switch, not
    two; a phase owns only what it trains), where the run has a GPU, forks its phases (prewarm, the
    local launcher, one node), runs every phase on as many processes and ZeRO stage 0-2 (under
    launch.device_memory, of a model the plan can size: the budget counts it once); "on" the same,
    also without a GPU (in host memory: for testing it on a CPU), and exit 2 where the run cannot;
    "off" every phase its own copy."""
    device_memory: str | None = None
    """The device memory relayer's processes may hold on one GPU, all of them together: a size
    (24GiB, 24GB, 24e9); None: the GPU's own. Each switch goes the first way that fits it: on the
    device, through host memory, through the checkpoint (orchestrator plan shows which and why); a
    schedule of which a phase alone does not fit is refused (exit 2) naming the keys that would
    make it fit (model.gradient_checkpointing, data.micro_batch_size, launch.prewarm_depth). Each
    process's allocator is capped at its share (torch.cuda.set_per_process_memory_fraction), the
    holder's copy of the model (launch.resident) counted once per GPU."""

    _int_is_float = field_validator("grace_seconds", "stall_seconds", "pause_preparing_seconds", "rendezvous_seconds",
                                    mode="before")(int_is_float)

    @field_validator("device_memory")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None and parse_size(v) is None:
            raise KeyProblem("launch.device_memory", f"expected a size such as 24GiB, 24GB or 24e9 (bytes), got {_show(v)}")
        return v

    @model_validator(mode="after")
    def _nodes(self) -> LaunchSection:
        if self.nnodes > 1 and self.launcher == "local":
            raise KeyProblem("launch.launcher", f'expected deepspeed, torchrun or slurm for {self.nnodes} nodes: '
                             '"local" starts processes on this node only')
        if self.nnodes > 1 and self.launcher == "deepspeed" and self.hostfile is None:
            raise KeyProblem("launch.hostfile", f"required with launcher deepspeed on {self.nnodes} nodes, but missing")
        return self


class EvalSection(Section):
    prompts: list[str] = Field(default_factory=list)
    """Prompts whose greedy continuations are generated at each evaluation (data.eval_every) and
    logged with it (metrics.jsonl's "generations", TensorBoard's text, W&B's table): each a user
    turn through the run's chat template where there is one, else the text as it is. Off: []."""
    max_new_tokens: PositiveInt = 16
    """Tokens generated for each prompt (greedy, ending early at the end-of-sequence token)."""


class CheckpointSection(Section):
    every_steps: NonNegSteps = 0
    """Mid-phase checkpoints for preemption; 0: only at phase ends."""
    every_seconds: NonNegSeconds = 300.0
    """Where a phase hands its state over to its successor (``launch.handover``), its end writes a
    checkpoint only once this long has passed since the last one; the successor carries what it
    trained on to the next. A stop (SIGTERM, SIGINT, SIGUSR1, SIGHUP) and the run's end always write one; a
    crash (SIGKILL, a lost node) costs the phases since the last, which the rerun trains again.
    0: a checkpoint at every phase end; where the state goes through the checkpoint (no handover),
    every phase end writes one anyway."""
    keep_last: PositiveInt = 2
    """Checkpoints kept whole; of older ones only the layers files a kept one composes from stay."""

    _int_is_float = field_validator("every_seconds", mode="before")(int_is_float)


class Schedule(Section):
    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection
    data: DataSection
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    lr_schedule: LrScheduleSection = Field(default_factory=LrScheduleSection)
    schedule: ScheduleSection
    deepspeed: DeepSpeedSection = Field(default_factory=DeepSpeedSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    eval: EvalSection = Field(default_factory=EvalSection)

    @model_validator(mode="after")
    def _stage_zero(self) -> Schedule:
        if self.deepspeed.zero_stage == 0 and self.model.dtype == "float16":
            raise KeyProblem("deepspeed.zero_stage", "0 (relayer's fp32-master AdamW, no ZeRO) takes model.dtype "
                             "bfloat16 or float32: float16 needs DeepSpeed's loss scaler, under ZeRO 1-3")
        return self


def cadence_seconds(s: Schedule) -> float:
    """The checkpoint cadence's seconds (``orchestrator.commit.Cadence``): ``checkpoint.every_seconds``,
    0 under ``schedule.optimizer_state = "keep"`` (every phase end parks its layers' kept Adam state
    in its checkpoint, whether it hands its state over or not)."""
    return 0.0 if s.schedule.optimizer_state == "keep" else s.checkpoint.every_seconds


def default_zero_stage(s: Schedule, worlds: set[int]) -> int | None:
    """deepspeed.zero_stage where the schedule leaves it unset (None where it is set), given the
    process counts of its phases: 0 on one process (ZeRO partitions nothing there and costs ~20 ms
    a 7B step), unless float16 (DeepSpeed's loss scaler) or a deepspeed.config brought along (its
    ZeRO keys, an axolotl zero2.json's stage) asks for DeepSpeed's optimizer; else 2."""
    if "zero_stage" in s.deepspeed.model_fields_set:
        return None
    alone = worlds == {1} and s.model.dtype != "float16" and not s.deepspeed.config
    return 0 if alone else 2


class Phase(BaseModel):
    """One planned phase: global steps [start_step, end_step), its body layers and process count."""

    model_config = ConfigDict(frozen=True)
    index: int
    start_step: int
    end_step: int
    layers: tuple[int, ...]
    nproc: int
    modules: tuple[str, ...] = ()
    """The module units it trains of ``layers`` ("<layer>.<module path>"); empty: each layer whole."""
    drawn_later: bool = False
    """Its layers are drawn as the run goes (schedule.layer_weights = "grad_norm", ``orchestrator.importance``);
    until then ``layers`` stands in for them (as many, drawn uniformly)."""

    @property
    def steps(self) -> int:
        return self.end_step - self.start_step


class LoadedSchedule(BaseModel):
    """A validated schedule with its paths resolved and its facts about the model read."""

    model_config = ConfigDict(frozen=True)
    source: Path
    schedule: Schedule
    raw: dict[str, Any]
    num_layers: int
    model_path: Path | None
    data_path: Path
    """The data file (with data.sources, the first source's)."""
    output_dir: Path
    nproc_override: int | None = None
    """--nproc: the process count of every phase, over launch.nproc and per-phase nproc."""
    data_check: dict[str, Any] | None = None
    """The data step's answer (``orchestrator.datastep``), where loading needed it: schedule.epochs."""
    layer_tensors: dict[int, dict[str, list[int]]] = {}
    """Under module units (``ScheduleSection.by_modules``): each body layer's tensors, past its prefix
    and index, with their shapes (``orchestrator.units``)."""
    deepspeed_config: dict[str, Any] = {}
    """deepspeed.config as merged: its table, or its file's, checked (``orchestrator.dsconfig``)."""

    @property
    def total_steps(self) -> int | None:
        """With a strategy: the run's optimizer steps, given or from schedule.epochs and the data."""
        sc, batch = self.schedule.schedule, self.schedule.data.batch_size
        if sc.epochs is None:
            return sc.total_steps
        assert self.data_check is not None, "schedule.epochs needs the data step's rows"
        return math.ceil(round(sc.epochs * self.data_check["stats"]["train"]["rows"]) / batch)
