"""Every command on damaged or wrong inputs: one clear message naming the file, exit 1 or 2, no traceback."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from shard_tools.errors import CheckpointError
from shard_tools.manifest import MANIFEST
from shard_tools.store import Checkpoints
from tests.shard_tools.conftest import assert_fails, ckpt, flip_byte, invoke, rewrite_manifests, truncate

DAMAGE = {
    # Keeps the 8-byte length and the start of the JSON header.
    "truncated_header": (lambda c: truncate(c / "head.safetensors", 40), "head.safetensors"),
    "flipped_byte": (lambda c: flip_byte(c / "layers.safetensors"), "layers.safetensors: checksum mismatch"),
    "missing_file": (lambda c: (c / "state.safetensors").unlink(), "state.safetensors: missing"),
    "missing_manifest": (lambda c: (c / MANIFEST).unlink(), f"{MANIFEST}: missing"),
    # The file is whole, but the manifest no longer vouches for it (nor would verify check it).
    "unlisted_file": (lambda c: _unlist(c, "layers.safetensors"), f"{MANIFEST}: files: layers.safetensors is not listed"),
}
COMMANDS = ["inspect", "verify", "diff", "export"]


def _unlist(c, name: str) -> None:
    m = json.loads((c / MANIFEST).read_text())
    del m["files"][name]
    (c / MANIFEST).write_text(json.dumps(m))


def _args(command: str, target, run, tmp_path) -> list:
    return {"inspect": ["inspect", target], "verify": ["verify", target], "diff": ["diff", ckpt(run, 10), target],
            "export": ["export", target, "--out", tmp_path / "out"]}[command]


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("command", COMMANDS)
def test_damaged_checkpoint(command, damage, run_copy, tmp_path):
    target = ckpt(run_copy, 30)
    apply, fault = DAMAGE[damage]
    apply(target)
    result = invoke(*_args(command, target, run_copy, tmp_path))
    if command == "inspect" and damage == "flipped_byte":
        # inspect reads headers only; checking the data is verify's job.
        assert result.exit_code == 0, result.output
        return
    assert_fails(result, 1, target / fault.split(":")[0], fault)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("command", COMMANDS)
def test_not_a_checkpoint(command, run_copy, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("not a checkpoint\n")
    result = invoke(*_args(command, plain, run_copy, tmp_path))
    assert_fails(result, 2, plain, "neither a run directory")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", COMMANDS)
def test_no_such_path(command, run_copy, tmp_path):
    missing = tmp_path / "nope"
    assert_fails(invoke(*_args(command, missing, run_copy, tmp_path)), 2, missing, "no such file or directory")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_file_instead_of_a_directory(command, run_copy, tmp_path):
    target = ckpt(run_copy, 30) / "head.safetensors"
    assert_fails(invoke(*_args(command, target, run_copy, tmp_path)), 2, target, "not a directory")


def test_inspect_run_shows_damaged_checkpoints_as_incomplete(run_copy):
    (ckpt(run_copy, 20) / "state.safetensors").unlink()
    (ckpt(run_copy, 30) / MANIFEST).unlink()
    result = invoke("inspect", run_copy)
    assert result.exit_code == 0, result.output
    assert re.search(r"step-00000020 [\d.]+ KiB \(incomplete\)", result.stdout), result.stdout
    assert f"incomplete checkpoint: {ckpt(run_copy, 20) / 'state.safetensors'}: missing" in result.stdout
    assert f"incomplete checkpoint: {ckpt(run_copy, 30) / MANIFEST}: missing" in result.stdout


def test_torn_journal_line_is_skipped(run_copy):
    with open(run_copy / "journal.jsonl", "a") as f:
        f.write('{"event": "phase_sta')
    result = invoke("inspect", run_copy, "--json")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", ["diff", "export"])
def test_checkpoint_outside_a_run(command, run_copy, tmp_path):
    loose = tmp_path / "loose" / "step-00000030"
    shutil.copytree(ckpt(run_copy, 30), loose)
    # Its weights compose from earlier checkpoints of its run, which a loose copy no longer has.
    assert_fails(invoke(*_args(command, loose, run_copy, tmp_path)), 2, loose, "not inside a run's checkpoints/")
    assert invoke("inspect", loose).exit_code == 0 and invoke("verify", loose).exit_code == 0


def test_an_older_layer_source_whose_manifest_leaves_its_layers_out_is_not_skipped(run_copy, tmp_path):
    """Step 20 trained layer 1; were its manifest's missing layers file read as "no layers here",
    step 30 would compose layer 1 from the base model without a word."""
    _unlist(ckpt(run_copy, 20), "layers.safetensors")
    result = invoke("export", ckpt(run_copy, 30), "--out", tmp_path / "out")
    assert_fails(result, 1, ckpt(run_copy, 20) / MANIFEST, "layers.safetensors is not listed")
    assert not (tmp_path / "out").exists()


def test_a_lost_layer_source_is_a_damaged_run_never_the_base_models_layer(run_copy, tmp_path):
    """Step 20 holds layer 1's only trained copy; step 30's manifest records it as that layer's
    source. With step 20 gone, every reader says which layer is lost and where it was, rather than
    composing the base model's layer 1; a resume falls back to step 10, which trained nothing after it."""
    shutil.rmtree(ckpt(run_copy, 20))
    lost = ("layer 1", "step-00000020", "is missing")
    assert_fails(invoke("verify", run_copy), 1, *lost)
    assert_fails(invoke("verify", ckpt(run_copy, 30)), 1, *lost)
    assert_fails(invoke("export", run_copy, "--out", tmp_path / "a"), 1, *lost)
    assert_fails(invoke("export", ckpt(run_copy, 30), "--out", tmp_path / "b"), 1, *lost)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    report = json.loads(invoke("inspect", run_copy, "--json").output)
    assert [p["status"] for p in report["phases"]][:2] == ["done", "lost: layer 1 (step-00000020 is gone)"]
    assert not next(c for c in report["checkpoints"] if c["step"] == 30)["complete"]
    assert "layer 1" in invoke("inspect", run_copy).output

    point = Checkpoints(run_copy).restore_point()
    assert point.path == ckpt(run_copy, 10) and "layer 1" in point.skipped[0][1]
    with pytest.raises(CheckpointError, match="a damaged run"):
        Checkpoints(run_copy).resume_point(ckpt(run_copy, 30))
    flip_byte(ckpt(run_copy, 10) / "head.safetensors")  # no older restore point holds every layer: exit 1, not step 0
    with pytest.raises(CheckpointError, match="no checkpoint holds every layer it trained: layer 1"):
        Checkpoints(run_copy).restore_point()


def test_a_layer_source_replaced_by_another_is_a_damaged_run(run_copy, tmp_path):
    """The record's checksum: a checkpoint at the recorded step whose layers file is another (a copy
    from another run, one written again) is not the layer's source either."""
    m = json.loads((ckpt(run_copy, 30) / MANIFEST).read_text())
    assert m["layer_sources"]["1"]["checkpoint"] == "step-00000020"
    m["layer_sources"]["1"]["sha256_chunked"] = "0" * 64
    (ckpt(run_copy, 30) / MANIFEST).write_text(json.dumps(m))
    assert_fails(invoke("export", run_copy, "--out", tmp_path / "a"), 1, "layer 1", "was replaced")


def test_checkpoints_without_the_record_compose_as_before(run_copy):
    """Run directories written before the record: by the newest checkpoint that holds each layer."""
    rewrite_manifests(run_copy, lambda d: d.pop("layer_sources", None))
    assert Checkpoints(run_copy).layer_sources(ckpt(run_copy, 30)) == {0: ckpt(run_copy, 30), 1: ckpt(run_copy, 20)}
    assert invoke("verify", run_copy).exit_code == 0
