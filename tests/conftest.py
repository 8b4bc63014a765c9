"""Shared fixtures: a tiny Llama saved as a Hugging Face directory, token data, schedules, runs.

Everything is made here (no downloads). Runs go through the real CLI in a subprocess, so each
phase is a real process with a real DeepSpeed engine on the CPU.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 96
SEQ = 16

os.environ.setdefault("DS_ACCELERATOR", "cpu")


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return make_tokens(tmp_path_factory.mktemp("data") / "train.jsonl")


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


def faults_env(**plan) -> dict[str, str]:
    """Environment for a run whose processes install the fault handlers of ``plan`` (see
    tests/faults/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (str(ROOT / "tests" / "faults"), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "RELAYER_TEST_FAULTS": json.dumps(plan)}


def cli(*args: str, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Runs ``orchestrator`` or ``shard-tools`` as a user would."""
    exe = Path(sys.executable).parent / args[0]
    return subprocess.run([str(exe), *args[1:]], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, tiny_model, tiny_data) -> Path:
    """A completed 3-phase run (ZeRO-2, fp32, one process); treat it as read-only."""
    d = tmp_path_factory.mktemp("tiny-run")
    sched = write_schedule(d / "schedule.toml", schedule_dict(tiny_model, tiny_data))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    return d / "run"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tests first, then those that start phase processes, each kind in file order: a
    whole run (``make test``) shows progress from its first minute, not after the first
    multiprocess file. The order within a file stays (module fixtures are built once)."""
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is not None)
