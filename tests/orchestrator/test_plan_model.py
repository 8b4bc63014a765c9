"""``orchestrator plan`` / ``run`` on mistaken and hostile input that used to pass plan and fail (or
silently train garbage) at run time: the model folder's weights against its config.json, non-finite
numbers, an unbounded phase table, values the model or DeepSpeed cannot take, paths that are loops,
folders or FIFOs. Each is exit 2 with one message naming the key or file, and nothing written.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from orchestrator.errors import ScheduleError
from orchestrator.plan import MAX_PHASES
from orchestrator.validate import validate_schedule
from tests.conftest import schedule_dict, write_schedule
from tests.orchestrator.test_cli_plan import (
    COMMANDS, build, expand, invoke, llama_names, on_path, setting, strategy, write_header_only,
)

TINY_CONFIG = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 64, "tie_word_embeddings": False}


def model_dir(tmp: Path, names: list[str] | None = None, name: str = "m", **config) -> Path:
    """A model folder: config.json and safetensors holding ``names`` (the 4-layer Llama's by default)."""
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY_CONFIG, **config}))
    write_header_only(d / "model.safetensors", llama_names(4) if names is None else names)
    return d


def with_model(make):
    """An edit that points model.path at the folder ``make(tmp)`` builds."""
    def edit(sched: dict, tmp: Path) -> None:
        sched["model"]["path"] = str(make(tmp))
    return edit


def without(*dropped: str) -> list[str]:
    return [n for n in llama_names(4) if n not in dropped]


def pickle_only(tmp: Path) -> Path:
    d = model_dir(tmp)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle; plan must refuse it unopened
    return d


def corrupt(data: bytes):
    def make(tmp: Path) -> Path:
        d = model_dir(tmp)
        (d / "model.safetensors").write_bytes(data)
        return d
    return make


def truncated(tmp: Path) -> Path:
    d = model_dir(tmp)
    whole = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(whole[:-10])
    return d


def sharded(weight_map: dict[str, str], files: dict[str, list[str]]):
    def make(tmp: Path) -> Path:
        d = model_dir(tmp)
        (d / "model.safetensors").unlink()
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        for file, names in files.items():
            write_header_only(d / file, names)
        return d
    return make


HALF = len(llama_names(4)) // 2
SHARDS = {"a.safetensors": llama_names(4)[:HALF], "b.safetensors": llama_names(4)[HALF:]}
SHARD_MAP = {n: f for f, names in SHARDS.items() for n in names}


def loop(tmp: Path, name: str) -> str:
    (tmp / name).symlink_to(tmp / name)
    return name


def fifo(tmp: Path, name: str) -> str:
    os.mkfifo(tmp / name)
    return name


# (id, edit, message after "<schedule>: "); {tmp} is the test's tmp_path, {m} its model folder "m".
BAD = [
    # Strict model loading, from the safetensors headers.
    ("config-names-more-layers", with_model(lambda t: model_dir(t, llama_names(2))),
     "model.path: {m}/config.json names 4 layers, {m}/model.safetensors holds layers 0..1 (model.layers.N)"),
    ("a-layer-beyond-the-config", with_model(lambda t: model_dir(t, llama_names(5))),
     "model.path: {m}/config.json names 4 layers, {m}/model.safetensors holds layers 0..4 (model.layers.N)"),
    ("a-layer-missing-in-the-middle", with_model(lambda t: model_dir(
        t, [n for n in llama_names(4) if not n.startswith("model.layers.2.")])),
     "model.path: {m}/config.json names 4 layers, {m}/model.safetensors holds layers 0..1, 3 (model.layers.N)"),
    ("a-tensor-dropped-from-a-layer", with_model(lambda t: model_dir(t, without("model.layers.3.mlp.up_proj.weight"))),
     "model.path: {m}/model.safetensors: layer model.layers.3 lacks mlp.up_proj.weight, which model.layers.0 holds"),
    ("no-embedding", with_model(lambda t: model_dir(t, without("model.embed_tokens.weight"))),
     "model.path: {m}/model.safetensors holds no token embedding (no tensor named like embed_tokens or wte)"),
    ("no-layers-at-all", with_model(lambda t: model_dir(t, ["model.embed_tokens.weight", "lm_head.weight"])),
     "model.path: {m}/model.safetensors holds no numbered layers (tensor names beginning model.layers.0.)"),
    ("pickle-only", with_model(pickle_only),
     "model.path: {m}/pytorch_model.bin: pickle weights are not loaded; convert to safetensors (model.safetensors)"),
    ("no-weights", with_model(lambda t: (model_dir(t) / "model.safetensors").unlink() or t / "m"),
     "model.path: expected the weights in model.safetensors, {m}/model.safetensors does not exist"),
    ("weights-a-directory", with_model(lambda t: ((model_dir(t) / "model.safetensors").unlink(),
                                                  (t / "m" / "model.safetensors").mkdir()) and t / "m"),
     "model.path: expected the weights in model.safetensors, {m}/model.safetensors is a directory"),
    ("weights-not-safetensors", with_model(corrupt(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")),
     "model.path: {m}/model.safetensors: not a readable safetensors file (its header is not JSON)"),
    ("weights-too-short", with_model(corrupt(b"abc")),
     "model.path: {m}/model.safetensors: not a readable safetensors file (3 bytes, less than its header length)"),
    ("weights-truncated", with_model(truncated),
     "model.path: {m}/model.safetensors: truncated: tensor "),
    ("sharded-file-missing", with_model(sharded(SHARD_MAP, {"a.safetensors": SHARDS["a.safetensors"]})),
     "model.path: expected a shard that model.safetensors.index.json names, {m}/b.safetensors does not exist"),
    ("sharded-tensor-not-in-its-file", with_model(sharded({**SHARD_MAP, "model.norm.weight": "b.safetensors"},
                                                          SHARDS)),
     "model.path: {m}/model.safetensors.index.json places model.norm.weight in b.safetensors, which does not hold it"),
    ("sharded-file-outside", with_model(sharded({**SHARD_MAP, "model.norm.weight": "../a.safetensors"}, SHARDS)),
     "model.path: {m}/model.safetensors.index.json: expected shard file names inside {m}, got '../a.safetensors'"),
    ("sharded-layers-missing", with_model(sharded(
        {n: "a.safetensors" for n in llama_names(3)}, {"a.safetensors": llama_names(3)})),
     "model.path: {m}/config.json names 4 layers, the shards of {m}/model.safetensors.index.json holds layers 0..2 "
     "(model.layers.N)"),
    ("model-type-missing", with_model(lambda t: model_dir(t, model_type=None)),
     'model.path: {m}/config.json: expected a model_type name such as "llama", got None'),
    ("model-type-not-a-string", with_model(lambda t: model_dir(t, model_type=7)),
     'model.path: {m}/config.json: expected a model_type name such as "llama", got 7'),
    ("inline-model-type-not-a-string", setting("model", path=None, config={"model_type": 7, "num_hidden_layers": 2}),
     'model.config.model_type: expected a model type name such as "llama", got 7'),
    ("persistent-matches-nothing", setting("model", persistent=["model.embed", "lm_head"]),
     "model.persistent: 'model.embed' matches no tensor in {model}/model.safetensors (outside the layers it holds "
     "lm_head.weight, model.embed_tokens, model.norm)"),
    ("model-path-a-symlink-loop", lambda s, t: s["model"].update(path=loop(t, "m")),
     "model.path: expected a Hugging Face model directory, {tmp}/m is a symlink loop"),
    ("model-path-a-file", lambda s, t: (t / "m").write_text("") or s["model"].update(path="m"),
     "model.path: expected a Hugging Face model directory, {tmp}/m is a file"),
    ("config-json-a-fifo", lambda s, t: ((t / "m").mkdir(), fifo(t / "m", "config.json"),
                                         s["model"].update(path="m")),
     "model.path: expected a Hugging Face model directory with config.json, {tmp}/m/config.json is a FIFO"),
    # Non-finite numbers anywhere.
    ("lr-inf", setting("optimizer", lr=float("inf")), "optimizer.lr: expected a finite number, got inf"),
    ("eps-nan", setting("optimizer", eps=float("nan")), "optimizer.eps: expected a finite number, got nan"),
    ("weight-decay-inf", setting("optimizer", weight_decay=float("inf")),
     "optimizer.weight_decay: expected a finite number, got inf"),
    ("beta-nan", setting("optimizer", betas=[0.9, float("nan")]),
     "optimizer.betas[1]: expected a finite number, got nan"),
    ("grace-inf", setting("launch", grace_seconds=float("inf")),
     "launch.grace_seconds: expected a finite number, got inf"),
    ("pause-nan", setting("launch", pause_preparing_seconds=float("nan")),
     "launch.pause_preparing_seconds: expected a finite number, got nan"),
    ("deepspeed-config-inf", setting("deepspeed", config={"zero_optimization": {"reduce_bucket_size": float("-inf")}}),
     "deepspeed.config.zero_optimization.reduce_bucket_size: expected a finite number, got -inf"),
    ("model-config-nan", setting("model", path=None, config={"model_type": "llama", "num_hidden_layers": 2,
                                                             "rms_norm_eps": float("nan")}),
     "model.config.rms_norm_eps: expected a finite number, got nan"),
    # A bounded phase table.
    ("phases-beyond-the-bound", setting("schedule", **strategy(strategy="lisa", total_steps=10**7, interval=1,
                                                               layers_per_phase=1)),
     f"schedule.interval: expected at most {MAX_PHASES:,} phases, got total_steps / interval = "
     f"10,000,000 / 1 = 10,000,000 phases"),
    ("layers-beyond-the-bound", lambda s, t: (
        s["model"].update(path=None, config={"model_type": "llama", "num_hidden_layers": 10**4}),
        s["schedule"].update(phases=None, strategy="ascending", total_steps=10**5, interval=1, layers_per_phase=10**4)),
     "schedule.layers_per_phase: expected at most 10,000,000 layers over all phases, got 100,000 phases x "
     "10,000"),
    # What the model or DeepSpeed cannot take.
    ("seq-len-beyond-positions", setting("data", seq_len=65),
     "data.seq_len: expected at most the model's max_position_embeddings = 64, got 65"),
    ("inline-seq-len-beyond-positions", setting("model", path=None, config={
        "model_type": "gpt2", "n_layer": 2, "n_positions": 8}),
     "data.seq_len: expected at most the model's n_positions = 8, got 16"),
    ("zero-optimization-not-a-table", setting("deepspeed", config={"zero_optimization": 3}),
     "deepspeed.config.zero_optimization: expected a table (merged into relayer's), got 3"),
    ("bf16-not-a-table", setting("deepspeed", config={"bf16": True}),
     "deepspeed.config.bf16: expected a table (merged into relayer's), got true"),
    # Paths that are loops, folders, FIFOs.
    ("data-path-a-symlink-loop", lambda s, t: s["data"].update(path=loop(t, "d")),
     "data.path: expected a data file or a datasets.save_to_disk folder, {tmp}/d is a symlink loop"),
    ("data-path-a-fifo", lambda s, t: s["data"].update(path=fifo(t, "d")),
     "data.path: expected a data file or a datasets.save_to_disk folder, {tmp}/d is a FIFO"),
    ("data-path-a-broken-symlink", lambda s, t: (t / "d").symlink_to(t / "nowhere") or s["data"].update(path="d"),
     "data.path: expected a data file or a datasets.save_to_disk folder, {tmp}/nowhere does not exist"),
    ("validation-path-a-directory", lambda s, t: s["data"].update(validation_path="."),
     "data.validation_path: expected a data file or a datasets.save_to_disk folder, {tmp} is a directory"),
    ("validation-path-a-symlink-loop", lambda s, t: s["data"].update(validation_path=loop(t, "v")),
     "data.validation_path: expected a data file or a datasets.save_to_disk folder, {tmp}/v is a symlink loop"),
    ("hostfile-a-directory", setting("launch", launcher="deepspeed", nnodes=2, hostfile="."),
     "launch.hostfile: expected a hostfile, {tmp} is a directory"),
    ("hostfile-a-symlink-loop", lambda s, t: s["launch"].update(launcher="deepspeed", nnodes=2, hostfile=loop(t, "h")),
     "launch.hostfile: expected a hostfile, {tmp}/h is a symlink loop"),
]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("edit,message", [pytest.param(e, m, id=i) for i, e, m in BAD])
def test_bad_input_exits_2_naming_the_key_and_writes_nothing(command, edit, message, tmp_path, tiny_model, tiny_data):
    sched = build(tmp_path, tiny_model, tiny_data, edit)
    before = sorted(tmp_path.rglob("*"))
    r = invoke(command, str(sched))
    assert r.exit_code == 2, (r.output, r.exception)
    expected = expand(message, tmp_path, tiny_model).replace("{m}", str(tmp_path.resolve() / "m")).replace("{model}",
                                                                                               str(tiny_model))
    assert r.stderr.startswith(f"orchestrator: {sched.resolve()}: {expected}"), r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.output
    assert r.stdout == ""
    assert sorted(tmp_path.rglob("*")) == before


def test_every_non_finite_number_is_named(tmp_path, tiny_model, tiny_data):
    raw = schedule_dict(tiny_model, tiny_data, optimizer={"lr": float("inf"), "eps": float("nan")})
    with pytest.raises(ScheduleError) as e:
        validate_schedule(raw, tmp_path / "s.toml")
    assert str(e.value).splitlines() == [f"{tmp_path / 's.toml'}: optimizer.eps: expected a finite number, got nan",
                                         f"{tmp_path / 's.toml'}: optimizer.lr: expected a finite number, got inf"]


def test_a_phase_list_beyond_the_bound_is_refused_before_it_is_read(tmp_path, tiny_model, tiny_data, monkeypatch):
    raw = schedule_dict(tiny_model, tiny_data, schedule={"phases": [{"steps": 1, "layers": [0]}] * (MAX_PHASES + 1)})

    def read(*_a, **_k):
        raise AssertionError("the phase list was read (validated) before its length was checked")

    import orchestrator.validate
    monkeypatch.setattr(orchestrator.validate.Schedule, "model_validate", read)  # a timing here was load-sensitive
    with pytest.raises(ScheduleError) as e:
        validate_schedule(raw, tmp_path / "s.toml")
    assert str(e.value) == (f"{tmp_path / 's.toml'}: schedule.phases: expected at most {MAX_PHASES:,} phases, "
                            f"got {MAX_PHASES + 1:,}")


def test_a_huge_model_plans_in_seconds(tmp_path, tiny_data):
    # An inline config of the most layers taken: the strategy walks them without listing them; a
    # billion is refused before anything is sized by it.
    raw = schedule_dict(Path("unused"), tiny_data, schedule={"phases": None, "strategy": "descending",
                                                             "total_steps": 100, "interval": 10, "layers_per_phase": 2})
    raw["model"] = {"config": {"model_type": "llama", "num_hidden_layers": 1 << 14}}
    del raw["schedule"]["phases"]
    t0 = time.perf_counter()
    loaded = validate_schedule(raw, tmp_path / "s.toml")
    assert time.perf_counter() - t0 < 5
    assert loaded.num_layers == 1 << 14
    raw["model"]["config"]["num_hidden_layers"] = 10**9
    with pytest.raises(ScheduleError, match="model.config: num_hidden_layers: expected an integer from 1 to 16,384"):
        validate_schedule(raw, tmp_path / "s.toml")


def test_slurm_without_srun(tmp_path, tiny_model, tiny_data, monkeypatch):
    sched = build(tmp_path, tiny_model, tiny_data, setting("launch", launcher="slurm"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    r = invoke("plan", str(sched))
    assert r.exit_code == 2
    assert r.stderr == (f"orchestrator: {sched.resolve()}: launch.launcher: \"slurm\" starts each phase with srun, "
                        "which is not on PATH\n")
    on_path(monkeypatch, tmp_path, "srun")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert invoke("plan", str(sched)).exit_code == 0


@pytest.mark.parametrize("tie", [False, True])
def test_a_tied_lm_head_may_be_persistent(tmp_path, tiny_data, tie):
    names = [n for n in llama_names(4) if not (tie and n == "lm_head.weight")]
    model = model_dir(tmp_path, names, tie_word_embeddings=tie)
    raw = schedule_dict(model, tiny_data, model={"persistent": ["model.embed_tokens", "lm_head"]})
    assert validate_schedule(raw, tmp_path / "s.toml").num_layers == 4


def test_layers_that_differ_by_kind_are_not_missing_anything(tmp_path, tiny_data):
    # Dense and MoE layers (or attention and linear attention) hold different tensors; neither lacks any.
    names = [n for n in llama_names(4) if not n.startswith("model.layers.3.mlp.")]
    names += [f"model.layers.3.mlp.experts.{e}.{p}.weight" for e in range(2) for p in ("up", "down")]
    raw = schedule_dict(model_dir(tmp_path, names), tiny_data)
    assert validate_schedule(raw, tmp_path / "s.toml").num_layers == 4


def test_a_sharded_model_plans(tmp_path, tiny_data):
    model = sharded(SHARD_MAP, SHARDS)(tmp_path)
    assert validate_schedule(schedule_dict(model, tiny_data), tmp_path / "s.toml").num_layers == 4


def test_the_tiny_models_weights_pass(tmp_path, tiny_model, tiny_data):
    # The real save_pretrained folder, not a stand-in: what every other test runs on.
    raw = schedule_dict(tiny_model, tiny_data, model={"persistent": ["model.embed_tokens", "lm_head", "model.norm"]})
    assert validate_schedule(raw, tmp_path / "s.toml").num_layers == 4


def test_a_schedule_that_is_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "s.toml")
    r = invoke("plan", str(tmp_path / "s.toml"))
    assert r.exit_code == 2
    assert r.stderr == f"orchestrator: {tmp_path / 's.toml'}: expected a schedule file, it is a FIFO\n"


@pytest.mark.parametrize("where", ["itself", "a-parent"])
def test_output_dir_that_cannot_be_a_directory(tmp_path, tiny_model, tiny_data, where):
    if where == "itself":
        loop(tmp_path, "run")
        out, bad = "run", "run"
    else:
        (tmp_path / "file").write_text("")
        out, bad = "file/run", "file"
    sched = write_schedule(tmp_path / "schedule.toml", schedule_dict(tiny_model, tiny_data, run={"output_dir": out}))
    r = invoke("run", str(sched))
    assert r.exit_code == 2
    kind = "a symlink loop" if where == "itself" else "a file"
    assert r.stderr == (f"orchestrator: {sched.resolve()}: run.output_dir: expected a directory, "
                        f"{tmp_path.resolve() / bad} is {kind}\n")
