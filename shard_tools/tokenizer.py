"""The files of a Hugging Face tokenizer folder, named once (no torch here: the control plane's
schedule check reads this too)."""

MAIN_FILES = ("tokenizer.json", "tokenizer_config.json")
"""One of these makes a folder a tokenizer the schedule accepts."""
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers reads a tokenizer's chat template first (before tokenizer_config.json's)."""
TOKENIZER_FILES = (*MAIN_FILES, "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json", CHAT_TEMPLATE_FILE, "chat_template.json")
"""Every file a tokenizer may be made of: what keys a data cache entry and what an export copies."""
