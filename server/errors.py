"""The error every room of the server raises for a bad request: the request pipeline (text/)
refuses fields with it, and both fronts turn it into their client error (INVALID_ARGUMENT, HTTP
400). It lives apart from text/validation.py so that any module can raise it without importing
the validator (chat_template.py raises it and validation.py imports ChatTemplate)."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request field is invalid or over a server limit; the message starts with the field
    ("request" for a message that cannot be parsed)."""

    @property
    def field(self) -> str:
        return str(self).partition(":")[0]
