"""A phase's param groups: the head's and the body's apart, each split by weight decay and by the
Adam step it starts from (``param_groups``), and their roles."""

from __future__ import annotations

from torch import nn

# The roles of a phase's param groups (``param_groups``): Adam's step is per group.
HEAD_DECAY, HEAD_NO_DECAY, BODY_DECAY, BODY_NO_DECAY = range(4)


def param_groups(model: nn.Module, head: set[str], body: set[str], opt,
                 starts: dict[str, int] | None = None) -> tuple[list[dict], list[int], list[int]]:
    """Four groups (head/body x decay/no-decay; 1-D parameters never decay), empty ones dropped;
    and each group's role and the Adam step it starts from.

    The head and the body must not share a group: Adam's step (bias correction) is per group. So
    body parameters that start from different steps (``starts``, by name: optimizer_state "keep",
    a layer's step of its last visit; 0 where not given) are split into a group per step too.
    """
    starts = starts or {}
    buckets: dict[tuple[int, int], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim < 2
        role = (HEAD_NO_DECAY if no_decay else HEAD_DECAY) if name in head else (BODY_NO_DECAY if no_decay else BODY_DECAY)
        assert name in head or name in body, name
        buckets.setdefault((role, 0 if name in head else starts.get(name, 0)), []).append(p)
    groups, roles, steps = [], [], []
    for (role, step), params in sorted(buckets.items()):
        wd = 0.0 if role in (HEAD_NO_DECAY, BODY_NO_DECAY) else opt.weight_decay
        groups.append({"params": params, "weight_decay": wd})
        roles.append(role)
        steps.append(step)
    return groups, roles, steps
