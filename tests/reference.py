"""An independent single-process LISA reference in plain PyTorch, for the equivalence tests.

Written from the contract, not from launch/: one AdamW for the head that lives through the whole
run, a new AdamW for the body in every phase, lr a function of the global step, the documented
data order (epochs of ``random.Random(f"relayer-data-{seed}-{epoch}")`` permutations; optimizer
step s takes samples [s*B, (s+1)*B), micro-step m of rank r the slice starting at (m*W + r)*mb).

The loss of a step is the summed token loss of its whole batch over the batch's target tokens
(labels aligned as in Hugging Face, -100: none; rows shorter than the longest are padded and
masked). ``carry_body``, ``reset_head`` and ``mean_of_means`` (each micro-batch's mean, averaged)
give wrong semantics, so tests can show they would fail; ``keep_body`` is optimizer_state "keep":
an AdamW per body layer that lives through the run, stepped only in the phases that train the
layer, so its state (and step, per parameter as torch keeps it) waits between its visits.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def load_tokens(path: Path, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, attention_mask) of a tokens file: rows cut to ``seq_len`` and padded
    (input 0, label -100, mask 0) to the longest; labels default to the inputs."""
    records = [json.loads(line) for line in open(path) if line.strip()]
    ids = [r["input_ids"][:seq_len] for r in records]
    labels = [r.get("labels", r["input_ids"])[:seq_len] for r in records]
    width = max(map(len, ids))
    pad = lambda rows, v: torch.tensor([r + [v] * (width - len(r)) for r in rows])  # noqa: E731
    return pad(ids, 0), pad(labels, -100), pad([[1] * len(r) for r in ids], 0)


def sample_index(g: int, n: int, seed: int) -> int:
    epoch, pos = divmod(g, n)
    perm = list(range(n))
    random.Random(f"relayer-data-{seed}-{epoch}").shuffle(perm)
    return perm[pos]


def reference_run(model_dir: Path, data: Path, phases: list[tuple[int, list[int]]], *, seed: int = 0,
                  lr: float = 1e-3, batch: int = 8, micro: int = 4, grad_clip: float = 1.0,
                  weight_decay: float = 0.0, carry_body: bool = False, reset_head: bool = False,
                  keep_body: bool = False,
                  grad_scale: float = 1.0, mean_of_means: bool = False, phase_warmup: int = 0,
                  head_modules: tuple[str, ...] = ("model.embed_tokens", "lm_head", "model.norm"),
                  losses: list[float] | None = None, norms: list[dict[int, float]] | None = None,
                  choose=None) -> dict[str, torch.Tensor]:
    """Final weights (fp32, by parameter name) of the LISA schedule ``phases`` = [(steps, layers)],
    where a phase's layers may be module units instead ("0.self_attn.q_proj": only those train);
    each step's loss is appended to ``losses`` when given. ``reset_head``: a new AdamW for the head
    every phase too (BAdam's "drop-all"); ``keep_body``: each layer's AdamW kept between its visits
    ("keep"); ``phase_warmup``: step s of each phase at lr x (s + 1) /
    (phase_warmup + 1) while s < phase_warmup; ``head_modules``: the head's modules that train.
    ``norms``: each phase's body layers' gradient L2 norms at its last step (before clipping) are
    appended; a phase whose layers are None takes ``choose(phase index, norms)``'s."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, labels, mask = load_tokens(data)
    params = dict(model.named_parameters())
    head = [n for n in params if n.startswith(tuple(f"{m}." for m in head_modules))]

    def adamw(names: list[str]) -> torch.optim.AdamW:
        decay = [params[n] for n in names if params[n].ndim >= 2]
        no_decay = [params[n] for n in names if params[n].ndim < 2]
        groups = [{"params": g, "weight_decay": wd} for g, wd in ((decay, weight_decay), (no_decay, 0.0)) if g]
        return torch.optim.AdamW(groups, lr=lr)

    head_opt = adamw(head)
    body_opts: dict[tuple[int, ...], torch.optim.AdamW] = {}
    layer_opts: dict[int, torch.optim.AdamW] = {}
    step = 0
    for index, (steps, layers) in enumerate(phases):
        if layers is None:
            layers = choose(index, norms)
        body = [n for n in params if n.startswith(tuple(f"model.layers.{i}." for i in layers))]  # or units, "0.mlp"
        trainable = set(head) | set(body)
        for n, p in params.items():
            p.requires_grad_(n in trainable)
        if reset_head:
            head_opt = adamw(head)
        key = tuple(layers)
        if keep_body:
            opts = [layer_opts.setdefault(i, adamw([n for n in body if n.startswith(f"model.layers.{i}.")]))
                    for i in layers]
        else:
            body_opt = body_opts.get(key) if carry_body else None
            if body_opt is None:
                body_opt = body_opts[key] = adamw(body)
            opts = [body_opt]
        for s in range(steps):
            for g in (*head_opt.param_groups, *(g for o in opts for g in o.param_groups)):
                g["lr"] = lr * (s + 1) / (phase_warmup + 1) if s < phase_warmup else lr
            rows = [sample_index(g, len(ids), seed) for g in range(step * batch, (step + 1) * batch)]
            targets = int((labels[rows, 1:] != -100).sum())
            step_loss = 0.0
            for m in range(batch // micro):
                r = rows[m * micro:(m + 1) * micro]
                logits = model(input_ids=ids[r], attention_mask=mask[r]).logits
                token_losses = torch.nn.functional.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), labels[r, 1:].flatten(), ignore_index=-100, reduction="none")
                count = int((labels[r, 1:] != -100).sum())
                if mean_of_means:
                    loss = token_losses.sum() / count / (batch // micro)
                else:
                    loss = token_losses.sum() / targets
                loss.backward()
                step_loss += loss.item()
            if losses is not None:
                losses.append(step_loss)
            trainable_params = [params[n] for n in params if n in trainable]
            if norms is not None and s == steps - 1:
                norms.append({i: sum(float(params[n].grad.double().pow(2).sum()) for n in body
                                     if n.startswith(f"model.layers.{i}.")) ** 0.5 for i in sorted(layers)})
            if grad_scale != 1.0:
                for p in trainable_params:
                    p.grad.mul_(grad_scale)
            if grad_clip:
                torch.nn.utils.clip_grad_norm_(trainable_params, grad_clip)
            for o in (head_opt, *opts):
                o.step()
                o.zero_grad(set_to_none=True)
            step += 1
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), a.keys() ^ b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def composed(model_dir: Path, run_dir: Path, ckpt: Path | None = None) -> dict[str, torch.Tensor]:
    """A run's weights as the contract defines them: the base model, then each layer's newest
    trained weights, then the head, as of ``ckpt`` (default: the newest valid checkpoint)."""
    from shard_tools.state import run_weights
    from shard_tools.store import Checkpoints

    if ckpt is None:
        ckpt, _, _ = Checkpoints(run_dir).newest_whole()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights.update(run_weights(run_dir, ckpt))
    return weights


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
