"""The phase spec's data part: the sources a run trains on and how their examples become rows.

Torch-free, part of the contract (``launch.contract.spec`` holds it): the orchestrator builds
a ``DataPart`` from the schedule's ``[data]``, the data tool and every phase process prepare
and read the same cache entry from it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

DataFormat = Literal["tokens", "text", "instruction", "chat"]
"""What the records of a data file are (``data.format``)."""
FIELDS: dict[DataFormat, tuple[str, ...]] = {
    "tokens": ("input_ids", "labels"), "text": ("text",), "instruction": ("instruction", "input", "output"),
    "chat": ("messages", "conversations")}
"""Per format, the record fields ``data.fields`` may rename (the names here are the defaults)."""
TEMPLATE_NAMES = ("llama3", "chatml", "qwen2.5", "mistral", "gemma", "phi3")
"""``data.chat_template`` values that name a template written here (``launch.data.templates``), for base
models whose tokenizer has none."""
ALPACA_PROMPT = "alpaca"
"""``chat_template = "alpaca"`` on an instruction source: the Alpaca prompt ("Below is an
instruction ... ### Response:"), not a chat template, whatever the tokenizer or data.chat_template
has (axolotl's ``type: alpaca``)."""
Layout = Literal["pad", "stream", "whole"]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourcePart(_Spec):
    """One data file and how to read it (``data.path`` and its keys, or one of ``data.sources``)."""

    path: str
    """A data file (.jsonl, .json, .parquet, .csv, .arrow, .txt) or a ``datasets.save_to_disk`` folder."""
    format: DataFormat
    train_on_prompt: bool = False
    """instruction/chat: the prompt and the user turns carry loss too."""
    chat_template: str | None = None
    """A Jinja chat template, a name of ``TEMPLATE_NAMES``, or the absolute path of a file holding one."""
    fields: dict[str, str] | None = None
    """Record field names by their default names (``FIELDS``), for data that names them otherwise."""
    weight: float = 1.0
    """How many times an epoch draws each of its examples (0.5: a seeded half of them)."""
    key: str = "data"
    """The schedule key it comes from (``data``, ``data.sources[1]``): messages name it; it keys no cache."""

    def field(self, name: str) -> str:
        return (self.fields or {}).get(name, name)


class DataPart(_Spec):
    sources: tuple[SourcePart, ...]
    """The training sources, mixed into one seeded order."""
    validation: tuple[SourcePart, ...] = ()
    """Held-out files (``data.validation_path``), every record of them."""
    validation_split: float | None = None
    """The fraction of each source's records held out (seeded), instead of ``validation``."""
    seed: int = 0
    """The run's seed: the split, the draws of fractional weights and the mixed order follow it."""
    seq_len: int
    batch_size: int
    micro_batch_size: int
    shuffle: bool
    eval_every: int = 0
    pack: bool | Literal["whole", "stream"] | None = None
    """How examples become rows (``layout``); None: the formats' default."""

    @property
    def layout(self) -> Layout:
        """``pad``: one example a row; ``whole``: examples packed whole, each attending to itself;
        ``stream``: one stream cut into rows. Text alone is a stream of documents (as pretraining
        reads it) when packed or by default; other data pads by default and packs whole."""
        if self.pack in ("whole", "stream"):
            return self.pack
        if self.pack is False:
            return "pad"
        if all(s.format == "text" for s in self.sources):
            return "stream"
        return "whole" if self.pack else "pad"


def is_template_path(value: str) -> bool:
    """``data.chat_template`` names a file unless it holds Jinja (every template has ``{``) or
    names a template of ``TEMPLATE_NAMES`` (or is ``ALPACA_PROMPT``)."""
    return "{" not in value and value not in (*TEMPLATE_NAMES, ALPACA_PROMPT)
