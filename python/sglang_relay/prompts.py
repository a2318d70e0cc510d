"""Prompts as a served chat model reads them."""

from __future__ import annotations

from typing import Any


def chat_prompt(tokenizer: Any, system: str, user: str) -> str:
    """A system and a user message in the model's chat template, ready for its reply."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
