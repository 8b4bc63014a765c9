"""``shard-tools inspect``: the phase table of a run, the tensors of a checkpoint, fast and without torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from shard_tools.history import read_journal
from shard_tools.checkpoint import write_checkpoint
from shard_tools.manifest import Manifest, read_manifest
from tests.conftest import ROOT, cli
from tests.shard_tools.conftest import ckpt, invoke

PHASES = 100


def test_run_phase_table(tiny_run):
    result = invoke("inspect", tiny_run, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(p["index"], p["start_step"], p["end_step"], p["layers"]) for p in report["phases"]] == [
        (0, 0, 10, [0]), (1, 10, 20, [1]), (2, 20, 30, [0])]
    done = {e["phase"]: e for e in read_journal(tiny_run) if e["event"] == "phase_done"}
    for p in report["phases"]:
        assert p["seconds"] == done[p["index"]]["seconds"]
        assert p["nproc"] == 1
        [c] = p["checkpoints"]
        assert c["name"] == f"step-{p['end_step']:08d}" and c["complete"]
        assert c["bytes"] == sum(f.stat().st_size for f in ckpt(tiny_run, p["end_step"]).glob("*.safetensors"))
    assert report["phases"][0]["switch_seconds"] is None
    for k in (1, 2):
        prev, cur = done[k - 1]["records"], done[k]["records"]
        ordinary = min(cur["step_seconds_median"], cur["first_step_seconds"])
        expected = cur["t_first_step_end"] - prev["t_last_step_end"] - ordinary
        assert report["phases"][k]["switch_seconds"] == pytest.approx(expected) and expected >= 0

    table = invoke("inspect", tiny_run)
    assert table.exit_code == 0, table.output
    assert "global steps" in table.stdout and "10-19" in table.stdout and "step-00000020" in table.stdout


def test_checkpoint_tensors(tiny_run):
    path = ckpt(tiny_run, 20)
    result = invoke("inspect", path, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    manifest = read_manifest(path)
    assert (report["head_step"], report["body_step"], report["world_size"]) == (20, 10, 1)
    assert report["versions"] == manifest.versions and report["layers"] == [1]
    groups = {"head.safetensors": "head", "layers.safetensors": "body", "state.safetensors": "state"}
    expected = {}
    for file, group in groups.items():
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                expected[(file, name)] = (group, list(t.shape), t.element_size() * t.numel())
    got = {(t["file"], t["name"]): (t["group"], t["shape"], t["bytes"]) for t in report["tensors"]}
    assert got == expected
    assert {t["dtype"] for t in report["tensors"] if t["group"] != "state"} == {"F32"}

    table = invoke("inspect", path)
    assert table.exit_code == 0, table.output
    assert "model.layers.1.mlp.down_proj.weight" in table.stdout and "body_step 10" in table.stdout
    # LISA's reset: phase 1's layer started fresh, the head from phase 0's last state (its end, step 10).
    started = report["extra"]["state_from"]
    assert {n: v for n, v in started.items() if not n.startswith("model.layers.")} == dict.fromkeys(
        ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"], "phase 0 step 10")
    assert {v for n, v in started.items() if n.startswith("model.layers.1.")} == {"fresh"} and len(started) == 12
    assert "optimizer state started from: phase 0 step 10: 3 tensors" in table.stdout
    assert "fresh: 9 tensors" in table.stdout


def test_inspect_and_verify_do_not_import_torch(tiny_run):
    code = (
        "import sys\n"
        "from shard_tools.cli import main\n"
        f"for args in (['inspect', {str(tiny_run)!r}], ['inspect', {str(tiny_run)!r}, '--json'],\n"
        f"             ['inspect', {str(ckpt(tiny_run, 30))!r}], ['verify', {str(tiny_run)!r}]):\n"
        "    main(args, standalone_mode=False)\n"
        "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'safetensors.torch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_shard_tools_imports_nothing_of_the_control_plane():
    # The format package is the lower layer: the journal's replay lives in it, for inspect and report alike.
    for path in sorted((ROOT / "shard_tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not {n.split(".")[0] for n in names} & {"orchestrator", "launch"}, (path.name, names)


def test_without_the_orchestrator_inspect_shows_the_phase_table(tiny_run):
    """Where only the format package is installed, and no process may be started: the same phases,
    statuses and switch overheads as with the control plane (the journal is replayed here)."""
    code = ("import json, subprocess, sys\n"
            "sys.modules['orchestrator'] = None  # as where only the format package is installed\n"
            "def refused(*a, **k):\n"
            "    raise AssertionError(f'inspect started a process: {a}')\n"
            "subprocess.Popen = subprocess.run = refused\n"
            "from shard_tools.cli import main\n"
            f"main(['inspect', {str(tiny_run)!r}, '--json'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    report = json.loads(r.stdout)
    assert [(p["index"], p["end_step"], p["layers"], p["status"]) for p in report["phases"]] == [
        (0, 10, [0], "done"), (1, 20, [1], "done"), (2, 30, [0], "done")]
    assert report["phases"] == json.loads(invoke("inspect", tiny_run, "--json").stdout)["phases"]
    assert report["last_event"] == "run_done" and report["events"] == len(read_journal(tiny_run))
    assert [p["switch_seconds"] is None for p in report["phases"]] == [True, False, False]


def _fake_run(root: Path, phases: int) -> Path:
    """A run as the orchestrator leaves it (journal, a small checkpoint per phase), without running one."""
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    events: list[dict] = [{"event": "run_started", "phases": phases, "total_steps": 2 * phases, "pid": 1, "time": 0.0}]
    for k in range(phases):
        start, end, layer = 2 * k, 2 * k + 2, k % 4
        t0 = 10.0 * k
        events.append({"event": "phase_started", "phase": k, "start_step": start, "end_step": end, "layers": [layer],
                       "nproc": 2, "pid": 100 + k, "restore": None, "time": t0})
        manifest = Manifest(global_step=end, phase=k, layers=[layer], phase_complete=True, head_step=end, body_step=2,
                            world_size=2, zero_stage=2, dtype="float32", files={}, versions={"relayer": "test"},
                            created=0.0, extra={"layers_attr": "model.layers"})
        path = write_checkpoint(
            run, manifest,
            {"head.safetensors": {"master/model.norm.weight": torch.full((4,), float(k))},
             "layers.safetensors": {f"model.layers.{layer}.w": torch.zeros(2, 2)},
             "state.safetensors": {"global_step": torch.tensor([end])}},
            {"layers.safetensors": {"layers": str(layer), "layers_prefix": "model.layers"}}).path
        events.append({"event": "checkpoint_committed", "step": end, "path": str(path), "time": t0 + 9})
        events.append({"event": "phase_done", "phase": k, "step": end, "layers": [layer], "nproc": 2, "seconds": 9.0,
                       "records": {"t_process_start": t0 + 1, "t_first_step_end": t0 + 3, "t_last_step_end": t0 + 8,
                                   "step_seconds_median": 0.5, "memory_peak": 1 << 30},
                       "time": t0 + 9})
    events.append({"event": "run_done", "step": 2 * phases, "time": 10.0 * phases})
    (run / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> Path:
    return _fake_run(tmp_path_factory.mktemp("long"), PHASES)


def test_long_run_table(long_run):
    report = json.loads(invoke("inspect", long_run, "--json").stdout)
    assert len(report["phases"]) == PHASES
    last = report["phases"][-1]
    assert (last["index"], last["start_step"], last["end_step"], last["layers"]) == (
        PHASES - 1, 2 * PHASES - 2, 2 * PHASES, [(PHASES - 1) % 4])
    # The next phase's first step ends 10 - 8 + 3 = 5 s after this one's last, less a 0.5 s step.
    assert [p["switch_seconds"] for p in report["phases"][1:]] == [pytest.approx(4.5)] * (PHASES - 1)
    assert all(len(p["checkpoints"]) == 1 and p["checkpoints"][0]["complete"] for p in report["phases"])


@pytest.mark.parametrize("args", [[], ["--json"]])
def test_long_run_answers_without_reading_a_checksum(long_run, args, monkeypatch):
    """What keeps ``inspect`` of a long run quick on a run in training (a second or less from the
    shell on an idle machine, 2026-12-06: 0.6-0.9 s): it reads manifests and headers, never a whole
    file's checksum. A timing bound would fail on a loaded machine (CI's runs take up to 2.3 x), so
    the test checks the cause; the subprocess's time is only kept from hanging."""
    import shard_tools.manifest as manifest_module

    def no_checksums(*_):
        raise AssertionError("inspect read a checksum")

    monkeypatch.setattr(manifest_module, "digest_fd", no_checksums)
    assert f"step-{2 * PHASES:08d}" in invoke("inspect", long_run, *args).stdout
    t0 = time.perf_counter()
    r = cli("shard-tools", "inspect", str(long_run), *args, timeout=60)
    assert r.returncode == 0 and f"step-{2 * PHASES:08d}" in r.stdout, r.stderr
    assert time.perf_counter() - t0 < 30
