"""The data step: ``python -m launch.data.tool`` prepares and checks the data in a subprocess (the
orchestrator never imports datasets or transformers) and answers with JSON.

- ``orchestrator data`` and ``orchestrator plan`` prepare into a temporary directory, removed after;
- ``orchestrator run`` prepares before the run directory exists (bad data: exit 2, no run
  directory), then moves the entries into ``RUN_DIR/data-cache``, where every phase process finds
  them by the same key and only maps them.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import psutil

from launch.contract.channels import DATA_TOOL, python_m
from launch.contract.data import is_template_path
from launch.contract.files import DATA_CACHE, WANDB_TMP
from orchestrator.errors import STOP_SIGNALS, Preempted, RelayerError, ScheduleError
from orchestrator.groups import exit_text
from orchestrator.modelcheck import read_model_config, resolve_path, tokenizer_of
from orchestrator.procs import end_session
from orchestrator.schedule import LoadedSchedule, SourceSection

TMP_CACHE = "relayer-data-"
"""``plan`` and ``data`` prepare into TMPDIR/relayer-data-<pid>.*, and the data tool keeps its
temporaries in another (in ``scratch_root``), both removed after (and by the next command where this one was killed)."""
# An AF_UNIX socket's path holds 107 bytes, and datasets.map's manager listens at
# TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX: a longer TMPDIR ends its workers at the first batch (EOFError).
SOCKET_PATH_MAX = 107
SOCKET_TAIL = len("/pymp-XXXXXXXX/listener-XXXXXXXX")
SHORT_ROOTS = (Path("/tmp"), Path("/dev/shm"), Path("/var/tmp"))
STAGED = ".relayer-data-"
"""A new run prepares beside its directory into .relayer-data-<run name>.<pid>.*, moved in after."""


def data_spec(loaded: LoadedSchedule) -> dict[str, Any]:
    """The phase spec's data part (``launch.contract.data.DataPart``): what keys the cache."""
    d, base = loaded.schedule.data, loaded.source.parent
    sources = [_source_spec(key, s, base) for key, s in d.resolved_sources()]
    validation = [{**sources[0], "path": str(resolve_path(base, d.validation_path)), "key": "data.validation_path"}] \
        if d.validation_path else []
    return {"sources": sources, "validation": validation, "validation_split": d.validation_split,
            "seed": loaded.schedule.run.seed, "seq_len": d.seq_len, "pack": d.pack, "batch_size": d.batch_size,
            "micro_batch_size": d.micro_batch_size, "shuffle": d.shuffle, "eval_every": d.eval_every}


def _source_spec(key: str, s: SourceSection, base: Path) -> dict[str, Any]:
    return {"path": str(resolve_path(base, s.path)), "format": s.format, "train_on_prompt": s.train_on_prompt,
            "chat_template": chat_template_of(s.chat_template, base), "fields": s.fields, "weight": s.weight,
            "key": key}


def chat_template_of(template: str | None, base: Path) -> str | None:
    """A chat_template key for the phase spec: the template itself or its name, or its file's absolute path."""
    return str((base / template).resolve()) if template is not None and is_template_path(template) else template


def inspect_data(loaded: LoadedSchedule, cache_root: Path, show: int = 0, reuse: tuple[Path, ...] = (),
                 stop_signals: tuple[int, ...] = STOP_SIGNALS) -> dict[str, Any]:
    """Prepares the data into ``cache_root`` (kept; an existing entry is reused, in it or in one of
    ``reuse``, read only) and checks it; the datatool's answer. Raises ScheduleError (exit 2) for
    data that does not fit, Preempted (exit 75) for one of ``stop_signals`` meanwhile: the datatool
    and its workers are gone before either returns."""
    s = loaded.schedule
    config = read_model_config(s.model, loaded.model_path, loaded.source)
    tok = tokenizer_of(s.model, loaded.source.parent)
    req = {"data": data_spec(loaded), "tokenizer": str(tok) if tok else None, "cache_root": str(cache_root),
           "reuse": [str(p) for p in reuse], "show": show, "vocab_size": config.get("vocab_size")}
    tmp_root = scratch_root()
    remove_left(tmp_root, TMP_CACHE)
    remove_left(Path(tempfile.gettempdir()), WANDB_TMP)  # a killed phase's W&B temporaries
    # Its TMPDIR (the workers' pymp-* folders) goes with it; a session of its own: a stop reaches
    # the whole tool, its datasets.map workers too, from here.
    with tempfile.TemporaryDirectory(prefix=f"{TMP_CACHE}{os.getpid()}.", dir=tmp_root) as scratch:
        proc = subprocess.Popen(python_m(DATA_TOOL), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, "TMPDIR": scratch})
        try:
            with stopped_by(stop_signals, loaded):
                out, err = proc.communicate(json.dumps(req))
        finally:
            end_session(proc)
    if proc.returncode == 2:
        raise ScheduleError(f"data: {err.strip()}")
    if proc.returncode != 0:
        tail = "\n  ".join(err.strip().splitlines()[-10:])
        raise RelayerError(f"data: preparing {loaded.data_path} failed ({exit_text(proc.returncode)}):\n  {tail}")
    answer = json.loads(out)
    rows, batch = answer["stats"]["train"]["rows"], s.data.batch_size
    if batch > rows:  # a step would take some row twice (and at 2^40 never be drawn at all)
        raise ScheduleError(f"{loaded.source}: data.batch_size: expected at most the {rows:,} training rows the data "
                            f"makes, got {batch:,}")
    return answer


def scratch_root() -> Path:
    """Where the datatool's own TMPDIR goes: the user's temporary folder, or, where that is too long
    for the sockets of datasets.map's workers, the first short one that can be written to."""
    default = Path(tempfile.gettempdir())
    for root in (default, *SHORT_ROOTS):
        room = len(os.fsencode(root)) + len(f"/{TMP_CACHE}{2**22}.XXXXXXXX") + SOCKET_TAIL
        if room <= SOCKET_PATH_MAX and root.is_dir() and os.access(root, os.W_OK | os.X_OK):
            return root
    return default


@contextmanager
def stopped_by(signals: tuple[int, ...], loaded: LoadedSchedule) -> Iterator[None]:
    """One of ``signals`` inside the block raises Preempted (exit 75), so that what the block made
    goes with it; the handlers before come back after."""
    def stop(signum: int, _frame) -> None:
        raise Preempted(f"stopped by signal {signum} while preparing the data ({loaded.data_path}); nothing was "
                        "written")

    old = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def check_data(loaded: LoadedSchedule, show: int = 0) -> dict[str, Any]:
    """``inspect_data`` into a temporary cache that is removed (a stop too): nothing is written.
    Data the run has prepared already (``RUN_DIR/data-cache``, the same key) is read from there, not
    again; the statistics that loading the schedule asked for already (``LoadedSchedule.data_check``)
    are those."""
    if loaded.data_check is not None and not show:
        return loaded.data_check
    run_cache = loaded.output_dir / DATA_CACHE
    reuse = (run_cache,) if run_cache.is_dir() and not run_cache.is_symlink() else ()
    with stopped_by(STOP_SIGNALS, loaded), tempfile.TemporaryDirectory(prefix=f"{TMP_CACHE}{os.getpid()}.") as tmp:
        return inspect_data(loaded, Path(tmp), show, reuse)


def remove_left(parent: Path, prefix: str) -> list[Path]:
    """Removes the folders ``<prefix><pid>.*`` in ``parent`` of processes that are gone (a
    SIGKILLed plan, data or run; a process of that pid now is left alone)."""
    gone = []
    for entry in parent.glob(f"{glob.escape(prefix)}*"):
        pid = entry.name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)) and entry.is_dir() and not entry.is_symlink() \
                and entry.stat().st_uid == os.getuid():
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(entry)
    return gone


def stage_data(loaded: LoadedSchedule, stop_signals: tuple[int, ...] = STOP_SIGNALS) -> Path:
    """Prepares the data of a run not started yet into a temporary cache beside it (removed on
    failure and on a stop, and by the next run where this process was killed); ``adopt_data``
    moves it into the run directory once that exists."""
    parent = next((p for p in loaded.output_dir.parents if p.exists()), loaded.output_dir.parent)
    prefix = f"{STAGED}{loaded.output_dir.name}."
    tmp = None
    try:
        with stopped_by(stop_signals, loaded):
            try:
                remove_left(parent, prefix)
                # Named before it is made: a stop right after mkdir (mkdtemp's return) would leave it.
                tmp = parent / f"{prefix}{os.getpid()}.{secrets.token_hex(4)}"
                tmp.mkdir(mode=0o700)
            except OSError as e:
                tmp = None  # not made here: nothing to remove
                # The run directory would be made beside it: where this fails, so would the run.
                raise ScheduleError(f"{loaded.output_dir}: cannot create the run directory: {e.strerror or e}") \
                    from None
            inspect_data(loaded, tmp, stop_signals=stop_signals)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Preempted):
            raise Preempted(f"{e}; {loaded.output_dir} was not made; run again to start") from None
        raise
    return tmp


def adopt_data(loaded: LoadedSchedule, staged: Path | None, stop_signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Puts the prepared data in ``RUN_DIR/data-cache``: the staged entries, or (on resume) a
    preparation there, which finds an existing entry and does nothing."""
    cache = loaded.output_dir / DATA_CACHE
    if staged is None:
        inspect_data(loaded, cache, stop_signals=stop_signals)
        return
    cache.mkdir(exist_ok=True)
    for entry in staged.iterdir():
        if not entry.name.startswith(".") and not (cache / entry.name).exists():
            shutil.move(str(entry), str(cache / entry.name))
    shutil.rmtree(staged, ignore_errors=True)
