"""Several data sources with weights, a validation split and epochs, as ``orchestrator data``,
``plan`` and ``run`` see them; every new key's bad values exit 2 naming the key.

The model and tokenizer are the Alpaca example's (made in a temporary folder); one source is
Alpaca-style instructions, the other ShareGPT conversations.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from tests.conftest import ROOT, cli, schedule_dict, write_schedule
from tests.orchestrator.test_data_cli import jsonl, model  # noqa: F401 - the Alpaca example's model, a fixture

ALPACA = [{"instruction": f"Name colour number {i}.", "input": "", "output": f"The colour is {c}."}
          for i, c in enumerate(["red", "green", "blue", "black", "white", "grey", "pink", "gold", "teal", "navy"])]
SHAREGPT = [{"conversations": [{"from": "human", "value": f"Which animal comes {i}?"},
                               {"from": "gpt", "value": f"It is the {a}."}]}
            for i, a in enumerate(["cat", "dog", "bird", "fish", "cow", "pig"])]


def mixed(tmp: Path, model: Path, data: dict | None = None, schedule: dict | None = None,
          sources: list[dict] | None = None, name: str = "s.toml") -> Path:
    """A schedule of the two sources, weights 1 and 2 unless ``sources`` says otherwise."""
    if sources is None:
        a, b = jsonl(tmp / "alpaca.jsonl", ALPACA), jsonl(tmp / "sharegpt.jsonl", SHAREGPT)
        sources = [{"path": str(a), "format": "instruction"}, {"path": str(b), "format": "chat", "weight": 2}]
    raw = schedule_dict(model, tmp / "unused", optimizer={"lr": 3e-3})
    raw["data"] = {"sources": sources, "seq_len": 48, "batch_size": 4, "micro_batch_size": 2, **(data or {})}
    raw["schedule"] = schedule or {"phases": [{"steps": 2, "layers": [0]}, {"steps": 2, "layers": [1]}]}
    return write_schedule(tmp / name, raw)


def data_json(schedule: Path, *args: str) -> dict:
    r = CliRunner().invoke(main, ["data", str(schedule), "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_two_sources_with_weights_are_drawn_as_counted(tmp_path, model):
    out = data_json(mixed(tmp_path, model))
    alpaca, share = out["sources"]
    assert (alpaca["key"], alpaca["format"], alpaca["records"], alpaca["examples"]) == (
        "data.sources[0]", "instruction", 10, 10)
    assert (share["key"], share["format"], share["records"], share["weight"], share["examples"]) == (
        "data.sources[1]", "chat", 6, 2.0, 12)
    assert out["train"]["examples"] == out["train"]["rows"] == 22  # one example a row, padded
    assert out["train"]["target_tokens"] == alpaca["target_tokens"] + share["target_tokens"]
    assert out["validation"] is None and out["validation_files"] == []
    assert [s["marking"] for s in out["sources"]] == [["prefixes"], ["prefixes"]]
    # A fractional weight draws a seeded part: round(0.5 x 6) = 3 of the conversations.
    half = data_json(mixed(tmp_path, model, name="h.toml", sources=[
        {"path": str(tmp_path / "alpaca.jsonl"), "format": "instruction"},
        {"path": str(tmp_path / "sharegpt.jsonl"), "format": "chat", "weight": 0.5}]))
    assert [s["examples"] for s in half["sources"]] == [10, 3] and half["train"]["examples"] == 13


def test_the_shown_rows_come_from_both_sources(tmp_path, model):
    schedule = mixed(tmp_path, model, data={"shuffle": False})
    r = CliRunner().invoke(main, ["data", str(schedule), "--show", "22", "--json"])
    assert r.exit_code == 0, r.output
    targets = [row["target"] for row in json.loads(r.output)]
    # In order: the instructions, then the conversations twice (the draws of weight 2).
    assert targets[:10] == [rec["output"] + "<|end|>\n" for rec in ALPACA]
    assert targets[10:] == [c["conversations"][1]["value"] + "<|end|>\n" for c in SHAREGPT] * 2


def test_a_validation_split_holds_out_each_source_s_part(tmp_path, model):
    out = data_json(mixed(tmp_path, model, data={"validation_split": 0.25, "eval_every": 2}))
    # ceil(0.25 x 10) = 3 and ceil(0.25 x 6) = 2 held out; the rest drawn at their weights.
    assert [(s["held_out"], s["examples"]) for s in out["sources"]] == [(3, 7), (2, 8)]
    assert out["validation"]["examples"] == 5 and out["train"]["examples"] == 15
    again = data_json(mixed(tmp_path, model, data={"validation_split": 0.25}, name="t.toml"))
    assert again["validation"] == out["validation"]  # seeded: the same records


def test_packing_whole_reports_rows_and_padding(tmp_path, model):
    padded = data_json(mixed(tmp_path, model))["train"]
    packed = data_json(mixed(tmp_path, model, data={"pack": True}, name="p.toml"))["train"]
    assert packed["examples"] == padded["examples"] and packed["target_tokens"] == padded["target_tokens"]
    assert packed["rows"] < padded["rows"] and packed["padding_tokens"] < padded["padding_tokens"]
    assert packed["truncated"] == padded["truncated"] == 0


def test_epochs_set_the_steps_and_plan_shows_both(tmp_path, model):
    schedule = mixed(tmp_path, model, schedule={"strategy": "lisa", "epochs": 1.5, "interval": 3,
                                                "layers_per_phase": 1})
    r = CliRunner().invoke(main, ["plan", str(schedule)])
    assert r.exit_code == 0, r.output
    steps = math.ceil(round(1.5 * 22) / 4)  # 22 rows, batch 4: 9 steps
    assert f"schedule: epochs = 1.5 of 22 rows at data.batch_size 4: total_steps = {steps}" in r.output
    assert "data.sources[1]: " in r.output and "weight 2: 12 examples an epoch" in r.output


@pytest.mark.parametrize("data,schedule,message", [
    ({"sources": []}, None, "data.sources: expected at least one source, got an empty list"),
    ({"path": "x.jsonl"}, None, "data.sources: expected data.path (one source) or data.sources (several), not both"),
    ({"format": "chat"}, None, "data.format: a key of the one-source form (data.path): with data.sources, set "
                               "data.sources[i].format"),
    ({"validation_path": "v.jsonl"}, None, "data.validation_path: a key of the one-source form (data.path): with "
                                           "data.sources, hold data out with data.validation_split"),
    ({"validation_split": 1.0}, None, "data.validation_split: expected a number < 1, got 1.0"),
    ({"validation_split": 0}, None, "data.validation_split: expected a positive number, got 0"),
    ({"pack": "tight"}, None, 'data.pack: expected true, false, "whole" or "stream", got \'tight\''),
    ({"sources[1].weight": 0}, None, "data.sources[1].weight: expected a positive number, got 0"),
    ({"sources[1].weight": "x"}, None, "data.sources[1].weight: expected a number, got 'x'"),
    ({"sources[0].format": "yaml"}, None, "data.sources[0].format: expected"),
    ({"sources[0].fields": {"prompt": "q"}}, None, "data.sources[0].fields.prompt: not a field of "
                                                   'data.sources[0].format = "instruction"; expected one of '
                                                   "instruction, input, output"),
    ({"sources[1].colour": 1}, None, "data.sources[1].colour: unknown key"),
    ({"sources": "a.jsonl"}, None, "data.sources: expected a list, got 'a.jsonl'"),
    ({"sources[0].train_on_prompt": "yes"}, None, "data.sources[0].train_on_prompt: expected true or false, got 'yes'"),
    ({"sources[1].weight": True}, None, "data.sources[1].weight: expected a number, got true"),
    ({"validation_split": "x"}, None, "data.validation_split: expected a number, got 'x'"),
    ({"sources[1].path": "nowhere.jsonl"}, None, "data.sources[1].path: expected a data file or a "
                                                 "datasets.save_to_disk folder"),
    ({"sources[0].chat_template": "llama-3"}, None, "data.sources[0].chat_template: expected a Jinja template, one "
                                                    "named llama3, chatml, qwen2.5, mistral, gemma, phi3, \"alpaca\" "
                                                    "(the Alpaca prompt), or a file holding one"),
    ({}, {"strategy": "lisa", "epochs": 0, "interval": 2, "layers_per_phase": 1},
     "schedule.epochs: expected a positive number, got 0"),
    ({}, {"strategy": "lisa", "epochs": 1, "total_steps": 4, "interval": 2, "layers_per_phase": 1},
     "schedule.epochs: expected schedule.total_steps or schedule.epochs, not both"),
    ({}, {"strategy": "lisa", "interval": 2, "layers_per_phase": 1},
     "schedule.total_steps: required with schedule.strategy = 'lisa' (or schedule.epochs), but missing"),
    ({}, {"phases": [{"steps": 2, "layers": [0]}], "epochs": 2},
     "schedule.epochs: expected either schedule.phases or schedule.strategy"),
])
def test_bad_new_keys_exit_2_naming_the_key(tmp_path, model, data, schedule, message):
    path = mixed(tmp_path, model, schedule=schedule)
    raw = __import__("tomllib").loads(path.read_text())
    for key, value in data.items():
        if key.startswith("sources["):
            i, field = int(key[8]), key.split(".", 1)[1]
            raw["data"]["sources"][i][field] = value
        else:
            raw["data"][key] = value
    write_schedule(path, raw)
    r = CliRunner().invoke(main, ["plan", str(path)])
    assert r.exit_code == 2, r.output
    assert f"{path}: {message}" in r.output, r.output


@pytest.mark.parametrize("change,message", [
    ({"validation_split": 0.95}, "data.validation_split = 0.95 holds out 6 of data.sources[1]'s 6 records: none "
                                 "is left to train on"),
    ({"weight": 0.01}, "data.sources[1].weight = 0.01 draws none of its 6 training examples"),
    ({"chat_template": "gemma"}, 'chat_template = "gemma" needs <bos> as one token of the tokenizer'),
])
def test_data_that_the_new_keys_cannot_use_exits_2_naming_key_and_source(tmp_path, model, change, message):
    share = {"path": str(jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT)), "format": "chat"}
    share.update({k: v for k, v in change.items() if k != "validation_split"})
    schedule = mixed(tmp_path, model, data={k: v for k, v in change.items() if k == "validation_split"},
                     sources=[{"path": str(jsonl(tmp_path / "alpaca.jsonl", ALPACA * 4)), "format": "instruction"},
                              share])
    r = CliRunner().invoke(main, ["data", str(schedule)])
    assert r.exit_code == 2, r.output
    assert message in r.output and str(tmp_path / "sharegpt.jsonl") in r.output, r.output


def test_a_bad_record_names_its_source_file_and_line(tmp_path, model):
    schedule = mixed(tmp_path, model)
    jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT[:3] + [{"conversations": [{"from": "bot", "value": "x"}]}])
    r = CliRunner().invoke(main, ["plan", str(schedule)])
    assert r.exit_code == 2, r.output
    assert f"{tmp_path / 'sharegpt.jsonl'}:4: turn 0: from \"bot\" is not one of" in r.output


@pytest.mark.multiprocess
def test_a_mixed_run_trains_on_the_counted_examples(tmp_path, model):
    """An epoch of the mix, batch 4 over 22 rows... made whole: 24 rows (the shuffled examples, two
    drawn twice more at weight 2), 6 steps; the targets each step trained on add up to the count."""
    sources = [{"path": str(jsonl(tmp_path / "alpaca.jsonl", ALPACA)), "format": "instruction"},
               {"path": str(jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT + SHAREGPT[:1])), "format": "chat",
                "weight": 2}]
    schedule = mixed(tmp_path, model, sources=sources, schedule={"strategy": "lisa", "epochs": 1, "interval": 3,
                                                                 "layers_per_phase": 1})
    counted = data_json(schedule)
    assert [s["examples"] for s in counted["sources"]] == [10, 14] and counted["train"]["rows"] == 24
    r = cli("orchestrator", "run", str(schedule))
    assert r.returncode == 0, r.stderr
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert [m["step"] for m in steps] == list(range(1, 7))
    assert sum(m["target_tokens"] for m in steps) == counted["train"]["target_tokens"]
    assert data_json(schedule) == counted  # now read from the run's own cache entry


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_mixed_example_runs(tmp_path):
    for name, files in (("alpaca", ("make_data.py", "make_model.py", "data/alpaca.jsonl")),
                        ("mixed", ("make_data.py", "run_demo.py", "schedule.toml")), (".", ("_demo.py",))):
        for f in files:
            (tmp_path / name / f).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / f).write_text((ROOT / "examples" / name / f).read_text())
    r = subprocess.run([sys.executable, str(tmp_path / "mixed" / "run_demo.py")], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "weight 2: 114 examples an epoch, chat template phi3" in r.stdout
    assert "schedule: epochs = 2 of 99 rows at data.batch_size 8: total_steps = 25" in r.stdout
    evals = [float(x.split(": ")[1]) for x in r.stdout.split("held-out loss: ")[1].splitlines()[0].split(", ")]
    assert len(evals) == 5 and evals[-1] < evals[0] - 1  # it learns both sources
    made = (tmp_path / "mixed" / "data" / "sharegpt.jsonl").read_text()
    assert made == (ROOT / "examples" / "mixed" / "data" / "sharegpt.jsonl").read_text()
