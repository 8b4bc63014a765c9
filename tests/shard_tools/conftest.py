"""Helpers for the shard-tools tests: the CLI in-process, copies of the tiny run to damage, damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from shard_tools.cli import main
from shard_tools.manifest import MANIFEST


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_fails(result: Result, code: int, *fragments: str | Path) -> None:
    """Exit ``code`` with one ``shard-tools:`` message holding every fragment, and no traceback."""
    assert result.exit_code == code, (result.output, result.exception)
    # CliRunner turns an uncaught exception into exit 1 too; only a deliberate exit is a clean failure.
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert "shard-tools: " in result.stderr
    for fragment in fragments:
        assert str(fragment) in result.output, (fragment, result.output)


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A copy of the tiny run that a test may damage."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def rewrite_manifests(run: Path, edit) -> None:
    """Applies ``edit(dict)`` to every manifest of a run (the manifest is not among its own checksums)."""
    for m in (run / "checkpoints").glob(f"step-*/{MANIFEST}"):
        data = json.loads(m.read_text())
        edit(data)
        m.write_text(json.dumps(data))
