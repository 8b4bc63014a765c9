"""The optimizer's state on the host (ZeRO 1/2 with ``offload_optimizer``, issue #42): how the
phase's ZeRO backend steps it there and what it asks DeepSpeed to pin."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from launch.engine import ZeroBackend

OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


def spec_with(table: dict) -> SimpleNamespace:
    """What ``ZeroBackend`` reads of a ZeRO-2 phase's spec with ``deepspeed.config = table``."""
    return SimpleNamespace(data=SimpleNamespace(batch_size=8, micro_batch_size=4), zero_stage=2,
                           optimizer=SimpleNamespace(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                                     grad_clip=1.0),
                           model=SimpleNamespace(dtype="bfloat16"), deepspeed_config=table)


def test_the_host_step_is_fused_and_steps_as_the_default_does():
    """torch's default AdamW on the host makes one pass over the partition per op and allocates
    temporaries of its size (2.7 GB at 7B); fused, it makes one pass, to within fp32's rounding."""
    weights = torch.randn(4096, generator=torch.Generator().manual_seed(42))
    fused, default = (torch.nn.Parameter(weights.clone()) for _ in range(2))
    opts = [ZeroBackend(2).optimizer([{"params": [p]}], spec_with(table), torch.device("cpu"), 1)
            for p, table in ((fused, OFFLOAD), (default, {}))]
    assert opts[0].defaults["fused"] is True
    assert not opts[1].defaults["fused"]  # the CPU tests' ZeRO without offload: the default, as before
    for step in range(5):
        grad = torch.randn(4096, generator=torch.Generator().manual_seed(step))
        for p, opt in zip((fused, default), opts):
            p.grad = grad.clone()
            opt.step()
    assert torch.allclose(fused, default, rtol=1e-6, atol=1e-7)


def test_offloaded_buffers_are_pinned_unless_the_schedule_says():
    table = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    built = ZeroBackend(2).config(spec_with(table), 1, 1000)
    assert built["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert table == OFFLOAD  # the spec's own table is left as it was
    unpinned = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    assert ZeroBackend(2).config(spec_with(unpinned), 1, 1000)["zero_optimization"]["offload_optimizer"]["pin_memory"] is False
    assert "offload_optimizer" not in ZeroBackend(2).config(spec_with({}), 1, 1000)["zero_optimization"]


def test_the_host_memory_pinned_ahead_bounds_what_deepspeed_pins():
    """``ZeroBackend.host_buffers``: per rank the fp32 masters' and gradients' partitions and a 16-bit
    copy, the largest parameter's 16-bit gradient, with accumulation a 16-bit buffer per parameter,
    a page per buffer; nothing without the offload, or unpinned. (Whether it bounds what DeepSpeed
    takes: ``tests/launch/test_equivalence.py``, every buffer served from it.)"""
    spec = spec_with(OFFLOAD)
    numels = [1000, 3000]
    pages = (2 + 64) * 4096
    assert ZeroBackend(2).host_buffers(spec, 1, numels) == 4000 * 10 + 3000 * 2 + 4000 * 2 + pages  # batch 8 of 4
    assert ZeroBackend(2).host_buffers(spec, 2, numels) == 2000 * 10 + 3000 * 2 + pages  # 4 a rank: no accumulation
    unpinned = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    assert ZeroBackend(2).host_buffers(spec_with(unpinned), 1, numels) == 0
    assert ZeroBackend(2).host_buffers(spec_with({}), 1, numels) == 0
    assert ZeroBackend(3).host_buffers(spec, 1, numels) == 0


def test_an_arena_hands_out_aligned_buffers_then_none():
    from launch.pinned import ALIGN, Arena

    arena = Arena(3 * ALIGN, pin=False)
    a = arena.take(torch.float32, (10,))
    b = arena.take(torch.bfloat16, (2, ALIGN // 2))
    assert a.shape == (10,) and b.shape == (2, ALIGN // 2) and b.dtype == torch.bfloat16
    assert b.data_ptr() - a.data_ptr() == ALIGN
    assert arena.take(torch.float32, (ALIGN,)) is None
    assert arena.summary() == {"bytes": 3 * ALIGN, "used": 3 * ALIGN, "served": 2, "missed": 1}
