"""relayer's optimizer where DeepSpeed runs no ZeRO (``deepspeed.zero_stage = 0``): AdamW over fp32
master weights of the trainable parameters, as DeepSpeed's ZeRO-1/2 keep them, in a handful of
kernels a step.

A LISA phase trains a small part of the model (at 7B the head and two layers: 0.67 B of 6.7 B
parameters), so on one GPU ZeRO partitions nothing and its bookkeeping is what the step pays for:
gradients copied into buckets, then into fp32 partitions, per-parameter hooks and their host
work, the masters copied back through an all-gather (a steady 7B step 1.116 x the Hugging Face
Trainer's with fused bf16 AdamW, ``benchmarks/results/2026-12-03-step-cost-h200``). Here each
trainable parameter's gradient is copied, as it is ready, into one flat fp32 buffer (in its
post-accumulate hook, which frees the low-precision gradient at once); the step is one norm over
that buffer, torch's fused AdamW over the flat fp32 masters (a kernel a param group; the clip
factor goes in as its ``grad_scale``, on the device, with no synchronisation) and one copy of the
masters into the flat low-precision weights the forward pass uses. Data parallel: one
``all_reduce`` of the fp32 buffer at the step (DeepSpeed's own reduction is turned off,
``detach_engine_reduction``).

The state is DeepSpeed's (fp32 master, ``exp_avg``, ``exp_avg_sq``, a step per param group), in
flat buffers: every trainable parameter has a ``Slot`` of views (``slot_of``), which
``launch.zero_state`` reads and writes; the optimizer's state is there from the start (no lazy
first step), and a handover offers three blocks of device memory instead of a tensor each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 64
"""Each parameter's place in the flat buffers starts at a multiple of this many elements (256 bytes of
fp32): the padding between stays zero (no gradient, so Adam leaves it at zero)."""
CLIP_EPS = 1e-6
"""DeepSpeed's: the clip factor is (norm + 1e-6) / grad_clip where that is above 1."""


@dataclass(frozen=True)
class Slot:
    """One trainable parameter's views into the optimizer's flat buffers, shaped as the parameter."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    group: int


def slot_of(p: nn.Parameter) -> Slot | None:
    """The parameter's ``Slot`` where a ``MasterAdamW`` steps it; None elsewhere (a ZeRO optimizer's)."""
    return getattr(p, "_relayer_slot", None)


class MasterAdamW(torch.optim.Optimizer):
    """AdamW with fp32 masters for ``groups`` (``launch.prepare.param_groups``' groups of the
    model's parameters, on ``device`` already). Its ``param_groups`` are the model's parameters,
    as DeepSpeed and the lr schedule expect; the fp32 work goes through ``inner``, a torch AdamW
    (fused on CUDA) over each group's slice of the flat masters."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, grad_clip: float, device: torch.device, world: int = 1):
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.grad_clip, self.world = grad_clip, world
        params = [p for g in self.param_groups for p in g["params"]]
        lp_dtype = params[0].dtype
        places, at = [], 0
        for p in params:
            places.append(at)
            at += -(-p.numel() // ALIGN) * ALIGN
        total = at
        self.master = torch.zeros(total, dtype=torch.float32, device=device)
        self.lp = self.master if lp_dtype == torch.float32 else torch.zeros(total, dtype=lp_dtype, device=device)
        self.grads = torch.zeros(total, dtype=torch.float32, device=device)
        moments = torch.zeros(2, total, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, start in zip(params, places):
                view = self.lp[start:start + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view  # the weights the forward pass uses, in one flat block
        self.master.copy_(self.lp)
        self._grad_of = {id(p): self.grads[s:s + p.numel()].view(p.shape) for p, s in zip(params, places)}
        self._seen: set[int] = set()
        """The parameters whose gradient is in ``grads`` this step (copied; later ones are added)."""
        fused = device.type == "cuda"
        inner_groups, bounds, index = [], [], 0
        for gi, group in enumerate(self.param_groups):
            n = len(group["params"])
            first = places[index]
            last = places[index + n - 1] + group["params"][-1].numel()
            for p, s in zip(group["params"], places[index:index + n]):
                p._relayer_slot = Slot(*(t[s:s + p.numel()].view(p.shape) for t in (self.master, *moments)), gi)
            index += n
            bounds.append((first, last))
            inner_groups.append({"params": [self.master[first:last]], "weight_decay": group["weight_decay"]})
        self.inner = torch.optim.AdamW(inner_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       fused=True if fused else None)
        self.moments = moments
        for ig, (first, last) in zip(self.inner.param_groups, bounds):
            flat = ig["params"][0]
            flat.grad = self.grads[first:last]
            step = torch.zeros((), dtype=torch.float32, device=device if fused else "cpu")
            self.inner.state[flat] = {"step": step, "exp_avg": moments[0, first:last], "exp_avg_sq": moments[1, first:last]}
        self._global_grad_norm: torch.Tensor | None = None
        """This step's gradient norm, before clipping (DeepSpeed's engine reads it from here)."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._take_grad) for p in params]

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in ``grads`` and are replaced at the next step's first micro-batch."""
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        """Reduces (data parallel), clips by the global norm and steps every group; then the
        low-precision weights take the new masters."""
        if closure is not None:
            raise NotImplementedError("MasterAdamW takes no closure")
        self._zero_unseen()
        if self.world > 1:
            torch.distributed.all_reduce(self.grads)
            self.grads.div_(self.world)
        norm = torch.linalg.vector_norm(self.grads)
        self._global_grad_norm = norm
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner["lr"] = outer["lr"]
        scale = None
        if self.grad_clip > 0:
            scale = torch.clamp((norm + CLIP_EPS) / self.grad_clip, min=1.0)
            if self.master.device.type != "cuda":  # torch's unfused AdamW takes no grad_scale
                self.grads.div_(scale)
                scale = None
        self.inner.grad_scale = scale  # fused AdamW divides each gradient by it, in its kernel
        self.inner.step()
        self._seen.clear()
        self.refresh_lp()

    def _zero_unseen(self) -> None:
        """A parameter that got no gradient this step (not used by the forward pass) steps with a
        zero one, as an element of ZeRO's flat partitions does (weight decay applies)."""
        if len(self._seen) == len(self._grad_of):
            return
        for key, view in self._grad_of.items():
            if key not in self._seen:
                view.zero_()

    @torch.no_grad()
    def refresh_lp(self) -> None:
        """The low-precision weights from the masters (nothing to do for an fp32 model)."""
        if self.lp is not self.master:
            self.lp.copy_(self.master)

    def set_steps(self, steps_by_group: list[int]) -> None:
        """Zero moments and the given Adam step in every group, as a fresh phase starts them."""
        self.moments.zero_()
        for group, inner in enumerate(self.inner.param_groups):
            self.inner.state[inner["params"][0]]["step"].fill_(float(steps_by_group[group]))

    def group_steps(self) -> dict[int, int]:
        return {g: int(self.inner.state[ig["params"][0]]["step"].item()) for g, ig in enumerate(self.inner.param_groups)}

    def destroy(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def detach_engine_reduction(engine) -> None:
    """DeepSpeed's engine all-reduces ``p.grad`` after each backward; a ``MasterAdamW`` moved the
    gradients into its buffer by then and reduces that at its step."""
    engine.enable_backward_allreduce = False
