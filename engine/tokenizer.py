"""Tokenizer: a thin wrapper over Hugging Face `tokenizers` reading a model folder."""
from __future__ import annotations

import json
import os
from typing import Optional

from tokenizers import Tokenizer as HFTokenizer


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _default_template(value) -> Optional[str]:
    """tokenizer_config.json holds one template, or a list of named ones (then "default")."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, path: str, eos_token_ids: list[int]):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(file):
            raise FileNotFoundError(f"model: no tokenizer.json in {path}")
        self._tok = HFTokenizer.from_file(file)
        self.eos_token_ids = list(eos_token_ids)
        self.chat_template: Optional[str] = None
        # bos_token, eos_token, ... as text: chat templates refer to them by these names.
        self.special_tokens: dict[str, str] = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file) as f:
                config = json.load(f)
            self.chat_template = _default_template(config.get("chat_template"))
            for name in SPECIAL_TOKEN_NAMES:
                token = config.get(name)
                if isinstance(token, dict):  # an AddedToken written out as a dict
                    token = token.get("content")
                if isinstance(token, str):
                    self.special_tokens[name] = token

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """`[decode(ids) for ids in sequences]` in one call, run in Rust without the GIL."""
        return self._tok.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)
