"""``orchestrator run`` and ``orchestrator plan`` on bad input: exit 2, one message naming the key
or file, nothing written. And ``plan`` on good input: the phase table, exit 0.

The messages are part of the interface, so most are checked word for word.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from tests.conftest import ROOT, schedule_dict, write_schedule

COMMANDS = ["run", "plan"]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def phases(*entries: tuple[int, list[int]]) -> dict:
    return {"phases": [{"steps": s, "layers": layers} for s, layers in entries]}


def strategy(**keys) -> dict:
    return {"phases": None, **keys}


def build(tmp_path: Path, model: Path, data: Path, edit) -> Path:
    """A schedule file in tmp_path whose run directory would be tmp_path/run; ``edit`` changes its dict."""
    sched = schedule_dict(model, data)
    edit(sched, tmp_path)
    for section in list(sched.values()):
        if isinstance(section, dict):
            for key in [k for k, v in section.items() if v is None]:
                del section[key]
    return write_schedule(tmp_path / "schedule.toml", sched)


def setting(section: str, **values):
    def edit(sched: dict, _tmp: Path) -> None:
        sched.setdefault(section, {}).update(values)
    return edit


def both(*edits):
    def edit(sched: dict, tmp: Path) -> None:
        for e in edits:
            e(sched, tmp)
    return edit


def missing(key: str, value: str, expected: str, **also) -> tuple:
    """(the edit, the message) for ``key`` (``also`` set beside it) naming ``value``, a file that is
    not there: every such key's message says what it expects and the path that does not exist."""
    section, name = key.split(".")
    return setting(section, **also, **{name: value}), f"{key}: expected {expected}, {{tmp}}/{value} does not exist"


# (id, edit of the schedule dict, message after "<schedule path>: "); {tmp} is the test's tmp_path.
BAD = [
    ("unknown-section", lambda s, _: s.update(bogus={"a": 1}),
     "bogus: unknown key; expected one of run, model, data, optimizer, lr_schedule, schedule, deepspeed, launch, "
     "checkpoint, eval"),
    ("unknown-key", setting("data", seqlen=64), "data.seqlen: unknown key (did you mean seq_len?)"),
    ("eval-prompts-without-evaluations", lambda s, _: s.update(eval={"prompts": ["Hi"]}),
     "eval.prompts: generated at each evaluation: needs data.eval_every"),
    ("unknown-key-far", setting("launch", colour="red"),
     "launch.colour: unknown key; expected one of launcher, nproc, nnodes, hostfile, master_addr, rendezvous_seconds, "
     "grace_seconds, stall_seconds, prewarm, prewarm_depth, pause_preparing_seconds, handover, resident, device_memory"),
    ("unknown-phase-key", setting("schedule", phases=[{"steps": 5, "layers": [0]},
                                                     {"steps": 5, "layers": [1], "lr": 1}]),
     "schedule.phases[1].lr: unknown key; expected one of steps, layers, modules, nproc"),
    ("phase-layers-and-modules", setting("schedule", phases=[{"steps": 5, "layers": [0], "modules": ["0.mlp"]}]),
     "schedule.phases[0]: expected layers or modules (one of them), got both"),
    ("unit-without-layer", setting("schedule", phases=[{"steps": 5, "modules": ["mlp"]}]),
     'schedule.phases[0].modules: expected "<layer>.<module path>" (such as "0.self_attn.q_proj"), got \'mlp\''),
    ("unit-inside-another", setting("schedule", phases=[{"steps": 5, "modules": ["0.mlp", "0.mlp.up_proj"]}]),
     "schedule.phases[0].modules: expected distinct units, none inside another, got '0.mlp' and '0.mlp.up_proj'"),
    ("unit-not-in-model", setting("schedule", phases=[{"steps": 5, "modules": ["0.attn"]}]),
     "schedule.phases[0].modules: '0.attn': layer 0 holds no tensor under 'attn' (its modules: input_layernorm, "
     "mlp.down_proj, mlp.gate_proj, mlp.up_proj, post_attention_layernorm, self_attn.k_proj, self_attn.o_proj, "
     "self_attn.q_proj, self_attn.v_proj)"),
    ("unit-layer-out-of-range", setting("schedule", phases=[{"steps": 5, "modules": ["7.mlp"]}]),
     "schedule.phases[0].modules: '7.mlp': layer 7 is out of range: the model has 4 layers (0..3)"),
    ("units-with-keep", setting("schedule", phases=[{"steps": 5, "modules": ["0.mlp"]}], optimizer_state="keep"),
     'schedule.optimizer_state: "keep" parks a whole layer\'s Adam state: module units take "reset" or "drop-all"'),
    ("misa-without-budget", setting("schedule", **strategy(strategy="misa", total_steps=10, interval=5)),
     "schedule.module_budget: required with schedule.strategy = 'misa', but missing"),
    ("budget-without-misa", setting("schedule", **strategy(strategy="lisa", total_steps=10, interval=5,
                                                           layers_per_phase=1, module_budget=0.5)),
     'schedule.module_budget: takes schedule.strategy = "misa", got \'lisa\''),
    ("misa-with-layers-per-phase", setting("schedule", **strategy(strategy="misa", total_steps=10, interval=5,
                                                                  layers_per_phase=1, module_budget=0.5)),
     "schedule.layers_per_phase: takes a strategy of whole layers (lisa, ascending, descending, badam): misa draws "
     "module units to schedule.module_budget"),
    ("misa-budget-below-a-unit", setting("schedule", **strategy(strategy="misa", total_steps=10, interval=5,
                                                                module_budget=0.0001)),
     "schedule.module_budget: 0.0001 of the body's 37,120 parameters is 3, less than its smallest unit (512)"),
    ("units-without-weights", both(setting("model", path=None, config={"model_type": "llama", "num_hidden_layers": 2}),
                                   setting("schedule", phases=[{"steps": 5, "modules": ["0.mlp"]}])),
     'model.config: module units (schedule.strategy = "misa", schedule.phases[i].modules) need model.path: its '
     "weights name a layer's modules"),
    ("seq-len-string", setting("data", seq_len="64"), "data.seq_len: expected an integer, got '64'"),
    ("lr-string", setting("optimizer", lr="x"), "optimizer.lr: expected a number, got 'x'"),
    ("shuffle-string", setting("data", shuffle="yes"), "data.shuffle: expected true or false, got 'yes'"),
    ("layers-not-a-list", setting("schedule", phases=[{"steps": 5, "layers": 1}]),
     "schedule.phases[0].layers: expected a list, got 1"),
    ("section-not-a-table", lambda s, _: s.update(launch="local"), "launch: expected a table, got 'local'"),
    ("betas-one", setting("optimizer", betas=[0.9]), "optimizer.betas: expected two numbers [beta1, beta2], got [0.9]"),
    ("beta-too-big", setting("optimizer", betas=[0.9, 1.5]), "optimizer.betas[1]: expected a number < 1, got 1.5"),
    ("layer-out-of-range", setting("schedule", **phases((5, [0]), (5, [4]))),
     "schedule.phases[1].layers: layer 4 is out of range: the model has 4 layers (0..3)"),
    ("layer-negative", setting("schedule", **phases((5, [-1]))),
     "schedule.phases[0].layers[0]: expected a non-negative integer, got -1"),
    ("layer-twice", setting("schedule", **phases((5, [1, 1]))),
     "schedule.phases[0].layers: expected distinct layers, got [1, 1] (layer 1 appears twice)"),
    ("no-layers", setting("schedule", **phases((5, []))),
     "schedule.phases[0].layers: expected at least 1 item(s), got []"),
    ("steps-zero", setting("schedule", **phases((10, [0]), (0, [1]))),
     "schedule.phases[1].steps: expected a positive integer, got 0"),
    ("steps-negative", setting("schedule", **phases((-5, [0]))),
     "schedule.phases[0].steps: expected a positive integer, got -5"),
    ("steps-missing", setting("schedule", phases=[{"layers": [0]}]), "schedule.phases[0].steps: required, but missing"),
    ("total-steps-zero", setting("schedule", **strategy(strategy="lisa", total_steps=0, interval=5,
                                                        layers_per_phase=1)),
     "schedule.total_steps: expected a positive integer, got 0"),
    ("zero-stage-4", setting("deepspeed", zero_stage=4), "deepspeed.zero_stage: expected 0, 1, 2 or 3, got 4"),
    ("zero-stage-0-fp16", both(setting("deepspeed", zero_stage=0), setting("model", dtype="float16")),
     "deepspeed.zero_stage: 0 (relayer's fp32-master AdamW, no ZeRO) takes model.dtype bfloat16 or float32: "
     "float16 needs DeepSpeed's loss scaler, under ZeRO 1-3"),
    ("batch-not-divisible", setting("data", batch_size=10, micro_batch_size=4),
     "data.batch_size: expected a multiple of micro_batch_size x processes = 4 x 1 = 4, got 10 (phase 0)"),
    ("batch-not-divisible-by-processes", setting("launch", nproc=3),
     "data.batch_size: expected a multiple of micro_batch_size x processes = 4 x 3 = 12, got 8 (phase 0)"),
    ("batch-not-divisible-in-a-phase", setting("schedule", phases=[{"steps": 5, "layers": [0]},
                                                                  {"steps": 5, "layers": [1], "nproc": 4}]),
     "data.batch_size: expected a multiple of micro_batch_size x processes = 4 x 4 = 16, got 8 (phase 1)"),
    ("batch-not-divisible-over-nodes", setting("launch", launcher="slurm", nproc=2, nnodes=2),
     "data.batch_size: expected a multiple of micro_batch_size x processes = 4 x 4 (2 per node x 2 nodes) = 16, "
     "got 8 (phase 0)"),
    ("phases-empty", setting("schedule", phases=[]), "schedule.phases: expected at least one phase, got an empty list"),
    ("dtype", setting("model", dtype="fp8"), "model.dtype: expected 'float32', 'bfloat16' or 'float16', got 'fp8'"),
    ("launcher", setting("launch", launcher="mpirun"),
     "launch.launcher: expected 'local', 'deepspeed', 'torchrun' or 'slurm', got 'mpirun'"),
    ("local-on-two-nodes", setting("launch", nnodes=2),
     'launch.launcher: expected deepspeed, torchrun or slurm for 2 nodes: "local" starts processes on this node only'),
    ("deepspeed-nodes-without-hostfile", setting("launch", launcher="deepspeed", nnodes=2),
     "launch.hostfile: required with launcher deepspeed on 2 nodes, but missing"),
    ("hostfile-missing", *missing("launch.hostfile", "hosts", "a hostfile", launcher="deepspeed", nnodes=2)),
    ("phases-and-strategy", setting("schedule", strategy="lisa", total_steps=20, interval=10, layers_per_phase=1),
     "schedule.strategy: expected either schedule.phases or schedule.strategy (with total_steps or epochs, "
     "interval, layers_per_phase), not both"),
    ("strategy-without-interval", setting("schedule", **strategy(strategy="lisa", total_steps=20, layers_per_phase=1)),
     "schedule.interval: required with schedule.strategy = 'lisa', but missing"),
    ("no-schedule", setting("schedule", phases=None), "schedule: expected schedule.phases or schedule.strategy"),
    ("unknown-strategy", setting("schedule", **strategy(strategy="random", total_steps=20, interval=10,
                                                        layers_per_phase=1)),
     "schedule.strategy: expected 'lisa', 'ascending', 'descending', 'badam' or 'misa', got 'random'"),
    ("more-layers-per-phase-than-layers", setting("schedule", **strategy(strategy="lisa", total_steps=20, interval=10,
                                                                         layers_per_phase=5)),
     "schedule.layers_per_phase: expected at most the model's 4 layers, got 5"),
    ("data-section-missing", lambda s, _: s.pop("data"), "data: required, but missing"),
    ("data-file-missing", *missing("data.path", "nope.jsonl", "a data file or a datasets.save_to_disk folder")),
    ("data-path-is-a-directory", setting("data", path="."),
     "data.path: expected a data file or a datasets.save_to_disk folder, {tmp} is a directory"),
    ("text-without-tokenizer", setting("data", format="text"),
     'model.tokenizer (default model.path): data.format = "text" needs a tokenizer: expected tokenizer.json or '
     "tokenizer_config.json in {model}"),
    ("tokenizer-missing", lambda s, tmp: s["data"].update(format="chat") or s["model"].update(tokenizer=str(tmp)),
     'model.tokenizer: data.format = "chat" needs a tokenizer: expected tokenizer.json or tokenizer_config.json '
     "in {tmp}"),
    ("data-field-of-another-format", setting("data", format="instruction", fields={"messages": "turns"}),
     'data.fields.messages: not a field of data.format = "instruction"; expected one of instruction, input, output'),
    ("data-format-unknown", setting("data", format="alpaca"),
     "data.format: expected 'tokens', 'text', 'instruction' or 'chat', got 'alpaca'"),
    ("chat-template-file-missing", *missing("data.chat_template", "nope.jinja", "a Jinja template, one named llama3, "
                                            "chatml, qwen2.5, mistral, gemma, phi3, \"alpaca\" (the Alpaca prompt), or a "
                                            "file holding one")),
    ("model-dir-missing", *missing("model.path", "no-model", "a Hugging Face model directory")),
    ("model-without-config-json", lambda s, tmp: (tmp / "empty-model").mkdir() or s["model"].update(path="empty-model"),
     "model.path: expected a Hugging Face model directory with config.json, {tmp}/empty-model/config.json does not "
     "exist"),
    ("model-path-and-config", setting("model", config={"model_type": "llama", "num_hidden_layers": 2}),
     "model: expected exactly one of model.path and model.config"),
    ("model-config-without-type", setting("model", path=None, config={"num_hidden_layers": 2}),
     'model.config: expected a model_type key (for example model_type = "llama")'),
    ("model-config-without-layers", setting("model", path=None, config={"model_type": "llama"}),
     "model.config: expected num_hidden_layers (or n_layer, num_layers), a positive integer"),
    ("deepspeed-config-sets-batch", setting("deepspeed", config={"train_batch_size": 64}),
     "deepspeed.config.train_batch_size: set by data.batch_size; set it there"),
    ("deepspeed-config-sets-stage", setting("deepspeed", config={"zero_optimization": {"stage": 3}}),
     "deepspeed.config.zero_optimization.stage: set by deepspeed.zero_stage; set it there"),
    ("deepspeed-config-sets-dtype", setting("deepspeed", config={"bf16": {"enabled": True}}),
     "deepspeed.config.bf16.enabled: set by model.dtype; set it there"),
]


def expand(message: str, tmp_path: Path, model: Path | None = None) -> str:
    return message.replace("{tmp}", str(tmp_path.resolve())).replace("{model}", str(model and model.resolve()))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("edit,message", [pytest.param(e, m, id=i) for i, e, m in BAD])
def test_bad_schedule_exits_2_with_one_message_and_writes_nothing(command, edit, message, tmp_path, tiny_model,
                                                                  tiny_data):
    sched = build(tmp_path, tiny_model, tiny_data, edit)
    r = invoke(command, str(sched))
    assert r.exit_code == 2, r.output
    assert r.stderr == f"orchestrator: {sched.resolve()}: {expand(message, tmp_path, tiny_model)}\n"
    assert r.stdout == ""
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_toml_syntax_error_names_the_line(command, tmp_path):
    sched = tmp_path / "schedule.toml"
    sched.write_text('[run]\nseed = 0\noutput_dir "run"\n')
    r = invoke(command, str(sched))
    assert r.exit_code == 2
    assert r.stderr.startswith(f"orchestrator: {sched}: TOML syntax error: ")
    assert "line 3" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_schedule_file_not_found(command, tmp_path):
    missing = tmp_path / "missing.toml"
    r = invoke(command, str(missing))
    assert r.exit_code == 2
    assert r.stderr == f"orchestrator: {missing}: schedule file not found\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", COMMANDS)
def test_schedule_not_utf8(command, tmp_path):
    sched = tmp_path / "schedule.toml"
    sched.write_bytes(b"[run]\nseed = 0 # \xff\n")
    r = invoke(command, str(sched))
    assert r.exit_code == 2
    assert r.stderr == f"orchestrator: {sched}: expected a UTF-8 TOML file: invalid start byte at byte 17\n"


@pytest.mark.parametrize("command", COMMANDS)
def test_nproc_zero(command, tmp_path, tiny_model, tiny_data):
    sched = write_schedule(tmp_path / "schedule.toml", schedule_dict(tiny_model, tiny_data))
    r = invoke(command, str(sched), "--nproc", "0")
    assert r.exit_code == 2
    assert r.stderr == "orchestrator: --nproc: expected a positive integer, got 0\n"
    assert not (tmp_path / "run").exists()


def test_nproc_that_breaks_the_batch(tmp_path, tiny_model, tiny_data):
    sched = write_schedule(tmp_path / "schedule.toml", schedule_dict(tiny_model, tiny_data))
    r = invoke("run", str(sched), "--nproc", "3")
    assert r.exit_code == 2
    assert r.stderr == (f"orchestrator: {sched.resolve()}: data.batch_size: expected a multiple of micro_batch_size x "
                        f"processes = 4 x 3 = 12, got 8 (phase 0)\n")
    assert not (tmp_path / "run").exists()


def test_run_output_dir_that_is_a_file(tmp_path, tiny_model, tiny_data):
    sched = write_schedule(tmp_path / "schedule.toml", schedule_dict(tiny_model, tiny_data))
    (tmp_path / "run").write_text("not a directory")
    r = invoke("run", str(sched))
    assert r.exit_code == 2
    assert r.stderr == (f"orchestrator: {sched.resolve()}: run.output_dir: expected a directory, "
                        f"{(tmp_path / 'run').resolve()} is a file\n")
    assert (tmp_path / "run").read_text() == "not a directory"


def test_several_faults_are_one_message_with_a_line_each(tmp_path, tiny_model, tiny_data):
    sched = schedule_dict(tiny_model, tiny_data)
    sched["data"].update(seq_len="64", shufle=True)
    path = write_schedule(tmp_path / "schedule.toml", sched)
    r = invoke("plan", str(path))
    assert r.exit_code == 2
    assert r.stderr == (f"orchestrator: {path.resolve()}: data.seq_len: expected an integer, got '64'\n"
                        f"{path.resolve()}: data.shufle: unknown key (did you mean shuffle?)\n")


def llama_names(layers: int) -> list[str]:
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                 "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    return ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            *(f"model.layers.{i}.{p}.weight" for i in range(layers) for p in per_layer)]


def write_header_only(path: Path, names: list[str]) -> Path:
    """A valid safetensors file holding one float32 element under each name."""
    header = {n: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i, n in enumerate(names)}
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(4 * len(names)))
    return path


def on_path(monkeypatch, tmp_path: Path, command: str) -> None:
    """An executable named ``command`` on PATH, for checks that look for it and never run it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / command).write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def table_rows(stdout: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("│").split("│")] for line in stdout.splitlines()
            if line.startswith("│")]


def test_plan_prints_the_phase_table(tmp_path, tiny_model, tiny_data):
    sched = schedule_dict(tiny_model, tiny_data, launch={"nproc": 2})
    sched["data"]["batch_size"] = 16
    sched["schedule"]["phases"][1]["nproc"] = 4
    path = write_schedule(tmp_path / "schedule.toml", sched)
    r = invoke("plan", str(path))
    assert r.exit_code == 0, r.output
    assert "3 phases, 30 steps, model of 4 layers" in r.stdout
    assert table_rows(r.stdout) == [
        ["0", "10", "0-9", "0", "2"],
        ["1", "10", "10-19", "1", "4"],
        ["2", "10", "20-29", "0", "2"],
    ]
    assert not (tmp_path / "run").exists()


def test_plan_nproc_overrides_every_phase(tmp_path, tiny_model, tiny_data):
    sched = schedule_dict(tiny_model, tiny_data, launch={"nproc": 2})
    sched["data"]["batch_size"] = 16
    sched["schedule"]["phases"][1]["nproc"] = 4
    path = write_schedule(tmp_path / "schedule.toml", sched)
    r = invoke("plan", str(path), "--nproc", "1")
    assert r.exit_code == 0, r.output
    assert [row[4] for row in table_rows(r.stdout)] == ["1", "1", "1"]


def test_plan_of_a_strategy(tmp_path, tiny_model, tiny_data):
    sched = schedule_dict(tiny_model, tiny_data, schedule={
        "phases": None, "strategy": "descending", "total_steps": 25, "interval": 10, "layers_per_phase": 2})
    del sched["schedule"]["phases"]
    path = write_schedule(tmp_path / "schedule.toml", sched)
    r = invoke("plan", str(path))
    assert r.exit_code == 0, r.output
    assert table_rows(r.stdout) == [
        ["0", "10", "0-9", "2, 3", "1"],
        ["1", "10", "10-19", "0, 1", "1"],
        ["2", "5", "20-24", "2, 3", "1"],
    ]


def write_word_tokenizer(out: Path, words: list[str]) -> None:
    """A real (word-level) fast tokenizer: plan tokenizes text data to check it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<eos>", *words])}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)


def test_the_slurm_example_plans(tmp_path, monkeypatch):
    # The example names an 8B model that is not here; plan reads only its config.json and the
    # safetensors headers, so tensors of one element with the 8B model's names stand in for it.
    shutil.copy(ROOT / "examples" / "slurm" / "schedule.toml", tmp_path)
    model = tmp_path / "models" / "Meta-Llama-3.1-8B"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 32}))
    write_header_only(model / "model.safetensors", llama_names(32))
    on_path(monkeypatch, tmp_path, "srun")
    write_word_tokenizer(model, ["hello"])
    (tmp_path / "data").mkdir()
    # Rows for one step at least: a batch larger than the data is refused.
    (tmp_path / "data" / "train.jsonl").write_text((json.dumps({"text": " ".join(["hello"] * 3000)}) + "\n") * 90)
    # A cluster's scratch file system, with room for the 8B run's checkpoints (plan refuses a shortfall).
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 50, 0, 1 << 50))
    r = invoke("plan", str(tmp_path / "schedule.toml"))
    assert r.exit_code == 0, r.output
    assert "40 phases, 2000 steps" in r.stdout
    assert {row[4] for row in table_rows(r.stdout)} == {"8"}


def test_the_cli_imports_no_torch():
    code = ('import sys, orchestrator.cli, orchestrator.schedule, orchestrator.validate, orchestrator.runner, orchestrator.display; '
            'heavy = {"torch", "deepspeed", "transformers"} & set(sys.modules); assert not heavy, heavy')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr


def test_plan_imports_no_torch(tmp_path, tiny_model, tiny_data):
    path = write_schedule(tmp_path / "schedule.toml", schedule_dict(tiny_model, tiny_data))
    code = ('import sys; from orchestrator.cli import main\n'
            'try:\n    main(["plan", sys.argv[1]])\nexcept SystemExit as e:\n    assert not e.code, e.code\n'
            'heavy = {"torch", "deepspeed", "transformers"} & set(sys.modules); assert not heavy, heavy')
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "3 phases" in r.stdout


def test_help_starts_fast():
    exe = Path(sys.executable).parent / "orchestrator"
    t0 = time.perf_counter()
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    seconds = time.perf_counter() - t0
    assert r.returncode == 0 and "plan" in r.stdout
    # The budget is "well under a second"; the bound is loose because the test machine is shared.
    assert seconds < 3, seconds


@pytest.mark.parametrize("command", ["plan", "data"])
def test_plan_and_data_take_the_runs_output_dir(tmp_path, tiny_model, tiny_data, monkeypatch, command):
    """Seen: after ``run --output-dir runs/mine``, data and plan prepared the data again (20-36 s):
    they looked for run.output_dir's cache. --output-dir names the run whose cache they read."""
    from orchestrator import datastep
    from orchestrator.errors import ScheduleError

    seen = []

    def check_data(loaded, show=0):
        seen.append(loaded.output_dir)
        raise ScheduleError("stop here")

    monkeypatch.setattr(datastep, "check_data", check_data)
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data))
    r = invoke(command, str(sched), "--output-dir", str(tmp_path / "runs" / "mine"))
    assert r.exit_code == 2 and "stop here" in r.output, r.output
    assert seen == [(tmp_path / "runs" / "mine").resolve()] or seen == [tmp_path / "runs" / "mine"], seen
