"""Every number that sizes work is bounded before it is used, and every name before it reaches the
file system (#48): ``plan`` exits 2 with one message naming the key or file, never a traceback,
an out-of-memory, a hang or a run that cannot take a step. In-process, no phase starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import schedule_dict, write_schedule
from tests.orchestrator.test_cli_plan import invoke


def plan(tmp_path: Path, sched: dict):
    path = write_schedule(tmp_path / "schedule.toml", sched)
    r = invoke("plan", str(path))
    assert "Traceback" not in r.output and not isinstance(r.exception, (RecursionError, MemoryError, AssertionError))
    return r


def model_with(tmp_path: Path, tiny_model: Path, **config) -> Path:
    """A copy of the tiny model whose config.json says ``config`` besides."""
    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, **config}))
    return model


@pytest.mark.parametrize("config,says", [
    ({"num_hidden_layers": 10 ** 11}, "num_hidden_layers: expected an integer from 1 to 16,384, got 100000000000"),
    ({"hidden_size": 64}, "hidden_size = 64, but model.embed_tokens.weight in"),
    ({"vocab_size": 97}, "vocab_size = 97, but model.embed_tokens.weight in"),
    ({"intermediate_size": 2 ** 40}, "intermediate_size: expected an integer from 1 to 4,194,304"),
])
def test_plan_checks_config_json_against_its_bounds_and_the_weights_shapes(config, says, tmp_path, tiny_model,
                                                                           tiny_data):
    r = plan(tmp_path, schedule_dict(model_with(tmp_path, tiny_model, **config), tiny_data))
    assert r.exit_code == 2 and "config.json" in r.stderr and says in r.stderr, r.output


def test_plan_bounds_an_inline_model_config(tmp_path, tiny_data):
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "vocab_size": 10 ** 12,
              "intermediate_size": 64, "num_attention_heads": 4}
    sched = schedule_dict(tmp_path, tiny_data)
    sched["model"] = {"config": config, "dtype": "float32"}
    r = plan(tmp_path, sched)
    assert r.exit_code == 2 and "model.config: vocab_size: expected an integer from 1 to 16,777,216" in r.stderr, r.output
