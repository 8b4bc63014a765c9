"""``shard-tools export``: a run's weights as a Hugging Face model directory.

    shard-tools export runs/tiny --out exported/tiny                # the run's newest whole checkpoint
    shard-tools export runs/tiny/checkpoints/step-00000020 --out exported/s20 --dtype bfloat16

The directory is written under a temporary sibling name and renamed into place at the end, so
``--out`` holds either a whole export or what was there before. ``--out`` must lie outside every
run, checkpoint and the base model; ``--force`` replaces only an earlier export (a folder of
files with its ``relayer.json``), never anything else.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from torch import nn

from shard_tools.digest import folder_digests
from shard_tools.errors import CheckpointError, InputError
from shard_tools.files import TMP_PREFIX, read_regular, regular_fault
from shard_tools.history import JOURNAL
from shard_tools.manifest import CHECKPOINTS, EXPORT_MARKER, FINAL, MANIFEST, Manifest, path_kind, step_of
from shard_tools.model import DTYPES, ModelSpec, build_base_model
from shard_tools.shards import parallel_shards
from shard_tools.sizes import parse_size
from shard_tools.state import run_weights
from shard_tools.store import Checkpoints
from shard_tools.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILES
from shard_tools.verify import trusted_checkpoint

COPIED_FILES = (*TOKENIZER_FILES, "generation_config.json")
"""Copied from the run's tokenizer folder (else the base model's) into an export, where present."""
# Shards of a few GB download and load piece by piece; one file per model would be up to 50 GB.
MAX_SHARD_SIZE = "5GB"


def base_spec(ckpt: Path, manifest: Manifest) -> ModelSpec:
    base = manifest.extra.get("base_model")
    if not (isinstance(base, dict) and base.keys() >= {"path", "config", "dtype", "seed"}):
        raise CheckpointError(f"{ckpt / MANIFEST}: extra.base_model {{path, config, dtype, seed}} is missing or "
                              f"incomplete, so the base model cannot be rebuilt")
    path, config, dtype, seed = base["path"], base["config"], base["dtype"], base["seed"]
    if not ((isinstance(path, str) and path and "\0" not in path and config is None)
            or (path is None and isinstance(config, dict))):
        raise CheckpointError(f"{ckpt / MANIFEST}: extra.base_model: expected a path (a string) or a config "
                              f"(an object), one of them null")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{ckpt / MANIFEST}: extra.base_model.dtype {dtype!r} is not one of "
                              f"{', '.join(DTYPES)}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise CheckpointError(f"{ckpt / MANIFEST}: extra.base_model.seed: expected an integer, found {seed!r}")
    return ModelSpec(path=path, config=config, dtype=dtype, seed=seed)


def base_model(ckpt: Path, manifest: Manifest, dtype: str = "float32") -> nn.Module:
    """The base model the checkpoint's run started from, in ``dtype`` (fp32 unless told)."""
    spec = base_spec(ckpt, manifest)
    if spec.path is not None and not os.path.isdir(spec.path):
        raise CheckpointError(f"{spec.path}: cannot build the base model that {ckpt / MANIFEST} names (not a "
                              f"directory)")
    try:
        return build_base_model(spec).to(DTYPES[dtype])
    except Exception as e:  # whatever transformers raises for a model folder or config it cannot build
        where = spec.path or "the config in the manifest"
        raise CheckpointError(f"{where}: cannot build the base model that {ckpt / MANIFEST} names ({e})") from None


def build_ahead(spec_json: str | None) -> tuple[ModelSpec, nn.Module] | None:
    """What an export needs before its checkpoint exists, made while the run's last phases train (the
    orchestrator's exporter, waiting for its go): transformers' model code imported and, given a spec
    (``extra.base_model`` as the run's phases record it, as JSON), the base model built on one thread.
    None without a spec or where it cannot be built: the export then builds what its checkpoint names
    (and says what is wrong with it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside a phase that trains: the build reads files, it needs no threads
    try:
        from transformers import AutoModelForCausalLM  # noqa: F401 - the import is the point

        if spec_json is None:
            return None
        spec = ModelSpec(**json.loads(spec_json))
        return spec, build_base_model(spec)
    except Exception:  # a spec or model it cannot build: after the go the export builds it, and names the fault
        return None
    finally:
        torch.set_num_threads(threads)


def compose(run_dir: Path, ckpt: Path, manifest: Manifest, dtype: str = "float32",
            base: nn.Module | None = None) -> nn.Module:
    """The base model (``base`` where it was built ahead, else built now) with the checkpoint's run
    weights loaded over it, in ``dtype``. Built in that dtype, never through fp32 (7B: 28 GB and
    seconds of converting): a base weight's bytes are those its round trip through fp32 gives, and a
    run weight (fp32) is rounded once, as ``.to`` rounds it."""
    model = base.to(DTYPES[dtype]) if base is not None else base_model(ckpt, manifest, dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in run_weights(run_dir, ckpt).items():
            if name not in params:
                raise CheckpointError(f"{ckpt}: tensor {name!r} is not a parameter of the base model")
            if params[name].shape != t.shape:
                raise CheckpointError(f"{ckpt}: tensor {name!r} has shape {list(t.shape)}, "
                                      f"the base model's has {list(params[name].shape)}")
            params[name].copy_(t)
    return model


class Laps:
    """Seconds each stage of an export took, into ``times`` where given (the orchestrator journals them)."""

    def __init__(self, times: dict | None):
        self.times, self.start = times, time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        if self.times is not None:
            self.times[stage] = round(now - self.start, 3)
        self.start = now


def export(source: Path, out: Path, dtype: str | None = None, force: bool = False,
           max_shard_size: str | int | None = None, warn: Callable[[str], None] | None = None,
           prebuilt: tuple[ModelSpec, nn.Module] | None = None, times: dict | None = None) -> Path:
    """Writes the composed model of ``source`` (run or checkpoint) to ``out``; returns the checkpoint used
    (``warn`` is told where a run's newest checkpoint is damaged and an older one is exported).
    ``prebuilt``: a base model built ahead (``build_ahead``), used where its spec is the checkpoint's;
    ``times``: filled with each stage's seconds."""
    out, lap = Path(out), Laps(times)
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    shard_bytes = shard_size(MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    dest, own_final = _destination(Path(source), out, force)
    run_dir, ckpt, manifest = trusted_checkpoint(source, warn)
    lap("verify")
    dtype = dtype or manifest.dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"{ckpt / MANIFEST}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    spec = base_spec(ckpt, manifest)
    base_path = spec.path
    if base_path is not None:
        guard(out, dest, {real_path(Path(base_path)): f"the base model folder that {ckpt.name} names"},
              inside_runs=not own_final)
    ahead = prebuilt is not None and prebuilt[0] == spec
    if times is not None:
        times["base_built_ahead"] = ahead
    model = compose(run_dir, ckpt, manifest, dtype, prebuilt[1] if ahead else None)
    _check_tied(model)
    lap("compose")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f"{TMP_PREFIX}{dest.name}.{os.getpid()}"
    try:
        with parallel_shards() as digests:
            model.save_pretrained(tmp, max_shard_size=shard_bytes)
        lap("write")
        _add_files(tmp, run_dir, ckpt, manifest, dtype, base_path, digests)
        _one_mode(tmp)
        _replace_dir(tmp, dest)
        lap("files")
    except (OSError, SafetensorError) as e:  # a full disk, a quota: one line, --out as it was
        shutil.rmtree(tmp, ignore_errors=True)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise CheckpointError(f"--out {out}: could not write the export ({reason}); what was there is unchanged") \
            from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt


def _destination(source: Path, out: Path, force: bool) -> tuple[Path, bool]:
    """(the real path to write ``--out`` to, whether it is the run's own final/); InputError where it may
    not be written (``check_out``, ``guard``) or is a link inside the run."""
    dest = check_out(out, force)
    # A run's own final/ is the one place inside a run an export may go (what a completed run writes).
    own_final = path_kind(source) == "run" and dest == real_path(source) / FINAL
    if path_kind(source) == "run" and out.is_symlink() and real_path(out.parent) == real_path(source):
        raise InputError(f"--out {out}: a symbolic link (to {os.readlink(out)}) in the run; an export replaces its "
                         f"--out, and nothing of the run is written through a link: remove it")
    if not own_final:
        guard(out, dest, _source_paths(source))
    return dest, own_final


def _one_mode(folder: Path) -> None:
    """Every file of an export gets the mode a new file gets under the umask (a run's final/ the
    run's own): safetensors writes 0600, Python 0666 less the umask, a copy keeps its source's."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def _add_files(tmp: Path, run_dir: Path, ckpt: Path, manifest: Manifest, dtype: str, base_path: str | None,
               known: dict[str, dict[str, int | str]]) -> None:
    """Beside the weights: the run's tokenizer (model.tokenizer, recorded since it may live apart
    from the base model) and relayer.json, which lists every file with its checksum (``known``:
    those of the weight files, hashed as they were written)."""
    tokenizer = manifest.extra.get("tokenizer")
    tokenizer = tokenizer if isinstance(tokenizer, str) and tokenizer else base_path
    for name in COPIED_FILES if tokenizer else ():
        if (Path(tokenizer) / name).is_file():
            # The bytes alone: the export's modes are the umask's (the run's), not the source's.
            shutil.copyfile(Path(tokenizer) / name, tmp / name)
    trained = manifest.extra.get("chat_template")
    if isinstance(trained, str) and trained:  # the run's data.chat_template: transformers reads this file first
        (tmp / CHAT_TEMPLATE_FILE).write_text(trained, encoding="utf-8")
    (tmp / EXPORT_MARKER).write_text(json.dumps({
        "export": "relayer", "run": str(run_dir.resolve()), "checkpoint": str(ckpt.resolve()),
        "global_step": manifest.global_step, "phase": manifest.phase, "dtype": dtype,
        "versions": manifest.versions, "files": folder_digests(tmp, skip=EXPORT_MARKER, known=known)}, indent=2) + "\n")


def shard_size(value: str | int) -> int:
    """Bytes of ``--max-shard-size`` (``parse_size``); InputError otherwise."""
    size = parse_size(value)
    if size is None:
        raise InputError(f"--max-shard-size: {str(value)!r} is not a size such as 500MB or 5GB (a positive number "
                         f"and B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)")
    return size


def real_path(path: Path) -> Path:
    """``path`` with every symbolic link resolved (also where its last parts do not exist yet)."""
    try:
        return Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:
        return Path(os.path.realpath(path))
    except OSError as e:
        raise InputError(f"{path}: {'a symbolic link loop' if e.errno == errno.ELOOP else e.strerror}") from None


def check_out(out: Path, force: bool) -> Path:
    """The real path to write ``--out`` to; InputError unless it is new, empty, or (with ``force``) an earlier
    export. The checks read, they write nothing."""
    dest = real_path(out)
    if dest == Path("/") or dest == real_path(Path.home()) or dest in (Path.cwd(), *Path.cwd().parents):
        raise InputError(f"--out {out}: is the root, the home or the current directory, or holds the current "
                         f"directory; an export replaces its --out")
    if not dest.exists():
        # The nearest folder that exists is where the export's folders are made.
        parent = next(p for p in dest.parents if p.exists())
        if not parent.is_dir():
            raise InputError(f"--out {out}: {parent} is not a directory")
        return dest
    if not dest.is_dir():
        raise InputError(f"--out {out}: exists and is not a directory")
    if not any(dest.iterdir()):
        return dest
    if not force:
        raise InputError(f"--out {out}: exists and is not empty; use --force to replace an earlier export")
    if reason := not_an_export(dest):
        raise InputError(f"--out {out}: --force replaces only an earlier export, and this folder is not one "
                         f"({reason}); nothing was changed")
    return dest


def not_an_export(folder: Path) -> str | None:
    """Why ``folder`` is not what an export writes (files only, with its ``relayer.json``), or None."""
    for entry in sorted(folder.iterdir()):
        if fault := regular_fault(entry, follow_symlinks=False):
            return f"{entry.name} is {fault}"
    try:
        marker = json.loads(read_regular(folder / EXPORT_MARKER, 1 << 20, follow_symlinks=False))
    except FileNotFoundError:
        return f"no {EXPORT_MARKER}"
    except (OSError, ValueError, RecursionError):
        marker = None
    if not (isinstance(marker, dict) and isinstance(marker.get("checkpoint"), str)
            and isinstance(marker.get("global_step"), int)):
        return f"its {EXPORT_MARKER} is not an export's"
    return None


def _source_paths(source: Path) -> dict[Path, str]:
    """What exporting ``source`` must leave alone, by real path: the checkpoint and its run."""
    kind = path_kind(source)
    real = real_path(source)
    if kind == "run":
        return {real: "the run directory being exported"}
    paths = {real: "the checkpoint being exported"}
    if real.parent.name == CHECKPOINTS:
        paths[real.parent.parent] = "the run directory of the checkpoint being exported"
    return paths


def guard(out: Path, dest: Path, keep: dict[Path, str], *, inside_runs: bool = True) -> None:
    """InputError when ``dest`` (the real ``--out``) is, holds or lies inside a path of ``keep``, or (with
    ``inside_runs``) lies inside any run directory or checkpoint."""
    for path, what in keep.items():
        if dest == path:
            raise InputError(f"--out {out}: is {what} ({path}); an export replaces its --out")
        if dest in path.parents:
            raise InputError(f"--out {out}: holds {what} ({path}); an export replaces its --out")
        if path in dest.parents:
            raise InputError(f"--out {out}: lies inside {what} ({path}); exports go outside it")
    for folder in (dest, *dest.parents) if inside_runs else ():
        if what := _run_or_checkpoint(folder):
            raise InputError(f"--out {out}: {'is' if folder == dest else 'lies inside'} {what} ({folder}); "
                             f"exports go outside runs and checkpoints")


def _run_or_checkpoint(folder: Path) -> str | None:
    if (folder / MANIFEST).exists() or (step_of(folder) is not None and folder.parent.name == CHECKPOINTS):
        return "a checkpoint"
    if (folder / JOURNAL).exists() or Checkpoints(folder).all():
        return "a run directory"
    return None


def _check_tied(model: nn.Module) -> None:
    if getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "lost the embedding tie"


def _replace_dir(new: Path, dest: Path) -> None:
    """Moves ``new`` to ``dest``; an existing ``dest`` goes aside first and is removed only afterwards."""
    old = dest.with_name(f"{TMP_PREFIX}{dest.name}.old.{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(new, dest)
    shutil.rmtree(old, ignore_errors=True)
