"""``orchestrator data``, the data checks of ``plan`` and ``run``, and instruction and chat runs.

The model and tokenizer are the Alpaca example's (a byte-level BPE trained locally, a chat
template with <|user|> / <|assistant|> turns closed by <|end|>), made in a temporary folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from tests.conftest import ROOT, cli, said, schedule_dict, write_schedule

ORCH = str(Path(sys.executable).parent / "orchestrator")
INSTRUCTIONS = [{"instruction": f"Name colour number {i}.", "input": "", "output": f"The colour is {c}."}
                for i, c in enumerate(["red", "green", "blue", "black", "white", "grey", "pink", "gold"])]
CHATS = [{"messages": [{"role": "user", "content": f"Which animal comes {i}?"},
                       {"role": "assistant", "content": f"It is the {a}."},
                       {"role": "user", "content": "And then?"},
                       {"role": "assistant", "content": f"Then the {b}."}]}
         for i, (a, b) in enumerate([("cat", "dog"), ("bird", "fish"), ("cow", "pig"), ("fox", "owl")] * 2)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("alpaca_model", ROOT / "examples" / "alpaca" / "make_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make(tmp_path_factory.mktemp("alpaca") / "model")


def jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def sched(tmp: Path, model: Path, records: list, fmt: str, name: str = "s.toml", sections: dict | None = None,
          **data) -> Path:
    path = jsonl(tmp / f"{name}.jsonl", records)
    d = {"path": str(path), "format": fmt, "seq_len": 64, "batch_size": 4, "micro_batch_size": 2, **data}
    return write_schedule(tmp / name, schedule_dict(model, path, data=d, optimizer={"lr": 3e-3},
                                                    schedule={"phases": [{"steps": 3, "layers": [0]},
                                                                         {"steps": 3, "layers": [1]},
                                                                         {"steps": 3, "layers": [0]}]},
                                                    **(sections or {})))


def shown(schedule: Path, n: int = 8, *overrides: str) -> list[dict]:
    r = CliRunner().invoke(main, ["data", str(schedule), "--show", str(n), "--json",
                                  *(a for item in overrides for a in ("--set", item))])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_instruction_targets_are_the_responses(tmp_path, model):
    rows = shown(sched(tmp_path, model, INSTRUCTIONS, "instruction", shuffle=False))
    assert len(rows) == len(INSTRUCTIONS)
    for row, rec in zip(rows, INSTRUCTIONS):
        assert row["target"] == rec["output"] + "<|end|>\n"
        assert rec["instruction"] in row["text"] and rec["instruction"] not in row["target"]
        assert "<|user|>" not in row["target"]


def test_instruction_train_on_prompt_makes_the_prompt_a_target(tmp_path, model):
    rows = shown(sched(tmp_path, model, INSTRUCTIONS, "instruction", shuffle=False, train_on_prompt=True))
    for row, rec in zip(rows, INSTRUCTIONS):
        assert rec["instruction"] in row["target"] and row["target"].endswith(rec["output"] + "<|end|>\n")
        assert row["text"].endswith(row["target"])  # every token but the first


def test_data_takes_set_to_try_a_template_option(tmp_path, model):
    """The quickest check of a masking option: data --show with --set, the file untouched."""
    path = sched(tmp_path, model, INSTRUCTIONS, "instruction", shuffle=False)
    rows = shown(path, 8, "data.train_on_prompt=true")
    assert all(rec["instruction"] in row["target"] for row, rec in zip(rows, INSTRUCTIONS))
    assert all(rec["instruction"] not in row["target"] for row, rec in zip(shown(path), INSTRUCTIONS))


def test_chat_targets_are_the_assistant_turns(tmp_path, model):
    rows = shown(sched(tmp_path, model, CHATS, "chat", shuffle=False))
    for row, rec in zip(rows, CHATS):
        user = [m["content"] for m in rec["messages"] if m["role"] == "user"]
        bot = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        assert row["target"] == "".join(b + "<|end|>\n" for b in bot)
        assert all(u in row["text"] and u not in row["target"] for u in user)
    flipped = shown(sched(tmp_path, model, CHATS, "chat", name="p.toml", shuffle=False, train_on_prompt=True))
    assert all(u["content"] in f["target"] for f, rec in zip(flipped, CHATS) for u in rec["messages"])


def test_data_statistics(tmp_path, model):
    r = CliRunner().invoke(main, ["data", str(sched(tmp_path, model, INSTRUCTIONS, "instruction", seq_len=20))])
    assert r.exit_code == 0, r.output
    assert "examples" in r.output and "truncated examples" in r.output
    r = CliRunner().invoke(main, ["data", str(tmp_path / "s.toml"), "--json"])
    stats = json.loads(r.output)["train"]
    assert stats["examples"] == stats["rows"] == len(INSTRUCTIONS)
    assert stats["truncated"] == len(INSTRUCTIONS)  # seq_len 20 cuts every rendered record, not every target
    assert not list(tmp_path.glob("run*")) and not list(tmp_path.glob(".relayer-data-*"))


def test_rows_without_a_target_are_warned_of_with_counts(tmp_path, model):
    """Seen: at seq_len 128, 189 rows had no target token (prompts that fill the row) and ``data``
    counted them without a word; ``data`` and ``plan`` warn, per source."""
    long = [{**rec, "input": " ".join(["many words of a long prompt"] * 12)} if i % 2 else rec
            for i, rec in enumerate(INSTRUCTIONS)]
    path = sched(tmp_path, model, long, "instruction", seq_len=32)
    for command in ("data", "plan"):
        r = CliRunner().invoke(main, [command, str(path)])
        assert r.exit_code == 0, r.output
        assert ("orchestrator: warning: 4 of 8 training rows carry no target token (nothing to learn: their targets "
                "cut by data.seq_len = 32, or none rendered); data: 4 of 8 examples") in r.stderr, r.stderr


def test_an_instruction_source_keeps_the_alpaca_prompt_beside_a_chat_template(tmp_path, model):
    """Seen: with a data-level chat_template, the Alpaca source rendered through it, where axolotl's
    ``type: alpaca`` keeps the Alpaca prompt: a source's ``chat_template = "alpaca"`` does."""
    rows = shown(sched(tmp_path, model, INSTRUCTIONS, "instruction", shuffle=False, chat_template="alpaca",
                       seq_len=256))
    for row, rec in zip(rows, INSTRUCTIONS):
        assert row["text"].startswith("Below is an instruction") and "### Response:" in row["text"]
        assert "<|user|>" not in row["text"] and row["target"].startswith(rec["output"])


BAD = INSTRUCTIONS[:3] + [{"instruction": "No output here."}] + INSTRUCTIONS[3:]


@pytest.mark.parametrize("command", ["plan", "run", "data"])
def test_malformed_record_exits_2_naming_file_and_line(tmp_path, model, command):
    schedule = sched(tmp_path, model, BAD, "instruction")
    r = CliRunner().invoke(main, [command, str(schedule)])
    assert r.exit_code == 2, r.output
    assert f"{tmp_path / 's.toml.jsonl'}:4:" in r.output and '"output"' in r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".*relayer-data-*"))


def test_token_ids_beyond_the_vocabulary_exit_2(tmp_path, model):
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    records = [{"input_ids": [1, 2, 3, 4]}] * 4 + [{"input_ids": [1, vocab, 2]}] + [{"input_ids": [5, 6]}] * 4
    r = CliRunner().invoke(main, ["plan", str(sched(tmp_path, model, records, "tokens"))])
    assert r.exit_code == 2, r.output
    assert f"s.toml.jsonl:5: input_ids: token id {vocab} is not below the model's vocab_size {vocab}" in r.output


def test_rows_longer_than_the_positions_exit_2(tmp_path, model):
    r = CliRunner().invoke(main, ["plan", str(sched(tmp_path, model, INSTRUCTIONS, "instruction", seq_len=512))])
    assert r.exit_code == 2, r.output
    assert "data.seq_len: expected at most the model's max_position_embeddings = 256, got 512" in r.output


@pytest.mark.multiprocess
@pytest.mark.parametrize("fmt", ["instruction", "chat"])
def test_preempted_run_resumes_and_exports(tmp_path, model, fmt):
    records = INSTRUCTIONS if fmt == "instruction" else CHATS
    schedule = sched(tmp_path, model, records, fmt, sections={"checkpoint": {"every_steps": 2, "keep_last": 10}})
    run = tmp_path / "run"
    orch = subprocess.Popen([ORCH, "run", str(schedule)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        metrics = run / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
            assert orch.poll() is None, said(orch)
            subprocess.run(["sleep", "0.1"])
        orch.send_signal(signal.SIGTERM)
        assert orch.wait(timeout=120) == 75, orch.communicate()[1]
    finally:
        if orch.poll() is None:
            os.killpg(orch.pid, signal.SIGKILL)
    assert (run / "data-cache").is_dir()
    r = cli("orchestrator", "run", str(schedule))
    assert r.returncode == 0, r.stderr
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if "loss" in x]
    assert set(steps) == set(range(1, 10))
    r = cli("shard-tools", "export", str(run), "--out", str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "export" / "config.json").is_file()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_alpaca_example_runs_shortened(tmp_path):
    ex = tmp_path / "alpaca"
    ex.mkdir()
    for name in ("make_data.py", "make_model.py", "run_demo.py", "schedule.toml"):
        (ex / name).write_text((ROOT / "examples" / "alpaca" / name).read_text())
    r = subprocess.run([sys.executable, str(ex / "run_demo.py"), "--steps", "4"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "\nprompt:\n<|user|>\nWrite the word in capital letters.\n\nriver<|end|>\n<|assistant|>\n" in r.stdout
    assert "answer:" in r.stdout and (ex / "export" / "model.safetensors").is_file()
    assert (ex / "data" / "alpaca.jsonl").read_text() == (ROOT / "examples" / "alpaca" / "data" / "alpaca.jsonl").read_text()


def test_a_tokenizer_that_does_not_load_exits_2(tmp_path, model):
    broken = tmp_path / "model"
    broken.mkdir()
    for f in model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "tokenizer.json").write_text("{}")
    r = CliRunner().invoke(main, ["plan", str(sched(tmp_path, broken, INSTRUCTIONS, "instruction"))])
    assert r.exit_code == 2, r.output
    assert f"model.tokenizer: cannot load a tokenizer from {broken}" in r.output


def stop_while_preparing(argv: list[str], sig: int, preparing, env: dict | None = None):
    """Starts ``argv``, sends it ``sig`` once ``preparing(process)`` returns (the data being
    prepared), and checks it exits 75 saying so, without a traceback; its session is killed where it
    has not ended by then. (The process, what ``preparing`` returned.)"""
    orch = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        found = preparing(orch)
        orch.send_signal(sig)
        _, err = orch.communicate(timeout=60)
    finally:
        if orch.poll() is None:
            os.killpg(orch.pid, signal.SIGKILL)
    assert orch.returncode == 75, err
    assert "while preparing the data" in err and "Traceback" not in err
    return orch, found


def test_a_stop_while_the_data_is_staged_leaves_nothing(tmp_path, model):
    """SIGTERM while a new run prepares its data (before its directory exists): exit 75, and
    neither the run directory nor the staging folder beside it is left."""
    def staging(orch: subprocess.Popen) -> None:
        # The data tool (a Python that imports transformers) takes seconds: the signal lands in it.
        while not list(tmp_path.glob(".relayer-data-*")):
            assert orch.poll() is None, said(orch)

    stop_while_preparing([ORCH, "run", str(sched(tmp_path, model, INSTRUCTIONS, "instruction"))], signal.SIGTERM,
                         staging)
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".*relayer-data-*"))
