"""relayer's optimizer where DeepSpeed runs no ZeRO (``deepspeed.zero_stage = 0``): AdamW over fp32
master weights of the trainable parameters, as DeepSpeed's ZeRO-1/2 keep them, in few kernels a step.

A LISA phase trains a small part of the model (at 7B the head and two layers: 0.67 B of 6.7 B
parameters), so on one GPU ZeRO partitions nothing and its bookkeeping is what the step pays for:
gradients copied into buckets, then into fp32 partitions, per-parameter hooks and their host work,
the masters copied back through an all-gather (a steady 7B step 1.116 x the Hugging Face Trainer's
with fused bf16 AdamW, ``benchmarks/results/2026-12-03-step-cost-h200``).

Here the step is a global gradient norm, then for each parameter one pass of ``launch.adamw_kernel``
(on CUDA, with Triton): the gradient divided by the clip factor (computed on the device: no
synchronisation), the fp32 master and moments updated, the bf16 weight written from the new
master. With one micro-batch a step and one rank the gradients are read where autograd left them.
Otherwise (accumulation, several ranks, or no kernel: the CPU) each gradient is copied, as it is
ready, into one flat fp32 buffer (its post-accumulate hook, which frees the low-precision one), the
ranks all-reduce that buffer at the step (DeepSpeed's own reduction is turned off,
``detach_engine_reduction``), and without the kernel torch's AdamW (fused on CUDA) steps the flat
masters a param group at a time and the weights are copied from them. A parameter that got no
gradient in a step steps with a zero one, as an element of ZeRO's flat partitions does (weight
decay applies).

The state is DeepSpeed's (fp32 master, ``exp_avg``, ``exp_avg_sq``, a step per param group) in flat
buffers, there from the start (no lazy first step): every trainable parameter has a ``Slot`` of
views (``slot_of``) that ``launch.engine.MasterBackend`` reads and writes, and a handover offers a few blocks
of device memory instead of a tensor each. The body's moments (``apart_from``) are an allocation of their own:
no successor carries them on, and they go once the phase has offered its state (``release_apart``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from launch import adamw_kernel

ALIGN = 64
"""Each parameter's place in the flat buffers starts at a multiple of this many elements (256 bytes of
fp32): the padding between stays zero (no gradient, so Adam leaves it at zero)."""
CLIP_EPS = 1e-6
"""DeepSpeed's: the clip factor is (norm + 1e-6) / grad_clip where that is above 1."""


@dataclass(frozen=True)
class Slot:
    """One trainable parameter's views into the optimizer's flat buffers, shaped as the parameter."""

    master: torch.Tensor
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    """None once ``MasterAdamW.release_apart`` gave them back."""
    group: int


def _autograds(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient where autograd left it; zero for one that got none."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]


def reads_autograds(accumulate: bool, world: int) -> bool:
    """Whether the kernel reads each gradient where autograd left it (one micro-batch a step, one
    rank), rather than from the fp32 buffer the micro-batches and ranks are summed in."""
    return not accumulate and world == 1


def kernel_grad_dtype(lp_dtype: torch.dtype, accumulate: bool, world: int) -> torch.dtype:
    """The dtype of the gradients the kernel reads: autograd's (the weights'), else the fp32 buffer's."""
    return lp_dtype if reads_autograds(accumulate, world) else torch.float32


def slot_of(p: nn.Parameter) -> Slot | None:
    """The parameter's ``Slot`` where a ``MasterAdamW`` steps it; None elsewhere (a ZeRO optimizer's)."""
    return getattr(p, "_relayer_slot", None)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW with fp32 masters for ``groups`` (``launch.engine.param_groups``' groups of the
    model's parameters, on ``device`` already). Its ``param_groups`` are the model's parameters, as
    DeepSpeed and the lr schedule expect. ``accumulate``: gradients of several micro-batches or
    ranks make a step (they are summed in fp32). ``kernel``: step with ``launch.adamw_kernel``
    (None: where it runs and steps as AdamW does, ``adamw_kernel.works``)."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, grad_clip: float, device: torch.device, world: int = 1,
                 accumulate: bool = True, kernel: bool | None = None, apart_from: int | None = None):
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.grad_clip, self.world = grad_clip, world
        lp_dtype = self.param_groups[0]["params"][0].dtype
        self.kernel = (adamw_kernel.works(device, lp_dtype, kernel_grad_dtype(lp_dtype, accumulate, world))
                       if kernel is None else kernel)
        self.direct = self.kernel and reads_autograds(accumulate, world)
        """The gradients are read where autograd left them (no fp32 buffer, no hooks)."""
        self.params = [p for g in self.param_groups for p in g["params"]]
        places = self._flatten(device)
        self.steps = [0] * len(self.param_groups)
        """Adam's step of each param group."""
        split = (places[id(self.param_groups[apart_from]["params"][0])]
                 if apart_from is not None and apart_from < len(self.param_groups) else self.master.numel())
        self.moments = torch.zeros(2, split, dtype=torch.float32, device=device)
        self.apart = torch.zeros(2, self.master.numel() - split, dtype=torch.float32, device=device)
        """The moments of the groups from ``apart_from`` on (the body's), an allocation of their own, which
        ``release_apart`` gives back once the phase's last step is taken: its successor starts them anew."""
        spans = self._slots(places)
        self.grads = None if self.direct else torch.zeros_like(self.master)
        self._grad_of = {} if self.direct else {id(p): self.grads[s:s + p.numel()].view(p.shape)
                                                for p in self.params for s in (places[id(p)],)}
        self._seen: set[int] = set()
        """The parameters whose gradient is in ``grads`` this step (copied; later ones are added)."""
        self.inner = None if self.kernel else self._torch_adamw(spans, device)
        self._global_grad_norm: torch.Tensor | None = None
        """This step's gradient norm, before clipping (DeepSpeed's engine reads it from here)."""
        self._hooks = [] if self.direct else [p.register_post_accumulate_grad_hook(self._take_grad)
                                              for p in self.params]

    def _flatten(self, device: torch.device) -> dict[int, int]:
        """The fp32 masters and the weights in flat buffers (the weights' own where they are fp32);
        each parameter's weights re-pointed there. Returns each parameter's place (by id)."""
        places, at = {}, 0
        for p in self.params:
            places[id(p)] = at
            at += -(-p.numel() // ALIGN) * ALIGN
        self.master = torch.zeros(at, dtype=torch.float32, device=device)
        lp_dtype = self.params[0].dtype
        self.lp = self.master if lp_dtype == torch.float32 else torch.zeros(at, dtype=lp_dtype, device=device)
        with torch.no_grad():
            for p in self.params:
                view = self.lp[places[id(p)]:places[id(p)] + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view  # the weights the forward pass uses, in one flat block
            if self.lp is not self.master:
                self.master.copy_(self.lp)
        return places

    def _slots(self, places: dict[int, int]) -> list[tuple[int, int]]:
        """Each parameter's ``Slot``; each param group's [first, last) in the flat buffers."""
        spans, split = [], self.moments.shape[1]
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                s = places[id(p)]
                m, at = (self.moments, s) if s < split else (self.apart, s - split)
                p._relayer_slot = Slot(self.master[s:s + p.numel()].view(p.shape),
                                       *(t[at:at + p.numel()].view(p.shape) for t in m), gi)
            last = group["params"][-1]
            spans.append((places[id(group["params"][0])], places[id(last)] + last.numel()))
        return spans

    def _torch_adamw(self, spans: list[tuple[int, int]], device: torch.device) -> torch.optim.AdamW:
        """Without the kernel: torch's AdamW over each group's slice of the flat masters, its
        gradient the same slice of the flat buffer, its moments those of the flat moments."""
        fused, split = device.type == "cuda", self.moments.shape[1]
        inner = torch.optim.AdamW([{"params": [self.master[a:b]], "weight_decay": g["weight_decay"]}
                                   for g, (a, b) in zip(self.param_groups, spans)],
                                  lr=self.defaults["lr"], betas=self.defaults["betas"], eps=self.defaults["eps"],
                                  fused=True if fused else None)
        for group, (a, b) in zip(inner.param_groups, spans):
            flat = group["params"][0]
            flat.grad = self.grads[a:b]
            step = torch.zeros((), dtype=torch.float32, device=device if fused else "cpu")
            m, at = (self.moments, a) if a < split else (self.apart, a - split)
            inner.state[flat] = {"step": step, "exp_avg": m[0, at:at + b - a], "exp_avg_sq": m[1, at:at + b - a]}
        return inner

    @torch.no_grad()
    def _take_grad(self, p: nn.Parameter) -> None:
        """A parameter's gradient of this micro-batch, into the fp32 buffer; the low-precision one goes."""
        into = self._grad_of[id(p)]
        if id(p) in self._seen:
            into.add_(p.grad)
        else:
            into.copy_(p.grad)
            self._seen.add(id(p))
        p.grad = None

    @torch.no_grad()
    def full_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """These parameters' gradients of the step about to be taken, as ``step`` will see them: summed
        over the micro-batches and, in a copy, averaged over the ranks (collective); zero for one
        that got none."""
        if self.direct:
            return _autograds(params)
        out = [self._grad_of[id(p)] if id(p) in self._seen else torch.zeros_like(self._grad_of[id(p)]) for p in params]
        if self.world == 1 or not out:
            return out
        flat = torch.cat([g.flatten() for g in out])
        torch.distributed.all_reduce(flat)
        return list(flat.div_(self.world).split([g.numel() for g in out]))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def release_grads(self) -> None:
        """After the last step: the gradients and the fp32 buffer they are summed in go; no step follows."""
        self.zero_grad()
        self.destroy()
        self.grads, self._grad_of = None, {}

    @torch.no_grad()
    def step(self, closure=None):
        """Reduces (data parallel), clips by the global norm and steps every group; the
        low-precision weights take the new masters."""
        if closure is not None:
            raise NotImplementedError("MasterAdamW takes no closure")
        grads = self._gradients()
        norm = (torch.linalg.vector_norm(self.grads) if grads is None else torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])))
        self._global_grad_norm = norm
        scale = torch.clamp((norm + CLIP_EPS) / self.grad_clip, min=1.0) if self.grad_clip > 0 else None
        self.steps = [s + 1 for s in self.steps]
        if self.kernel:
            self._kernel_step(grads, scale if scale is not None else torch.ones((), device=norm.device))
        else:
            self._torch_step(scale)
        self._seen.clear()

    def _gradients(self) -> list[torch.Tensor] | None:
        """This step's gradients: autograd's (``direct``), or None where they are in ``grads``,
        summed over the ranks by now."""
        if self.direct:
            return _autograds(self.params)
        if len(self._seen) != len(self._grad_of):  # a parameter that got no gradient steps with a zero one
            for key, view in self._grad_of.items():
                if key not in self._seen:
                    view.zero_()
        if self.world > 1:
            torch.distributed.all_reduce(self.grads)
            self.grads.div_(self.world)
        return None

    def _kernel_step(self, grads: list[torch.Tensor] | None, scale: torch.Tensor) -> None:
        write = self.lp is not self.master
        for i, p in enumerate(self.params):
            slot = slot_of(p)
            group = self.param_groups[slot.group]
            grad = grads[i] if grads is not None else self._grad_of[id(p)]
            adamw_kernel.adamw_step(grad.contiguous(), slot.master, slot.exp_avg, slot.exp_avg_sq,
                                    p.data if write else None, scale, step=self.steps[slot.group], lr=group["lr"],
                                    betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
            p.grad = None

    def _torch_step(self, scale: torch.Tensor | None) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner["lr"] = outer["lr"]
        if scale is not None and self.master.device.type != "cuda":  # torch's unfused AdamW takes no grad_scale
            self.grads.div_(scale)
            scale = None
        self.inner.grad_scale = scale  # fused AdamW divides each gradient by it, in its kernel
        self.inner.step()
        self.refresh_lp()

    @torch.no_grad()
    def refresh_lp(self) -> None:
        """The low-precision weights from the masters (nothing to do for an fp32 model)."""
        if self.lp is not self.master:
            self.lp.copy_(self.master)

    def set_steps(self, steps_by_group: list[int]) -> None:
        """Zero moments and the given Adam step in every group, as a fresh phase starts them."""
        self.moments.zero_()
        self.apart.zero_()
        self.steps = list(steps_by_group)
        if self.inner is not None:
            for group, inner in enumerate(self.inner.param_groups):
                self.inner.state[inner["params"][0]]["step"].fill_(float(steps_by_group[group]))

    def release_apart(self) -> int:
        """After the last step, once the phase-end state is gathered: the moments kept apart (the body's,
        which no successor carries on) go, their slots with none; the bytes given back to the allocator.
        At 7B, 3.2 GB less on the device while the successor takes over (``launch.handover``)."""
        given = self.apart.numel() * self.apart.element_size()
        if not given:
            return 0
        ptr = self.apart.untyped_storage().data_ptr()
        for p in self.params:
            slot = slot_of(p)
            if slot.exp_avg is not None and slot.exp_avg.untyped_storage().data_ptr() == ptr:
                p._relayer_slot = Slot(slot.master, None, None, slot.group)
        for state in (self.inner.state.values() if self.inner is not None else ()):
            if state["exp_avg"] is not None and state["exp_avg"].untyped_storage().data_ptr() == ptr:
                state["exp_avg"] = state["exp_avg_sq"] = None
        self.apart = torch.zeros(2, 0, dtype=torch.float32, device=self.apart.device)
        return given

    def group_steps(self) -> dict[int, int]:
        return dict(enumerate(self.steps))

    def destroy(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def detach_engine_reduction(engine) -> None:
    """DeepSpeed's engine all-reduces ``p.grad`` after each backward; a ``MasterAdamW`` moved the
    gradients into its buffer by then and reduces that at its step."""
    engine.enable_backward_allreduce = False
