"""Chat templates for base models, by name (``data.chat_template = "llama3"``), each written from its
family's documented prompt format, and a source's template text.

Every one renders a conversation of system, user and assistant turns; where a family has no
system turn (mistral, gemma) the system text opens the first user turn, followed by a blank line.
``add_generation_prompt`` ends the text where the assistant's answer begins. Each template's
``MARKERS`` must be single tokens of the tokenizer: a base model whose tokenizer would spell
``<|im_start|>`` in five pieces is refused rather than trained on a prompt it cannot read.
"""

from __future__ import annotations

from pathlib import Path

from launch.contract.data import ALPACA_PROMPT, TEMPLATE_NAMES, DataPart, SourcePart, is_template_path
from launch.data.records import DataError

_SYSTEM_FIRST = "{% set system = messages[0].content if messages[0].role == 'system' else none %}"
_CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TEMPLATES = {
    # Meta Llama 3 / 3.1 model card: a header per turn, closed by <|eot_id|>.
    "llama3": ("{{ '<|begin_of_text|>' }}{% for m in messages %}"
               "{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
               "{% endif %}"),
    # OpenAI's ChatML, as Qwen, Yi and others use it.
    "chatml": _CHATML,
    # Qwen2.5 model card: ChatML with Qwen's default system turn where the conversation has none.
    "qwen2.5": ("{% if messages[0].role != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, created by Alibaba "
                "Cloud. You are a helpful assistant.<|im_end|>\\n' }}{% endif %}" + _CHATML),
    # Mistral's instruct format: <s>[INST] user [/INST] answer</s>[INST] ...
    "mistral": (_SYSTEM_FIRST + "{{ '<s>' }}{% for m in messages if m.role != 'system' %}{% if m.role == 'user' %}"
                "{{ '[INST] ' + (system + '\\n\\n' if loop.first and system is not none else '') + m.content + "
                "' [/INST]' }}{% else %}{{ ' ' + m.content + '</s>' }}{% endif %}{% endfor %}"),
    # Gemma model card: <start_of_turn>user / model turns closed by <end_of_turn>.
    "gemma": (_SYSTEM_FIRST + "{{ '<bos>' }}{% for m in messages if m.role != 'system' %}"
              "{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else 'user') + '\\n' + "
              "(system + '\\n\\n' if loop.first and system is not none else '') + m.content + '<end_of_turn>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
    # Phi-3 model card: <|system|>, <|user|>, <|assistant|> turns closed by <|end|>.
    "phi3": ("{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '<|end|>\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"),
}
MARKERS = {
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "qwen2.5": ("<|im_start|>", "<|im_end|>"),
    "mistral": ("<s>", "</s>"),
    "gemma": ("<bos>", "<start_of_turn>", "<end_of_turn>"),
    "phi3": ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
}
assert set(TEMPLATES) == set(MARKERS) == set(TEMPLATE_NAMES)


def template_text(source: SourcePart) -> str | None:
    """The Jinja text of ``source.chat_template`` (a name, a file or the template itself), or None."""
    t = source.chat_template
    if t == ALPACA_PROMPT:
        return None
    if t is None or not is_template_path(t):
        return TEMPLATES.get(t, t)
    try:
        return Path(t).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"chat_template: cannot read it: {e}", t) from None


def trained_template(data: DataPart) -> str | None:
    """The chat template a run trains with where the schedule names one (``data.chat_template``, a
    source's own): the first training source's that renders through one; saved with the run's
    checkpoints for its final model and every export. None: the tokenizer's own (copied anyway)."""
    named = [s for s in data.sources
             if s.format in ("chat", "instruction") and s.chat_template not in (None, ALPACA_PROMPT)]
    return template_text(named[0]) if named else None


def check_markers(source: SourcePart, tok) -> None:
    """A named template's markers are single tokens of ``tok`` (see the module docstring)."""
    for marker in MARKERS.get(source.chat_template, ()):
        tokens = tok.convert_ids_to_tokens(tok(marker, add_special_tokens=False)["input_ids"])
        if tokens != [marker]:
            raise DataError(f'chat_template = "{source.chat_template}" needs {marker} as one token of the tokenizer; '
                            f"it has none (it reads {tokens}): use a template of the tokenizer's own tokens",
                            source.path)
