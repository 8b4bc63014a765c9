"""``orchestrator plan`` on random mutations of a valid schedule: keys deleted or added, values of the
wrong type, zero, negative, huge, non-finite, empty, unicode, paths to nowhere, a folder or a FIFO.

Every outcome is exit 0 or exit 2 with one message that names the schedule file (and so a key in
it) or the path at fault; never a traceback, never a hang, and nothing written. Seeded: a failure
names its seed and mutations, and reproduces with them.
"""

from __future__ import annotations

import copy
import os
import random
import tomllib
from pathlib import Path

import pytest
import tomli_w
from click.testing import CliRunner

from orchestrator.cli import main
from tests.conftest import ROOT

CASES_PER_SEED = 150
SEEDS = range(8)


def base_schedule(model: Path, data: Path) -> dict:
    """examples/tiny/schedule.toml on the test fixtures: the tiny model and token data."""
    raw = tomllib.loads((ROOT / "examples" / "tiny" / "schedule.toml").read_text())
    raw["run"]["output_dir"] = "run"
    raw["model"]["path"] = str(model)
    raw["data"].update(path=str(data), format="tokens", seq_len=16)
    return raw


def values(tmp: Path) -> list:
    return [0, -1, 1, 2**70, 10**30, -(10**30), 1.5, float("inf"), float("-inf"), float("nan"), "", "x" * 300,
            "ünï✓\u202e", True, False, [], {}, [1], [1, 2, 3], [0.9, 2.0], {"a": 1}, [{"steps": 1}],
            str(tmp / "nowhere"), str(tmp), str(tmp / "fifo"), str(tmp / "loop"), "../" * 40, "\u0000",
            "llama", "lisa", "slurm", "deepspeed", "bfloat16", "text"]


def locations(node, path=()) -> list[tuple]:
    """Every key path into the schedule, tables and lists alike."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in items:
        out.append((*path, k))
        out.extend(locations(v, (*path, k)))
    return out


def mutate(raw: dict, rng: random.Random, tmp: Path) -> str:
    """One random change, in place; returns what it did."""
    where = rng.choice(locations(raw))
    *parents, last = where
    parent = raw
    for p in parents:
        parent = parent[p]
    kind = rng.choice(["delete", "unknown", "value", "value", "value"])
    if kind == "delete":
        if isinstance(parent, list):
            parent.pop(last)
        else:
            del parent[last]
        return f"delete {where}"
    if kind == "unknown" and isinstance(parent, dict):
        key = rng.choice(["colour", "seqlen", "Lr", "ñ", "0"])
        parent[key] = rng.choice(values(tmp))
        return f"add {(*parents, key)} = {parent[key]!r}"
    parent[last] = rng.choice(values(tmp))
    return f"set {where} = {parent[last]!r}"


@pytest.fixture
def playground(tmp_path) -> Path:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    return tmp_path


@pytest.mark.parametrize("seed", SEEDS)
def test_random_mutations_of_a_schedule(seed, playground, tiny_model, tiny_data):
    rng = random.Random(seed)
    base = base_schedule(tiny_model, tiny_data)
    before = sorted(playground.rglob("*"))
    outcomes = {0: 0, 2: 0}
    for case in range(CASES_PER_SEED):
        raw = copy.deepcopy(base)
        done = [mutate(raw, rng, playground) for _ in range(rng.randint(1, 3))]
        sched = playground / "schedule.toml"
        try:
            sched.write_text(tomli_w.dumps(raw))
        except (ValueError, TypeError):
            continue  # not expressible in TOML (a NUL in a key, a list of mixed tables)
        r = CliRunner().invoke(main, ["plan", str(sched)])
        what = f"seed {seed} case {case}: {done}\n{r.output}"
        assert isinstance(r.exception, SystemExit) or r.exception is None, (what, r.exception)
        assert r.exit_code in (0, 2), what
        assert "Traceback" not in r.output, what
        if r.exit_code == 2:
            assert r.stderr.startswith("orchestrator: ") and r.stderr.endswith("\n"), what
            assert str(sched) in r.stderr or str(playground) in r.stderr or str(tiny_data) in r.stderr, what
        outcomes[r.exit_code] += 1
        sched.unlink()
        assert not (playground / "run").exists(), what
        assert sorted(playground.rglob("*")) == before, what
    assert outcomes[2] > 0
