"""The schedule file: TOML parsed into typed, validated sections, and the phase plan derived from it.

Validation happens here, once; every error names the key (``model.dtype``) or the file. Nothing in
this module imports torch: model facts (layer count, family) come from ``config.json``.
"""

from __future__ import annotations

import difflib
import errno
import importlib.util
import json
import math
import os
import random
import re
import shutil
import stat
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from launch.contract import FIELDS, is_template_path
from orchestrator.errors import ScheduleError
from shard_tools.inspect import tensor_headers
from shard_tools.manifest import CheckpointError

PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]

MAX_PHASES = 100_000
"""A schedule of more phases is refused: at a second or more per switch, more than a day of switching."""
MAX_PLANNED_LAYERS = 10_000_000
"""Phases x layers_per_phase, the size of the phase table a strategy builds."""


class KeyProblem(ValueError):
    """A check that spans several keys, raised inside a section; ``key`` is the dotted key to blame."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are not coerced across types."""

    # Attribute docstrings become field descriptions: docs/schedule.md is generated from them.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


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
    """Recompute activations in backward: less memory for about a third more compute."""
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


class DataSection(Section):
    path: str
    """A .jsonl, .json (an array or JSON lines), .parquet, .csv, .arrow or .txt file, or a folder
    written by datasets.save_to_disk; relative to the schedule file."""
    format: Literal["tokens", "text", "instruction", "chat"] = "tokens"
    """tokens: {"input_ids": [...], "labels": [...] (optional, aligned as in Hugging Face; -100: no
    loss)}; text: a .txt file (documents separated by blank lines) or {"text": "..."} records, loss
    on every token; instruction: Alpaca {"instruction", "input", "output"}, loss on the output and
    its EOS; chat: {"messages": [{"role", "content"}]} or ShareGPT {"conversations": [{"from",
    "value"}]}, rendered with the chat template, loss on the assistant turns."""
    pack: bool | None = None
    """Concatenate examples into seq_len rows, each example's labels kept (an example's first
    token is never a target of the one before). false: one example a row, padded or cut to
    seq_len. Default: true for text (a stream of documents, as before), false for the others (an
    example is never cut in two, nor attends to another)."""
    train_on_prompt: bool = False
    """instruction and chat: the prompt and the system/user turns carry loss too."""
    chat_template: str | None = None
    """A Jinja chat template, or a file holding one (relative to the schedule file), used instead
    of the tokenizer's; a value without "{" is a file."""
    fields: dict[str, str] | None = None
    """Record field names where the data names them otherwise, by their default names: text;
    instruction, input, output; messages, conversations; input_ids, labels. Example:
    {instruction = "prompt", output = "answer"}."""
    seq_len: PositiveInt = 128
    """Tokens per example."""
    batch_size: PositiveInt = 8
    """Examples per optimizer step over all processes; kept when the process count changes."""
    micro_batch_size: PositiveInt = 1
    """Examples per process per forward pass."""
    shuffle: bool = True
    """Shuffle the examples, seeded by run.seed."""
    validation_path: str | None = None
    """Held-out data in the same format; its mean loss goes to metrics.jsonl as eval_loss."""
    eval_every: NonNegInt = 0
    """Evaluate every this many global steps (and so also across phases); 0: never."""

    @model_validator(mode="after")
    def _fields(self) -> DataSection:
        for name in self.fields or {}:
            if name not in FIELDS[self.format]:
                raise KeyProblem(f"data.fields.{name}", f'not a field of data.format = "{self.format}"; expected one '
                                 f"of {', '.join(FIELDS[self.format])}")
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

    @field_validator("lr", "weight_decay", "eps", "grad_clip", mode="before")
    @classmethod
    def _int_is_float(cls, v: Any) -> Any:
        # TOML writes 0 and 1 as integers; strict mode would refuse them as floats.
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, v: Any) -> Any:
        if not isinstance(v, list | tuple) or len(v) != 2:
            raise KeyProblem("optimizer.betas", f"expected two numbers [beta1, beta2], got {_show(v)}")
        return tuple(float(x) if isinstance(x, int) and not isinstance(x, bool) else x for x in v)


class LrScheduleSection(Section):
    kind: Literal["constant", "linear", "cosine"] = "constant"
    """How the lr moves over the run's global steps after the warm-up: constant, linear or cosine decay to 0."""
    warmup_steps: NonNegInt = 0
    """Steps of linear warm-up from lr / warmup_steps to lr."""


class PhaseEntry(Section):
    steps: PositiveInt
    """Optimizer steps of this phase."""
    layers: Annotated[list[NonNegInt], Field(min_length=1)]
    """Body layers this phase trains (0-based), besides the head."""
    nproc: PositiveInt | None = None
    """Processes per node for this phase; None: launch.nproc. --nproc overrides both."""

    @field_validator("layers")
    @classmethod
    def _distinct(cls, v: list[int]) -> list[int]:
        twice = sorted({x for x in v if v.count(x) > 1})
        if twice:
            raise ValueError(f"expected distinct layers, got {v} (layer {twice[0]} appears twice)")
        return v


class ScheduleSection(Section):
    phases: list[PhaseEntry] | None = None
    """Explicit phases, in order: [{ steps = 10, layers = [0] }, ...]; or use strategy."""
    strategy: Literal["lisa", "ascending", "descending"] | None = None
    """lisa: layers sampled at random each phase (seeded by run.seed); ascending / descending: in turn."""
    total_steps: PositiveInt | None = None
    """With strategy: optimizer steps of the whole run."""
    interval: PositiveInt | None = None
    """With strategy: steps per phase (the last phase may be shorter)."""
    layers_per_phase: PositiveInt | None = None
    """With strategy: body layers trained per phase."""

    @model_validator(mode="after")
    def _one_form(self) -> ScheduleSection:
        strategy_keys = {k: getattr(self, k) for k in ("total_steps", "interval", "layers_per_phase")}
        if self.phases is not None:
            given = [k for k in ("strategy", *strategy_keys) if getattr(self, k) is not None]
            if given:
                raise KeyProblem(f"schedule.{given[0]}", "expected either schedule.phases or schedule.strategy "
                                 "(with total_steps, interval, layers_per_phase), not both")
            if not self.phases:
                raise KeyProblem("schedule.phases", "expected at least one phase, got an empty list")
        else:
            if self.strategy is None:
                raise KeyProblem("schedule", "expected schedule.phases or schedule.strategy")
            missing = [k for k, v in strategy_keys.items() if v is None]
            if missing:
                raise KeyProblem(f"schedule.{missing[0]}",
                                 f"required with schedule.strategy = {_show(self.strategy)}, but missing")
        return self


# DeepSpeed config keys that relayer derives from the schedule; setting them twice would disagree.
DERIVED_DEEPSPEED_KEYS = {
    "train_batch_size": "data.batch_size",
    "train_micro_batch_size_per_gpu": "data.micro_batch_size",
    "gradient_accumulation_steps": "data.batch_size / (data.micro_batch_size x processes)",
    "gradient_clipping": "optimizer.grad_clip",
    "optimizer": "[optimizer] (relayer builds its own AdamW)",
    "scheduler": "[lr_schedule]",
    "zero_optimization.stage": "deepspeed.zero_stage",
    "bf16.enabled": "model.dtype",
    "fp16.enabled": "model.dtype",
}


# Sections of the generated DeepSpeed config that deepspeed.config merges into, key by key.
MERGED_DEEPSPEED_TABLES = ("zero_optimization", "bf16", "fp16")


class DeepSpeedSection(Section):
    zero_stage: Literal[1, 2, 3] = 2
    """DeepSpeed ZeRO stage; checkpoints are the same for every stage."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Merged into the generated DeepSpeed config."""

    @model_validator(mode="after")
    def _not_derived(self) -> DeepSpeedSection:
        for section in MERGED_DEEPSPEED_TABLES:
            if section in self.config and not isinstance(self.config[section], dict):
                raise KeyProblem(f"deepspeed.config.{section}",
                                 f"expected a table (merged into relayer's), got {_show(self.config[section])}")
        for dotted, source in DERIVED_DEEPSPEED_KEYS.items():
            *parents, key = dotted.split(".")
            table = self.config
            for parent in parents:
                table = table.get(parent) if isinstance(table, dict) else None
            if isinstance(table, dict) and key in table:
                raise KeyProblem(f"deepspeed.config.{dotted}", f"set by {source}; set it there")
        return self


class LaunchSection(Section):
    launcher: Literal["local", "deepspeed", "torchrun", "slurm"] = "local"
    """How a phase's processes start: local (the fork server), deepspeed, torchrun or slurm (srun)."""
    nproc: PositiveInt = 1
    """Processes per node."""
    nnodes: PositiveInt = 1
    """Nodes; more than one needs launcher deepspeed (with hostfile), torchrun or slurm."""
    hostfile: str | None = None
    """DeepSpeed hostfile for several nodes; relative to the schedule file."""
    grace_seconds: Annotated[float, Field(gt=0)] = 30.0
    """How long a phase gets to stop after SIGTERM before SIGKILL."""
    prewarm: bool = True
    """Start each phase's processes while earlier ones train, to hide imports and setup."""
    prewarm_depth: PositiveInt = 3
    """How many phases ahead to start: more where a phase trains for less time than a start takes
    (each waiting phase holds a CUDA context and a host copy of the model)."""
    pause_preparing_seconds: Annotated[float, Field(ge=0)] = 30.0
    """While a phase switches (from the finished phase's last step to the next one's first), the
    phases still preparing further ahead are paused (SIGSTOP), for at most this long; 0: never."""

    @field_validator("grace_seconds", "pause_preparing_seconds", mode="before")
    @classmethod
    def _int_is_float(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _nodes(self) -> LaunchSection:
        if self.nnodes > 1 and self.launcher == "local":
            raise KeyProblem("launch.launcher", f'expected deepspeed, torchrun or slurm for {self.nnodes} nodes: '
                             '"local" starts processes on this node only')
        if self.nnodes > 1 and self.launcher == "deepspeed" and self.hostfile is None:
            raise KeyProblem("launch.hostfile", f"required with launcher deepspeed on {self.nnodes} nodes, but missing")
        return self


class CheckpointSection(Section):
    every_steps: NonNegInt = 0
    """Mid-phase checkpoints for preemption; 0: only at phase ends."""
    keep_last: PositiveInt = 2
    """Checkpoints kept; older ones go, except what a kept one still needs."""


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


class Phase(BaseModel):
    """One planned phase: global steps [start_step, end_step), its body layers and process count."""

    model_config = ConfigDict(frozen=True)
    index: int
    start_step: int
    end_step: int
    layers: tuple[int, ...]
    nproc: int

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
    output_dir: Path
    nproc_override: int | None = None
    """--nproc: the process count of every phase, over launch.nproc and per-phase nproc."""


def _show(v: Any) -> str:
    """A value as the TOML file spells it, short."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "a table"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The section class that holds the last key of ``loc``, for suggesting the keys it takes."""
    cls: type[BaseModel] | None = Schedule
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = cls.model_fields.get(part)
        if field is None:
            return None
        todo, cls = [field.annotation], None
        while todo:
            t = todo.pop()
            if isinstance(t, type) and issubclass(t, BaseModel):
                cls = t
                break
            todo.extend(typing.get_args(t))
        if cls is None:
            return None
    return cls


def _unknown_key(loc: tuple) -> str:
    section = _section_at(loc)
    if section is None:
        return "unknown key"
    known = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if close:
        return f"unknown key (did you mean {close[0]}?)"
    return f"unknown key; expected one of {', '.join(known)}"


_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _bound(err: dict[str, Any]) -> str:
    (op, limit), = ((k, v) for k, v in err["ctx"].items() if k in _BOUNDS)
    noun = "integer" if isinstance(err["input"], int) else "number"
    if limit == 0 and op in ("gt", "ge"):
        return f"expected a {'positive' if op == 'gt' else 'non-negative'} {noun}"
    return f"expected a{'n' if noun == 'integer' else ''} {noun} {_BOUNDS[op]} {limit:g}"


_EXPECTED = {
    "int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer",
    "float_type": "a number", "float_parsing": "a number",
    "string_type": "a string", "bool_type": "true or false", "bool_parsing": "true or false",
    "list_type": "a list", "tuple_type": "a list", "dict_type": "a table",
    "model_type": "a table", "model_attributes_type": "a table",
}


def _plain(err: dict[str, Any]) -> tuple[str, str]:
    """(dotted key, what is expected) for one pydantic error, in the schedule's own words."""
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    key = ""
    for p in loc:
        key += f"[{p}]" if isinstance(p, int) else (("." if key else "") + str(p))
    kind, got = err["type"], f", got {_show(err['input'])}"
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, KeyProblem):
        return cause.key, str(cause)
    if kind == "extra_forbidden":
        return key, _unknown_key(loc)
    if kind == "missing":
        return key, "required, but missing"
    if kind in _EXPECTED:
        return key, f"expected {_EXPECTED[kind]}{got}"
    if kind == "literal_error":
        return key, f"expected {err['ctx']['expected']}{got}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return key, _bound(err) + got
    if kind == "too_short":
        return key, f"expected at least {err['ctx']['min_length']} item(s){got}"
    return key, err["msg"].removeprefix("Value error, ")


def _format_validation(err: ValidationError, source: Path) -> str:
    return "\n".join(f"{source}: {key or '(top level)'}: {msg}" for key, msg in map(_plain, err.errors()))


def _read_model_config(model: ModelSection, model_path: Path | None, source: Path) -> dict[str, Any]:
    if model.config is not None:
        return model.config
    assert model_path is not None
    cfg = model_path / "config.json"
    if _kind(model_path) != "a directory":
        raise ScheduleError(f"{source}: model.path: expected a Hugging Face model directory, {model_path} "
                            f"{_is(model_path)}")
    if _kind(cfg) != "a file":
        raise ScheduleError(f"{source}: model.path: expected a Hugging Face model directory with config.json, "
                            f"{cfg} {_is(cfg)}")
    try:
        config = json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ScheduleError(f"{source}: model.path: {cfg} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ScheduleError(f"{source}: model.path: {cfg} is not valid: expected a JSON object")
    if not (isinstance(config.get("model_type"), str) and config["model_type"]):
        raise ScheduleError(f"{source}: model.path: {cfg}: expected a model_type name such as \"llama\", got "
                            f"{_show(config.get('model_type'))}")
    return config


def _kind(path: Path) -> str:
    """What is at ``path``, following symlinks: 'a file', 'a directory', 'a symlink loop', ..."""
    try:
        mode = os.stat(path).st_mode
    except ValueError:
        return "not a valid path"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "missing"
        return f"unreadable ({e.strerror})"
    if stat.S_ISREG(mode):
        return "a file"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"


def _is(path: Path) -> str:
    kind = _kind(path)
    return {"missing": "does not exist", "not a valid path": "is not a valid path"}.get(kind, f"is {kind}")


def _resolve(base: Path, value: str) -> Path:
    """``value`` against ``base``, symlinks followed where they lead somewhere; a loop stays as written."""
    path = base / value
    try:
        return path.resolve()
    except (RuntimeError, OSError, ValueError):
        return Path(os.path.abspath(path))


def _need_file(path: Path, key: str, what: str, source: Path) -> None:
    if _kind(path) != "a file":
        raise ScheduleError(f"{source}: {key}: expected {what}, {path} {_is(path)}")


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_LAYER_NAME = re.compile(r"(.+?)\.(\d+)\.(.+)")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def _weight_names(model_path: Path, source: Path) -> tuple[str, set[str]]:
    """(how to name the weight files in a message, every tensor name they hold), from the safetensors
    headers alone; raises ScheduleError for pickle-only folders and unreadable or inconsistent files."""
    single, index = model_path / "model.safetensors", model_path / "model.safetensors.index.json"
    if _kind(single) != "missing" or _kind(index) == "missing":
        if _kind(single) == "missing":
            try:
                pickles = sorted(p.name for p in model_path.iterdir() if p.name.endswith(_PICKLE_SUFFIXES))
            except OSError as e:
                raise ScheduleError(f"{source}: model.path: cannot list {model_path}: {e.strerror}") from None
            if pickles:
                raise ScheduleError(f"{source}: model.path: {model_path / pickles[0]}: pickle weights are not "
                                    "loaded; convert to safetensors (model.safetensors)")
        _need_file(single, "model.path", "the weights in model.safetensors", source)
        return str(single), set(_headers(single, source))
    _need_file(index, "model.path", "a safetensors index", source)
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError) as e:
        raise ScheduleError(f"{source}: model.path: {index} is not a safetensors index: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ScheduleError(f"{source}: model.path: {index}: expected a weight_map object of tensor name -> file name")
    names: set[str] = set()
    for file in sorted(set(weight_map.values())):
        if Path(file).name != file or file in (".", ".."):
            raise ScheduleError(f"{source}: model.path: {index}: expected shard file names inside {model_path}, "
                                f"got {file!r}")
        _need_file(model_path / file, "model.path", f"a shard that {index.name} names", source)
        held = _headers(model_path / file, source)
        absent = sorted(n for n, f in weight_map.items() if f == file and n not in held)
        if absent:
            raise ScheduleError(f"{source}: model.path: {index} places {absent[0]} in {file}, which does not hold "
                                f"it{f' ({len(absent) - 1} more like it)' if len(absent) > 1 else ''}")
        names |= held.keys()
    return f"the shards of {index}", names


def _headers(file: Path, source: Path) -> dict[str, Any]:
    try:
        return tensor_headers(file)[0]
    except (CheckpointError, ValueError, RecursionError) as e:
        raise ScheduleError(f"{source}: model.path: {e}") from None


def _ranges(indices: set[int]) -> str:
    """0..3, 5, 7..8"""
    out, ordered = [], sorted(indices)
    start = prev = ordered[0]
    for i in [*ordered[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}..{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


def _check_weights(model: ModelSection, config: dict[str, Any], n_layers: int, model_path: Path,
                   source: Path) -> None:
    """Every weight config.json implies is in the safetensors files, and only those: the layer list
    covers exactly layers 0..n-1, no layer lacks a tensor its siblings hold, the embedding is there."""
    weights, names = _weight_names(model_path, source)
    cfg = model_path / "config.json"
    layers: dict[str, dict[int, set[str]]] = {}
    for name in names:
        m = _LAYER_NAME.fullmatch(name)
        if m and (model.layers is None or m.group(1) == model.layers):
            layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), set()).add(m.group(3))
    if not layers:
        wanted = f"{model.layers}.0." if model.layers else "model.layers.0."
        raise ScheduleError(f"{source}: {'model.layers' if model.layers else 'model.path'}: {weights} holds no "
                            f"numbered layers (tensor names beginning {wanted})")
    # The body is the numbered list that config.json counts, else the one with the most tensors.
    prefix = max(layers, key=lambda p: (len(layers[p]) == n_layers, sum(map(len, layers[p].values()))))
    held = layers[prefix]
    if set(held) != set(range(n_layers)):
        raise ScheduleError(f"{source}: model.path: {cfg} names {n_layers} layers, {weights} holds layers "
                            f"{_ranges(set(held))} ({prefix}.N)")
    # Layers of one model may differ (dense and MoE, attention and linear attention): only a layer
    # holding a strict subset of another's tensors is missing some.
    kinds: dict[frozenset[str], int] = {}
    for i in sorted(held):
        kinds.setdefault(frozenset(held[i]), i)
    for small, i in kinds.items():
        for big, j in kinds.items():
            if small < big:
                lacking = sorted(big - small)
                more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
                raise ScheduleError(f"{source}: model.path: {weights}: layer {prefix}.{i} lacks {lacking[0]}{more}, "
                                    f"which {prefix}.{j} holds")
    outside = [n for n in names if not n.startswith(prefix + ".")]
    if not any(re.search(r"embed|wte", n) for n in outside):
        raise ScheduleError(f"{source}: model.path: {weights} holds no token embedding (no tensor named like "
                            "embed_tokens or wte)")
    for p in model.persistent or []:
        if any(n == p or n.startswith(p + ".") for n in names):
            continue
        # A tied output embedding is saved once, as the input embedding.
        if p.rsplit(".", 1)[-1] == "lm_head" and config.get("tie_word_embeddings") is not False:
            continue
        tops = sorted({".".join(n.split(".")[:2]) for n in outside})
        raise ScheduleError(f"{source}: model.persistent: {p!r} matches no tensor in {weights} (outside the layers "
                            f"it holds {', '.join(tops[:8])}{', ...' if len(tops) > 8 else ''})")


def _positions(config: dict[str, Any]) -> tuple[str, int] | None:
    for key in _POSITION_KEYS:
        n = config.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return key, n
    text = config.get("text_config")
    return _positions(text) if isinstance(text, dict) else None


def _non_finite(raw: dict[str, Any]) -> list[tuple[str, float]]:
    """(dotted key, value) of every inf and nan in a parsed schedule, however deep."""
    found, todo = [], [("", raw)]
    while todo:
        key, value = todo.pop()
        if isinstance(value, float) and not math.isfinite(value):
            found.append((key, value))
        elif isinstance(value, dict):
            todo.extend((f"{key}.{k}" if key else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((f"{key}[{i}]", v) for i, v in enumerate(value))
    return sorted(found)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``datasets``' save_to_disk (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def tokenizer_of(model: ModelSection, base: Path) -> Path | None:
    """The tokenizer directory: model.tokenizer, else model.path (None for an inline config)."""
    path = model.tokenizer or model.path
    return (base / path).resolve() if path else None


def chat_template_of(data: DataSection, base: Path) -> str | None:
    """data.chat_template for the phase spec: the template itself, or its file's absolute path."""
    t = data.chat_template
    return str((base / t).resolve()) if t is not None and is_template_path(t) else t


def num_layers_of(config: dict[str, Any]) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        n = config.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    text = config.get("text_config")
    return num_layers_of(text) if isinstance(text, dict) else None


def load_schedule(
    path: str | Path, *, output_dir: str | Path | None = None, nproc: int | None = None,
    overrides: tuple[str, ...] | list[str] = (),
) -> LoadedSchedule:
    """Reads and validates a schedule file, with ``--set KEY=VALUE`` overrides applied; raises
    ScheduleError naming the file and key."""
    source = _resolve(Path.cwd(), str(path))
    if _kind(source) not in ("a file", "missing"):
        raise ScheduleError(f"{path}: expected a schedule file, it {_is(source)}")
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScheduleError(f"{path}: schedule file not found") from None
    except OSError as e:
        raise ScheduleError(f"{path}: cannot read the schedule file: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ScheduleError(f"{path}: expected a UTF-8 TOML file: {e.reason} at byte {e.start}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScheduleError(f"{path}: TOML syntax error: {e}") from None
    except RecursionError:
        raise ScheduleError(f"{path}: TOML nested too deeply") from None
    if overrides:
        from orchestrator.overrides import apply_overrides

        raw = apply_overrides(raw, overrides)
    return validate_schedule(raw, source, output_dir=output_dir, nproc=nproc)


def validate_schedule(
    raw: dict[str, Any], source: Path, *, output_dir: str | Path | None = None, nproc: int | None = None
) -> LoadedSchedule:
    """Checks a parsed schedule against the model, the data and the launch it names; touches nothing."""
    if nproc is not None and nproc < 1:
        raise ScheduleError(f"--nproc: expected a positive integer, got {nproc}")
    non_finite = _non_finite(raw)
    if non_finite:
        raise ScheduleError("\n".join(f"{source}: {key}: expected a finite number, got {v}" for key, v in non_finite))
    listed = raw.get("schedule", {}).get("phases") if isinstance(raw.get("schedule"), dict) else None
    if isinstance(listed, list) and len(listed) > MAX_PHASES:
        raise ScheduleError(f"{source}: schedule.phases: expected at most {MAX_PHASES:,} phases, got {len(listed):,}")
    try:
        sched = Schedule.model_validate(raw)
    except ValidationError as e:
        raise ScheduleError(_format_validation(e, source)) from None
    base = source.parent
    model_path = _resolve(base, sched.model.path) if sched.model.path else None
    config = _read_model_config(sched.model, model_path, source)
    n_layers = num_layers_of(config)
    if n_layers is None:
        where = f"model.path: {model_path / 'config.json'}" if model_path else "model.config"
        raise ScheduleError(f"{source}: {where}: expected num_hidden_layers (or n_layer, num_layers), "
                            "a positive integer")
    if model_path is not None:
        _check_weights(sched.model, config, n_layers, model_path, source)
    positions = _positions(config)
    if positions is not None and sched.data.seq_len > positions[1]:
        raise ScheduleError(f"{source}: data.seq_len: expected at most the model's {positions[0]} = {positions[1]}, "
                            f"got {sched.data.seq_len}")
    data_path = _resolve(base, sched.data.path)
    if not is_saved_dataset(data_path):
        _need_file(data_path, "data.path", "a data file or a datasets.save_to_disk folder", source)
    tokenizer_path = tokenizer_of(sched.model, base)
    if sched.data.format != "tokens":
        key = "model.tokenizer" if sched.model.tokenizer else "model.tokenizer (default model.path)"
        if tokenizer_path is None:
            raise ScheduleError(f'{source}: {key}: data.format = "{sched.data.format}" needs a tokenizer, but '
                                "there is none (model.config has no files)")
        if not any((tokenizer_path / f).is_file() for f in TOKENIZER_FILES):
            raise ScheduleError(f'{source}: {key}: data.format = "{sched.data.format}" needs a tokenizer: expected '
                                f"tokenizer.json or tokenizer_config.json in {tokenizer_path}")
    template = sched.data.chat_template
    if template is not None and is_template_path(template):
        _need_file(_resolve(base, template), "data.chat_template", "a Jinja template or a file holding one", source)
    for extra in {"tensorboard", "wandb"} & set(sched.run.report_to):
        if importlib.util.find_spec(extra) is None:
            raise ScheduleError(f"{source}: run.report_to: {extra} needs the {extra} package, which is not installed "
                                f"(pip install 'relayer[{extra}]')")
    if sched.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ScheduleError(f"{source}: run.tensorboard: needs the tensorboard package, which is not installed "
                            "(pip install 'relayer[tensorboard]')")
    if sched.data.validation_path is not None:
        validation = _resolve(base, sched.data.validation_path)
        if not is_saved_dataset(validation):
            _need_file(validation, "data.validation_path", "a data file or a datasets.save_to_disk folder", source)
    if sched.data.eval_every and sched.data.validation_path is None:
        raise ScheduleError(f"{source}: data.eval_every: needs data.validation_path, which is missing")
    launch = sched.launch
    if launch.hostfile is not None:
        _need_file(_resolve(base, launch.hostfile), "launch.hostfile", "a hostfile", source)
    out = _resolve(Path.cwd(), str(output_dir)) if output_dir is not None else _resolve(base, sched.run.output_dir)
    key = "--output-dir" if output_dir is not None else f"{source}: run.output_dir"
    # The nearest existing folder on the way must be a folder: the run directory is made there.
    existing = out
    while _kind(existing) == "missing" and existing.parent != existing:
        existing = existing.parent
    if _kind(existing) != "a directory":
        raise ScheduleError(f"{key}: expected a directory, {existing} {_is(existing)}")
    loaded = LoadedSchedule(
        source=source, schedule=sched, raw=raw, num_layers=n_layers,
        model_path=model_path, data_path=data_path, output_dir=out, nproc_override=nproc,
    )
    phases = plan_phases(loaded)
    for ph in phases:
        for layer in ph.layers:
            if layer >= n_layers:
                key = f"schedule.phases[{ph.index}].layers" if sched.schedule.phases else "schedule.layers_per_phase"
                raise ScheduleError(f"{source}: {key}: layer {layer} is out of range: the model has {n_layers} "
                                    f"layers (0..{n_layers - 1})")
        check_batch(sched.data, ph.nproc, source, ph.index, nnodes=launch.nnodes)
    if launch.launcher == "slurm" and shutil.which("srun") is None:
        raise ScheduleError(f'{source}: launch.launcher: "slurm" starts each phase with srun, which is not on PATH')
    return loaded


def check_batch(data: DataSection, nproc: int, source: Path, phase: int, *, nnodes: int = 1) -> None:
    """batch_size must split into whole micro-batches on every process: gradient accumulation is an integer."""
    world = nproc * nnodes
    per_step = data.micro_batch_size * world
    if data.batch_size % per_step:
        nodes = f" ({nproc} per node x {nnodes} nodes)" if nnodes > 1 else ""
        raise ScheduleError(
            f"{source}: data.batch_size: expected a multiple of micro_batch_size x processes = "
            f"{data.micro_batch_size} x {world}{nodes} = {per_step}, got {data.batch_size} (phase {phase})"
        )


def plan_phases(loaded: LoadedSchedule) -> list[Phase]:
    """The phase table; the same schedule and seed give the same table, always."""
    s = loaded.schedule
    nproc_default = loaded.nproc_override or s.launch.nproc
    if s.schedule.phases is not None:
        phases, step = [], 0
        for i, p in enumerate(s.schedule.phases):
            nproc = loaded.nproc_override or p.nproc or s.launch.nproc
            phases.append(Phase(index=i, start_step=step, end_step=step + p.steps, layers=tuple(p.layers), nproc=nproc))
            step += p.steps
        return phases
    sc = s.schedule
    n, k = loaded.num_layers, sc.layers_per_phase
    assert sc.total_steps and sc.interval and k
    if k > n:
        raise ScheduleError(f"{loaded.source}: schedule.layers_per_phase: expected at most the model's {n} layers, "
                            f"got {k}")
    count = -(-sc.total_steps // sc.interval)
    if count > MAX_PHASES:
        raise ScheduleError(f"{loaded.source}: schedule.interval: expected at most {MAX_PHASES:,} phases, got "
                            f"total_steps / interval = {sc.total_steps:,} / {sc.interval:,} = {count:,} phases")
    if count * k > MAX_PLANNED_LAYERS:
        raise ScheduleError(f"{loaded.source}: schedule.layers_per_phase: expected at most {MAX_PLANNED_LAYERS:,} "
                            f"layers over all phases, got {count:,} phases x {k:,}")
    rng = random.Random(f"relayer-lisa-{s.run.seed}")
    phases, step, i = [], 0, 0
    while step < sc.total_steps:
        if sc.strategy == "lisa":
            layers = tuple(sorted(rng.sample(range(n), k)))
        else:
            walk = ((i * k + j) % n for j in range(k))
            layers = tuple(sorted(walk if sc.strategy == "ascending" else (n - 1 - x for x in walk)))
        end = min(step + sc.interval, sc.total_steps)
        phases.append(Phase(index=i, start_step=step, end_step=end, layers=layers, nproc=nproc_default))
        step, i = end, i + 1
    return phases
