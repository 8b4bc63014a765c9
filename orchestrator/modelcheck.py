"""What a schedule names on disk, checked without torch: paths, the model's config.json and its
safetensors weights (from their headers alone)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from orchestrator.errors import ScheduleError
from orchestrator.schedule import ModelSection, _show
from shard_tools.errors import CheckpointError
from shard_tools.header import tensor_headers

CONFIG = "config.json"
"""A Hugging Face model folder's configuration."""


def path_kind(path: Path) -> str:
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


def path_is(path: Path) -> str:
    kind = path_kind(path)
    return {"missing": "does not exist", "not a valid path": "is not a valid path"}.get(kind, f"is {kind}")


def tokenizer_of(model: ModelSection, base: Path) -> Path | None:
    """The tokenizer directory: model.tokenizer, else model.path (None for an inline config)."""
    path = model.tokenizer or model.path
    return (base / path).resolve() if path else None


def resolve_path(base: Path, value: str) -> Path:
    """``value`` against ``base``, symlinks followed where they lead somewhere; a loop stays as written."""
    path = base / value
    try:
        return path.resolve()
    except (RuntimeError, OSError, ValueError):
        return Path(os.path.abspath(path))


def need_file(path: Path, key: str, what: str, source: Path) -> None:
    if path_kind(path) != "a file":
        raise ScheduleError(f"{source}: {key}: expected {what}, {path} {path_is(path)}")



def need_files(folder: Path, names: tuple[str, ...] | list[str], key: str, source: Path) -> None:
    """Each of ``names`` in ``folder`` that is there at all is a file (links followed): a FIFO, a
    device, a folder or a link loop where a loader opens a file would block or fail it."""
    for name in names:
        path = folder / name
        if path.is_symlink() or path_kind(path) != "missing":
            need_file(path, key, "a file", source)


def read_model_config(model: ModelSection, model_path: Path | None, source: Path) -> dict[str, Any]:
    if model.config is not None:
        check_sizes(model.config, "model.config", source)
        return model.config
    assert model_path is not None
    cfg = model_path / CONFIG
    if path_kind(model_path) != "a directory":
        raise ScheduleError(f"{source}: model.path: expected a Hugging Face model directory, {model_path} "
                            f"{path_is(model_path)}")
    if path_kind(cfg) != "a file":
        raise ScheduleError(f"{source}: model.path: expected a Hugging Face model directory with config.json, "
                            f"{cfg} {path_is(cfg)}")
    need_files(model_path, MODEL_FILES, "model.path", source)
    try:
        config = json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ScheduleError(f"{source}: model.path: {cfg} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ScheduleError(f"{source}: model.path: {cfg} is not valid: expected a JSON object")
    if not (isinstance(config.get("model_type"), str) and config["model_type"]):
        raise ScheduleError(f"{source}: model.path: {cfg}: expected a model_type name such as \"llama\", got "
                            f"{_show(config.get('model_type'))}")
    check_sizes(config, f"model.path: {cfg}", source)
    return config


SIZE_LIMITS = {
    # The largest models published have ~100-200 layers, hidden sizes up to ~30k, vocabularies up to
    # ~260k: these bounds are far above any, and low enough that nothing sized by them runs away
    # (a claim of 10^11 layers once made plan grow by 150 MB/s).
    ("num_hidden_layers", "n_layer", "num_layers"): 1 << 14,
    ("hidden_size", "n_embd", "d_model"): 1 << 20,
    ("intermediate_size", "n_inner", "ffn_dim", "moe_intermediate_size"): 1 << 22,
    ("num_attention_heads", "n_head", "num_key_value_heads", "head_dim"): 1 << 16,
    ("vocab_size",): 1 << 24,
    ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok"): 1 << 16,
}


def check_sizes(config: dict[str, Any], where: str, source: Path, depth: int = 0) -> None:
    """ScheduleError naming the key where a number that sizes the model (layers, widths, heads,
    vocabulary, experts) is not an integer from 1 to its bound (``SIZE_LIMITS``), before anything
    is sized by it; ``text_config`` (and the like) are checked as well."""
    for keys, bound in SIZE_LIMITS.items():
        for key in keys:
            v = config.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= bound:
                raise ScheduleError(f"{source}: {where}: {key}: expected an integer from 1 to {bound:,}, got {_show(v)}")
    for key, sub in config.items():
        if key.endswith("_config") and isinstance(sub, dict) and depth < 4:
            check_sizes(sub, f"{where}: {key}", source, depth + 1)



MODEL_FILES = ("generation_config.json", "model.safetensors.index.json")
"""Files beside config.json that transformers opens when it builds the model (the weights are
checked by ``check_weights``)."""
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_LAYER_NAME = re.compile(r"(.+?)\.(\d+)\.(.+)")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def _weight_names(model_path: Path, source: Path) -> tuple[str, dict[str, Any]]:
    """(how to name the weight files in a message, every tensor name they hold), from the safetensors
    headers alone; raises ScheduleError for pickle-only folders and unreadable or inconsistent files."""
    single, index = model_path / "model.safetensors", model_path / "model.safetensors.index.json"
    if path_kind(single) != "missing" or path_kind(index) == "missing":
        if path_kind(single) == "missing":
            try:
                pickles = sorted(p.name for p in model_path.iterdir() if p.name.endswith(_PICKLE_SUFFIXES))
            except OSError as e:
                raise ScheduleError(f"{source}: model.path: cannot list {model_path}: {e.strerror}") from None
            if pickles:
                raise ScheduleError(f"{source}: model.path: {model_path / pickles[0]}: pickle weights are not "
                                    "loaded; convert to safetensors (model.safetensors)")
        need_file(single, "model.path", "the weights in model.safetensors", source)
        return str(single), _headers(single, source)
    need_file(index, "model.path", "a safetensors index", source)
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError) as e:
        raise ScheduleError(f"{source}: model.path: {index} is not a safetensors index: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ScheduleError(f"{source}: model.path: {index}: expected a weight_map object of tensor name -> file name")
    names: dict[str, Any] = {}
    for file in sorted(set(weight_map.values())):
        if Path(file).name != file or file in (".", ".."):
            raise ScheduleError(f"{source}: model.path: {index}: expected shard file names inside {model_path}, "
                                f"got {file!r}")
        need_file(model_path / file, "model.path", f"a shard that {index.name} names", source)
        held = _headers(model_path / file, source)
        absent = sorted(n for n, f in weight_map.items() if f == file and n not in held)
        if absent:
            raise ScheduleError(f"{source}: model.path: {index} places {absent[0]} in {file}, which does not hold "
                                f"it{f' ({len(absent) - 1} more like it)' if len(absent) > 1 else ''}")
        names |= held
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


def check_weights(model: ModelSection, config: dict[str, Any], n_layers: int, model_path: Path,
                   source: Path) -> dict[int, dict[str, list[int]]]:
    """Every weight config.json implies is in the safetensors files, and only those: the layer list
    covers exactly layers 0..n-1, no layer lacks a tensor its siblings hold, the embedding is there.
    Returns each layer's tensors (past its prefix and index) with their shapes."""
    weights, headers = _weight_names(model_path, source)
    names = set(headers)
    prefix, held = _body(model, names, n_layers, weights, model_path / CONFIG, source)
    _check_layer_kinds(prefix, held, weights, source)
    outside = [n for n in names if not n.startswith(prefix + ".")]
    embeddings = sorted(n for n in outside if re.search(r"embed|wte", n))
    if not embeddings:
        raise ScheduleError(f"{source}: model.path: {weights} holds no token embedding (no tensor named like "
                            "embed_tokens or wte)")
    _check_embedding(config, headers, embeddings, weights, model_path / CONFIG, source)
    _check_persistent(model, config, names, outside, prefix, weights, source)
    return {i: {t: list(headers[f"{prefix}.{i}.{t}"].get("shape") or []) for t in ts} for i, ts in held.items()}


def _check_embedding(config: dict[str, Any], headers: dict[str, Any], embeddings: list[str], weights: str,
                     cfg: Path, source: Path) -> None:
    """config.json's vocab_size and hidden size are the token embedding's shape (vocabulary x hidden)."""
    name = next((n for n in embeddings if n.endswith(("embed_tokens.weight", "wte.weight"))), None)
    shape = headers[name].get("shape") if name else None
    if not (isinstance(shape, list) and len(shape) == 2):
        return
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for keys, size in ((("vocab_size",), shape[0]), (("hidden_size", "n_embd", "d_model"), shape[1])):
        key = next((k for k in keys if k in config), next((k for k in keys if k in text), None))
        said = config.get(key, text.get(key)) if key else None
        if said is not None and said != size:
            raise ScheduleError(f"{source}: model.path: {cfg}: {key} = {said}, but {name} in {weights} has shape "
                                f"{shape} ({size}); config.json does not describe these weights")


def _body(model: ModelSection, names: set[str], n_layers: int, weights: str, cfg: Path,
          source: Path) -> tuple[str, dict[int, set[str]]]:
    """The body's prefix and each of its layers' tensor names (past the prefix and the index)."""
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
    if len(held) != n_layers or min(held) != 0 or max(held) != n_layers - 1:  # distinct indices: exactly 0..n-1
        raise ScheduleError(f"{source}: model.path: {cfg} names {n_layers} layers, {weights} holds layers "
                            f"{_ranges(set(held))} ({prefix}.N)")
    return prefix, held


def _check_layer_kinds(prefix: str, held: dict[int, set[str]], weights: str, source: Path) -> None:
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


def _check_persistent(model: ModelSection, config: dict[str, Any], names: set[str], outside: list[str],
                      prefix: str, weights: str, source: Path) -> None:
    """Every ``model.persistent`` name matches a tensor (a tied lm_head, the input embedding) outside
    the body ``prefix`` (a body layer in the head would be trained and saved twice)."""
    for p in model.persistent or []:
        if p == prefix or p.startswith(prefix + ".") or prefix.startswith(p + "."):
            raise ScheduleError(f"{source}: model.persistent: {p!r} names the body ({prefix}.N), whose layers the "
                                "phases train by the schedule; the head is what lies outside it")
        if any(n == p or n.startswith(p + ".") for n in names):
            continue
        # A tied output embedding is saved once, as the input embedding.
        if p.rsplit(".", 1)[-1] == "lm_head" and config.get("tie_word_embeddings") is not False:
            continue
        tops = sorted({".".join(n.split(".")[:2]) for n in outside})
        raise ScheduleError(f"{source}: model.persistent: {p!r} matches no tensor in {weights} (outside the layers "
                            f"it holds {', '.join(tops[:8])}{', ...' if len(tops) > 8 else ''})")


def position_limit(config: dict[str, Any]) -> tuple[str, int] | None:
    for key in _POSITION_KEYS:
        n = config.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return key, n
    text = config.get("text_config")
    return position_limit(text) if isinstance(text, dict) else None



def num_layers_of(config: dict[str, Any]) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        n = config.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    text = config.get("text_config")
    return num_layers_of(text) if isinstance(text, dict) else None
