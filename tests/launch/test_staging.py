"""The pinned staging ring (launch.staging): exact copies both ways. Needs CUDA (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact(dtype):
    from launch.staging import Staging

    staging = Staging(torch.device("cuda", 0), slots=3, slot_bytes=1 << 20)  # many turns of the ring
    host = [torch.randn(n, dtype=torch.float32).to(dtype) for n in (1, 1000, 3 << 20, (5 << 18) + 7)]
    on_device = [staging.to_device(t) for t in host]
    assert all(torch.equal(d.cpu(), h) for d, h in zip(on_device, host))
    # Work queued on the current stream right before: the copy back must see its result.
    doubled = [d * 2 for d in on_device]
    back = [torch.empty_like(h) for h in host]
    for d, b in zip(doubled, back):
        staging.to_host(d, b)
    assert all(torch.equal(b, h * 2) for b, h in zip(back, host))


def test_module_to_device_keeps_ties_and_buffers():
    from launch.staging import Staging
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16))
    before = {n: t.clone() for n, t in model.state_dict().items()}
    Staging(torch.device("cuda", 0), slots=2, slot_bytes=4096).module_to_device(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    assert all(torch.equal(model.state_dict()[n].cpu(), t) for n, t in before.items())
