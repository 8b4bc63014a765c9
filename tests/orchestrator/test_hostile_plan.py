"""What ``plan`` must refuse because the run could not do it (each a wasted start a minute in), and
the read-only commands on a run directory holding special files or damaged lines (#26). In-process,
no phase starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.journal import Journal
from orchestrator.libfacts import deepspeed_refusal
from orchestrator.rundir import LOCK, create_run_dir
from orchestrator.validate import wandb_can_log
from tests.conftest import schedule_dict, write_schedule
from tests.orchestrator.test_cli_plan import build, expand, invoke, setting

ORCH = str(Path(sys.executable).parent / "orchestrator")
OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}

# (id, edit of the schedule dict, message after "<schedule path>: ").
REFUSED = [
    ("offload-at-stage-0", setting("deepspeed", zero_stage=0, config=OFFLOAD),
     "deepspeed.config.zero_optimization.offload_optimizer: needs deepspeed.zero_stage 1 or 2, got 0"),
    ("offload-to-nvme", setting("deepspeed", config={"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}),
     'deepspeed.config.zero_optimization.offload_optimizer: expected device = "cpu": on NVMe'),
    ("offload-forcing-deepspeeds-optimizer", setting("deepspeed", config={**OFFLOAD, "zero_force_ds_cpu_optimizer": True}),
     "deepspeed.config.zero_force_ds_cpu_optimizer: expected false (or unset) with offload_optimizer"),
    ("amp-removed", setting("deepspeed", config={"amp": {"enabled": True}}),
     "deepspeed.config.amp: removed from DeepSpeed, which refuses it"),
    ("steps-per-print-zero", setting("deepspeed", config={"steps_per_print": 0}),
     "deepspeed.config.steps_per_print: expected a positive integer (DeepSpeed divides by it), got 0"),
    ("quoted-dotted-key", setting("deepspeed", config={"zero_optimization.overlap_comm": True}),
     'deepspeed.config."zero_optimization.overlap_comm": a quoted key with a dot'),
    ("unknown-model-type", setting("model", path=None, config={"model_type": "lama", "num_hidden_layers": 2}),
     "model.config.model_type: 'lama' is not a model type the installed transformers builds as a causal LM "
     "(did you mean 'llama'?)"),
    ("persistent-names-the-body", setting("model", persistent=["model.layers.1"]),
     "model.persistent: 'model.layers.1' names the body (model.layers.N)"),
    ("tokenizer-missing", setting("model", tokenizer="no-tokenizer"),
     "model.tokenizer: expected a Hugging Face tokenizer folder, {tmp}/no-tokenizer does not exist"),
]


@pytest.mark.parametrize("edit,message", [pytest.param(e, m, id=i) for i, e, m in REFUSED])
def test_plan_refuses_what_the_run_cannot_do(edit, message, tmp_path, tiny_model, tiny_data):
    sched = build(tmp_path, tiny_model, tiny_data, edit)
    r = invoke("plan", str(sched))
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith(f"orchestrator: {sched.resolve()}: {expand(message, tmp_path, tiny_model)}"), r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "run").exists()


def test_offload_at_zero_1_and_2_passes():
    """torch's AdamW steps the offloaded partitions on the host; the phase's config says so to DeepSpeed."""
    assert deepspeed_refusal({**OFFLOAD, "zero_force_ds_cpu_optimizer": False}) is None
    assert deepspeed_refusal(OFFLOAD, 1) is None and deepspeed_refusal(OFFLOAD, 2) is None
    assert deepspeed_refusal(OFFLOAD, 3)[1] == "needs deepspeed.zero_stage 1 or 2, got 3"
    assert "zero_force_ds_cpu_optimizer" not in deepspeed_config_of({})
    assert deepspeed_config_of(OFFLOAD)["zero_force_ds_cpu_optimizer"] is False
    assert deepspeed_refusal({"steps_per_print": 10, "zero_optimization": {"overlap_comm": True}}) is None


def deepspeed_config_of(table: dict) -> dict:
    """The phase's DeepSpeed config (its ZeRO-2 backend's, ``launch.engine``) of the tiny schedule with ``table``."""
    from types import SimpleNamespace

    from launch.engine import ZeroBackend

    spec = SimpleNamespace(data=SimpleNamespace(batch_size=8, micro_batch_size=4), zero_stage=2,
                           optimizer=SimpleNamespace(grad_clip=1.0), model=SimpleNamespace(dtype="float32"),
                           deepspeed_config=table)
    return ZeroBackend(2).config(spec, 1, 1000)


@pytest.mark.parametrize("env,ok", [({}, False), ({"WANDB_MODE": "offline"}, True), ({"WANDB_API_KEY": "k" * 40}, True),
                                    ({"NETRC": "api.wandb.ai"}, True)])
def test_wandb_online_needs_an_api_key(env, ok, tmp_path, tiny_model, tiny_data, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text(f"machine {env.pop('NETRC', 'example.org')} login user password p\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert wandb_can_log() == ok
    if not ok:  # the whole plan: one line naming the key, before the data is read
        r = invoke("plan", str(build(tmp_path, tiny_model, tiny_data, setting("run", report_to=["wandb"]))))
        assert r.exit_code == 2, r.output
        assert "run.report_to: wandb logs online (WANDB_MODE is not offline) and finds no API key" in r.stderr


def test_set_with_a_newline_is_refused_not_cut(tmp_path, tiny_model, tiny_data):
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data))
    r = invoke("plan", str(sched), "--set", "optimizer.lr=0.5\nweight_decay = 0.1")
    assert r.exit_code == 2 and "--set: expected one TOML value" in r.stderr, r.output


def started_run(tmp_path: Path, tiny_model: Path, tiny_data: Path) -> Path:
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data))
    rd = tmp_path / "run"
    create_run_dir(rd, sched.read_text())
    Journal(rd).write("run_started", phases=3, total_steps=30)
    return rd


@pytest.mark.parametrize("name,command", [(LOCK, "status"), ("journal.jsonl", "status"), ("journal.jsonl", "report"),
                                          ("metrics.jsonl", "report --out")])
def test_a_fifo_where_a_command_reads_is_an_answer_never_a_block(name, command, tmp_path, tiny_model, tiny_data):
    """A subprocess with a deadline: on the code before, ``status`` blocked forever on a FIFO lock."""
    rd = started_run(tmp_path, tiny_model, tiny_data)
    (rd / name).unlink(missing_ok=True)
    os.mkfifo(rd / name)
    args = {"report": ["--json"], "report --out": ["--out", str(tmp_path / "r.png")]}.get(command, [])
    r = subprocess.run([ORCH, command.split()[0], str(rd), *args], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode in (1, 2) and r.stderr.startswith(f"orchestrator: {rd / name}: a FIFO"), r.stderr


def test_report_reads_a_damaged_metrics_file_line_by_line(tmp_path, tiny_model, tiny_data):
    from orchestrator.report import read_metrics

    rd = started_run(tmp_path, tiny_model, tiny_data)
    lines = [json.dumps({"step": 1, "loss": 2.5}).encode(), b"\xff\xfe not utf-8", b"[" * 100_000,
             json.dumps({"step": "2", "loss": 1.0}).encode(), json.dumps({"step": 3, "loss": "NaN"}).encode(),
             json.dumps({"step": 4, "loss": True}).encode(), b'{"step": 5, "loss": 1e999}', b"[1, 2]",
             json.dumps({"step": 6, "loss": 1.5}).encode(), b'{"step": 7, "lo']
    (rd / "metrics.jsonl").write_bytes(b"\n".join(lines))
    assert read_metrics(rd) == {1: 2.5, 6: 1.5}
