"""The data step: ``python -m launch.datatool`` prepares and checks the data in a subprocess (the
orchestrator never imports datasets or transformers) and answers with JSON.

- ``orchestrator data`` and ``orchestrator plan`` prepare into a temporary directory, removed after;
- ``orchestrator run`` prepares before the run directory exists (bad data: exit 2, no run
  directory), then moves the entries into ``RUN_DIR/data-cache``, where every phase process finds
  them by the same key and only maps them.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from launch.contract.channels import DATA_TOOL, python_m
from launch.contract.files import DATA_CACHE
from orchestrator.errors import Preempted, RelayerError, ScheduleError
from orchestrator.modelcheck import read_model_config
from orchestrator.schedule import LoadedSchedule
from orchestrator.validate import chat_template_of, tokenizer_of

def data_spec(loaded: LoadedSchedule) -> dict[str, Any]:
    """The phase spec's data part (``launch.contract.spec.DataPart``): what keys the cache."""
    d, base = loaded.schedule.data, loaded.source.parent
    return {"path": str(loaded.data_path), "format": d.format, "seq_len": d.seq_len, "pack": d.pack,
            "train_on_prompt": d.train_on_prompt, "fields": d.fields, "chat_template": chat_template_of(d, base),
            "batch_size": d.batch_size, "micro_batch_size": d.micro_batch_size, "shuffle": d.shuffle,
            "eval_every": d.eval_every,
            "validation_path": str(base / d.validation_path) if d.validation_path else None}


def inspect_data(loaded: LoadedSchedule, cache_root: Path, show: int = 0, reuse: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Prepares the data into ``cache_root`` (kept; an existing entry is reused, in it or in one of
    ``reuse``, read only) and checks it; the datatool's answer. Raises ScheduleError (exit 2) for
    data that does not fit."""
    s = loaded.schedule
    config = read_model_config(s.model, loaded.model_path, loaded.source)
    tok = tokenizer_of(s.model, loaded.source.parent)
    req = {"data": data_spec(loaded), "tokenizer": str(tok) if tok else None, "cache_root": str(cache_root),
           "reuse": [str(p) for p in reuse], "seed": s.run.seed, "show": show, "vocab_size": config.get("vocab_size")}
    proc = subprocess.run(python_m(DATA_TOOL), input=json.dumps(req), capture_output=True,
                          text=True)
    if proc.returncode == 2:
        raise ScheduleError(f"data: {proc.stderr.strip()}")
    if proc.returncode != 0:
        tail = "\n  ".join(proc.stderr.strip().splitlines()[-10:])
        raise RelayerError(f"data: preparing {loaded.data_path} failed (exit {proc.returncode}):\n  {tail}")
    return json.loads(proc.stdout)


def check_data(loaded: LoadedSchedule, show: int = 0) -> dict[str, Any]:
    """``inspect_data`` into a temporary cache that is removed: nothing is written. Data the run
    has prepared already (``RUN_DIR/data-cache``, the same key) is read from there, not again."""
    run_cache = loaded.output_dir / DATA_CACHE
    reuse = (run_cache,) if run_cache.is_dir() and not run_cache.is_symlink() else ()
    with tempfile.TemporaryDirectory(prefix="relayer-data-") as tmp:
        return inspect_data(loaded, Path(tmp), show, reuse)


def stage_data(loaded: LoadedSchedule, stop_signals: tuple[int, ...] = ()) -> Path:
    """Prepares the data of a run not started yet into a temporary cache (removed on failure);
    ``adopt_data`` moves it into the run directory once that exists. One of ``stop_signals`` meanwhile
    raises Preempted (exit 75), so the temporary cache goes with it."""
    parent = next(p for p in loaded.output_dir.parents if p.exists())
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".relayer-data-", dir=parent))
    except OSError as e:
        # The run directory would be made beside it: where this fails, so would the run.
        raise ScheduleError(f"{loaded.output_dir}: cannot create the run directory: {e.strerror or e}") from None

    def stop(signum: int, _frame) -> None:
        raise Preempted(f"stopped by signal {signum} while preparing the data, before {loaded.output_dir} "
                        "was made; nothing was written; run again to start")

    old = {s: signal.signal(s, stop) for s in stop_signals}
    try:
        inspect_data(loaded, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return tmp


def adopt_data(loaded: LoadedSchedule, staged: Path | None) -> None:
    """Puts the prepared data in ``RUN_DIR/data-cache``: the staged entries, or (on resume) a
    preparation there, which finds an existing entry and does nothing."""
    cache = loaded.output_dir / DATA_CACHE
    if staged is None:
        inspect_data(loaded, cache)
        return
    cache.mkdir(exist_ok=True)
    for entry in staged.iterdir():
        if not entry.name.startswith(".") and not (cache / entry.name).exists():
            shutil.move(str(entry), str(cache / entry.name))
    shutil.rmtree(staged, ignore_errors=True)
