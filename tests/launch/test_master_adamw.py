"""relayer's optimizer without ZeRO (``launch.master_adamw``) against torch's AdamW and
``clip_grad_norm_`` on fp32 weights, in one process: the same steps bitwise where nothing rounds
differently, and its state where ``launch.engine.MasterBackend`` reads and writes it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from launch.engine import MasterBackend
from launch.master_adamw import ALIGN, MasterAdamW, slot_of


def _net(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Linear(4, 4))
    return net.to(dtype)


def _groups(net: nn.Sequential, wd: float) -> list[dict]:
    # net[3] is never used by the forward pass below: it steps with a zero gradient, as an element
    # of ZeRO's flat partitions does (weight decay applies).
    return [{"params": [net[0].weight, net[2].weight, net[3].weight], "weight_decay": wd},
            {"params": [net[0].bias, net[2].bias], "weight_decay": 0.0}]


def _train(net, opt, steps: int, micro: int, clip_tail: bool) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    norms = []
    for step in range(steps):
        x, y = torch.randn(8 * micro, 8, generator=gen), torch.randn(8 * micro, 4, generator=gen)
        if clip_tail and step >= steps - 2:
            y = y * 1e3  # large gradients: the clip acts
        for m in range(micro):
            out = net[2](net[1](net[0](x[8 * m:8 * (m + 1)].to(net[0].weight.dtype))))
            (((out.float() - y[8 * m:8 * (m + 1)]) ** 2).mean() / micro).backward()
        norms.append(opt())
    return norms


def test_steps_as_torch_adamw_with_clipping_and_accumulation():
    mine, ref = _net(), _net()
    opt = MasterAdamW(_groups(mine, 0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, grad_clip=1.0,
                      device=torch.device("cpu"))
    torch_opt = torch.optim.AdamW(_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)

    def mine_step() -> float:
        opt.step()
        return float(opt._global_grad_norm)

    def ref_step() -> float:
        trained = [p for g in torch_opt.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in trained]))
        scale = max(1.0, (float(norm) + 1e-6) / 1.0)  # DeepSpeed's clip: divide by (norm + 1e-6) / clip
        for p in trained:
            p.grad.div_(scale)
        torch_opt.step()
        torch_opt.zero_grad()
        return float(norm)

    mine_norms = _train(mine, mine_step, 6, 2, clip_tail=True)
    ref_norms = _train(ref, ref_step, 6, 2, clip_tail=True)
    assert mine_norms == pytest.approx(ref_norms, rel=1e-6)
    assert max(ref_norms[-2:]) > 10  # the clip acted
    for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
        if name.startswith("3."):
            continue
        assert torch.allclose(p, q, rtol=0, atol=1e-6), name
        assert torch.equal(slot_of(p).master, p.detach())  # fp32: the weights are the masters
    decayed = _net()[3].weight.detach() * (1 - 1e-2 * 0.1) ** 6
    assert torch.allclose(mine[3].weight, decayed, rtol=1e-6, atol=0)
    assert opt.group_steps() == {0: 6, 1: 6}


def test_low_precision_weights_are_the_masters_rounded_in_one_block():
    net = _net(torch.bfloat16)
    opt = MasterAdamW(_groups(net, 0.0), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, grad_clip=0.0,
                      device=torch.device("cpu"))
    _train(net, opt.step, 3, 1, clip_tail=False)
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        assert p.dtype == torch.bfloat16 and slot_of(p).master.dtype == torch.float32
        assert torch.equal(p.detach(), slot_of(p).master.to(torch.bfloat16))
        assert p.untyped_storage().data_ptr() == opt.lp.untyped_storage().data_ptr()
        assert (p.data_ptr() - opt.lp.data_ptr()) // p.element_size() % ALIGN == 0
    assert all(p.grad is None for p in params)  # each went into the fp32 buffer as it came


class _Engine:
    """What ``launch.engine.MasterBackend`` sees of a DeepSpeed engine without ZeRO: its optimizer."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_zero_state_reads_and_writes_its_views():
    net = _net()
    opt = MasterAdamW(_groups(net, 0.0), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, grad_clip=1.0,
                      device=torch.device("cpu"))
    engine, backend = _Engine(opt), MasterBackend()
    _train(net, opt.step, 2, 1, clip_tail=False)
    named = [(n, p) for n, p in net.named_parameters() if slot_of(p) is not None]
    state = backend.get_state(named, on_device=True)
    assert state["master"]["0.weight"].data_ptr() == slot_of(net[0].weight).master.data_ptr()  # no copy
    assert float(state["exp_avg_sq"]["0.weight"].abs().sum()) > 0
    backend.materialise(engine, [5, 7])
    assert backend.group_steps(engine) == {0: 5, 1: 7}
    assert float(opt.moments.abs().sum()) == 0
    new = {k: {n: torch.full_like(t, 0.5) for n, t in by.items()} for k, by in state.items()}
    backend.set_state(named, new, with_moments=True)
    backend.refresh_lp(engine)
    assert all(bool((p == 0.5).all()) for _, p in named)
    assert bool((slot_of(net[2].bias).exp_avg == 0.5).all())
    assert backend.param_groups(engine) is opt.param_groups


@pytest.mark.parametrize("fused_torch", [False, True], ids=["one-loop", "torch-adamw"])
def test_the_bodys_moments_apart_step_the_same_and_go_after_the_last_step(fused_torch):
    """``apart_from``: the second group's moments in an allocation of their own (a phase's body), the
    steps bitwise those of one allocation; ``release_apart`` gives them back and leaves the first
    group's state as it was (what a successor carries on)."""
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, grad_clip=1.0, device=torch.device("cpu"),
              accumulate=fused_torch, kernel=False)
    one, two = _net(), _net()
    whole, apart = MasterAdamW(_groups(one, 0.1), **kw), MasterAdamW(_groups(two, 0.1), apart_from=1, **kw)
    _train(one, whole.step, 4, 1, clip_tail=True)
    _train(two, apart.step, 4, 1, clip_tail=True)
    for p, q in zip(whole.params, apart.params):
        assert torch.equal(p, q)
        assert all(torch.equal(getattr(slot_of(p), k), getattr(slot_of(q), k)) for k in ("master", "exp_avg", "exp_avg_sq"))
    first, second = apart.param_groups[0]["params"], apart.param_groups[1]["params"]
    assert slot_of(second[0]).exp_avg.untyped_storage().data_ptr() == apart.apart.untyped_storage().data_ptr()
    assert slot_of(first[0]).exp_avg.untyped_storage().data_ptr() == apart.moments.untyped_storage().data_ptr()
    kept = {id(p): slot_of(p).exp_avg.clone() for p in first}
    assert apart.release_apart() == 2 * 4 * sum(-(-p.numel() // ALIGN) * ALIGN for p in second)
    assert apart.apart.numel() == 0 and apart.release_apart() == 0
    assert all(slot_of(p).exp_avg is None and slot_of(p).exp_avg_sq is None for p in second)
    assert all(torch.equal(slot_of(p).exp_avg, kept[id(p)]) for p in first)
    assert whole.release_apart() == 0  # nothing apart: nothing goes


def _kernel_device() -> torch.device:
    """CUDA with Triton (the lent GPU), or the CPU under Triton's interpreter (TRITON_INTERPRET=1
    before the process imported Triton)."""
    from launch import adamw_kernel

    for device in (torch.device("cuda"), torch.device("cpu")):
        if (device.type == "cpu" or torch.cuda.is_available()) and adamw_kernel.available(device):
            return device
    pytest.skip("no Triton here: the kernel runs where torch's CUDA build brings it (or under TRITON_INTERPRET=1)")


@pytest.mark.parametrize("accumulate", [False, True])
def test_the_kernel_steps_as_torch_adamw(accumulate):
    """``launch.adamw_kernel`` (one pass a parameter, the bf16 weight written from the master) against
    torch's AdamW over the flat masters, step by step from the same state (the same bf16 weights and
    batches), the clip acting in the last steps. Each step starts both from the kernel's state: over
    several steps apart, a last-bit difference of one master flips a bf16 weight now and then, and
    Adam's first steps (the update about lr times the sign of the gradient) make that 1e-3 apart on a
    GPU, where torch's fused AdamW and the kernel round their arithmetic differently."""
    from launch import adamw_kernel

    device = _kernel_device()
    assert adamw_kernel.works(device, torch.bfloat16, torch.float32 if accumulate else torch.bfloat16)

    def made(kernel: bool) -> tuple[nn.Sequential, MasterAdamW]:
        net = _net(torch.bfloat16).to(device)
        return net, MasterAdamW(_groups(net, 0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                                grad_clip=1.0, device=device, accumulate=accumulate, kernel=kernel)

    (net_k, with_kernel), (net_t, with_torch) = made(True), made(False)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen) * (1e3 if step > 2 else 1)
        for net, opt in ((net_k, with_kernel), (net_t, with_torch)):
            for m in range(2 if accumulate else 1):
                out = net[2](net[1](net[0](x[8 * m:8 * (m + 1)].to(device, torch.bfloat16))))
                (((out.float() - y[8 * m:8 * (m + 1)].to(device)) ** 2).mean()).backward()
            opt.step()
        assert torch.allclose(with_kernel.master, with_torch.master, rtol=0, atol=1e-5), step
        assert torch.allclose(with_kernel.moments, with_torch.moments, rtol=1e-4, atol=1e-7), step
        for p in with_kernel.params:  # the weights are the masters rounded to nearest even, as torch rounds
            assert torch.equal(p.detach(), slot_of(p).master.to(torch.bfloat16))
            assert p.grad is None
        with torch.no_grad():  # the next step from the same state
            with_torch.master.copy_(with_kernel.master)
            with_torch.moments.copy_(with_kernel.moments)
            with_torch.refresh_lp()
    assert with_kernel.direct == (not accumulate) and not with_torch.direct
    assert with_kernel.group_steps() == with_torch.group_steps() == {0: 5, 1: 5}
    assert float(with_torch._global_grad_norm) > 10  # the clip acted


def test_the_kernel_check_takes_a_cuda_device_without_an_index(monkeypatch):
    """``works(torch.device("cuda"), ...)`` checks on the current device: ``torch.cuda.set_device``
    refuses a device without an index, and the kernel's check used to fall back to torch's AdamW there."""
    from launch import adamw_kernel

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert adamw_kernel.indexed(torch.device("cuda")) == torch.device("cuda", 3)
    assert adamw_kernel.indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert adamw_kernel.indexed(torch.device("cpu")) == torch.device("cpu")
