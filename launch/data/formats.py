"""Each data format a small transform from a record to one intermediate form, and the one path that
turns that form into token ids and labels.

    encode = Encoder(source, tok)       # a datasets.map function over a source's records
    Encoder.check(rec)                  # what is wrong with one record for its format, or ""

The forms: ``Conversation`` (turns rendered with the chat template, loss on the assistant turns),
``Pieces`` (text pieces tokenized in turn, each carrying loss or not, closed by an EOS) and
``Tokens`` (ids and labels as the record gives them). A new format is one class with ``fields``,
``check`` and ``sample``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launch.contract import faults
from launch.data.chat import render_chat
from launch.contract.data import SourcePart
from launch.data.records import DataError, token_fault
from launch.data.rows import IGNORE
from launch.data.template import BudgetExceeded, Renderer, TemplateFault

ALPACA = ("Below is an instruction that describes a task{context}. Write a response that appropriately completes "
          "the request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MARKINGS = ("", "prefixes", "turn by turn", "generation marks")
"""How a record's assistant turns were found (``launch.data.chat``), by its number in the ``marking`` column."""


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]


@dataclass(frozen=True)
class Pieces:
    parts: list[tuple[str, bool]]
    """(text, carries loss), tokenized one by one."""
    specials: bool = False
    """The first piece gets the tokenizer's own special tokens (a BOS where it adds one), as a plain prompt does."""


@dataclass(frozen=True)
class Tokens:
    ids: list[int]
    labels: list[int]


class TokensFormat:
    """Ids below the model's vocabulary (``vocab_size``; none given: below int32, never narrowed)."""

    fields = ("input_ids", "labels")

    def __init__(self, f, vocab_size: int | None = None):
        self.f, self.vocab_size = f, vocab_size

    def check(self, rec: dict) -> str:
        return token_fault(rec.get(self.f("input_ids")), rec.get(self.f("labels")), self.f, self.vocab_size)

    def sample(self, rec: dict, tok) -> Tokens:
        ids, labels = list(rec[self.f("input_ids")]), rec.get(self.f("labels"))
        return Tokens(ids, list(ids if labels is None else labels))


class TextFormat:
    fields = ("text",)

    def __init__(self, f):
        self.f = f

    def check(self, rec: dict) -> str:
        if isinstance(rec.get(self.f("text")), str):
            return ""
        return f'expected a "{self.f("text")}" field holding a string'

    def sample(self, rec: dict, tok) -> Pieces:
        return Pieces([(rec[self.f("text")], True)])


class InstructionFormat:
    """Alpaca records: through the chat template where the tokenizer has one, else the Alpaca prompt."""

    fields = ("instruction", "input", "output")

    def __init__(self, f):
        self.f = f

    def check(self, rec: dict) -> str:
        for name, required in (("instruction", True), ("input", False), ("output", True)):
            v = rec.get(self.f(name))
            if not isinstance(v, str) and (required or v is not None):
                return f'expected a "{self.f(name)}" field holding a string' + ("" if required else " (or none)")
        return ""

    def sample(self, rec: dict, tok) -> Conversation | Pieces:
        instruction, context, output = rec[self.f("instruction")], rec.get(self.f("input")) or "", rec[self.f("output")]
        if tok.chat_template:
            user = instruction + ("\n\n" + context if context else "")
            return Conversation([{"role": "user", "content": user}, {"role": "assistant", "content": output}])
        prompt = ALPACA.format(context=", paired with an input that provides further context" if context else "",
                               instruction=instruction, input=f"### Input:\n{context}\n\n" if context else "")
        return Pieces([(prompt, False), (output, True)], specials=True)


class ChatFormat:
    """``messages`` [{role, content}] or ShareGPT ``conversations`` [{from, value}]."""

    fields = ("messages", "conversations")

    def __init__(self, f):
        self.f = f

    def check(self, rec: dict) -> str:
        turns = self.messages(rec)
        return turns if isinstance(turns, str) else ""

    def sample(self, rec: dict, tok) -> Conversation:
        return Conversation(self.messages(rec))

    def messages(self, rec: dict) -> list[dict] | str:
        """The record's turns as [{"role", "content"}], or what is wrong with them."""
        f = self.f
        if rec.get(f("messages")) is not None:
            turns, role, content, roles = rec[f("messages")], "role", "content", None
        elif rec.get(f("conversations")) is not None:
            turns, role, content, roles = rec[f("conversations")], "from", "value", SHAREGPT_ROLES
        else:
            return f'expected "{f("messages")}" [{{"role", "content"}}] or "{f("conversations")}" [{{"from", "value"}}]'
        if not isinstance(turns, list) or not turns:
            return "expected a non-empty list of turns"
        out = []
        for j, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get(role), str) or not isinstance(t.get(content), str):
                return f'turn {j}: expected {{"{role}": string, "{content}": string}}'
            r = t[role] if roles is None else roles.get(t[role])
            if r not in ("system", "user", "assistant"):
                known = "system, user, assistant" if roles is None else ", ".join(SHAREGPT_ROLES)
                return f'turn {j}: {role} "{t[role]}" is not one of {known}'
            out.append({"role": r, "content": t[content]})
        if not any(t["role"] == "assistant" for t in out):
            return "no assistant turn: nothing to learn"
        return out


FORMATS = {"tokens": TokensFormat, "text": TextFormat, "instruction": InstructionFormat, "chat": ChatFormat}


class StoppedAt(Exception):
    """Raised out of ``datasets.map`` (its workers too): (message, record index); picklable."""


class Encoder:
    """``datasets.map`` function: a batch of records -> input_ids, labels, how the turns were marked
    (``MARKINGS``) and an error per record (a string, empty when the record is fine: an exception
    inside a worker would lose its index). The chat template renders under its budget
    (``launch.data.template``): a syntax error is ``TemplateFault`` here, a record past the budget
    ``StoppedAt`` (the template's fault: the rest are not rendered)."""

    def __init__(self, source: SourcePart, tok, vocab_size: int | None = None):
        self.source, self.tok = source, tok
        self.format = TokensFormat(source.field, vocab_size) if source.format == "tokens" \
            else FORMATS[source.format](source.field)
        self.eos = [] if tok is None or tok.eos_token_id is None else [tok.eos_token_id]
        key = f"{source.key}.chat_template" if source.chat_template is not None else "the tokenizer's chat_template"
        self.renderer = Renderer(tok.get_chat_template(), tok.special_tokens_map, key) \
            if tok is not None and tok.chat_template else None

    def check(self, rec: Any) -> str:
        if not isinstance(rec, dict):
            return f"expected a record (an object), got {type(rec).__name__}"
        return self.format.check(rec)

    def __call__(self, batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        faults.point("data.batch")
        out: dict[str, list] = {"input_ids": [], "labels": [], "marking": [], "error": []}
        for i in range(len(indices)):
            rec = {k: v[i] for k, v in batch.items()}
            err, ids, labels, marking = self.check(rec), [], [], 0
            if not err:
                try:
                    ids, labels, marking = self.encode(self.format.sample(rec, self.tok))
                except BudgetExceeded as e:
                    raise StoppedAt(str(e), indices[i]) from None
                except (DataError, TemplateFault) as e:
                    err = str(e)
            if not err and not ids:
                err = "no tokens"
            for name, value in zip(out, (ids, labels, marking, err)):
                out[name].append(value)
        return out

    def encode(self, sample: Conversation | Pieces | Tokens) -> tuple[list[int], list[int], int]:
        """(ids, labels, marking) of one sample: the one path from the intermediate forms to tokens."""
        if isinstance(sample, Tokens):
            return sample.ids, sample.labels, 0
        every = self.source.train_on_prompt
        if isinstance(sample, Pieces):
            ids, labels = [], []
            for k, (text, trained) in enumerate(sample.parts):
                part = self.tok(text, add_special_tokens=sample.specials and k == 0)["input_ids"]
                ids += part
                labels += part if trained or every else [IGNORE] * len(part)
            return ids + self.eos, labels + self.eos, 0
        text, spans, marking = render_chat(self.tok, sample.messages, self.renderer)
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        if every:
            return ids, list(ids), MARKINGS.index(marking)
        labels = [t if any(a <= s < b for a, b in spans) else IGNORE for t, (s, _) in zip(ids, enc["offset_mapping"])]
        return ids, labels, MARKINGS.index(marking)
