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


def two_sources(sched: dict, weight: float) -> None:
    path = sched["data"].pop("path")
    del sched["data"]["format"]
    sched["data"]["sources"] = [{"path": path}, {"path": path, "weight": weight}]


def strategy(**keys) -> dict:
    return {"strategy": "ascending", "interval": 5, "layers_per_phase": 1, **keys}


@pytest.mark.parametrize("edit,says", [
    # What sizes the data: a weight that would draw 10^9 copies, a batch beyond the data or int64.
    (lambda s: two_sources(s, 2e6),
     "data.sources[1].weight: expected a number <= 1e+06, got 2000000.0"),
    (lambda s: s["data"].update(batch_size=2 ** 40), "data.batch_size: expected an integer <= 2,147,483,648"),
    (lambda s: s["data"].update(batch_size=128, micro_batch_size=4), "data.batch_size: expected at most the 64 "
                                                                     "training rows the data makes, got 128"),
    (lambda s: s["data"].update(seq_len=2 ** 63), "data.seq_len: expected an integer <= 2,147,483,648"),
    # Steps: eight digits of a checkpoint's name, epochs that round to no step, a warm-up past the end.
    (lambda s: s.update(schedule={"phases": [{"steps": 2 ** 63 - 1, "layers": [0]}]}),
     "schedule.phases[0].steps: expected an integer <= 99,999,999"),
    (lambda s: s.update(schedule={"phases": [{"steps": 6 * 10 ** 7, "layers": [0]}, {"steps": 6 * 10 ** 7, "layers": [1]}]}),
     "schedule.phases: expected at most 99,999,999 steps in all"),
    (lambda s: s.update(schedule=strategy(epochs=1e-9)), "schedule.epochs: 1e-09 epochs of 64 rows at data.batch_size "
                                                         "8 make 0 steps; expected 1 to 99,999,999"),
    (lambda s: s.update(schedule=strategy(epochs=1e7)), "schedule.epochs: expected a number <= 1e+06"),
    (lambda s: s.update(lr_schedule={"warmup_steps": 31}),
     "lr_schedule.warmup_steps: expected at most the run's 30 steps, got 31"),
    # Durations: past any timer's range, which switched the backstop off.
    (lambda s: s["launch"].update(grace_seconds=1e10), "launch.grace_seconds: expected a number <= 1e+08"),
    (lambda s: s["launch"].update(stall_seconds=1e19), "launch.stall_seconds: expected a number <= 1e+08"),
    (lambda s: s["checkpoint"].update(every_seconds=1e12), "checkpoint.every_seconds: expected a number <= 1e+08"),
    (lambda s: s["checkpoint"].update(every_steps=2 ** 62), "checkpoint.every_steps: expected an integer <= 99,999,999"),
    (lambda s: s["run"].update(seed=2 ** 64), "run.seed: expected an integer <= 9,223,372,036,854,775,807"),
])
def test_plan_bounds_every_number_that_sizes_work(edit, says, tmp_path, tiny_model, tiny_data):
    sched = schedule_dict(tiny_model, tiny_data)
    edit(sched)
    r = plan(tmp_path, sched)
    assert r.exit_code == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.output


def test_nesting_is_bounded_before_anything_recurses(tmp_path, tiny_model, tiny_data):
    """A 5000-deep deepspeed.config file, a 3000-deep --set value (RecursionError tracebacks), and
    one 100 deep, which parses but is no schedule: exit 2 naming where."""
    (tmp_path / "ds.json").write_text('{"a":' * 5000 + "1" + "}" * 5000)
    sched = schedule_dict(tiny_model, tiny_data, deepspeed={"config": str(tmp_path / "ds.json")})
    r = plan(tmp_path, sched)
    assert r.exit_code == 2 and "ds.json: expected a DeepSpeed JSON config (deepspeed.config): nested deeper" \
        in r.stderr, r.output
    path = write_schedule(tmp_path / "schedule.toml", schedule_dict(tiny_model, tiny_data))
    for depth, says in ((3000, "--set: '{a={a="), (100, "deepspeed.config.a.a.a")):
        r = invoke("plan", str(path), "--set", "deepspeed.config=" + "{a=" * depth + "1" + "}" * depth)
        assert r.exit_code == 2 and says in r.stderr and "nested deeper than 32 levels" in r.stderr, r.output


def test_names_longer_than_the_file_system_allows(tmp_path, tiny_model, tiny_data):
    """[Errno 36] tracebacks: exit 2 naming the name, for a schedule's paths and a command's argument."""
    from click.testing import CliRunner

    from shard_tools.cli import main as shard_tools

    long = "x" * 300
    for edit in ({"data": {"path": long}}, {"model": {"path": str(tiny_model), "tokenizer": long}},
                 {"run": {"output_dir": f"{long}/run"}}):
        r = plan(tmp_path, schedule_dict(tiny_model, tiny_data, **edit))
        assert r.exit_code == 2 and long in r.stderr and "File name too long" in r.stderr, r.output
    r = invoke("status", str(tmp_path / long))
    assert r.exit_code == 2 and long in r.stderr, r.output
    r = CliRunner().invoke(shard_tools, ["inspect", str(tmp_path / long)])
    assert r.exit_code == 2 and long in r.output and "Traceback" not in r.output, r.output


def hostfile(tmp_path: Path, text: str, **launch) -> dict:
    (tmp_path / "hosts").write_text(text)
    return {"launcher": "deepspeed", "nnodes": 2, "hostfile": str(tmp_path / "hosts"), "master_addr": "127.0.0.1",
            **launch}


@pytest.mark.parametrize("edit,says", [
    (lambda s, t: s["deepspeed"].update(zero_stage=True), "deepspeed.zero_stage: expected 0, 1, 2 or 3, got true"),
    (lambda s, t: s["deepspeed"].update(config=5),
     "deepspeed.config: expected a table, or a DeepSpeed JSON file's path, got 5"),
    (lambda s, t: s["launch"].update(hostfile(t, "node1 slots=8\n# node2 slots=8\n")),
     "names 1 host(s), launch.nnodes = 2 needs that many"),
    (lambda s, t: s["launch"].update(hostfile(t, "node1 slots=8\nnode2 slots=1\n", nproc=2)),
     "node2 has slots=1, fewer than launch.nproc = 2 processes a node"),
])
def test_plan_refuses_what_it_read_as_something_else(edit, says, tmp_path, tiny_model, tiny_data):
    """true taken as stage 1, 5 said to be no "dict[str,any]", a hostfile that cannot serve the
    nodes the run asks for (the rendezvous would wait for ranks never started)."""
    sched = schedule_dict(tiny_model, tiny_data)
    edit(sched, tmp_path)
    r = plan(tmp_path, sched)
    assert r.exit_code == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.output
