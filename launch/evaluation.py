"""What an evaluation reports beside its loss: the loss of each source's held-out rows
(``eval_loss/NAME``, where the held-out rows come from several sources), and greedy generations
from ``eval.prompts`` (``generations``). ``launch.train.evaluate`` runs both."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from launch.data.examples import Examples, _take
from launch.data.cache import source_names
from launch.record import Phase
from launch.data.templates import trained_template

IGNORE = -100


def source_keys(record: dict[str, Any]) -> list[str]:
    """The per-source evaluation losses of a metrics record."""
    return [k for k in record if k.startswith("eval_loss/")]


class BySource:
    """Target-token loss sums and counts per source of the held-out rows, from each pass's logits."""

    def __init__(self, ph: Phase, val: Examples):
        data = ph.spec.data
        self.val, self.device = val, ph.device
        self.names = source_names([*data.sources, *data.validation]) if val.sources is not None else []
        self.sums = torch.zeros(2, len(self.names), device=ph.device, dtype=torch.float64)

    def add(self, logits: torch.Tensor, batch: dict[str, torch.Tensor], idx: list[int]) -> None:
        """``idx``: the rows of the pass (``rows(val, idx)``: flattened where packed whole)."""
        if not self.names or not idx:
            return
        sources = torch.from_numpy(_take(self.val.sources, idx).astype(np.int64)).reshape(batch["labels"].shape)
        labels, sources = batch["labels"][:, 1:].to(self.device), sources[:, 1:].to(self.device)
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                                   ignore_index=IGNORE, reduction="none").double()
        counted = labels.flatten() != IGNORE
        which = sources.flatten()[counted]
        self.sums[0].index_add_(0, which, losses[counted])
        self.sums[1].index_add_(0, which, torch.ones_like(losses[counted]))

    def result(self) -> dict[str, float]:
        """Each source's mean over its target tokens, over every rank (call on every rank)."""
        if not self.names:
            return {}
        torch.distributed.all_reduce(self.sums)
        return {f"eval_loss/{name}": (self.sums[0, i] / self.sums[1, i]).item()
                for i, name in enumerate(self.names) if self.sums[1, i] > 0}


def generations(ph: Phase) -> list[dict[str, str]]:
    """Greedy continuations of ``eval.prompts`` (every rank generates, so that ZeRO-3's gathers
    stay collective): [{"prompt", "text"}]."""
    spec, engine = ph.spec, ph.built.engine
    if not spec.eval_prompts:
        return []
    tok = _tokenizer(ph)
    out = []
    for prompt in spec.eval_prompts:
        ids = _encode(tok, prompt).to(ph.device)
        made = engine.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec.eval_max_new_tokens,
                                      do_sample=False, use_cache=True, pad_token_id=tok.pad_token_id or tok.eos_token_id,
                                      synced_gpus=ph.backend.partitions_weights and ph.world > 1)
        out.append({"prompt": prompt, "text": tok.decode(made[0, ids.shape[1]:], skip_special_tokens=True)})
    return out


def _tokenizer(ph: Phase) -> Any:
    return _loaded_tokenizer(ph.spec.model.tokenizer or ph.spec.model.path, trained_template(ph.spec.data))


@functools.lru_cache(maxsize=1)
def _loaded_tokenizer(path: str, template: str | None) -> Any:
    """Loaded once a process (a phase evaluates many times), with the run's chat template."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(Path(path))
    if template is not None:
        tok.chat_template = template
    return tok


def _encode(tok: Any, prompt: str) -> torch.Tensor:
    """A user turn through the chat template where there is one, else the text as it is."""
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
    else:
        ids = tok(prompt)["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)
