"""Tokenizer and chat template without transformers: `tokenizers` + jinja2, rendering
the template the way transformers' `apply_chat_template` does."""
from __future__ import annotations

from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from .errors import BundleError, InputError


def _raise(message: str) -> None:
    raise InputError(f"chat template: {message}")


class ChatTokenizer:
    def __init__(self, path: Path, chat_template: str | None, special_tokens: dict):
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:
            raise BundleError(f"cannot read tokenizer {path}: {e}") from e
        self.special = special_tokens
        self.template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(chat_template)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.template is None:
            raise InputError("this bundle has no chat template; pass raw text instead")
        return self.template.render(messages=messages, add_generation_prompt=True,
                                    bos_token=self.special.get("bos_token") or "",
                                    eos_token=self.special.get("eos_token") or "")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """As transformers' apply_chat_template(messages, add_generation_prompt=True)."""
        return self.tokenizer.encode(self.render(messages), add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stream(self) -> DecodeStream:
        """Incremental detokenizer: `.step(tokenizer, id)` returns new text or None."""
        return DecodeStream(skip_special_tokens=True)
