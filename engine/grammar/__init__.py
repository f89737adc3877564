"""Structured outputs: grammars compiled by xgrammar (compiler.py), each sequence's matcher
(request_grammar.py), the token bitmasks a constrained batch's forward applies (batch.py,
bitmask.py). Nothing here runs for a batch without a constrained request."""
