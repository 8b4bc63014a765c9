"""What a disk holds is untrusted input: manifests, file kinds, safetensors headers, journals, paths.

Every outcome is one message naming the file, exit 1 (a damaged checkpoint) or 2 (a bad argument),
never a traceback and never a hang; the orchestrator's plain functions skip what is damaged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest

from shard_tools.header import tensor_headers
from shard_tools.errors import CheckpointError
from shard_tools.manifest import MANIFEST
from shard_tools.store import Checkpoints
from tests.conftest import cli
from tests.shard_tools.conftest import assert_fails, ckpt, invoke

WRONG = {
    "global_step": "30", "phase": -1, "layers": 5, "phase_complete": "yes", "head_step": 1.5,
    "world_size": 0, "zero_stage": 7, "dtype": 32, "versions": {"torch": 2}, "created": None, "extra": [],
    "files": [], "format_version": 99,
}


def _edit(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("field", WRONG)
@pytest.mark.parametrize("command", ["verify", "inspect", "export"])
def test_manifest_field_of_the_wrong_type(field, command, run_copy, tmp_path):
    target = ckpt(run_copy, 30)
    _edit(target / MANIFEST, lambda m: m.update({field: WRONG[field]}))
    args = ["export", target, "--out", tmp_path / "out"] if command == "export" else [command, target]
    assert_fails(invoke(*args), 1, target / MANIFEST, field)
    found, _, skipped = Checkpoints(run_copy).newest_whole()
    assert found == ckpt(run_copy, 20) and field in skipped[0]


def test_manifest_step_matches_its_directory(run_copy):
    _edit(ckpt(run_copy, 30) / MANIFEST, lambda m: m.update(global_step=10 ** 9))
    assert_fails(invoke("verify", run_copy), 1, "global_step 1000000000, but the checkpoint is step-00000030")


@pytest.mark.parametrize("name", ["../step-00000020/head.safetensors", "/etc/passwd", "a/b", "..", ""])
def test_manifest_file_names_stay_in_their_checkpoint(name, run_copy):
    """A name pointing at step-20's file with its size and checksum verified whole before."""
    target = ckpt(run_copy, 30)
    step20 = json.loads((ckpt(run_copy, 20) / MANIFEST).read_text())["files"]["head.safetensors"]

    def rename(m):
        del m["files"]["head.safetensors"]
        m["files"][name] = step20

    _edit(target / MANIFEST, rename)
    assert_fails(invoke("verify", target), 1, target / MANIFEST, "not a plain file name")


def test_a_symlinked_file_is_not_followed(run_copy, tmp_path):
    """Same bytes elsewhere: the checksum would pass, but the checkpoint no longer holds its file."""
    head = ckpt(run_copy, 30) / "head.safetensors"
    shutil.move(head, tmp_path / "head.safetensors")
    head.symlink_to(tmp_path / "head.safetensors")
    assert_fails(invoke("verify", run_copy), 1, head, "a symbolic link, not a file")
    assert_fails(invoke("inspect", ckpt(run_copy, 30)), 1, head, "a symbolic link, not a file")
    assert Checkpoints(run_copy).newest_whole()[0] == ckpt(run_copy, 20)


@pytest.mark.parametrize("what", ["manifest", "head"])
@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_a_fifo_never_hangs(what, command, run_copy):
    target = ckpt(run_copy, 30)
    path = target / (MANIFEST if what == "manifest" else "head.safetensors")
    path.unlink()
    os.mkfifo(path)
    r = cli("shard-tools", command, str(target), timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"{path}: a FIFO, not a file" in r.stdout + r.stderr


def test_a_symlink_loop_in_a_checkpoint_is_skipped(run_copy):
    head = ckpt(run_copy, 30) / "head.safetensors"
    head.unlink()
    head.symlink_to(head)
    assert Checkpoints(run_copy).newest_whole()[0] == ckpt(run_copy, 20)
    assert_fails(invoke("verify", run_copy), 1, head, "a symbolic link, not a file")


@pytest.mark.parametrize("command", ["inspect", "verify", "diff", "export"])
def test_a_symlink_loop_as_an_argument(command, tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    args = {"diff": ["diff", loop, loop], "export": ["export", loop, "--out", tmp_path / "out"]}.get(command,
                                                                                                    [command, loop])
    assert_fails(invoke(*args), 2, loop, "symbolic link loop")


def test_stray_temporary_that_is_a_link_goes_as_a_link(run_copy, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep\n")
    (run_copy / "checkpoints" / ".tmp-step-00000040.999999").symlink_to(elsewhere)
    assert len(Checkpoints(run_copy).remove_stray_temporaries()) == 1
    assert (elsewhere / "precious").read_text() == "keep\n"
    assert not list((run_copy / "checkpoints").glob(".tmp-*"))


def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _f32(shape, offsets) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": offsets}


BAD_HEADERS = {
    "unknown dtype": ({"t": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, 8, "unknown dtype"),
    "shape and span differ": ({"t": _f32([4], [0, 8])}, 8, "its data_offsets span 8"),
    "start after end": ({"t": _f32([0], [8, 0])}, 8, "not [start, end]"),
    "negative dimension": ({"t": _f32([-2], [0, 8])}, 8, "not a list of integers"),
    "gap": ({"a": _f32([1], [0, 4]), "b": _f32([1], [8, 12])}, 12, "a gap or an overlap"),
    "overlap": ({"a": _f32([2], [0, 8]), "b": _f32([1], [4, 8])}, 8, "a gap or an overlap"),
    "past the end": ({"t": _f32([4], [0, 16])}, 8, "truncated"),
    "bytes after the data": ({"t": _f32([2], [0, 8])}, 12, "4 bytes after the last tensor"),
    "metadata of numbers": ({"__metadata__": {"n": 1}, "t": _f32([2], [0, 8])}, 8, "__metadata__"),
    "entry not an object": ({"t": [1, 2]}, 8, "not {dtype, shape, data_offsets}"),
    "huge shape": ({"t": _f32([2 ** 62, 2 ** 62], [0, 8])}, 8, "its data_offsets span 8"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_tensor_headers_refuses_what_safetensors_would(case, tmp_path):
    header, size, fragment = BAD_HEADERS[case]
    path = _safetensors(tmp_path / "x.safetensors", header, bytes(size))
    with pytest.raises(CheckpointError, match=f"{re.escape(str(path))}: .*{re.escape(fragment)}"):
        tensor_headers(path)


@pytest.mark.timeout(30)
def test_tensor_headers_file_kinds(tmp_path):
    good = _safetensors(tmp_path / "good.safetensors", {"a": _f32([2], [0, 8]), "b": _f32([], [8, 12])}, bytes(12))
    assert set(tensor_headers(good)[0]) == {"a", "b"}
    link = tmp_path / "link.safetensors"
    link.symlink_to(good)  # a hub cache snapshot is links into its blobs
    assert set(tensor_headers(link)[0]) == {"a", "b"}
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    folder = tmp_path / "dir.safetensors"
    folder.mkdir()
    for path, fragment in ((fifo, "a FIFO, not a file"), (loop, "a symbolic link loop"),
                           (folder, "a directory, not a file"), (tmp_path / "none", "missing")):
        with pytest.raises(CheckpointError, match=re.escape(f"{path}: {fragment}")):
            tensor_headers(path)


JOURNAL_LINES = [
    b'{"event": "phase_done", "phase": 0, "step": "ten", "seconds": "slow", "records": [1]}\n',
    b'{"event": "phase_started", "phase": 1, "start_step": "x", "end_step": {}, "layers": "all", "nproc": 1.5}\n',
    b'{"event": "phase_done", "phase": 1, "records": {"memory_peak": "lots", "t_first_step_end": null}}\n',
    b'{"phase": 2}\n[1, 2]\n"text"\n{"event": 7, "phase": 2}\n',
    b'\xff\xfe not utf-8 \x80\n',
    b'{"event": "phase_started", "phase": true}\n',
]


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_journal_lines_that_are_not_events(json_flag, run_copy):
    with open(run_copy / "journal.jsonl", "ab") as f:
        f.writelines(JOURNAL_LINES)
    result = invoke("inspect", run_copy, *json_flag)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "Traceback" not in result.output


def test_journal_that_is_a_fifo(run_copy):
    (run_copy / "journal.jsonl").unlink()
    os.mkfifo(run_copy / "journal.jsonl")
    r = cli("shard-tools", "inspect", str(run_copy), timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "journal.jsonl: a FIFO, not a file" in r.stderr
