"""The schedule file: TOML parsed into typed, validated sections, and the phase plan derived from it.

Validation happens here, once; every error names the key (``model.dtype``) or the file. Nothing in
this module imports torch: model facts (layer count, family) come from ``config.json``.
"""

from __future__ import annotations

import json
import random
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.errors import ScheduleError

PositiveInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are not coerced across types."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RunSection(Section):
    output_dir: str = "runs/default"
    """The run directory; relative to the schedule file."""
    seed: NonNegInt = 0
    """Seeds data order, random init and the lisa layer sampling: one seed, one run."""


class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model directory (config.json + safetensors)."""
    config: dict[str, Any] | None = None
    """Or an inline config: a random init from it, seeded by run.seed."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    persistent: list[str] | None = None
    """Module prefixes of the always-trained head; None: detected from the model family."""
    layers: str | None = None
    """Attribute path of the transformer layer list; None: detected."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.path is None) == (self.config is None):
            raise ValueError("give exactly one of model.path and model.config")
        if self.config is not None and "model_type" not in self.config:
            raise ValueError("model.config needs model_type (for example \"llama\")")
        return self


class DataSection(Section):
    path: str
    format: Literal["tokens", "text"] = "tokens"
    seq_len: PositiveInt = 128
    batch_size: PositiveInt = 8
    """Examples per optimizer step over all processes; kept when the process count changes."""
    micro_batch_size: PositiveInt = 1
    """Examples per process per forward pass."""
    shuffle: bool = True


class OptimizerSection(Section):
    lr: Annotated[float, Field(gt=0)] = 1e-3
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    eps: Annotated[float, Field(gt=0)] = 1e-8
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
        if isinstance(v, list):
            return tuple(float(x) if isinstance(x, int) and not isinstance(x, bool) else x for x in v)
        return v


class LrScheduleSection(Section):
    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: NonNegInt = 0


class PhaseEntry(Section):
    steps: PositiveInt
    layers: Annotated[list[NonNegInt], Field(min_length=1)]
    nproc: PositiveInt | None = None
    """Processes for this phase; None: launch.nproc (or --nproc)."""


class ScheduleSection(Section):
    phases: list[PhaseEntry] | None = None
    strategy: Literal["lisa", "ascending", "descending"] | None = None
    total_steps: PositiveInt | None = None
    interval: PositiveInt | None = None
    layers_per_phase: PositiveInt | None = None

    @model_validator(mode="after")
    def _one_form(self) -> ScheduleSection:
        strategy_keys = {k: getattr(self, k) for k in ("total_steps", "interval", "layers_per_phase")}
        if self.phases is not None:
            if self.strategy is not None or any(v is not None for v in strategy_keys.values()):
                raise ValueError("give either schedule.phases or schedule.strategy with its keys, not both")
            if not self.phases:
                raise ValueError("schedule.phases is empty: give at least one phase")
        else:
            if self.strategy is None:
                raise ValueError("give schedule.phases or schedule.strategy")
            missing = [k for k, v in strategy_keys.items() if v is None]
            if missing:
                raise ValueError(f"schedule.strategy needs {', '.join('schedule.' + m for m in missing)}")
        return self


class DeepSpeedSection(Section):
    zero_stage: Literal[1, 2, 3] = 2
    config: dict[str, Any] = Field(default_factory=dict)
    """Merged into the generated DeepSpeed config."""


class LaunchSection(Section):
    launcher: Literal["local", "deepspeed", "torchrun", "slurm"] = "local"
    nproc: PositiveInt = 1
    """Processes per node."""
    nnodes: PositiveInt = 1
    hostfile: str | None = None
    grace_seconds: Annotated[float, Field(gt=0)] = 30.0
    """How long a phase gets to stop after SIGTERM before SIGKILL."""

    @field_validator("grace_seconds", mode="before")
    @classmethod
    def _int_is_float(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v



class CheckpointSection(Section):
    every_steps: NonNegInt = 0
    """Mid-phase checkpoints for preemption; 0: only at phase ends."""
    keep_last: PositiveInt = 2


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


def _loc(err: dict[str, Any]) -> str:
    parts = [str(p) for p in err["loc"] if not str(p).startswith("function-after")]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (("." if out else "") + p)
    return out or "(top level)"


def _format_validation(err: ValidationError, source: Path) -> str:
    lines = []
    for e in err.errors():
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"{source}: {_loc(e)}: {msg}")
    return "\n".join(lines)


def _read_model_config(model: ModelSection, model_path: Path | None, source: Path) -> dict[str, Any]:
    if model.config is not None:
        return model.config
    assert model_path is not None
    cfg = model_path / "config.json"
    if not model_path.is_dir():
        raise ScheduleError(f"{source}: model.path: {model_path} is not a directory")
    if not cfg.is_file():
        raise ScheduleError(f"{source}: model.path: {cfg} not found (a Hugging Face model directory needs config.json)")
    try:
        return json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ScheduleError(f"{source}: model.path: {cfg} is not valid JSON: {e}") from e


def num_layers_of(config: dict[str, Any]) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(config.get(key), int):
            return config[key]
    text = config.get("text_config")
    return num_layers_of(text) if isinstance(text, dict) else None


def load_schedule(path: str | Path, *, output_dir: str | Path | None = None, nproc: int | None = None) -> LoadedSchedule:
    """Reads and validates a schedule file; raises ScheduleError naming the file and key."""
    source = Path(path).resolve()
    try:
        text = source.read_text()
    except FileNotFoundError:
        raise ScheduleError(f"{path}: schedule file not found") from None
    except OSError as e:
        raise ScheduleError(f"{path}: cannot read: {e.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScheduleError(f"{path}: TOML syntax error: {e}") from None
    return validate_schedule(raw, source, output_dir=output_dir, nproc=nproc)


def validate_schedule(
    raw: dict[str, Any], source: Path, *, output_dir: str | Path | None = None, nproc: int | None = None
) -> LoadedSchedule:
    if nproc is not None and nproc < 1:
        raise ScheduleError(f"--nproc: must be at least 1, got {nproc}")
    try:
        sched = Schedule.model_validate(raw)
    except ValidationError as e:
        raise ScheduleError(_format_validation(e, source)) from None
    base = source.parent
    model_path = (base / sched.model.path).resolve() if sched.model.path else None
    config = _read_model_config(sched.model, model_path, source)
    n_layers = num_layers_of(config)
    if n_layers is None:
        raise ScheduleError(f"{source}: model: the model config has no num_hidden_layers (or n_layer)")
    data_path = (base / sched.data.path).resolve()
    if not data_path.is_file():
        raise ScheduleError(f"{source}: data.path: {data_path} not found")
    out = Path(output_dir).resolve() if output_dir is not None else (base / sched.run.output_dir).resolve()
    loaded = LoadedSchedule(
        source=source, schedule=sched, raw=raw, num_layers=n_layers,
        model_path=model_path, data_path=data_path, output_dir=out, nproc_override=nproc,
    )
    phases = plan_phases(loaded)
    for ph in phases:
        for layer in ph.layers:
            if layer >= n_layers:
                key = f"schedule.phases[{ph.index}].layers" if sched.schedule.phases else "schedule.layers_per_phase"
                raise ScheduleError(f"{source}: {key}: layer {layer} is out of range: the model has {n_layers} layers (0..{n_layers - 1})")
        check_batch(sched.data, ph.nproc, source, ph.index)
    return loaded


def check_batch(data: DataSection, nproc: int, source: Path, phase: int) -> None:
    per_step = data.micro_batch_size * nproc
    if data.batch_size % per_step:
        raise ScheduleError(
            f"{source}: data.batch_size: {data.batch_size} is not divisible by micro_batch_size x processes "
            f"= {data.micro_batch_size} x {nproc} = {per_step} (phase {phase})"
        )


def plan_phases(loaded: LoadedSchedule) -> list[Phase]:
    """The phase table; the same schedule and seed give the same table, always."""
    s = loaded.schedule
    nproc_default = loaded.nproc_override or s.launch.nproc
    if s.schedule.phases is not None:
        phases, step = [], 0
        for i, p in enumerate(s.schedule.phases):
            nproc = loaded.nproc_override or p.nproc or nproc_default
            phases.append(Phase(index=i, start_step=step, end_step=step + p.steps, layers=tuple(p.layers), nproc=nproc))
            step += p.steps
        return phases
    sc = s.schedule
    n, k = loaded.num_layers, sc.layers_per_phase
    assert sc.total_steps and sc.interval and k
    if k > n:
        raise ScheduleError(f"{loaded.source}: schedule.layers_per_phase: {k} is more than the model's {n} layers")
    rng = random.Random(f"relayer-lisa-{s.run.seed}")
    phases, step, i = [], 0, 0
    while step < sc.total_steps:
        if sc.strategy == "lisa":
            layers = tuple(sorted(rng.sample(range(n), k)))
        else:
            order = list(range(n)) if sc.strategy == "ascending" else list(range(n - 1, -1, -1))
            layers = tuple(sorted(order[(i * k + j) % n] for j in range(k)))
        end = min(step + sc.interval, sc.total_steps)
        phases.append(Phase(index=i, start_step=step, end_step=end, layers=layers, nproc=nproc_default))
        step, i = end, i + 1
    return phases
