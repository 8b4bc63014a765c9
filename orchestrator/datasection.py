"""The schedule's ``[data]`` section: one source (``data.path`` and its keys) or several
(``data.sources``), how their examples become rows, batches and held-out data."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from launch.contract.data import FIELDS
from orchestrator.sections import KeyProblem, NonNegSteps, Rows, Section, _show, int_is_float

Format = Literal["tokens", "text", "instruction", "chat"]


class SourceSection(Section):
    path: str
    """A data file or folder as data.path takes; relative to the schedule file."""
    format: Format = "tokens"
    """As data.format, for this source."""
    fields: dict[str, str] | None = None
    """As data.fields, for this source's format."""
    chat_template: str | None = None
    """As data.chat_template, for this source; None: data.chat_template."""
    train_on_prompt: bool | None = None
    """As data.train_on_prompt, for this source; None: data.train_on_prompt."""
    weight: Annotated[float, Field(gt=0, le=1e6)] = 1.0
    """How many times an epoch draws each of its examples: 2 twice, 0.5 a seeded half; round(weight
    x examples) in all, the same ones every epoch."""

    _weight_float = field_validator("weight", mode="before")(int_is_float)


class DataSection(Section):
    path: str | None = None
    """A .jsonl, .json (an array or JSON lines), .parquet, .csv, .arrow or .txt file, or a folder
    written by datasets.save_to_disk; relative to the schedule file. One source; several: data.sources."""
    format: Format = "tokens"
    """tokens: {"input_ids": [...], "labels": [...] (optional, aligned as in Hugging Face; -100: no
    loss)}; text: a .txt file (documents separated by blank lines) or {"text": "..."} records, loss
    on every token; instruction: Alpaca {"instruction", "input", "output"}, loss on the output and
    its EOS; chat: {"messages": [{"role", "content"}]} or ShareGPT {"conversations": [{"from",
    "value"}]}, rendered with the chat template, loss on the assistant turns."""
    sources: list[SourceSection] | None = None
    """Several sources, instead of data.path: [{ path, format, weight, ... }, ...], mixed into one
    seeded order; data.chat_template and data.train_on_prompt are their defaults."""
    pack: bool | Literal["whole", "stream"] | None = None
    """"whole": examples packed whole into seq_len rows (best fit in the mixed order), each
    attending only to itself with its positions from 0; one longer than seq_len is cut to a row of
    its own. "stream": every example one after another, cut into rows where seq_len falls (an
    example may start in one row and end in the next). false: one example a row, padded or cut.
    true: "stream" for text alone, else "whole". Default: "stream" for text alone, else false."""
    train_on_prompt: bool = False
    """instruction and chat: the prompt and the system/user turns carry loss too."""
    chat_template: str | None = None
    """A Jinja chat template, a template by name (llama3, chatml, qwen2.5, mistral, gemma, phi3:
    docs/data.md), or a file holding one (relative to the schedule file), used
    instead of the tokenizer's; a value without "{" that is not a name is a file. "alpaca": an
    instruction source renders through the Alpaca prompt, not a chat template (a source's own
    chat_template = "alpaca" keeps it beside a data-level template, as axolotl's type: alpaca). It renders in
    transformers' sandbox under a budget: 5 s and about 1 MiB (plus 8 characters per character of
    the text) per conversation; a template past it, or one that fails (syntax, `raise_exception`, an
    undefined attribute, a blocked call) is exit 2 naming `data.chat_template`. Data in which no
    token carries loss (no assistant turn rendered within `seq_len`, every label -100) is refused."""
    fields: dict[str, str] | None = None
    """Record field names where the data names them otherwise, by their default names: text;
    instruction, input, output; messages, conversations; input_ids, labels. Example:
    {instruction = "prompt", output = "answer"}."""
    seq_len: Rows = 128
    """Tokens per row."""
    batch_size: Rows = 8
    """Rows per optimizer step over all processes; kept when the process count changes."""
    micro_batch_size: Rows = 1
    """Rows per process per forward pass; batch_size / (micro_batch_size x processes) of them are
    accumulated into a step. Memory: the activations grow with it (orchestrator plan counts them:
    8.5 GiB at 7B for 4 x 512 without gradient checkpointing, 2.1 GiB for 1 x 512). Speed: a smaller
    one takes more, smaller passes a step. Results: the same rows make the same step, their
    gradients summed in another order (fp32 at deepspeed.zero_stage = 0), equal up to rounding."""
    shuffle: bool = True
    """Take the rows in a seeded order, a new one every epoch (and, packing whole, the examples
    into rows shuffled), seeded by run.seed."""
    validation_path: str | None = None
    """Held-out data in data.format; its mean loss goes to metrics.jsonl as eval_loss. The one-source form's."""
    validation_split: Annotated[float, Field(gt=0, lt=1)] | None = None
    """Instead of validation_path: ceil(validation_split x records) of each source's records are
    held out (seeded by run.seed: the same ones on every resume and process count), not drawn for
    training, and evaluated as validation_path is."""
    eval_every: NonNegSteps = 0
    """Evaluate every this many global steps (and so also across phases); 0: never."""

    @field_validator("pack", mode="before")
    @classmethod
    def _pack(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, bool) and v not in ("whole", "stream"):
            raise KeyProblem("data.pack", f'expected true, false, "whole" or "stream", got {_show(v)}')
        return v

    _split_float = field_validator("validation_split", mode="before")(int_is_float)

    @model_validator(mode="after")
    def _one_form(self) -> DataSection:
        if (self.path is None) == (self.sources is None):
            raise KeyProblem("data.path" if self.path is None else "data.sources",
                             "expected data.path (one source) or data.sources (several), " +
                             ("but neither is set" if self.path is None else "not both"))
        if self.sources is not None:
            if not self.sources:
                raise KeyProblem("data.sources", "expected at least one source, got an empty list")
            for key in sorted({"format", "fields", "validation_path"} & self.model_fields_set):
                raise KeyProblem(f"data.{key}", "a key of the one-source form (data.path): with data.sources, " +
                                 ("hold data out with data.validation_split" if key == "validation_path"
                                  else f"set data.sources[i].{key}"))
        if self.validation_split is not None and self.validation_path is not None:
            raise KeyProblem("data.validation_split",
                             "expected data.validation_path or data.validation_split, not both")
        for key, source in self.resolved_sources():
            for name in source.fields or {}:
                if name not in FIELDS[source.format]:
                    raise KeyProblem(f"{key}.fields.{name}", f'not a field of {key}.format = "{source.format}"; '
                                     f"expected one of {', '.join(FIELDS[source.format])}")
        return self

    def resolved_sources(self) -> list[tuple[str, SourceSection]]:
        """(its key, the source with data's defaults filled in) of every training source."""
        if self.sources is None:
            return [("data", SourceSection(path=self.path, format=self.format, fields=self.fields,
                                           chat_template=self.chat_template, train_on_prompt=self.train_on_prompt))]
        defaults = {"chat_template": self.chat_template, "train_on_prompt": self.train_on_prompt}
        return [(f"data.sources[{i}]", s.model_copy(update={k: v for k, v in defaults.items()
                                                             if getattr(s, k) is None}))
                for i, s in enumerate(self.sources)]
