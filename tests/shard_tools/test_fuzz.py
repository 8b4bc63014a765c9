"""Random damage to a committed checkpoint, seeded: every command ends with exit 0, 1 or 2 and a
message, no traceback, no hang, and nothing of the run changed by reading it.

Each case copies the tiny run and damages one of its checkpoints: bytes flipped, cut or added
(sometimes with the manifest's size and checksum updated to match, as a writer that lies would),
safetensors header entries rewritten, manifest fields deleted, of the wrong type, absurd, or file
names that leave the checkpoint, and files replaced by a directory, a symbolic link (to a copy, to
itself, to nothing), a FIFO or an empty file. The orchestrator's plain functions must skip the
damaged checkpoint, raising nothing but CheckpointError.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import struct
from pathlib import Path

import pytest

from shard_tools.digest import digest_fd
from shard_tools.errors import CheckpointError
from shard_tools.manifest import MANIFEST, verify_checkpoint
from shard_tools.store import Checkpoints
from tests.conftest import cli
from tests.shard_tools.conftest import invoke
from tests.trees import snapshot

CASES = 200
NAMES = ["../x", "/etc/passwd", "a/b", "..", ".", "", "../step-00000010/head.safetensors", "x\u0000y", "\\evil"]
VALUES = [None, "x", "", -1, 0, 1.5, True, False, [], {}, [1, "a"], {"a": 1}, 10 ** 30, -(10 ** 30), 2 ** 63,
          float("inf"), float("nan"), "../x", "/etc/passwd", "a/b", "F99", "float32", [[[[]]]]]
KINDS = ["directory", "symlink to a copy", "symlink loop", "dangling symlink", "fifo", "empty file"]


def _files(c: Path) -> list[Path]:
    return sorted(p for p in c.iterdir())


def _flip(rng: random.Random, path: Path) -> str:
    data = bytearray(path.read_bytes())
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return f"bits flipped in {path.name}"


def _truncate(rng: random.Random, path: Path) -> str:
    data = path.read_bytes()
    keep = rng.choice([0, 1, 7, 8, 9, rng.randrange(len(data) + 1)])
    path.write_bytes(data[:keep])
    return f"{path.name} cut to {keep} bytes"


def _extend(rng: random.Random, path: Path) -> str:
    extra = rng.randbytes(rng.choice([1, 8, 100]))
    with open(path, "ab") as f:
        f.write(extra)
    return f"{len(extra)} bytes added to {path.name}"


def _header(rng: random.Random, path: Path) -> str:
    """One entry of the safetensors header rewritten, the length prefix kept right."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    name = rng.choice(sorted(k for k in header if k != "__metadata__"))
    key = rng.choice(["dtype", "shape", "data_offsets", None, "__metadata__"])
    if key == "__metadata__":
        header["__metadata__"] = rng.choice([{"layers": "x"}, {"layers_prefix": 5}, {"layers": "0,99"}, [], None])
    elif key is None:
        header[name] = rng.choice(VALUES)
    else:
        header[name][key] = rng.choice(VALUES + [[0, 10 ** 12], [10, 0], [0], [2, 3], [1 << 40]])
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    return f"header of {path.name}: {name}.{key}"


def _json_paths(value, prefix=()) -> list[tuple]:
    paths = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            paths += _json_paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            paths += _json_paths(v, prefix + (i,))
    return paths


def _manifest(rng: random.Random, c: Path) -> str:
    path = c / MANIFEST
    m = json.loads(path.read_text())
    action = rng.choice(["delete", "set", "set", "rename"])
    if action == "rename":
        old = rng.choice(sorted(m["files"]))
        new = rng.choice(NAMES)
        m["files"][new] = m["files"].pop(old)
        what = f"files: {old} renamed {new!r}"
    else:
        where = rng.choice(_json_paths(m)[1:])
        parent = m
        for k in where[:-1]:
            parent = parent[k]
        if action == "delete":
            del parent[where[-1]]
        else:
            parent[where[-1]] = rng.choice(VALUES)
        what = f"{action} {'.'.join(map(str, where))}"
    path.write_text(json.dumps(m))
    return f"manifest: {what}"


def _kind(rng: random.Random, path: Path, elsewhere: Path) -> str:
    kind = rng.choice(KINDS)
    copy = elsewhere / path.name
    shutil.copy2(path, copy)
    path.unlink()
    if kind == "directory":
        path.mkdir()
        (path / "inside").write_bytes(copy.read_bytes())
    elif kind == "symlink to a copy":
        path.symlink_to(copy)
    elif kind == "symlink loop":
        path.symlink_to(path)
    elif kind == "dangling symlink":
        path.symlink_to(elsewhere / "nothing")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.touch()
    return f"{path.name} replaced by a {kind}"


def _rehash(c: Path, name: str) -> None:
    """The manifest made to vouch for the damaged file: what a lying writer would leave."""
    path = c / MANIFEST
    m = json.loads(path.read_text())
    fd = os.open(c / name, os.O_RDONLY)
    try:
        m["files"][name] = {"size": os.fstat(fd).st_size, "sha256_chunked": digest_fd(fd)}
    finally:
        os.close(fd)
    path.write_text(json.dumps(m))


def damage(rng: random.Random, c: Path, elsewhere: Path) -> str:
    files = [p for p in _files(c) if p.name != MANIFEST]
    what = rng.choice(["bytes", "header", "manifest", "kind"])
    if what == "manifest":
        return _manifest(rng, c)
    if what == "bytes":
        what = rng.choice(["flip", "truncate", "extend"])
    target = rng.choice(files + [c / MANIFEST])
    if what == "kind":
        return _kind(rng, target, elsewhere)
    if what == "header":
        target = rng.choice(files)
    said = {"flip": _flip, "truncate": _truncate, "extend": _extend, "header": _header}[what](rng, target)
    if target.name != MANIFEST and rng.random() < 0.5:
        _rehash(c, target.name)
        said += ", manifest updated to match"
    return said


def _clean(result, what: str) -> None:
    assert result.exit_code in (0, 1, 2), (what, result.exit_code, result.output, result.exception)
    # CliRunner turns an uncaught exception into exit 1 too; only a deliberate exit is a clean failure.
    assert result.exception is None or isinstance(result.exception, SystemExit), (what, repr(result.exception))
    assert "Traceback" not in result.output, (what, result.output)
    if result.exit_code:
        assert "shard-tools: " in result.stderr, (what, result.output)


def copied(source: Path, tmp: Path) -> tuple[Path, Path]:
    """A copy of ``source``'s checkpoints and journal to damage, in ``tmp``, and a folder outside it
    (for links out of the run)."""
    run, elsewhere = tmp / "run", tmp / "elsewhere"
    shutil.copytree(source / "checkpoints", run / "checkpoints")
    shutil.copy2(source / "journal.jsonl", run / "journal.jsonl")
    elsewhere.mkdir()
    return run, elsewhere


def read_cleanly(args: list, fifo: bool, what: str) -> None:
    """``shard-tools ARGS`` ends cleanly (``_clean``); where the damage is a FIFO, in a process of
    its own, since a regression would hang: one that a timeout ends."""
    if not fifo:
        _clean(invoke(*args), f"{what}: {args}")
        return
    r = cli("shard-tools", *map(str, args), timeout=60)
    assert r.returncode in (0, 1, 2) and "Traceback" not in r.stderr, (what, args, r.stderr)
    assert r.returncode == 0 or "shard-tools: " in r.stderr, (what, args, r.stderr)


@pytest.mark.parametrize("seed", range(CASES))
def test_damaged_checkpoint(seed, tiny_run, tmp_path):
    rng = random.Random(seed)
    run, elsewhere = copied(tiny_run, tmp_path)
    checkpoints = Checkpoints(run).all()
    target = rng.choice(checkpoints)
    what = f"seed {seed}: {target.name}: {damage(rng, target, elsewhere)}"
    before = snapshot(run)
    fifo = any(stat.S_ISFIFO(p.lstat().st_mode) for p in target.iterdir())

    for args in (["verify", run], ["verify", target], ["inspect", run], ["inspect", target],
                 ["inspect", "--json", run], ["inspect", "--json", target]):
        read_cleanly(args, fifo, what)
    other = next(c for c in checkpoints if c != target)
    _clean(invoke("diff", other, target), f"{what}: diff")
    exported = invoke("export", target, "--out", tmp_path / "out")
    _clean(exported, f"{what}: export")
    assert snapshot(run) == before, what

    faults = {c: verify_checkpoint(c) for c in checkpoints}
    assert all(not f for c, f in faults.items() if c != target), (what, faults)
    newest, manifest, skipped = Checkpoints(run).newest_whole()
    assert newest == max(c for c in checkpoints if not faults[c]), (what, newest, skipped)
    for c in checkpoints:
        try:
            Checkpoints(run).layer_sources(c)
        except CheckpointError:
            pass
    if faults[target]:
        assert exported.exit_code == 1, (what, exported.output)
