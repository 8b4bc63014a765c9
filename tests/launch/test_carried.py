"""The carried layers on the host (``launch.carried``): a chain of processes hands them on without
copying them, each maps what its predecessor holds and adds what it trained, and the memory goes
with the last process that holds it. Real processes, no phases: a second each."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from launch.carried import HostCarry

CHILD = """
import json, sys, torch
from launch.carried import HostCarry
host = HostCarry()
refs = json.loads(sys.stdin.readline())
got = host.adopt(refs)
# as a successor: its own layer goes to its device, another one it trained is added
mine = got.pop("layers.0.w").clone()
host.fresh = {"layers.2.w": mine * 3}
host.hold_later(got, torch.device("cpu"))
host.settle()
print(json.dumps({"sums": {n: float(t.sum()) for n, t in got.items()}, "refs": host.refs(got)}), flush=True)
sys.stdin.readline()  # until its successor has mapped them
"""


def test_a_chain_hands_the_carried_layers_on_without_a_copy(tmp_path):
    host = HostCarry()
    layers = {"layers.0.w": torch.full((1000,), 1.0), "layers.1.w": torch.arange(3000.0).view(30, 100)}
    held = host.hold(layers)
    assert all(torch.equal(held[n], layers[n]) for n in layers)
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdin.write(json.dumps(host.refs(held)) + "\n")
        child.stdin.flush()
        answer = json.loads(child.stdout.readline())
        assert answer["sums"] == {"layers.1.w": float(layers["layers.1.w"].sum()), "layers.2.w": 3000.0}
        by_name = {r["name"]: r for r in answer["refs"]}
        assert by_name["layers.1.w"]["pid"] == by_name["layers.2.w"]["pid"] == child.pid
        assert by_name["layers.1.w"]["fd"] != by_name["layers.2.w"]["fd"]  # adopted, and its own
        # The first process lets go; the third maps what the second holds: the first's segment too.
        host.release()
        del held
        third = HostCarry()
        got = third.adopt(answer["refs"])
        assert torch.equal(got["layers.1.w"], layers["layers.1.w"])
        assert torch.equal(got["layers.2.w"], torch.full((1000,), 3.0))
        # Written in place by nobody: a view a process changes is its own business, the others' is not.
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == 0
        assert torch.equal(got["layers.1.w"], layers["layers.1.w"])  # still there: the last holder maps it
        third.release()
    finally:
        child.kill()


def test_a_copy_under_way_is_waited_for_and_what_it_raised_is_raised():
    host = HostCarry()
    carried: dict[str, torch.Tensor] = {}
    host.fresh = {"a": torch.ones(10)}
    host.hold_later(carried, torch.device("cpu"))
    host.settle()
    assert torch.equal(carried["a"], torch.ones(10)) and host.fresh == {}
    assert host.refs(carried)[0]["name"] == "a"
    host.fresh = {"b": "not a tensor"}
    host.hold_later(carried, torch.device("cpu"))
    with pytest.raises(AttributeError):
        host.settle()
    assert host.copying is None  # raised once: nothing under way any more
