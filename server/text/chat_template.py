"""A model's Hugging Face chat template: chat messages -> prompt text, rendered as transformers'
`apply_chat_template` renders it.

Templates come from the model folder and may come from anywhere (the Hub), so they run in
Jinja2's immutable sandbox. The rendered text already carries the special tokens the template
writes (a BOS for Llama 3), so it is tokenized without adding them again.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Mapping, Optional, Sequence

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve.server.errors import InvalidRequest


def _raise_exception(message: str) -> None:
    """Templates call raise_exception("...") to refuse a conversation (e.g. roles that do not
    alternate); the message goes back to the client."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &), which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """One compiled template; `render` is thread-safe (it runs in the server's prepare threads)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        # The same environment options as transformers, so that whitespace renders identically.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat_template: not a valid Jinja2 template ({e})") from None
        self._special_tokens = dict(special_tokens)

    @classmethod
    def of(cls, tokenizer: Any) -> Optional["ChatTemplate"]:
        """The template of the engine's tokenizer, or None when the model has none."""
        source = getattr(tokenizer, "chat_template", None)
        if not source:
            return None
        return cls(source, getattr(tokenizer, "special_tokens", {}))

    def render(self, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = True, tools: Optional[list] = None) -> str:
        """The prompt text; InvalidRequest naming `messages` if the template refuses them.
        `tools`: the OpenAI tool definitions (templates that support tools render them)."""
        try:
            return self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         tools=tools, **self._special_tokens)
        except jinja2.exceptions.TemplateError as e:  # raise_exception and sandbox violations
            raise InvalidRequest(f"messages: the model's chat template refused them: {e}") from None
