"""The contract between the orchestrator and the phase processes (launch.contract): the learning
rate of a step, the phase directory's files and their readers, the channels' framing, the spec."""

import importlib.util
import json
import math
import os
import typing

import pytest
from pydantic import ValidationError

from launch.contract.channels import DATA_TOOL, FORK_REQUESTS, FORK_SERVER, GO, PHASE_LAUNCHER
from launch.contract.files import RANK, ExitRecord, PhaseDir, PidRecord, RunDir, read_reasons, write_reason
from launch.contract.data import FIELDS, DataFormat
from launch.contract.spec import OptimizerPart, PhaseSpec, lr_at


def opt(kind: str, warmup: int = 0, **kw) -> OptimizerPart:
    return OptimizerPart(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, grad_clip=1.0, lr_kind=kind,
                         warmup_steps=warmup, total_steps=110, **kw)


def test_warmup_ramps_linearly_to_the_peak_from_zero():
    o = opt("constant", warmup=10)
    assert [lr_at(s, o) for s in (0, 4, 9, 10, 100)] == pytest.approx([0.0, 4e-4, 9e-4, 1e-3, 1e-3])


def test_warmup_from_one_step_is_the_ramp_of_runs_before_the_key():
    o = opt("constant", warmup=10, warmup_from="one_step")
    assert [lr_at(s, o) for s in (0, 4, 9, 10, 100)] == pytest.approx([1e-4, 5e-4, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("kind, hf", [("constant", "constant_with_warmup"), ("linear", "linear"), ("cosine", "cosine")])
@pytest.mark.parametrize("warmup", [0, 1, 10])
def test_every_step_matches_hugging_face_get_scheduler(kind, hf, warmup):
    """A curve ported from the Trainer is the same curve: transformers' scheduler, stepped after each
    optimizer step as the Trainer does, gives step s the lr relayer gives it."""
    import torch
    from transformers import get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = get_scheduler(hf, optimizer, num_warmup_steps=warmup, num_training_steps=110)
    theirs = []
    for _ in range(110):
        theirs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert [lr_at(s, opt(kind, warmup)) for s in range(110)] == pytest.approx(theirs, abs=1e-15)


@pytest.mark.parametrize("kind, mid, end", [("linear", 0.5e-3, 0.0), ("cosine", 0.5e-3, 0.0), ("constant", 1e-3, 1e-3)])
def test_decay_over_the_run_after_warmup(kind, mid, end):
    o = opt(kind, warmup=10)
    assert lr_at(10, o) == pytest.approx(1e-3)
    assert lr_at(60, o) == pytest.approx(mid)
    assert lr_at(110, o) == pytest.approx(end, abs=1e-12)


def test_cosine_shape():
    o = opt("cosine")
    assert lr_at(55, o) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 0.5)))


# -- the phase directory's files ----------------------------------------------------------------
# The names are what users and scripts read (docs/run-directory.md): they must not drift.
def test_the_layout_names_the_files_both_sides_use(tmp_path):
    run = RunDir(tmp_path)
    d = run.phase(3)
    assert d.path == tmp_path / "phases" / "phase-0003"
    assert [p.relative_to(d.path).as_posix() for p in (d.spec, d.log, d.go, d.records, d.stages, d.pids, d.exits,
                                                       d.errors)] == [
        "spec.json", "worker.log", "go", "records.json", "stages.jsonl", "pids", "exit", "errors"]
    assert [p.name for p in (run.zygote_fifo, run.zygote_log, run.zygote_error)] == [
        "zygote.fifo", "zygote.log", "zygote.error"]
    run.phase(1).path.mkdir(parents=True)
    d.path.mkdir()
    (tmp_path / "phases" / "other").mkdir()
    assert [p.path.name for p in run.phase_dirs()] == ["phase-0001", "phase-0003"]


def test_the_host_transports_bytes_are_listed_by_the_name_they_are_written_under(tmp_path):
    d = PhaseDir(tmp_path)
    d.handover.mkdir()
    for path in (d.blob_path(1), d.blob_path(0), d.offer_path(0), d.handover / "other.bin"):
        path.write_bytes(b"")
    assert d.blobs() == [d.blob_path(0), d.blob_path(1)]
    assert d.blob_path(0).name == "rank-0.bin"


@pytest.mark.parametrize("module", [PHASE_LAUNCHER, FORK_SERVER, DATA_TOOL])
def test_the_entry_points_the_orchestrator_starts_are_modules_that_run(module):
    spec = importlib.util.find_spec(module)
    assert spec is not None and (spec.submodule_search_locations is None or importlib.util.find_spec(f"{module}.__main__"))


def test_every_data_format_has_its_fields():
    assert set(FIELDS) == set(typing.get_args(DataFormat))


def test_records_round_trip_and_a_torn_or_missing_file_reads_as_none(tmp_path):
    d = PhaseDir(tmp_path)
    assert d.read_records() == {}
    d.write_records({"rank": 0, "t_go": 1.5})
    assert d.read_records() == {"rank": 0, "t_go": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == ["records.json"]  # no temporary left
    for text in ('{"rank": 0, "t_g', "[1, 2]", ""):
        d.records.write_text(text)
        assert d.read_records() == {}


def test_pid_records_skip_what_is_not_one(tmp_path):
    d = PhaseDir(tmp_path)
    d.record_pid("rank-1", 12, 100.5)
    d.record_pid("rank-0", 11, 100)
    d.record_pid("launcher", 10, 99.0)
    d.pids.joinpath("rank-2.json").write_text('{"pid": 13, "create')  # a writer killed mid-write
    d.pids.joinpath("rank-3.json").write_text('{"pid": "14", "started": 1.0}')
    d.pids.joinpath("rank-4.json").write_text('{"pid": 0, "started": 1.0}')
    run = tmp_path.parent.parent.stat().st_ino  # RUN_DIR/phases/phase-NNNN's
    assert d.pid_records(RANK) == [PidRecord(pid=11, started=100.0, run=run),
                                   PidRecord(pid=12, started=100.5, run=run)]
    assert {r.pid for r in d.pid_records()} == {10, 11, 12}
    assert PhaseDir(tmp_path / "none").pid_records() == []


def test_exit_records(tmp_path):
    d = PhaseDir(tmp_path)
    assert d.read_exit(0) is None
    d.write_exit(0, -9, 123.25)
    assert d.read_exit(0) == ExitRecord(rc=-9, time=123.25)
    d.exits.joinpath("rank-1.json").write_text('{"rc": 0, "ti')
    d.exits.joinpath("rank-2.json").write_text('{"time": 1.0}')
    assert d.read_exit(1) is None and d.read_exit(2) is None


def test_error_reasons_are_distinct_and_in_rank_order(tmp_path):
    d = PhaseDir(tmp_path)
    assert d.error_reasons() == []
    d.write_error(1, ValueError("loss is nan"))
    d.write_error(0, RuntimeError("gloo: connection reset"))
    d.write_error(2, ValueError("loss is nan"))
    d.errors.joinpath("rank-3.txt").write_text("  \n")
    assert d.error_reasons() == ["RuntimeError: gloo: connection reset", "ValueError: loss is nan"]
    write_reason(tmp_path / "zygote.error", OSError("no space left"))
    assert read_reasons([tmp_path / "zygote.error", tmp_path / "missing"]) == ["OSError: no space left"]


def test_stages_append_lines_and_clear_removes_what_an_attempt_left(tmp_path):
    d = PhaseDir(tmp_path)
    d.append_stage("loading the model")
    d.append_stage("warming up")
    lines = [json.loads(line) for line in d.stages.read_text().splitlines()]
    assert [s["stage"] for s in lines] == ["loading the model", "warming up"]
    d.record_pid("rank-0", 1, 1.0)
    d.write_exit(0, 0, 1.0)
    d.write_error(0, ValueError("x"))
    d.write_records({})
    d.spec.write_text("{}")
    d.clear()
    assert [p.name for p in tmp_path.iterdir()] == ["spec.json"]


# -- the channels -------------------------------------------------------------------------------
def test_records_are_padded_to_the_channel_size_and_round_trip():
    go = GO.encode(restore="/runs/a/checkpoints/step-00000010", handover="/runs/a/phases/phase-0000", defer=False)
    assert len(go) == 4096 and go.endswith(b" ")
    assert GO.decode(go) == {"restore": "/runs/a/checkpoints/step-00000010", "handover": "/runs/a/phases/phase-0000", "defer": False}
    assert GO.decode(GO.encode(restore=None, handover=None, defer=True)) == {"restore": None, "handover": None, "defer": True}
    request = FORK_REQUESTS.encode(spec="/runs/a/phases/phase-0001/spec.json", nproc=2)
    assert len(request) == 4096
    assert FORK_REQUESTS.decode(request) == {"spec": "/runs/a/phases/phase-0001/spec.json", "nproc": 2}


def test_a_record_that_does_not_fit_is_an_error():
    # Past PIPE_BUF a write may interleave with another's: it must not be written at all.
    with pytest.raises(ValueError, match="does not fit the channel's 4096"):
        GO.encode(restore="/" + "x" * 2048, handover="/" + "x" * 2048, defer=False)
    with pytest.raises(ValueError, match="keys"):
        GO.encode(restore=None, handover=None, defer=False, spec="x")
    with pytest.raises(ValueError, match="keys"):
        GO.encode(restore=None)


def test_a_short_or_foreign_record_is_an_error():
    with pytest.raises(ValueError, match="a record of 4095 bytes, expected 4096"):
        GO.decode(GO.encode(restore=None, handover=None, defer=False)[:-1])
    with pytest.raises(ValueError, match="not a record of keys"):
        GO.decode(json.dumps({"spec": "x", "nproc": 1}).encode().ljust(4096))


def test_read_takes_a_record_in_pieces_and_none_at_eof(tmp_path):
    r, w = os.pipe()
    record = FORK_REQUESTS.encode(spec="s.json", nproc=1)
    os.write(w, record[:100])
    os.write(w, record[100:] + record[:10])  # and the start of a record its writer did not finish
    os.close(w)
    try:
        assert FORK_REQUESTS.read(r) == {"spec": "s.json", "nproc": 1}
        assert FORK_REQUESTS.read(r) is None
    finally:
        os.close(r)


def test_read_calls_idle_until_the_go_comes(tmp_path):
    fifo = tmp_path / "go"
    os.mkfifo(fifo, 0o600)
    keep = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # as the orchestrator holds it
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    calls = []

    def idle():
        calls.append(1)
        if len(calls) == 3:
            os.write(keep, GO.encode(restore="/c", handover=None, defer=False))

    try:
        assert GO.read(fd, idle, interval=0.001) == {"restore": "/c", "handover": None, "defer": False}
        assert len(calls) == 3
        os.close(keep)
        keep = -1
        assert GO.read(fd, idle, interval=0.001) is None  # the writer is gone
    finally:
        os.close(fd)
        if keep >= 0:
            os.close(keep)


# -- the spec -----------------------------------------------------------------------------------
def test_changed_validates_what_model_copy_does_not():
    spec = PhaseSpec.model_validate(SPEC)
    warm = spec.changed(prewarm=True, go_fifo="/r/phases/phase-0001/go", restore=None, preload="/c")
    assert (warm.prewarm, warm.go_fifo, warm.restore, warm.preload, spec.prewarm) == (
        True, "/r/phases/phase-0001/go", None, "/c", False)
    assert spec.model_copy(update={"nproc": "two", "go_fifos": "/x"}).nproc == "two"  # what changed guards against
    with pytest.raises(ValidationError, match="nproc"):
        spec.changed(nproc="two")
    with pytest.raises(ValidationError, match="go_fifos"):
        spec.changed(go_fifos="/x")


SPEC = {
    "run_dir": "/r", "phase_dir": "/r/phases/phase-0001", "seed": 0, "phase": 1, "start_step": 10,
    "phase_start_step": 10, "end_step": 20, "layers": [1], "restore": "/r/checkpoints/step-00000010",
    "model": {"path": "/m", "config": None, "dtype": "float32", "persistent": None, "layers": None},
    "data": {"sources": [{"path": "/d.jsonl", "format": "tokens"}], "seq_len": 16, "batch_size": 8,
             "micro_batch_size": 4, "shuffle": True},
    "optimizer": {"lr": 1e-3, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 1.0,
                  "lr_kind": "constant", "warmup_steps": 0, "total_steps": 30},
    "zero_stage": 2, "deepspeed_config": {}, "every_steps": 0, "launcher": "local", "nproc": 1, "nnodes": 1,
    "hostfile": None, "master_port": 29500, "orchestrator_pid": 1,
}
