"""Reading a schedule file and checking it against the model, the data and the launch it names."""

from __future__ import annotations

import configparser
import difflib
import importlib.util
import math
import netrc
import os
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from launch.contract.data import TEMPLATE_NAMES, is_template_path
from orchestrator.budget import check_budget
from orchestrator.dsconfig import deepspeed_config
from orchestrator.errors import ScheduleError
from orchestrator.libfacts import causal_lm_types
from orchestrator.modelcheck import (
    check_weights, need_file, need_files, num_layers_of, path_is, path_kind, position_limit, read_model_config,
    resolve_path, tokenizer_of,
)
from orchestrator.nodes import check_hostfile, check_launch
from orchestrator.plan import MAX_PHASES, check_batch, check_warmup, plan_phases
from orchestrator.schedule import DataSection, LoadedSchedule, Schedule, default_zero_stage
from orchestrator.schema_errors import format_validation
from orchestrator.sections import MAX_NESTING, too_deep
from orchestrator.units import check_units
from shard_tools.tokenizer import MAIN_FILES, TOKENIZER_FILES


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


def is_saved_dataset(path: Path) -> bool:
    """A folder written by ``datasets``' save_to_disk (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def load_schedule(
    path: str | Path, *, output_dir: str | Path | None = None, nproc: int | None = None,
    overrides: tuple[str, ...] | list[str] = (), device_memory: int | None = None,
) -> LoadedSchedule:
    """Reads and validates a schedule file, with ``--set KEY=VALUE`` overrides applied; raises
    ScheduleError naming the file and key. ``device_memory``: plan's --device-memory, the budget
    checked instead of launch.device_memory."""
    source = resolve_path(Path.cwd(), str(path))
    if path_kind(source) not in ("a file", "missing"):
        raise ScheduleError(f"{path}: expected a schedule file, it {path_is(source)}")
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
    if not overrides:
        return validate_schedule(raw, source, output_dir=output_dir, nproc=nproc, device_memory=device_memory)
    from orchestrator.overrides import apply_overrides, blame_overrides

    try:
        return validate_schedule(apply_overrides(raw, overrides), source, output_dir=output_dir, nproc=nproc,
                                 device_memory=device_memory)
    except ScheduleError as e:
        raise ScheduleError(blame_overrides(str(e), source, overrides)) from None


def validate_schedule(
    raw: dict[str, Any], source: Path, *, output_dir: str | Path | None = None, nproc: int | None = None,
    device_memory: int | None = None,
) -> LoadedSchedule:
    """Checks a parsed schedule against the model, the data and the launch it names; touches nothing."""
    sched = _parse(raw, source, nproc)
    base = source.parent
    model_path, n_layers, tensors = _check_model(sched, base, source)
    data_path = _check_inputs(sched, base, source)
    loaded = LoadedSchedule(
        source=source, schedule=sched, raw=raw, num_layers=n_layers, model_path=model_path, data_path=data_path,
        output_dir=_output_dir(sched, base, source, output_dir), nproc_override=nproc, layer_tensors=tensors,
    )
    if sched.schedule.epochs is not None:
        from orchestrator.datastep import check_data  # it runs the data tool, which needs a loaded schedule

        loaded = loaded.model_copy(update={"data_check": check_data(loaded)})
    phases = plan_phases(loaded)
    check_warmup(loaded, phases)
    stage = default_zero_stage(sched, {ph.nproc * sched.launch.nnodes for ph in phases})
    if stage is not None:
        sched = sched.model_copy(update={"deepspeed": sched.deepspeed.model_copy(update={"zero_stage": stage})})
        loaded = loaded.model_copy(update={"schedule": sched})
    for ph in phases:
        if ph.modules and sched.schedule.phases:
            check_units(loaded, ph.index, ph.modules)
        for layer in ph.layers:
            if layer >= n_layers:
                key = f"schedule.phases[{ph.index}].layers" if sched.schedule.phases else "schedule.layers_per_phase"
                raise ScheduleError(f"{source}: {key}: layer {layer} is out of range: the model has {n_layers} "
                                    f"layers (0..{n_layers - 1})")
        check_batch(sched.data, ph.nproc, source, ph.index, nnodes=sched.launch.nnodes)
    check_launch(sched.launch, source)
    loaded = loaded.model_copy(update={"deepspeed_config": deepspeed_config(sched, base, source, phases)})
    check_budget(loaded, phases, device_memory)
    return loaded


def _parse(raw: dict[str, Any], source: Path, nproc: int | None) -> Schedule:
    if nproc is not None and nproc < 1:
        raise ScheduleError(f"--nproc: expected a positive integer, got {nproc}")
    if deep := too_deep(raw):
        raise ScheduleError(f"{source}: {deep}: nested deeper than {MAX_NESTING} levels of tables and lists")
    non_finite = _non_finite(raw)
    if non_finite:
        raise ScheduleError("\n".join(f"{source}: {key}: expected a finite number, got {v}" for key, v in non_finite))
    listed = raw.get("schedule", {}).get("phases") if isinstance(raw.get("schedule"), dict) else None
    if isinstance(listed, list) and len(listed) > MAX_PHASES:
        raise ScheduleError(f"{source}: schedule.phases: expected at most {MAX_PHASES:,} phases, got {len(listed):,}")
    try:
        return Schedule.model_validate(raw)
    except ValidationError as e:
        raise ScheduleError(format_validation(e, source)) from None


def _check_model(sched: Schedule, base: Path, source: Path) -> tuple[Path | None, int, dict[int, dict[str, list[int]]]]:
    """(the model folder, its layer count, its layers' tensors and their shapes); the weights match
    config.json, seq_len fits the model."""
    model_path = resolve_path(base, sched.model.path) if sched.model.path else None
    config = read_model_config(sched.model, model_path, source)
    types = causal_lm_types()
    if types is not None and config["model_type"] not in types:
        where = f"model.path: {model_path / 'config.json'}: model_type" if model_path else "model.config.model_type"
        close = difflib.get_close_matches(config["model_type"], types, n=1)
        raise ScheduleError(f"{source}: {where}: {config['model_type']!r} is not a model type the installed transformers "
                            f"builds as a causal LM{f' (did you mean {close[0]!r}?)' if close else ''}")
    n_layers = num_layers_of(config)
    if n_layers is None:
        where = f"model.path: {model_path / 'config.json'}" if model_path else "model.config"
        raise ScheduleError(f"{source}: {where}: expected num_hidden_layers (or n_layer, num_layers), "
                            "a positive integer")
    tensors = check_weights(sched.model, config, n_layers, model_path, source) if model_path is not None else {}
    if sched.schedule.by_modules and model_path is None:
        raise ScheduleError(f"{source}: model.config: module units (schedule.strategy = \"misa\", "
                            "schedule.phases[i].modules) need model.path: its weights name a layer's modules")
    positions = position_limit(config)
    if positions is not None and sched.data.seq_len > positions[1]:
        raise ScheduleError(f"{source}: data.seq_len: expected at most the model's {positions[0]} = {positions[1]}, "
                            f"got {sched.data.seq_len}")
    return model_path, n_layers, tensors if sched.schedule.by_modules else {}


def _check_inputs(sched: Schedule, base: Path, source: Path) -> Path:
    """The data files, tokenizer, templates, reporting packages and hostfile exist; returns the
    (first) data path."""
    d = sched.data
    _check_sources(d, base, source)
    _check_tokenizer(sched, base, source)
    for extra in {"tensorboard", "wandb"} & set(sched.run.report_to):
        if importlib.util.find_spec(extra) is None:
            raise ScheduleError(f"{source}: run.report_to: {extra} needs the {extra} package, which is not installed "
                                f"(pip install 'relayer[{extra}]')")
    if "wandb" in sched.run.report_to and not wandb_can_log():
        raise ScheduleError(f"{source}: run.report_to: wandb logs online (WANDB_MODE is not offline) and finds no "
                            "API key: set WANDB_API_KEY, run `wandb login`, or WANDB_MODE=offline (then wandb sync)")
    if sched.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ScheduleError(f"{source}: run.tensorboard: needs the tensorboard package, which is not installed "
                            "(pip install 'relayer[tensorboard]')")
    if d.validation_path is not None:
        _need_data(resolve_path(base, d.validation_path), "data.validation_path", source)
    if sched.eval.prompts and not d.eval_every:
        raise ScheduleError(f"{source}: eval.prompts: generated at each evaluation: needs data.eval_every")
    if d.eval_every and d.validation_path is None and d.validation_split is None:
        raise ScheduleError(f"{source}: data.eval_every: needs data.validation_path or data.validation_split, "
                            "which are missing")
    if sched.launch.hostfile is not None:
        need_file(resolve_path(base, sched.launch.hostfile), "launch.hostfile", "a hostfile", source)
        if sched.launch.launcher == "deepspeed":
            check_hostfile(resolve_path(base, sched.launch.hostfile), sched.launch, source)
    return resolve_path(base, d.resolved_sources()[0][1].path)


def _check_sources(data: DataSection, base: Path, source: Path) -> None:
    for key, src in data.resolved_sources():
        _need_data(resolve_path(base, src.path), f"{key}.path", source)
    # Named where each is set: data.chat_template is every source's default.
    templates = [("data", data.chat_template)] + [(f"data.sources[{i}]", s.chat_template)
                                                  for i, s in enumerate(data.sources or [])]
    for key, template in templates:
        if template is not None and is_template_path(template):
            need_file(resolve_path(base, template), f"{key}.chat_template",
                      f"a Jinja template, one named {', '.join(TEMPLATE_NAMES)}, \"alpaca\" (the Alpaca prompt), or a "
                      "file holding one", source)


def wandb_can_log() -> bool:
    """Whether W&B would log without asking for a login, which a phase process cannot answer: offline
    (WANDB_MODE, or ``wandb offline`` in its settings), or an API key (WANDB_API_KEY, or the entry
    ``wandb login`` leaves in ~/.netrc for its host)."""
    mode = os.environ.get("WANDB_MODE")
    if mode is None:
        settings = configparser.ConfigParser()
        try:
            settings.read([Path(os.environ.get("WANDB_CONFIG_DIR", Path.home() / ".config" / "wandb")) / "settings"])
            mode = settings.get("default", "mode", fallback="online")
        except (configparser.Error, UnicodeDecodeError):
            mode = "online"
    if mode in ("offline", "dryrun", "disabled") or os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _need_data(path: Path, key: str, source: Path) -> None:
    """A data file, or a datasets.save_to_disk folder whose entries are files and folders only."""
    if not is_saved_dataset(path):
        need_file(path, key, "a data file or a datasets.save_to_disk folder", source)
        return
    for entry in sorted(path.rglob("*")):
        if path_kind(entry) != "a directory":
            need_file(entry, key, "a file of the saved data set", source)


def _check_tokenizer(sched: Schedule, base: Path, source: Path) -> None:
    """The tokenizer that text, instruction and chat data need, and any model.tokenizer given (an
    export copies it): a folder whose tokenizer files are files (a FIFO there would block its load)."""
    tokenizer_path = tokenizer_of(sched.model, base)
    key = "model.tokenizer" if sched.model.tokenizer else "model.tokenizer (default model.path)"
    if tokenizer_path is not None:
        need_files(tokenizer_path, TOKENIZER_FILES, key, source)
    if sched.model.tokenizer and path_kind(tokenizer_path) != "a directory":
        raise ScheduleError(f"{source}: model.tokenizer: expected a Hugging Face tokenizer folder, {tokenizer_path} "
                            f"{path_is(tokenizer_path)}")
    formats = [(name, s.format) for name, s in sched.data.resolved_sources() if s.format != "tokens"]
    if not formats:
        return
    what, fmt = f"{formats[0][0]}.format", formats[0][1]
    if tokenizer_path is None:
        raise ScheduleError(f'{source}: {key}: {what} = "{fmt}" needs a tokenizer, but '
                            "there is none (model.config has no files)")
    if not any((tokenizer_path / f).is_file() for f in MAIN_FILES):
        raise ScheduleError(f'{source}: {key}: {what} = "{fmt}" needs a tokenizer: expected '
                            f"tokenizer.json or tokenizer_config.json in {tokenizer_path}")


def _output_dir(sched: Schedule, base: Path, source: Path, output_dir: str | Path | None) -> Path:
    out = resolve_path(Path.cwd(), str(output_dir)) if output_dir is not None else resolve_path(base, sched.run.output_dir)
    key = "--output-dir" if output_dir is not None else f"{source}: run.output_dir"
    if out.parent == out:
        raise ScheduleError(f"{key}: expected a folder of its own for the run, got the root {out}")
    # The nearest existing folder on the way must be a folder: the run directory is made there.
    existing = out
    while path_kind(existing) == "missing" and existing.parent != existing:
        existing = existing.parent
    if path_kind(existing) != "a directory":
        raise ScheduleError(f"{key}: expected a directory, {existing} {path_is(existing)}")
    return out
