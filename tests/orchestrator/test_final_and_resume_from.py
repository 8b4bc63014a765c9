"""A finished run's RUN_DIR/final, ``--resume-from``, the schedule copy of ``--set`` and the lr-history
refusal, on one real two-phase run (cosine lr, the tiny example's model with its tokenizer)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import tomllib
from pathlib import Path

import pytest

from shard_tools.manifest import read_manifest
from tests.conftest import ROOT, cli, make_tokens, schedule_dict, write_schedule

pytestmark = pytest.mark.multiprocess
SET = ("--set", "optimizer.lr=2e-3")


def make_example_model(out: Path) -> Path:
    spec = importlib.util.spec_from_file_location("make_model", ROOT / "examples" / "tiny" / "make_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make(out)


def cosine(tmp: Path, model: Path, data: Path, name: str, phases: list[dict]) -> Path:
    return write_schedule(tmp / name, schedule_dict(model, data, run={"final_model": True, "report_to": ["tensorboard"]},
                                                    lr_schedule={"kind": "cosine", "warmup_steps": 1},
                                                    schedule={"phases": phases}))


TWO = [{"steps": 2, "layers": [0]}, {"steps": 2, "layers": [1]}]


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("final")
    model = make_example_model(tmp / "base")
    data = make_tokens(tmp / "train.jsonl")
    sched = cosine(tmp, model, data, "s.toml", TWO)
    r = cli("orchestrator", "run", str(sched), *SET)
    assert r.returncode == 0, r.stderr
    return tmp, model, data, sched, tmp / "run"


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "journal.jsonl").read_text().splitlines()]


def test_final_model_loads_and_generates_without_the_base_model(done):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, model_dir, _, _, run = done
    final = run / "final"
    base_head = AutoModelForCausalLM.from_pretrained(model_dir).lm_head.weight.detach().clone()
    assert (final / "tokenizer.json").is_file() and (final / "config.json").is_file()
    assert "final_model_written" in [e["event"] for e in events(run)]
    for f in final.iterdir():
        assert str(model_dir) not in f.read_text(errors="replace"), f"{f} names the base model"
    moved = tmp / "base-moved"
    model_dir.rename(moved)
    try:
        model = AutoModelForCausalLM.from_pretrained(final)
        tok = AutoTokenizer.from_pretrained(final)
        ids = tok("The ", return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    finally:
        moved.rename(model_dir)
    assert out.shape[1] == ids.shape[1] + 5
    assert not torch.equal(model.lm_head.weight, base_head), "the final model is the base model, untrained"


def files_of(folder: Path) -> dict[str, bytes]:
    """An export's files but its relayer.json (which names the checkpoint and the run)."""
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.name != "relayer.json"}


def test_the_final_model_was_prepared_ahead_and_is_what_export_writes(done, tmp_path):
    """The exporter started with the last phase's pre-warmed group built the base model then and used it; its
    final/ is byte for byte what ``shard-tools export`` of the run writes on its own."""
    *_, run = done
    ev = events(run)
    assert [e["base_model"] for e in ev if e["event"] == "final_model_prewarm"] == [True]
    order = [f"{e['event']} {e.get('phase', '')}".strip() for e in ev]
    assert order.index("prewarm_started 1") + 1 == order.index("final_model_prewarm"), "not with the last phase's"
    seconds = next(e for e in ev if e["event"] == "final_model_written")["seconds"]
    assert seconds["base_built_ahead"] is True and seconds.keys() >= {"verify", "compose", "write", "files"}
    r = cli("shard-tools", "export", str(run), "--out", str(tmp_path / "plain"))
    assert r.returncode == 0, r.stderr
    assert files_of(run / "final") == files_of(tmp_path / "plain")


def test_an_exporter_without_its_go_writes_nothing_and_one_that_died_is_replaced(done):
    """EOF on its stdin (the run stopped or failed, the orchestrator died): it exits 0 having written
    nothing. One dead before its go: write_final starts another. A base model built ahead for another
    spec than the checkpoint's is not used."""
    from orchestrator import final

    *_, run = done
    before = {f.name: f.stat().st_mtime_ns for f in (run / "final").iterdir()}
    waiting = final.Exporter(run, None)
    waiting.proc.stdin.close()
    assert waiting.proc.wait(120) == 0
    waiting.log.seek(0)
    assert b"exported" not in waiting.log.read()
    assert {f.name: f.stat().st_mtime_ns for f in (run / "final").iterdir()} == before
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp")]
    written = files_of(run / "final")
    dead = final.Exporter(run, None)
    dead.proc.kill()
    dead.proc.wait()
    out, rc, output, seconds = final.write_final(run, dead)
    assert (out, rc, seconds["base_built_ahead"]) == (run / "final", 0, False), output
    assert files_of(run / "final") == written
    newest = max((run / "checkpoints").glob("step-*"))
    other = final.Exporter(run, {**read_manifest(newest).extra["base_model"], "seed": 12345})
    out, rc, output, seconds = final.write_final(run, other)
    assert (rc, seconds["base_built_ahead"]) == (0, False), output
    assert files_of(run / "final") == written


def test_set_is_recorded_in_the_run_copy(done):
    *_, run = done
    assert tomllib.loads((run / "schedule.toml").read_text())["optimizer"]["lr"] == 2e-3


def test_lr_change_of_steps_taken_is_refused(done):
    tmp, model, data, _, run = done
    longer = cosine(tmp, model, data, "longer.toml", TWO + [{"steps": 2, "layers": [0]}])
    r = cli("orchestrator", "run", str(longer), "--output-dir", str(run), *SET)
    assert r.returncode == 2, r.stderr
    assert "lr of step 2, already taken, would change" in r.stderr and "total_steps 4 -> " in r.stderr
    assert "--force" in r.stderr


def loss_steps(run: Path) -> tuple[list[int], list[int]]:
    """The steps of metrics.jsonl's loss lines, and of TensorBoard's loss curve as it shows it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    logged = [m["step"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    return logged, [e.step for e in board.Scalars("loss")]


def test_resume_from_sets_later_checkpoints_aside(done):
    tmp, model, data, sched, run = done
    ckpts = run / "checkpoints"
    before = read_manifest(ckpts / "step-00000004")
    assert loss_steps(run) == ([1, 2, 3, 4], [1, 2, 3, 4])
    r = cli("orchestrator", "run", str(sched), *SET, "--resume-from", str(tmp / "elsewhere"))
    assert r.returncode == 2 and "--resume-from: expected a checkpoint of this run" in r.stderr
    r = cli("orchestrator", "run", str(sched), *SET, "--resume-from", str(ckpts / "step-00000002"))
    assert r.returncode == 0, r.stderr
    aside, = ckpts.glob(".set-aside-*")
    assert (aside / "step-00000004" / "manifest.json").is_file() and (aside / "final" / "config.json").is_file()
    e, = [e for e in events(run) if e["event"] == "checkpoints_set_aside"]
    assert e["checkpoints"] == ["step-00000004"] and e["to"] == str(aside)
    resumed = [e for e in events(run) if e["event"] == "resumed"][-1]
    assert resumed["step"] == 2
    again = read_manifest(ckpts / "step-00000004")
    assert {n: f.sha256_chunked for n, f in again.files.items()} == {n: f.sha256_chunked for n, f in before.files.items()}
    assert (run / "final" / "config.json").is_file()
    # One history: the set-aside branch's steps 3 and 4 left metrics.jsonl (kept beside its
    # checkpoints) and TensorBoard's curve; the steps trained again are there once.
    assert loss_steps(run) == ([1, 2, 3, 4], [1, 2, 3, 4])
    assert [json.loads(m)["step"] for m in (aside / "metrics.jsonl").read_text().splitlines()] == [3, 4]
    assert e["metrics_lines"] == 2


def test_the_warmup_starts_at_zero_as_hugging_face(done):
    """Step 0 of a one-step warm-up trains at lr 0, then the cosine decay: transformers' curve."""
    import torch
    from transformers import get_scheduler

    *_, run = done
    logged = {m["step"]: m["lr"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in m}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=1, num_training_steps=4)
    theirs = []
    for _ in range(4):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [logged[s + 1] for s in range(4)] == pytest.approx(theirs, abs=1e-15)  # metrics count steps done


def test_a_run_from_before_warmup_from_resumes_only_with_its_own_warmup(done, tmp_path):
    """A run whose journal does not record lr_schedule.warmup_from warmed up from one step: resuming
    it under the new default would change the lr of steps taken, so it is refused, naming the key."""
    import shutil

    _, _, _, sched, run = done
    old = tmp_path / "old-run"
    shutil.copytree(run, old)
    journal = old / "journal.jsonl"
    journal.write_text("".join(json.dumps({k: v for k, v in e.items() if k != "warmup_from"}) + "\n"
                               for e in events(run)))
    r = cli("orchestrator", "run", str(sched), *SET, "--output-dir", str(old))
    assert r.returncode == 2, r.stderr
    assert "lr of step 0, already taken, would change: 0.002 -> 0 " in r.stderr, r.stderr
    assert "--set lr_schedule.warmup_from=one_step" in r.stderr
    r = cli("orchestrator", "run", str(sched), *SET, "--set", "lr_schedule.warmup_from=one_step", "--output-dir", str(old))
    assert r.returncode == 0, r.stderr


def test_a_complete_run_whose_checkpoints_are_gone_is_not_trained_again(tmp_path, done):
    """A user deletes a finished run's checkpoints, keeping final/: running it again says it is
    complete and trains nothing (it trained it all again from step 0, and wrote final/ anew)."""
    _, model, data, _, _ = done
    sched = cosine(tmp_path, model, data, "s.toml", TWO)
    assert cli("orchestrator", "run", str(sched)).returncode == 0
    run = tmp_path / "run"
    final_files = {f.name: f.read_bytes() for f in (run / "final").iterdir()}
    for gone in (["step-00000004"], ["step-00000002"]):  # the end's first (an older one left), then all
        for name in gone:
            shutil.rmtree(run / "checkpoints" / name)
        started = len([e for e in events(run) if e["event"] == "phase_started"])
        r = cli("orchestrator", "run", str(sched))
        assert r.returncode == 0, r.stderr
        assert f"complete at step 4: {run / 'final'} is its model; its checkpoints are gone" in r.stdout + r.stderr
        assert len([e for e in events(run) if e["event"] == "phase_started"]) == started
        assert events(run)[-1]["event"] == "run_done"
        assert {f.name: f.read_bytes() for f in (run / "final").iterdir()} == final_files
    assert not list((run / "checkpoints").glob("step-*"))
