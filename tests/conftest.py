"""Shared fixtures: a tiny Llama saved as a Hugging Face directory, token data, schedules, runs.

Everything is made here (no downloads). Runs go through the real CLI in a subprocess, so each
phase is a real process with a real DeepSpeed engine on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import tomli_w
from filelock import FileLock

from launch.contract.pids import started
from shard_tools.manifest import read_manifest
from shard_tools.store import Checkpoints

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 96
SEQ = 16

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# One torch thread a process, in this one and every process a test starts: the tiny model's work is
# too small to split, and tests/run.py runs tests side by side on every core, where the default (a
# thread per core in every rank) has threads spin against each other's (a busy 2-core machine's
# steps 12x slower). Runs compared bitwise all run under the same setting.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def make_llama(out: Path, layers: int = 4, tie: bool = False, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def make_tokens(out: Path, n: int = 64, seq: int = SEQ, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(out, "w") as f:
        for _ in range(n):
            # A learnable pattern (a noisy counter) so the loss moves, not pure noise.
            start = rng.randrange(VOCAB)
            f.write(json.dumps({"input_ids": [(start + i * 3 + (rng.random() < 0.1)) % VOCAB for i in range(seq)]}) + "\n")
    return out


def shared(tmp_path_factory: pytest.TempPathFactory, key: str, make: Callable[[Path], None]) -> Path:
    """A folder ``make`` fills once for the whole session, however many pytest-xdist workers ask
    for it: the first builds it under a lock (the others wait), every later one reads it. The
    folder is read-only by contract; a test that changes it works on a copy."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' common folder
    folder, done = root / f"shared-{key}", root / f"shared-{key}.done"
    with FileLock(str(root / f"shared-{key}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return shared(tmp_path_factory, "model", lambda d: make_llama(d / "tiny-llama")) / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return shared(tmp_path_factory, "data", lambda d: make_tokens(d / "train.jsonl")) / "train.jsonl"


def schedule_dict(model_dir: Path, data_path: Path, **sections) -> dict:
    """The tiny 3-phase schedule ([0], [1], [0] x 10 steps); ``sections`` override per section."""
    base = {
        # No RUN_DIR/final: exporting costs every run a torch start; the tests of it turn it on.
        "run": {"output_dir": "run", "seed": 0, "final_model": False},
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": {"path": str(data_path), "format": "tokens", "seq_len": SEQ, "batch_size": 8, "micro_batch_size": 4},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.0, "grad_clip": 1.0},
        "schedule": {"phases": [{"steps": 10, "layers": [0]}, {"steps": 10, "layers": [1]},
                                {"steps": 10, "layers": [0]}]},
        "deepspeed": {"zero_stage": 2},
        "launch": {"launcher": "local", "nproc": 1, "grace_seconds": 10},
        # A checkpoint at every phase end, as the tests of phase ends expect; the cadence has its own.
        "checkpoint": {"every_steps": 0, "every_seconds": 0, "keep_last": 10},
    }
    for name, values in sections.items():
        if values is None:
            base.pop(name, None)
        else:
            base[name] = {**base.get(name, {}), **values}
    return base


def write_schedule(path: Path, schedule: dict) -> Path:
    path.write_text(tomli_w.dumps(schedule))
    return path


def alive(rec: dict) -> bool:
    """Whether the process of a pid record (``pids/NAME.json`` read as JSON) still runs: matched on
    its start, so a reused pid is never taken for it."""
    try:
        return started(rec["pid"]) == rec["started"]
    except psutil.NoSuchProcess:
        return False


def said(proc: subprocess.Popen) -> str:
    """Everything an ended process printed, whole: an assert's message that is not a string (the
    tuple ``communicate()`` returns) is cut in the middle, which cut a failed phase's reason out."""
    out, err = proc.communicate()
    return f"exit {proc.returncode}\n{out or ''}\n{err or ''}"


def faults_env(**plan) -> dict[str, str]:
    """Environment for a run whose processes install the fault handlers of ``plan`` (see
    tests/faults/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (str(ROOT / "tests" / "faults"), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "RELAYER_TEST_FAULTS": json.dumps(plan)}


def cli(*args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Runs ``orchestrator`` or ``shard-tools`` as a user would."""
    exe = Path(sys.executable).parent / args[0]
    return subprocess.run([str(exe), *args[1:]], capture_output=True, text=True, timeout=timeout, **kw)


def truncated_copy(src: Path, dst: Path, keep_upto: int) -> Path:
    """A copy of a run as it was at step ``keep_upto``: later checkpoints removed."""
    shutil.copytree(src, dst)
    for ckpt in Checkpoints(dst).all():
        if read_manifest(ckpt).global_step > keep_upto:
            shutil.rmtree(ckpt)
    return dst


def killed_then_rerun(sched: Path, step: int) -> None:
    """``orchestrator run sched`` killed (SIGKILL of rank 0) in global step ``step``, exit 1; then run
    again, to its end."""
    r = cli("orchestrator", "run", str(sched), env={**os.environ, **faults_env(
        kill_at={"point": "data.micro_batch", "step": step, "rank": 0})})
    assert r.returncode == 1, r.stderr
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr


def finished_run(tmp_path_factory: pytest.TempPathFactory, schedule: dict) -> Path:
    """The run directory of ``schedule`` run to its end, once per session for every test and
    worker that asks for the same schedule (a reference run several modules compare with); treat
    it as read-only."""
    text = tomli_w.dumps(schedule)
    key = "run-" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def make(d: Path) -> None:
        (d / "schedule.toml").write_text(text)
        r = cli("orchestrator", "run", str(d / "schedule.toml"))
        assert r.returncode == 0, r.stderr

    return shared(tmp_path_factory, key, make) / schedule["run"]["output_dir"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_model, tiny_data) -> Path:
    """A completed 3-phase run (ZeRO-2, fp32, one process); treat it as read-only."""
    return finished_run(tmp_path_factory, schedule_dict(tiny_model, tiny_data))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--alone", choices=("any", "skip", "only"), default="any",
                     help="tests marked alone (they need the machine to themselves): run them with the "
                          "others (any), leave them out (skip) or run only them (only); tests/run.py "
                          "runs the rest on every core, then these one at a time")


COSTS = json.loads((ROOT / "tests" / "costs.json").read_text())
"""Seconds each multiprocess test module took (``tests/costs.json``): the longest start first."""


def order(item: pytest.Item) -> tuple:
    """The fast tests first, in file order; then the multiprocess modules, the longest first, so
    that the workers of ``tests/run.py`` end together. The order within a module stays (module
    fixtures are built once)."""
    if item.get_closest_marker("multiprocess") is None:
        return (0, 0.0)
    module = item.nodeid.split("::", 1)[0]
    return (1, -COSTS.get(module, 60.0))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    alone = config.getoption("--alone")
    if alone != "any":
        wanted = alone == "only"
        config.hook.pytest_deselected(items=[i for i in items if (i.get_closest_marker("alone") is not None) != wanted])
        items[:] = [i for i in items if (i.get_closest_marker("alone") is not None) == wanted]
    items.sort(key=order)
