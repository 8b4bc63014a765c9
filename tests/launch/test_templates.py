"""Chat templates: every named one pinned token by token with its targets, a Qwen3-style template
(earlier turns' reasoning dropped) and one that marks the last assistant turn, marked turn by turn,
and {% generation %} marks masked as transformers masks them.

The tokenizer is made here: word level, every template's markers special tokens, newlines tokens
of their own (spaces are dropped), so each rendering reads token by token. In the pins below a
token is written as it is ("⏎" for a newline) and [brackets] hold the tokens that carry loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from launch.data.chat import render_chat
from launch.contract.data import DataPart, SourcePart
from launch.data.examples import DataError, prepare, read_stats
from launch.data.formats import Conversation, Encoder
from launch.data.rows import IGNORE
from launch.data.templates import MARKERS, TEMPLATES

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi friend"}, {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine thanks"}]
WORDS = ("be brief hello there hi friend how are you fine thanks plan it recall system user assistant model [INST] "
         "[/INST] You are Qwen, created by Alibaba Cloud. a helpful assistant.").split()
SPECIAL = sorted({m for ms in MARKERS.values() for m in ms} | {"<think>", "</think>"})


def tokenizer(template: str | None = None, special: list[str] = SPECIAL) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "[UNK]", "\n", *special, *sorted(set(WORDS))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                 pre_tokenizers.Split("\n", "isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="[UNK]",
                                   additional_special_tokens=special)
    fast.chat_template = template
    return fast


def pinned(tok, ids: list[int], labels: list[int]) -> str:
    """Tokens as the pins write them: [targets] in brackets, newlines as ⏎."""
    out, inside = [], False
    for t, label in zip(tok.convert_ids_to_tokens(ids), labels):
        t = "⏎" if t == "\n" else t
        if (label != IGNORE) != inside:
            out.append("[" if not inside else "]")
            inside = not inside
        out.append(t)
    return " ".join(out + ["]"] * inside).replace("[ ", "[").replace(" ]", "]")


def encode(template: str, messages: list[dict], tok=None) -> tuple[str, str]:
    """(the tokens pinned, how the turns were marked) of one conversation."""
    tok = tok or tokenizer(template)
    ids, labels, marking = Encoder(SourcePart(path="x", format="chat"), tok).encode(Conversation(messages))
    return pinned(tok, ids, labels), ["", "prefixes", "turn by turn", "generation marks"][marking]


NAMED = {
    "llama3": "<|begin_of_text|> <|start_header_id|> system <|end_header_id|> ⏎ ⏎ be brief <|eot_id|> "
              "<|start_header_id|> user <|end_header_id|> ⏎ ⏎ hello there <|eot_id|> "
              "<|start_header_id|> assistant <|end_header_id|> ⏎ ⏎ [hi friend <|eot_id|>] "
              "<|start_header_id|> user <|end_header_id|> ⏎ ⏎ how are you <|eot_id|> "
              "<|start_header_id|> assistant <|end_header_id|> ⏎ ⏎ [fine thanks <|eot_id|>]",
    "chatml": "<|im_start|> system ⏎ be brief <|im_end|> ⏎ <|im_start|> user ⏎ hello there <|im_end|> ⏎ "
              "<|im_start|> assistant ⏎ [hi friend <|im_end|> ⏎] <|im_start|> user ⏎ how are you <|im_end|> ⏎ "
              "<|im_start|> assistant ⏎ [fine thanks <|im_end|> ⏎]",
    "qwen2.5": "<|im_start|> system ⏎ be brief <|im_end|> ⏎ <|im_start|> user ⏎ hello there <|im_end|> ⏎ "
               "<|im_start|> assistant ⏎ [hi friend <|im_end|> ⏎] <|im_start|> user ⏎ how are you <|im_end|> ⏎ "
               "<|im_start|> assistant ⏎ [fine thanks <|im_end|> ⏎]",
    "mistral": "<s> [INST] be brief ⏎ ⏎ hello there [/INST] [hi friend </s>] [INST] how are you [/INST] "
               "[fine thanks </s>]",
    "gemma": "<bos> <start_of_turn> user ⏎ be brief ⏎ ⏎ hello there <end_of_turn> ⏎ <start_of_turn> model ⏎ "
             "[hi friend <end_of_turn> ⏎] <start_of_turn> user ⏎ how are you <end_of_turn> ⏎ "
             "<start_of_turn> model ⏎ [fine thanks <end_of_turn> ⏎]",
    "phi3": "<|system|> ⏎ be brief <|end|> ⏎ <|user|> ⏎ hello there <|end|> ⏎ <|assistant|> ⏎ [hi friend <|end|> ⏎] "
            "<|user|> ⏎ how are you <|end|> ⏎ <|assistant|> ⏎ [fine thanks <|end|> ⏎]",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_named_template_is_pinned(name):
    assert encode(TEMPLATES[name], CHAT) == (NAMED[name], "prefixes")


def test_named_templates_without_a_system_turn():
    assert encode(TEMPLATES["qwen2.5"], CHAT[1:3])[0] == (
        "<|im_start|> system ⏎ You are Qwen, created by Alibaba Cloud. You are a helpful assistant. <|im_end|> ⏎ "
        "<|im_start|> user ⏎ hello there <|im_end|> ⏎ <|im_start|> assistant ⏎ [hi friend <|im_end|> ⏎]")
    assert encode(TEMPLATES["mistral"], CHAT[1:3])[0] == "<s> [INST] hello there [/INST] [hi friend </s>]"
    assert encode(TEMPLATES["gemma"], CHAT[1:3])[0] == (
        "<bos> <start_of_turn> user ⏎ hello there <end_of_turn> ⏎ <start_of_turn> model ⏎ [hi friend <end_of_turn> ⏎]")


# Qwen3's template in the part that matters here (no tools): an assistant turn after the last user
# turn shows its reasoning in <think> (an empty one when it has none), one before it drops it.
QWEN3 = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role != 'assistant' -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
REASONED = [CHAT[1], {"role": "assistant", "content": "<think>\nplan it\n</think>\n\nhi friend"}, CHAT[3],
            {"role": "assistant", "content": "<think>\nrecall\n</think>\n\nfine thanks"}]


def test_a_qwen3_style_template_is_marked_turn_by_turn():
    tok = tokenizer(QWEN3)
    text, _, _ = render_chat(tok, REASONED)
    # The earlier turn's reasoning is gone from the whole; rendered alone (as the last turn) it has it.
    assert "plan it" not in text and "plan it" in tok.apply_chat_template(REASONED[:2], tokenize=False)
    assert encode(QWEN3, REASONED, tok) == (
        "<|im_start|> user ⏎ hello there <|im_end|> ⏎ <|im_start|> assistant ⏎ [hi friend <|im_end|> ⏎] "
        "<|im_start|> user ⏎ how are you <|im_end|> ⏎ <|im_start|> assistant ⏎ "
        "[<think> ⏎ recall ⏎ </think> ⏎ ⏎ fine thanks <|im_end|> ⏎]", "turn by turn")
    # Without reasoning in the data the last turn still opens with an empty <think> block: a target too.
    assert encode(QWEN3, CHAT[1:], tok)[0].endswith(
        "<|im_start|> assistant ⏎ [<think> ⏎ ⏎ </think> ⏎ ⏎ fine thanks <|im_end|> ⏎]")


def test_a_template_that_marks_the_last_turn():
    """The Phi-3 template of its first release closed the conversation with an EOS: every turn but the
    last ends with <|end|>, the last with <|end|> and the EOS."""
    template = TEMPLATES["phi3"] + "{% if not add_generation_prompt %}{{ eos_token }}{% endif %}"
    assert encode(template, CHAT[1:]) == (
        "<|user|> ⏎ hello there <|end|> ⏎ <|assistant|> ⏎ [hi friend <|end|> ⏎] <|user|> ⏎ how are you <|end|> ⏎ "
        "<|assistant|> ⏎ [fine thanks <|end|> ⏎ <eos>]", "turn by turn")


def test_generation_marks_mask_as_transformers_does():
    template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{% if m.role == 'assistant' %}"
                "{% generation %}{{ m.content + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
                "{{ m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}")
    tok = tokenizer(template)
    got, marking = encode(template, CHAT, tok)
    assert (got, marking) == (NAMED["chatml"], "generation marks")
    theirs = tok.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, labels, _ = Encoder(SourcePart(path="x", format="chat"), tok).encode(Conversation(CHAT))
    assert ids == theirs["input_ids"] and [int(x != IGNORE) for x in labels] == theirs["assistant_masks"]


def test_a_named_template_needs_its_markers_as_tokens(tmp_path):
    tok_dir = tmp_path / "tok"
    tokenizer(None, special=[s for s in SPECIAL if s != "<|im_start|>"]).save_pretrained(tok_dir)
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    part = DataPart(sources=[SourcePart(path=str(data), format="chat", chat_template="chatml", key="data.sources[1]")],
                    seq_len=64, batch_size=1, micro_batch_size=1, shuffle=False)
    with pytest.raises(DataError, match=r'chat_template = "chatml" needs <\|im_start\|> as one token'):
        prepare(part, str(tok_dir), tmp_path / "c")


def test_the_marking_is_reported_per_source(tmp_path):
    tok_dir = tmp_path / "tok"
    tokenizer(TEMPLATES["chatml"]).save_pretrained(tok_dir)
    (tmp_path / "qwen3.jinja").write_text(QWEN3)
    files = []
    for name, records in (("plain", [{"messages": CHAT}]), ("reasoned", [{"messages": REASONED}])):
        files.append(tmp_path / f"{name}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in records))
    part = DataPart(sources=[SourcePart(path=str(files[0]), format="chat"),
                             SourcePart(path=str(files[1]), format="chat", chat_template=str(tmp_path / "qwen3.jinja"))],
                    seq_len=64, batch_size=1, micro_batch_size=1, shuffle=False)
    sources = read_stats(prepare(part, str(tok_dir), tmp_path / "c"))["sources"]
    assert [(s["template"], s["marking"]) for s in sources] == [
        ("the tokenizer's", ["prefixes"]), (str(tmp_path / "qwen3.jinja"), ["turn by turn"])]


def test_a_template_whose_turns_cannot_be_found_is_refused():
    # The assistant's content is rendered twice and differently: nothing locates one turn.
    template = ("{% for m in messages %}{{ m.role + ':' + m.content + '|' }}{% endfor %}"
                "{% if not add_generation_prompt %}{{ messages | map(attribute='content') | join('+') }}{% endif %}")
    with pytest.raises(DataError, match="neither its prefixes nor a rendering turn by turn locate it"):
        render_chat(tokenizer(template), CHAT[1:])


def test_the_template_a_run_trains_with_is_the_one_its_exports_keep(tmp_path):
    """Seen: RUN_DIR/final had no chat template after a run with data.chat_template = "llama3"."""
    from launch.contract.data import DataPart, SourcePart
    from launch.data.templates import TEMPLATES, trained_template

    def data(*sources: SourcePart) -> DataPart:
        return DataPart(sources=sources, seq_len=8, batch_size=1, micro_batch_size=1, shuffle=False)

    text = SourcePart(path="t.txt", format="text", chat_template="chatml")  # renders through no template
    alpaca = SourcePart(path="a.jsonl", format="instruction")
    chat = SourcePart(path="c.jsonl", format="chat", chat_template="llama3")
    assert trained_template(data(text, alpaca, chat)) == TEMPLATES["llama3"]
    assert trained_template(data(alpaca)) is None  # the tokenizer's own: copied with its files
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    assert trained_template(data(SourcePart(path="c.jsonl", format="chat",
                                            chat_template=str(tmp_path / "t.jinja")))) == "{{ messages }}"
