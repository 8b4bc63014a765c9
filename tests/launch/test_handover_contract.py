"""The handover's files in a phase directory (launch.contract): offers and answers round trip,
the first answer stands, they are private to the owner, and the go names the offering phase."""

import itertools
import json
import stat

import pytest
from pydantic import ValidationError

from launch.contract.cadence import end_writes
from launch.contract.channels import GO
from launch.contract.files import Answer, Carried, Offer, PhaseDir, TensorRef


def offer(pid: int = 42) -> Offer:
    refs = [TensorRef(name="master/lm_head.weight", block=0, dtype="float32", shape=[96, 32], stride=[32, 1],
                      offset=0),
            TensorRef(name="exp_avg/lm_head.weight", block=0, dtype="bfloat16", shape=[96, 32], stride=[1, 96],
                      offset=3072)]
    return Offer(pid=pid, device="GPU-0f1e", transport="cuda",
                 blocks=[{"device": 0, "handle": "aGFuZGxl", "size": 18432, "offset": 0, "event_sync": True}],
                 tensors=refs, carried=Carried(phase=0, global_step=10, layers=[0], head_step=10, body_step=10,
                                               scaler={"cur_scale": 65536.0}, restore=None,
                                               end="/runs/a/checkpoints/step-00000010"))


def test_offer_round_trips_and_is_private(tmp_path):
    d = PhaseDir(tmp_path / "phase-0001")
    d.path.mkdir()
    assert d.read_offer(0) is None
    d.write_offer(0, offer())
    assert d.read_offer(0) == offer()
    assert d.offer_path(0) == d.handover / "offer-rank-0.json"
    assert stat.S_IMODE(d.offer_path(0).stat().st_mode) == 0o600
    assert stat.S_IMODE(d.handover.stat().st_mode) == 0o700
    assert [p.name for p in d.handover.iterdir()] == ["offer-rank-0.json"]  # no temporary left


def test_a_torn_or_foreign_offer_reads_as_none(tmp_path):
    d = PhaseDir(tmp_path)
    d.write_offer(0, offer())
    text = d.offer_path(0).read_text()
    d.offer_path(0).write_text(text[: len(text) // 2])
    assert d.read_offer(0) is None
    d.offer_path(0).write_text(json.dumps({**json.loads(text), "transport": "nccl"}))
    assert d.read_offer(0) is None


def test_offered_needs_every_rank(tmp_path):
    d = PhaseDir(tmp_path)
    assert not d.offered(2)
    d.write_offer(1, offer())
    assert not d.offered(2)
    d.write_offer(0, offer())
    assert d.offered(2) and d.offered(1)


def test_the_first_answer_stands(tmp_path):
    d = PhaseDir(tmp_path)
    assert d.read_answer(0) is None
    assert d.write_answer(0, Answer(taken=True, by="successor"))
    assert not d.write_answer(0, Answer(taken=False, by="orchestrator", reason="the successor ended"))
    assert d.read_answer(0) == Answer(taken=True, by="successor")
    assert d.write_answer(1, Answer(taken=False, by="orchestrator", reason="stopped"))
    assert d.read_answer(1).reason == "stopped"
    assert stat.S_IMODE(d.answer_path(0).stat().st_mode) == 0o600
    assert sorted(p.name for p in d.handover.iterdir()) == ["answer-rank-0.json", "answer-rank-1.json"]


def test_an_answer_names_who_gave_it():
    with pytest.raises(ValidationError):
        Answer(taken=True, by="someone")
    with pytest.raises(ValidationError):
        Answer(taken="yes", by="successor")  # strict: no coercion


def test_the_go_names_the_offering_phase(tmp_path):
    record = GO.encode(restore=str(tmp_path / "checkpoints" / "step-00000010"), handover=str(tmp_path / "phase-0000"), defer=False)
    assert len(record) == 4096
    assert GO.decode(record) == {"restore": str(tmp_path / "checkpoints" / "step-00000010"),
                                 "handover": str(tmp_path / "phase-0000"), "defer": False}
    assert GO.decode(GO.encode(restore=None, handover=None, defer=True)) == {"restore": None, "handover": None, "defer": True}
    with pytest.raises(ValueError):
        GO.encode(restore=None)  # the key is always there: None where there is no handover


def test_clear_removes_an_earlier_attempts_handover(tmp_path):
    d = PhaseDir(tmp_path)
    d.write_offer(0, offer())
    d.write_answer(0, Answer(taken=False, by="orchestrator"))
    d.blob_path(0).write_bytes(b"\0" * 64)
    d.clear()
    assert not d.handover.exists()


@pytest.mark.parametrize("answer, written", [
    (None, True),  # offered to no successor, or never answered
    (Answer(taken=True, by="successor", write=False), False),  # taken and carried on (checkpoint.every_seconds)
    (Answer(taken=True, by="successor"), True),
    (Answer(taken=False, by="orchestrator", write=False), True),
])
def test_rank_0s_answer_says_whether_the_phase_end_was_written(tmp_path, answer, written):
    d = PhaseDir(tmp_path)
    if answer is not None:
        d.write_answer(0, answer)
    d.write_answer(1, Answer(taken=True, by="successor", write=not written))  # ranks are answered alike
    assert d.end_written() is written


def test_an_end_writes_unless_none_is_due_and_its_successor_takes_and_carries_it_on():
    skips = [(due, takes, carries) for due, takes, carries in itertools.product([False, True], repeat=3)
             if not end_writes(due=due, takes=takes, carries=carries)]
    assert skips == [(False, True, True)]
