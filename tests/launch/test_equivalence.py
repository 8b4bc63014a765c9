"""The orchestrated run equals an independent plain-PyTorch LISA reference.

Sensitivity of the setup (tiny Llama, lr 1e-3, 30 steps, fp32), measured by
``test_setup_is_not_chaotic``: scaling every gradient by 1 + 1e-6 moves the final weights by
~1e-9..1e-8 (1.3e-6 on an AMD EPYC with AVX2 kernels, CI's machine of 2026-12-07), while the
wrong semantics (body state carried over, head state reset) move them by ~1e-4 or more. So a 1e-5
tolerance separates "same algorithm, other summation order" from "wrong".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shard_tools.manifest import read_manifest
from shard_tools.store import Checkpoints
from tests.conftest import alive, cli, schedule_dict, write_schedule
from tests.reference import composed, max_abs_diff, reference_run

PHASES = [(10, [0]), (10, [1]), (10, [0])]
TOL = 1e-5

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_data) -> dict[str, torch.Tensor]:
    return reference_run(tiny_model, tiny_data, PHASES)


def test_setup_is_not_chaotic(tiny_model, tiny_data, reference):
    nudged = reference_run(tiny_model, tiny_data, PHASES, grad_scale=1 + 1e-6)
    assert max_abs_diff(reference, nudged) < TOL / 4  # 1.3e-6 on CI's AMD EPYC (AVX2) of 2026-12-07


def test_wrong_semantics_would_fail(tiny_model, tiny_data, reference):
    """The tolerance catches both ways of getting LISA's state wrong."""
    carried = reference_run(tiny_model, tiny_data, PHASES, carry_body=True)
    reset = reference_run(tiny_model, tiny_data, PHASES, reset_head=True)
    assert max_abs_diff(reference, carried) > 10 * TOL
    assert max_abs_diff(reference, reset) > 10 * TOL


@pytest.mark.smoke  # make test-fast: the shared tiny run against the reference
def test_one_process_matches_reference(tiny_run, tiny_model, reference):
    assert max_abs_diff(reference, composed(tiny_model, tiny_run)) <= TOL


@pytest.mark.smoke  # make test-fast: the shared tiny run against the reference
def test_step_counters_and_layer_history(tiny_run, tiny_model):
    ckpts = {read_manifest(c).global_step: c for c in Checkpoints(tiny_run).all()}
    assert sorted(ckpts) == [10, 20, 30]
    last = read_manifest(ckpts[30])
    assert (last.head_step, last.body_step, last.phase, last.layers) == (30, 10, 2, [0])
    assert [read_manifest(ckpts[s]).head_step for s in (10, 20)] == [10, 20]
    base = {n: t for n, t in AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters()}
    at = {s: composed(tiny_model, tiny_run, ckpts[s]) for s in (10, 20, 30)}

    def layer(w, i):
        return {n: t for n, t in w.items() if n.startswith(f"model.layers.{i}.")}

    def same(a, b):
        return all(torch.equal(a[n], b[n]) for n in a)

    # Layer 1 changed in phase 1 (steps 10-19) only.
    assert same(layer(at[10], 1), layer(base, 1))
    assert not same(layer(at[20], 1), layer(base, 1))
    assert same(layer(at[30], 1), layer(at[20], 1))
    # Layer 0's phase-0 weights carried through phase 1 and into phase 2, which moved them on.
    assert not same(layer(at[10], 0), layer(base, 0))
    assert same(layer(at[20], 0), layer(at[10], 0))
    assert not same(layer(at[30], 0), layer(at[10], 0))
    # Untouched layers are the base model's.
    assert same(layer(at[30], 2), layer(base, 2)) and same(layer(at[30], 3), layer(base, 3))


@pytest.mark.smoke  # make test-fast: the shared tiny run against the reference
def test_each_phase_its_own_process_and_none_survives(tiny_run):
    events = [json.loads(line) for line in (tiny_run / "journal.jsonl").read_text().splitlines()]
    phases = [e for e in events if e["event"] == "phase_started"]
    assert [e["phase"] for e in phases] == [0, 1, 2]
    rank_pids = []
    for i in range(3):
        rec = json.loads((tiny_run / "phases" / f"phase-{i:04d}" / "pids" / "rank-0.json").read_text())
        rank_pids.append(rec["pid"])
        assert not alive(rec), f"phase {i}'s worker {rec['pid']} is still alive"
    assert len(set(rank_pids)) == 3


@pytest.mark.parametrize("launcher", ["deepspeed", "local"])
def test_two_processes_match_reference(tmp_path, tiny_model, tiny_data, reference, launcher):
    """Two ranks started by the deepspeed runner, or ("local") forked by the run's fork server. The
    runner's run takes the first two phases (one switch; each of its phases starts the runner and
    each rank cold, some 8 s of CPU here), against their own reference; the fork server's the three."""
    phases = PHASES if launcher == "local" else PHASES[:2]
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(
        tiny_model, tiny_data, launch={"launcher": launcher, "nproc": 2},
        schedule={"phases": [{"steps": steps, "layers": layers} for steps, layers in phases]}))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    assert read_manifest(Checkpoints(run).newest_whole()[0]).world_size == 2
    forked = any(json.loads(x)["event"] == "zygote_started" for x in (run / "journal.jsonl").read_text().splitlines())
    assert forked == (launcher == "local")
    expected = reference if phases == PHASES else reference_run(tiny_model, tiny_data, phases)
    assert max_abs_diff(expected, composed(tiny_model, run)) <= TOL
    # DeepSpeed's CPU comm op never unlinks its shared-memory buffers (69 MB a process): none is left.
    ports = {json.loads(f.read_text())["master_port"] for f in run.glob("phases/*/spec.json")}
    left = [p for port in ports for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")]
    assert ports and not left


def test_stage_0_two_processes_handing_over_match_reference(tmp_path, tiny_model, tiny_data, reference):
    """relayer's own AdamW without ZeRO (``deepspeed.zero_stage = 0``, ``launch.master_adamw``):
    its reduction over two ranks, and its state handed from phase to phase (through the host
    here), as the reference; the checkpoints say stage 0."""
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(
        tiny_model, tiny_data, deepspeed={"zero_stage": 0}, launch={"nproc": 2, "handover": "on"}))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    taken = [json.loads((run / "phases" / f"phase-{i:04d}" / "records.json").read_text()).get("handover")
             for i in (1, 2)]
    assert taken == ["device", "device"]
    assert {read_manifest(c).zero_stage for c in Checkpoints(run).all()} == {0}
    assert max_abs_diff(reference, composed(tiny_model, run)) <= TOL


def test_what_makes_7b_fit_a_small_card_matches_reference(tmp_path, tiny_model, tiny_data, reference):
    """Issue #42's options in one run: gradient checkpointing (the same forward computed again),
    micro-batches of 1 accumulated into the same batch (another summation order), and the
    optimizer's state on the host under ZeRO 2 (torch's AdamW stepping the fp32 partitions there):
    each within the tolerance of fp32 with another summation order."""
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(
        tiny_model, tiny_data, model={"gradient_checkpointing": True}, data={"micro_batch_size": 1},
        deepspeed={"zero_stage": 2, "config": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}}))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    spec = json.loads((tmp_path / "run" / "phases" / "phase-0000" / "spec.json").read_text())
    assert spec["model"]["gradient_checkpointing"] and spec["data"]["micro_batch_size"] == 1
    assert spec["deepspeed_config"]["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert max_abs_diff(reference, composed(tiny_model, tmp_path / "run")) <= TOL
    # The pre-warmed phases' engines took every buffer DeepSpeed pins from the host memory they
    # set aside while they waited (launch.pinned; on a GPU pinned then, not at the go).
    for i in (1, 2):
        records = json.loads((tmp_path / "run" / "phases" / f"phase-{i:04d}" / "records.json").read_text())
        ahead = records["pinned_ahead"]
        assert ahead["served"] >= 4 and ahead["missed"] == 0 and 0 < ahead["used"] <= ahead["bytes"], ahead


MASKED_PHASES = [(5, [0]), (5, [1])]


@pytest.fixture(scope="module")
def masked_data(tmp_path_factory) -> Path:
    """Rows of 6..16 tokens whose labels mask a prompt of 1..10 tokens and a few tokens more, so
    micro-batches hold very different numbers of target tokens."""
    import random

    rng = random.Random(1)
    out = tmp_path_factory.mktemp("masked") / "train.jsonl"
    with open(out, "w") as f:
        for _ in range(48):
            n = rng.randrange(6, 17)
            start = rng.randrange(96)
            ids = [(start + 3 * i) % 96 for i in range(n)]
            prompt = rng.randrange(1, n - 4)
            labels = [-100 if i < prompt or rng.random() < 0.2 else t for i, t in enumerate(ids)]
            f.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
    return out


MASKED_LOSSES: list[float] = []


@pytest.fixture(scope="module")
def masked_reference(tiny_model, masked_data) -> dict[str, torch.Tensor]:
    MASKED_LOSSES.clear()
    return reference_run(tiny_model, masked_data, MASKED_PHASES, micro=2, losses=MASKED_LOSSES)


def test_mean_of_micro_means_would_fail(tiny_model, masked_data, masked_reference):
    wrong = reference_run(tiny_model, masked_data, MASKED_PHASES, micro=2, mean_of_means=True)
    assert max_abs_diff(masked_reference, wrong) > 10 * TOL


@pytest.mark.parametrize("nproc,micro", [(1, 4), (2, 2)])
def test_labels_and_padding_match_reference(tmp_path, tiny_model, masked_data, masked_reference, nproc, micro):
    """The loss of a step is the mean over the target tokens of the whole global batch, whatever
    the micro-batch size and the process count."""
    phases = [{"steps": s, "layers": layers} for s, layers in MASKED_PHASES]
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(
        tiny_model, masked_data, data={"micro_batch_size": micro}, schedule={"phases": phases},
        launch={"nproc": nproc}))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    assert max_abs_diff(masked_reference, composed(tiny_model, tmp_path / "run")) <= TOL
    # The logged loss is the step's global token mean too.
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == list(range(1, 11))
    assert max(abs(m["loss"] - ref) for m, ref in zip(logged, MASKED_LOSSES)) <= TOL


def test_a_step_without_targets_is_a_zero_gradient(tmp_path, tiny_model):
    """Every label of a step's rows -100: the step still runs (an optimizer step on zero gradients,
    so Adam moves nothing), its loss is logged as 0.0 with target_tokens 0, and nothing divides by
    zero. (Data with no target token at all is refused before the run: tests/orchestrator/test_hostile_data.py.)"""
    data = tmp_path / "masked.jsonl"
    rows = [{"input_ids": [i % 96] * 16, "labels": [-100] * 16} for i in range(16)]  # the 2 steps' 16 rows
    rows += [{"input_ids": [i % 96] * 16, "labels": [i % 96] * 16} for i in range(8)]  # later rows learn
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(
        tiny_model, data, schedule={"phases": [{"steps": 2, "layers": [0]}]}))
    sched.write_text(sched.read_text().replace("[data]\n", "[data]\nshuffle = false\n", 1))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["loss"], m["target_tokens"]) for m in logged] == [(0.0, 0), (0.0, 0)]
    base = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(tiny_model).named_parameters()}
    assert max_abs_diff(base, composed(tiny_model, tmp_path / "run")) == 0.0
