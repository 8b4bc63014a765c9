"""The host path's pieces without a run (launch/hostpath.py): the fp32 state written to a file and
mapped back bit for bit, and the walk that finds an optimizer's tensors to let go of."""

from __future__ import annotations

import time

import torch

from launch import hostpath
from launch.contract import devmem
from launch.contract.files import Carried, Offer
from launch.master_adamw import MasterAdamW


def test_the_state_goes_through_the_file_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"master/a.weight": torch.randn(3, 5, generator=g), "exp_avg/a.weight": torch.randn(3, 5, generator=g),
               "master/b": torch.randn(7, generator=g), "exp_avg_sq/a.weight": torch.rand(3, 5, generator=g),
               "master/t": torch.randn(4, 2, generator=g).t()}  # not contiguous
    blob = tmp_path / "rank-0.bin"
    blocks, refs = hostpath.export(tensors, blob, None)
    assert blob.stat().st_mode & 0o777 == 0o600
    assert all(b["offset"] % hostpath.ALIGN == 0 for b in blocks)
    carried = Carried(phase=0, global_step=1, layers=[0], head_step=1, body_step=1, scaler={}, restore=None,
                      end="step-00000001")
    offer = Offer(pid=1, device="host", transport="shm", blocks=blocks, tensors=refs, carried=carried)
    parts = hostpath.map_blob(offer, blob)
    back = {f"{k}/{n}": t for k, by_name in parts.items() for n, t in by_name.items()}
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    # Copy-on-write: what the reader changes stays its own, the file keeps the offered bytes.
    parts["master"]["b"].zero_()
    again = hostpath.map_blob(offer, blob)
    assert torch.equal(again["master"]["b"], tensors["master/b"])


def test_the_file_made_ahead_takes_the_offer_and_one_too_small_does_not(tmp_path):
    """``hostpath.prepare``'s file (``make_blob``: sized, 0600, its pages in memory) is what ``export``
    writes into where it holds the offer; where it does not, ``export`` makes the file again."""
    tensors = {"master/a": torch.arange(10.0), "exp_avg/a": torch.ones(3, 4)}
    blob = tmp_path / "rank-0.bin"
    ahead = hostpath.make_blob(blob, 4096)
    assert blob.stat().st_size == 4096 and blob.stat().st_mode & 0o777 == 0o600
    blocks, refs = hostpath.export(tensors, blob, None, ahead)
    assert blob.stat().st_size == 4096  # written into the file made ahead, not made again
    assert torch.equal(ahead[:40].view(torch.float32), tensors["master/a"])
    offer = Offer(pid=1, device="host", transport="shm", blocks=blocks, tensors=refs,
                  carried=Carried(phase=0, global_step=1, layers=[0], head_step=1, body_step=1, scaler={},
                                  restore=None, end="step-00000001"))
    assert torch.equal(hostpath.map_blob(offer, blob)["exp_avg"]["a"], tensors["exp_avg/a"])
    small = hostpath.make_blob(blob, 8)
    blocks, _ = hostpath.export(tensors, blob, None, small)
    assert blob.stat().st_size == blocks[-1]["offset"] + blocks[-1]["size"]  # too small: a file of its own


def test_without_nvml_no_process_holds_the_device():
    """``devmem.Listing`` (what a successor under a budget asks before its first step) on a machine
    without NVML: no process is listed, so the wait ends when the process has exited."""
    listing = devmem.Listing()
    try:
        assert listing(1) is False
    finally:
        listing.close()
    listing.close()  # twice: nothing left to close


def test_every_tensor_of_the_optimizer_is_found():
    model = torch.nn.Linear(4, 3)
    opt = MasterAdamW([{"params": list(model.parameters())}], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                      weight_decay=0.0, grad_clip=1.0, device=torch.device("cpu"))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    found = {id(t) for t in hostpath._tensors(opt)}
    assert {id(opt.master), id(opt.moments)} <= found
    inner_state = [t for s in opt.inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert inner_state and all(id(t) in found for t in inner_state)


def test_release_lets_the_block_of_frozen_weights_go():
    """A module's frozen weights and its buffers lie in one block (``staging.module_to_device``);
    a buffer left pointing into it kept the whole block (12.1 GB at 7B) on the device."""
    from types import SimpleNamespace

    from launch.staging import one_block

    model = torch.nn.Linear(4, 3)
    model.register_buffer("inv_freq", torch.arange(4.0))
    views = one_block([model.weight.data, model.bias.data, model.inv_freq], torch.device("cpu"))
    model.weight.data, model.bias.data = views[0], views[1]
    model._buffers["inv_freq"] = views[2]
    block = views[0].untyped_storage().data_ptr()
    del views

    def in_block() -> list[torch.Tensor]:
        return [t for t in (*model.parameters(), *model.buffers()) if t.untyped_storage().data_ptr() == block]

    assert len(in_block()) == 3
    ph = SimpleNamespace(device=torch.device("cpu"), made=SimpleNamespace(carried={}),
                         built=SimpleNamespace(engine=SimpleNamespace(module=model, optimizer=SimpleNamespace())))
    hostpath.release_device(ph)
    assert in_block() == []


RELEASED = """
import gc, os, sys
from types import SimpleNamespace
import deepspeed, torch
from transformers import LlamaConfig, LlamaForCausalLM
from launch import hostpath
from launch.engine import ZeroBackend
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4)).to(torch.bfloat16)
for n, p in model.named_parameters():
    p.requires_grad_("layers.1." in n or "embed" in n)
spec = SimpleNamespace(data=SimpleNamespace(batch_size=2, micro_batch_size=2), zero_stage=2, model=SimpleNamespace(dtype="bfloat16"),
                       optimizer=SimpleNamespace(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, grad_clip=1.0),
                       deepspeed_config={"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
backend, trained = ZeroBackend(2), [p for p in model.parameters() if p.requires_grad]
engine = backend.initialize(model, backend.optimizer([{"params": trained}], spec, torch.device("cpu"), 1),
                            backend.config(spec, 1, sum(p.numel() for p in trained)))
x = torch.randint(0, 1000, (2, 16))
engine.backward(engine(input_ids=x, labels=x).loss)
engine.step()
def left():
    gc.collect()
    return [t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.numel() >= 20000]
assert left(), "the 16-bit weights are there before"
hostpath.release_device(SimpleNamespace(device=torch.device("cpu"), built=SimpleNamespace(engine=engine),
                                        made=SimpleNamespace(carried={})))
print(len(left()))
"""


def test_release_lets_zeros_links_to_the_16_bit_block_go():
    """ZeRO 1-2 link each parameter to its partitions (``_hp_mapping``), and the link holds a view of
    the trainable weights' 16-bit flat block (on a GPU, 1.2 GiB at 7B): after ``release_device`` no
    16-bit weight of the engine is left (a real ZeRO-2 engine with the optimizer on the host, in a
    process of its own)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_PORT": str(port)}
    r = subprocess.run([sys.executable, "-c", RELEASED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "0", r.stdout


def test_under_a_budget_the_successor_waits_for_its_predecessor_to_be_gone():
    """``release_device`` does not give all of a finished phase's device memory back; its exit does.
    An exited process not yet reaped (a zombie) counts as gone; one that stays is waited for no longer
    than the timeout."""
    import subprocess

    short = subprocess.Popen(["sleep", "0.3"])
    try:
        waited = hostpath.wait_gone(short.pid, timeout=10)  # not reaped here: a zombie once it exits
        assert waited is not None and 0.2 < waited < 9
    finally:
        short.wait()
    long = subprocess.Popen(["sleep", "30"])
    try:
        assert hostpath.wait_gone(long.pid, timeout=0.3) is None
    finally:
        long.kill()
        long.wait()


def test_an_exited_predecessor_is_waited_for_until_the_driver_lets_its_memory_go():
    """An exited process holds its device memory until the driver has torn its context down (on an
    H100 0.3-0.5 s after its exit): the successor waits until NVML lists it no more. Here NVML's list
    is a stand-in that drops the pid 0.4 s after its exit; without NVML nothing is listed."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    until = time.monotonic() + 0.4
    waited = hostpath.wait_gone(gone.pid, timeout=10, holds=lambda pid: time.monotonic() < until)
    assert waited is not None and 0.35 < waited < 5
    assert hostpath.wait_gone(gone.pid, timeout=0.3, holds=lambda pid: True) is None
    with devmem.holders() as holds:  # this machine: no NVML, or not listed
        assert holds(gone.pid) is False and holds(gone.pid) is False  # one session, asked twice


def test_a_full_shared_memory_is_an_error_not_a_sigbus(tmp_path):
    """``make_blob`` on a tmpfs too small for the offer: None (its pages could not be populated), and
    ``export`` then says which file and how many bytes, where the copy into a file mapped over pages
    the tmpfs cannot give would have died of SIGBUS. A 1 MiB tmpfs of its own (root only)."""
    import subprocess

    import pytest

    small = tmp_path / "shm"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        assert hostpath.make_blob(small / "blob", 4 << 20) is None
        with pytest.raises(OSError, match="cannot make 4194304 bytes in shared memory"):
            hostpath.export({"master/a": torch.ones(1 << 20)}, small / "blob", None)
    finally:
        subprocess.run(["umount", str(small)], check=True)
