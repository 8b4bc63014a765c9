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
    apart = "transformer.h.0.attn.c_attn.weight"  # a trainable one: memory of its own
    Staging(torch.device("cuda", 0), slots=2, slot_bytes=4096).module_to_device(model, frozenset({apart}))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    assert all(torch.equal(model.state_dict()[n].cpu(), t) for n, t in before.items())
    # The rest in one block of device memory, each at a multiple of 256 bytes.
    storages = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    assert len({ptr for n, ptr in storages.items() if n != apart}) == 1 and storages[apart] not in set(
        ptr for n, ptr in storages.items() if n != apart)
    assert all(p.data_ptr() % 256 == 0 for p in model.parameters())


def test_registered_module_goes_to_the_device_by_dma_and_is_unpinned_after():
    import threading

    from launch.staging import Staging
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=16))
    model.transformer.h[0].attn.c_attn.weight.data = model.transformer.h[0].attn.c_attn.weight.data.bfloat16()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    staging = Staging(torch.device("cuda", 0), slots=2, slot_bytes=4096)
    assert staging.register_module(model)
    buf = staging.registered
    # Every weight now lives in the one registered buffer, tied ones once, values unchanged.
    assert model.lm_head.weight is model.transformer.wte.weight
    for t in model.state_dict().values():
        assert buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.nbytes
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())
    with torch.no_grad():
        model.transformer.wte.weight.add_(1.0)  # written after registering (the early read does): still copied
    staging.module_to_device(model)
    torch.cuda.synchronize()
    assert all(t.device.type == "cuda" for t in model.state_dict().values())
    assert torch.equal(model.lm_head.weight.cpu(), before["lm_head.weight"] + 1.0)
    assert all(torch.equal(model.state_dict()[n].cpu(), t) for n, t in before.items() if "wte" not in n and "lm_head" not in n)
    staging.unregister_later()
    assert staging.registered is None
    for t in threading.enumerate():
        if t.name == "unpin":
            t.join(10)
    assert torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()) != 0  # already unpinned
